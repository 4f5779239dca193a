"""Spare ranks (``--spares K``): idle ranks that take the place of a replica that dies or
leaves, as Project Adam kept standby machines (section 3.3).

Who does what:

* **A shard** that loses a replica (silent past ``--heartbeat-timeout``, or a message that
  broke off) tells the chief, world rank 0 (``REPLICA_LOST``: the replica, its world rank, how
  long it had been silent). Every shard notices on its own, so the chief hears it up to S
  times and acts on the first.
* **A replica** that leaves on SIGTERM finishes its last push, waits until it is committed,
  sends DONE to its shards like any finished replica (so nobody waits for it) and then
  ``REPLICA_LEFT`` to the chief.
* **The chief** (:class:`SparePool`), between two of its own steps, hands the replica's data
  shard to the next idle spare k: it first tells every shard to expect replica index R + k at
  the spare's rank (``EXPECT``), then tells the spare (``ASSIGN``). The EXPECT goes out
  before the chief's own DONE, so no shard can have ended before the newcomer arrives; from
  then on the shards wait for R + k as for any replica and lose it the same way if it never
  speaks. With no idle spare left, the run goes on without the replica, as without spares.
  When its own training ends the chief releases the spares still idle (``RELEASE``).
* **A spare** (:func:`wait_for_assignment`) waits for one of the two; assigned, it loads the
  data shard, fetches the parameters and trains as replica R + k until the shards have
  applied the run's steps, like the other replicas.

Shards that die (``--ps-copies C``): a shard that finds another dead tells the chief
(``SHARD_LOST``); the chief makes the next idle spare k shard S + k, a holder of every set the
dead one held (``HEAL`` to every shard, ``ASSIGN`` to the spare with the heals so far), and
each such set's primary sends it the set's state while it goes on serving, then forwards it
every push as to any secondary: the set is back at C copies once the spare acknowledges the
state (:mod:`hpcps.ps.replicated`).

Ranks that join the running job (``--joins J``, :mod:`hpcps.mpi.joins`): the chief gives a
launch of n ranks the next n of its J slots, then, once the launch is connected to every
listener (``JOIN_READY``), makes each a spare, k = K + j for the j-th rank to join (at rank
N + j), idle like the others or, asked to train at once, replica R + k on data shard
j mod R. A joined spare never becomes a shard (the replicas reach only the job's ranks).

A spare trains under an index of its own (R + k), not the dead replica's: what the shards
hold of the dead one (its lost state, its late pushes discarded, with ``--ps-copies`` each set's
count of its pushes) stays its own, and nothing in flight from it can be taken for the
newcomer's. Every rank computes a spare's world rank from its index
(:meth:`hpcps.mpi.topology.Layout.trainer_rank`).
"""
from __future__ import annotations

import time

from hpcps.mpi import joins
from hpcps.mpi.comm import Poller, Transport, done, source_of, status
from hpcps.mpi.protocol import H, Message, Tag

CHIEF = 0  # world rank 0 assigns the spares: the run cannot survive its loss anyway
IDLE_POLL_S = 0.02  # an idle spare looks for its assignment this often (cheap on shared cores)


def report_lost(send, replica: int, rank: int, silent_s: float) -> None:
    """On a shard: tell the chief that ``replica`` (world rank ``rank``) is lost; ``send(buf,
    dest, tag)`` does not wait (a blocking send can stall a shard, and its heartbeats, for
    as long as the chief is busy)."""
    msg = Message(0)
    hd = msg.header
    hd[H.SENDER], hd[H.PEER], hd[H.STALENESS], hd[H.CLOCK] = replica, rank, silent_s, time.time()
    send(msg.buf, CHIEF, Tag.REPLICA_LOST)


def report_shard_lost(send, me: int, dead: int, silent_s: float) -> None:
    """On a shard: tell the chief that shard ``dead`` is dead (``--ps-copies``); ``send(buf,
    dest, tag)`` is the shard's own non-blocking send, which keeps the buffer until done."""
    msg = Message(0)
    hd = msg.header
    hd[H.SENDER], hd[H.PEER], hd[H.STALENESS], hd[H.CLOCK] = me, dead, silent_s, time.time()
    send(msg.buf, CHIEF, Tag.SHARD_LOST)


def report_joined(net: Transport, replica: int, at: float) -> None:
    """On a spare: tell the chief when its first step as replica ``replica`` ended (the
    chief keeps it: the spare's own figures are lost if it dies later)."""
    msg = Message(0)
    msg.header[H.SENDER], msg.header[H.CLOCK] = replica, at
    net.send_eager(msg.buf, CHIEF, Tag.JOINED)


def report_left(net: Transport, replica: int) -> None:
    """On a replica that leaves: tell the chief, once its last push is committed."""
    msg = Message(0)
    msg.header[H.SENDER], msg.header[H.CLOCK] = replica, time.time()
    net.send_eager(msg.buf, CHIEF, Tag.REPLICA_LEFT)


class SparePool:
    """On the chief: the replicas that died or left, and the spares handed their data shards.

    Parameters
    ----------
    comm : the world communicator.
    layout : the grid (R replicas, K spares, the shards' ranks).
    say : ``say(text, record[, kind])``: a line for the log and a record of ``kind``
        (``replacement``, or ``join``) for the metrics (the chief's
        :class:`hpcps.runtime.metrics.Metrics`).
    welcome : what a launch that joins is told besides its ranks (the job's configuration).
    timeout : seconds :meth:`release` waits for a launch let in to say it is connected.
    view : ``view()``, the chief's view of the shards (:meth:`hpcps.ps.replicated.client.
        ReplicatedClient.view`), handed to every spare made a replica.
    """

    def __init__(self, comm, layout, say=None, copies: int = 1, welcome=None,
                 timeout: float = 60.0, view=None):
        self.net = Transport(comm)
        self.comm = comm
        self.layout = layout
        self.R, self.K, self.S, self.C = layout.replicas, layout.spares, layout.servers, copies
        self.members = dict(enumerate(layout.server_ranks))  # shard index -> world rank
        self.dead_shards: set[int] = set()
        self.heals: list[tuple[int, int]] = []  # (dead shard, the spare's shard index)
        self.shard_replacements: list[dict] = []
        self.idle = list(range(self.K))
        self.data_of = {r: r for r in range(self.R)}  # replica index -> its data shard
        self.gone: dict[int, str] = {}  # replica index -> "lost" or "left"
        self.replacements: list[dict] = []
        self.released: list[int] = []  # the spares idle at the end, sent away
        self.over = False  # the chief's training ended (its DONE sent): no more assignments
        self.say = say
        self._small = Message(0)
        self._st = status()
        self._sends: list = []  # (request, buffer): never a blocking send to a rank that died
        # --joins: the slots handed to launches, the ranks that joined, what a launch is told
        self.slots = joins.Slots(layout.n_world, layout.joins)
        self.joins: list[dict] = []
        self.ready = 0  # joined ranks that said they are connected (JOIN_READY)
        self.welcome = welcome or {}
        self.timeout = timeout
        self.view = view  # () -> the chief's client's view of the shards (--ps-copies)
        if isinstance(comm, joins.RoutedComm):
            comm.allot = self._allot

    def _allot(self, n: int, want) -> tuple[int | None, dict]:
        """A launch of ``n`` ranks connects (:mod:`hpcps.mpi.joins`): its first rank and
        what it is told (the job's configuration, the listeners alive), or a refusal."""
        if want not in ("spare", "replica"):
            return None, {"refused": f"a rank joins as a spare or a replica, not {want!r}"}
        first, why = self.slots.take(n)
        if first is None:
            return None, {"refused": why}
        spares_left = [self.layout.spare_rank(k) for k in self.idle if k < self.K]
        listeners = sorted(set(self._live_members()) | set(spares_left))
        return first, {**self.welcome, "first": first, "n_world": self.layout.n_world,
                       "slots": self.layout.joins, "listeners": listeners}

    def _send(self, buf, dest: int, tag: int) -> None:
        self._sends = [(r, b) for r, b in self._sends if not done(r)]
        self._sends.append((self.net.send_nowait(buf, dest, tag), buf))

    def _live_members(self) -> list[int]:
        return [rank for j, rank in self.members.items() if j not in self.dead_shards]

    def poll(self) -> None:
        """Take every REPLICA_LOST and REPLICA_LEFT waiting; hand out spares."""
        net, st, hd = self.net, self._st, self._small.header
        while net.probe(st, Tag.REPLICA_LOST):
            src = st.Get_source()
            if not net.taken(self._small.buf, src, Tag.REPLICA_LOST):
                continue
            self._gone(int(hd[H.SENDER]), "lost", float(hd[H.CLOCK]), float(hd[H.STALENESS]),
                       next((j for j, rank in self.members.items() if rank == src), None))
        while net.probe(st, Tag.REPLICA_LEFT):
            if not net.taken(self._small.buf, st.Get_source(), Tag.REPLICA_LEFT):
                continue
            self._gone(int(hd[H.SENDER]), "left", float(hd[H.CLOCK]), 0.0, None)
        while net.probe(st, Tag.SHARD_LOST):
            if not net.taken(self._small.buf, st.Get_source(), Tag.SHARD_LOST):
                continue
            self._shard_gone(int(hd[H.PEER]), float(hd[H.CLOCK]), float(hd[H.STALENESS]),
                             int(hd[H.SENDER]))
        while net.probe(st, Tag.RESTORED):
            if not net.taken(self._small.buf, st.Get_source(), Tag.RESTORED):
                continue
            for rec in self.shard_replacements:
                if rec["as_shard"] == int(hd[H.SENDER]):
                    rec["restored_at"][int(hd[H.SET])] = float(hd[H.CLOCK])
        while net.probe(st, Tag.JOINED):
            if not net.taken(self._small.buf, st.Get_source(), Tag.JOINED):
                continue
            for rec in self.replacements + self.joins:
                if rec["as_replica"] == int(hd[H.SENDER]):
                    rec["first_step_at"] = float(hd[H.CLOCK])
        while net.probe(st, Tag.JOIN_READY):
            self._joined(net.take_obj(source_of(st), Tag.JOIN_READY))

    def _joined(self, got: dict) -> None:
        """A launch is connected to every listener: its ranks become spares (or replicas)."""
        n_world = self.layout.n_world
        for v in range(int(got["first"]), int(got["first"]) + int(got["n"])):
            self.ready += 1
            j = v - n_world
            k = self.K + j
            rec = {"rank": v, "join": j, "spare": k, "wants": got["want"], "at": time.time(),
                   "unreached": got.get("unreached", []),
                   "as_replica": None, "data_shard": None, "assigned_at": None,
                   "first_step_at": None}
            self.joins.append(rec)
            if self.over:  # the shards may have ended: it leaves at once
                self._send(Message(0).buf, v, Tag.RELEASE)
                rec["wants"] = "released"
            elif got["want"] == "replica":
                self._assign(k, j % self.R, rec)
            else:
                self.idle.append(k)
            if self.say is not None:
                self.say(f"rank {v} joined the run as spare {k}" + (
                    f": replica {rec['as_replica']} on data shard {rec['data_shard']}"
                    if rec["as_replica"] is not None else
                    ", released (the run is over)" if rec["wants"] == "released" else
                    ", idle"), rec, "join")

    def _assign(self, k: int, data_shard: int, rec: dict) -> None:
        """Spare ``k`` trains as replica R + k on ``data_shard``: the live shards expect it
        first, then it is told."""
        new, rank = self.R + k, self.layout.spare_rank(k)
        self.data_of[new] = data_shard
        msg = Message(0)
        msg.header[H.SENDER], msg.header[H.PEER] = new, rank
        for dest in self._live_members():
            self._send(msg.buf, dest, Tag.EXPECT)
        # a rank that joined missed the failovers before it connected: the chief's view
        view = {"view": self.view()} if self.view is not None else {}
        self._sends.append((self.net.send_obj_nowait(
            {"role": "replica", "index": new, "data": data_shard, **view}, rank, Tag.ASSIGN),
            None))
        rec.update(as_replica=new, data_shard=data_shard, assigned_at=time.time())

    def _gone(self, r: int, how: str, at: float, silent_s: float, shard) -> None:
        if r in self.gone or r not in self.data_of:
            return  # heard already (every shard reports a loss)
        self.gone[r] = how
        rec = {"replica": r, "rank": self.layout.trainer_rank(r), "how": how,
               "data_shard": self.data_of[r], "detected_at": at, "silent_s": round(silent_s, 3),
               "detected_by_shard": shard, "spare": None, "spare_rank": None,
               "as_replica": None, "assigned_at": None, "first_step_at": None}
        if self.idle:
            k = self.idle.pop(0)
            rec.update(spare=k, spare_rank=self.layout.spare_rank(k))
            self._assign(k, self.data_of[r], rec)
        self.replacements.append(rec)
        if self.say is not None:
            what = (f"replica {r} (rank {rec['rank']}) {'died' if how == 'lost' else 'left'}: "
                    + (f"spare {rec['spare']} (rank {rec['spare_rank']}) takes its data shard "
                       f"{rec['data_shard']} as replica {rec['as_replica']}"
                       if rec["spare"] is not None else
                       "no spare left, the others take over its share of the steps"))
            self.say(what, rec)

    def _shard_gone(self, d: int, at: float, silent_s: float, by: int) -> None:
        if d in self.dead_shards or d not in self.members:
            return  # heard already (every live shard finds it dead)
        self.dead_shards.add(d)
        rec = {"shard": d, "rank": self.members[d], "detected_at": at,
               "silent_s": round(silent_s, 3), "detected_by_shard": by, "spare": None,
               "spare_rank": None, "as_shard": None, "assigned_at": None,
               "restored_at": {}}
        real = [k for k in self.idle if k < self.K]  # a joined spare never becomes a shard
        if real and self.C > 1:
            k = real[0]
            self.idle.remove(k)
            n, rank = self.S + k, self.layout.spare_rank(k)
            msg = Message(0)
            msg.header[H.SENDER], msg.header[H.PEER] = d, n
            for dest in self._live_members():
                self._send(msg.buf, dest, Tag.HEAL)
            self.heals.append((d, n))
            self.members[n] = rank
            joined = [r["as_replica"] for r in self.replacements + self.joins
                      if r["as_replica"] is not None]
            self._sends.append((self.net.send_obj_nowait(
                {"role": "shard", "index": n, "heals": list(self.heals),
                 "dead": sorted(self.dead_shards), "joined": joined}, rank, Tag.ASSIGN), None))
            rec.update(spare=k, spare_rank=rank, as_shard=n, assigned_at=time.time())
        self.shard_replacements.append(rec)
        if self.say is not None:
            self.say(f"server shard {d} (rank {rec['rank']}) died: "
                     + (f"spare {rec['spare']} (rank {rec['spare_rank']}) becomes shard "
                        f"{rec['as_shard']} and takes a copy of each of its chunk sets"
                        if rec["spare"] is not None else
                        "no spare left, its chunk sets keep one copy fewer"), rec)

    @property
    def shard_ranks(self) -> list[int]:
        """World ranks of every shard, the spares that became shards included."""
        return list(self.members.values())

    def release(self) -> None:
        """The chief's training is over: the spares still idle leave. No launch may join
        any more; one let in already is waited for (``timeout``) and sent away."""
        self.over = True  # even with no spare idle: a launch ready now is sent away
        self.slots.open = False
        joins.stop_listening(self.comm)
        msg = Message(0)
        for k in self.idle:
            self._send(msg.buf, self.layout.spare_rank(k), Tag.RELEASE)
        self.released, self.idle = self.idle, []
        deadline, poll = time.monotonic() + self.timeout, Poller()
        while self.ready < self.slots.given and time.monotonic() < deadline:
            self.poll()  # JOIN_READY now sends RELEASE
            poll.pause()

    def figures(self) -> dict:
        return {"spares": self.K, "replacements": self.replacements, "joins": self.joins,
                "shard_replacements": self.shard_replacements,
                "spares_idle_at_end": len(self.released)}


def wait_for_assignment(comm) -> dict | None:
    """On a spare: wait for the chief's ASSIGN or RELEASE (None). ASSIGN says what it becomes:
    ``{"role": "replica", "index": R + k, "data": data shard}`` or ``{"role": "shard",
    "index": S + k, "heals": [(dead shard, spare shard), ...], "dead": [...]}``, with
    ``assigned_at`` added. No deadline: an idle spare waits for the whole run, and the run's
    end always releases it (a failed run aborts every rank)."""
    net, st, msg = Transport(comm), status(), Message(0)
    while True:
        if net.probe(st, Tag.ASSIGN, CHIEF):
            return {**net.take_obj(CHIEF, Tag.ASSIGN), "assigned_at": time.time()}
        if net.probe(st, Tag.RELEASE, CHIEF):
            net.take(msg.buf, CHIEF, Tag.RELEASE)
            return None
        time.sleep(IDLE_POLL_S)  # not Poller's 1 ms: K idle spares would take a core
