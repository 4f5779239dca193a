"""A replica's side of replicated server shards: fetches and pushes routed to each set's
primary, re-sent to a new primary on failover, and the chief's taking of every set's final
state (the protocol is described in :mod:`hpcps.ps.replicated`)."""
from __future__ import annotations

import time

import numpy as np

from hpcps.compress.bf16 import FP32, Wire
from hpcps.mpi.comm import (REQUEST_NULL, Transport, abandon, done, reply_spin_s, size_of,
                             status, test, wait_until)
from hpcps.mpi.protocol import HEADER_BYTES, ByteMessage, H, Message, Tag
from hpcps.ps.client import fill_packed
from hpcps.ps.liveness import DROPPED, Dropped, HeartbeatThread
from hpcps.ps.replicated.placement import assemble, primary



def live_ranks(view: dict, shard_ranks) -> list[int]:
    """World ranks of the shards a :meth:`ReplicatedClient.view` knows to serve and not
    found dead (``shard_ranks[j]``: shard j's world rank)."""
    dead = set(view["dead"])
    return [shard_ranks[j] for j in sorted(view["members"]) if j not in dead]

class ReplicatedClient:
    """A replica's fetches and pushes when every set has a primary and secondaries.

    The same calls as :class:`hpcps.ps.client.Client`; in addition it listens, while it waits,
    for ``PUSH_ACK`` (a push committed) and ``NEW_PRIMARY`` (send what is still outstanding
    for that set to its new primary).
    """

    def __init__(self, comm, shard_ranks, plan, replica: int, timeout: float, copies: int,
                 packed_bytes: list[int] | None = None, n_sets: int | None = None,
                 wire: Wire = FP32):
        self.comm = comm
        self.net = Transport(comm)
        # every shard index's world rank: the S shards, then (--spares) the spares, which may
        # become shards and primaries; ``members`` are those known to serve
        self.shard_ranks = list(shard_ranks)
        self.S = len(self.shard_ranks) if n_sets is None else n_sets
        self.C = copies
        self.members = set(range(self.S))
        self.plan = plan
        self.replica = replica
        self.timeout = timeout
        self.dead: set[int] = set()
        self.route = [self.shard_ranks[primary(h, self.S, copies, ())] for h in range(self.S)]
        sizes = plan.sizes
        self._params = [Message(n, wire) for n in sizes]
        self._fetch_req = [REQUEST_NULL] * self.S
        self._ask = []
        for h in range(self.S):
            ask = Message(0)
            ask.header[H.SENDER], ask.header[H.SET] = replica, h
            self._ask.append(ask)
        if packed_bytes is None:
            self._push = [[Message(n, wire), Message(n, wire)] for n in sizes]
        else:
            self._push = [[ByteMessage(b), ByteMessage(b)] for b in packed_bytes]
        self._push_req = [[REQUEST_NULL, REQUEST_NULL] for _ in range(self.S)]
        self._push_seq = [[0, 0] for _ in range(self.S)]
        self._push_out = [[None, None] for _ in range(self.S)]  # (bytes view, tag) as sent
        self.seq = 0
        self.acked = [0] * self.S
        self._small = Message(0)
        self._done_msg = Message(0)
        self._done_msg.header[H.SENDER] = replica
        self.heartbeat: HeartbeatThread | None = None
        # called between polls while a fetch or push waits (the chief's spare pool: a loss
        # reported while the chief waits for a set's new primary is acted on at once)
        self.while_waiting = None
        self.versions = np.zeros(self.S)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.resent = 0
        self.reroutes = 0
        self.last_reply: dict[str, float] = {}

    # -- what it knows of the shards -------------------------------------------------------------
    def view(self) -> dict:
        """Each set's primary, the shards found dead and those known to serve: what a rank
        that joined the job later missed of the ``NEW_PRIMARY`` messages (the chief hands
        it this view with its assignment)."""
        return {"route": list(self.route), "dead": sorted(self.dead),
                "members": sorted(self.members)}

    def adopt(self, view: dict) -> None:
        """Take another replica's :meth:`view` (before the first fetch)."""
        self.route = [int(r) for r in view["route"]]
        self.dead = {int(j) for j in view["dead"]}
        self.members = {int(j) for j in view["members"]}
        if self.heartbeat is not None:
            self.heartbeat.dests = self.live_ranks()

    def live_ranks(self) -> list[int]:
        """World ranks of the shards known to serve and not found dead."""
        return live_ranks(self.view(), self.shard_ranks)

    # -- events --------------------------------------------------------------------------------
    def _events(self) -> bool:
        """Take acknowledgements and role changes; True if a set was re-routed."""
        if self.while_waiting is not None:
            self.while_waiting()
        st = status()
        moved = False
        while self.net.probe(st, Tag.PUSH_ACK):
            if not self.net.taken(self._small.buf, st.Get_source(), Tag.PUSH_ACK):
                continue  # (ULFM) its shard died: the push is sent again to its successor
            h, seq = int(self._small.header[H.SET]), int(self._small.header[H.SEQ])
            self.acked[h] = max(self.acked[h], seq)
        while self.net.probe(st, Tag.NEW_PRIMARY):
            if not self.net.taken(self._small.buf, st.Get_source(), Tag.NEW_PRIMARY):
                continue  # (ULFM) the new primary died too: its successor says so again
            hd = self._small.header
            moved |= self._reroute(int(hd[H.SET]), int(hd[H.SENDER]), int(hd[H.PEER]))
        return moved

    def _reroute(self, h: int, a: int, d: int) -> bool:
        if a in self.dead or h < 0:  # from a shard found dead that serves on (it will leave)
            return False
        self.dead.add(d)
        self.members.add(a)
        if self.heartbeat is not None:
            self.heartbeat.dests = self.live_ranks()
        new = self.shard_ranks[a]
        if self.route[h] == new:
            return False
        self.route[h] = new
        self.reroutes += 1
        req = self._fetch_req[h]
        state = test(req) if req != REQUEST_NULL else True
        if state is not True:  # a fetch of h in flight, or one that failed (its sender died)
            if state is None or not self.net.cancel(req, time.monotonic() + 1.0,
                                                    self._params[h].buf):
                self._params[h] = self._params[h].fresh()  # MPI may still write there
            self._fetch_req[h] = self.net.post_recv(self._params[h].buf, new, Tag.PARAMS)
            self.net.send_eager(self._ask[h].buf, new, Tag.FETCH)
        for slot in sorted((0, 1), key=lambda k: self._push_seq[h][k]):
            if self._push_seq[h][slot] <= self.acked[h] or self._push_out[h][slot] is None:
                continue
            data, tag = self._push_out[h][slot]
            req = self._push_req[h][slot]
            if req != REQUEST_NULL and not done(req):  # to the dead: its buffer stays
                old = self._push[h][slot]
                abandon(req, old.buf)
                fresh = old.fresh() if isinstance(old, Message) else \
                    ByteMessage(len(old.body))
                fresh.buf[:len(data)] = data
                self._push[h][slot] = fresh
                data = fresh.buf[:len(data)]
                self._push_out[h][slot] = (data, tag)
            self._push_req[h][slot] = self.net.send_nowait(data, new, tag)
            self.resent += 1
        return True

    def _wait(self, ready, what, spin_s: float = 0.0) -> None:
        """Wait for ``ready()``, taking acknowledgements and role changes meanwhile; a set
        re-routed to a new primary starts the timeout again (``spin_s``: ``wait_until``'s)."""
        wait_until(ready, self.timeout, lambda: f"{what()}; no shard took over",
                   events=self._events, spin_s=spin_s)

    # -- the calls ------------------------------------------------------------------------------
    def fetch(self, params: np.ndarray) -> dict[str, float]:
        self._events()
        for h in range(self.S):
            self._fetch_req[h] = self.net.post_recv(self._params[h].buf, self.route[h],
                                                    Tag.PARAMS)
        for h in range(self.S):  # header only, to a rank that posted its receive first
            self.net.send_eager(self._ask[h].buf, self.route[h], Tag.FETCH)
        self._wait(lambda: all(done(r) for r in self._fetch_req),
                   lambda: f"parameters from server ranks {self.route}", reply_spin_s())
        if any(m.header[H.STEPS] == DROPPED for m in self._params):
            raise Dropped("a server shard lost this replica (silent past the heartbeat "
                          "timeout) and discards its pushes")
        for h in range(self.S):
            msg = self._params[h]
            if int(msg.header[H.SET]) != h:
                raise RuntimeError(f"asked rank {self.route[h]} for set {h}, got set "
                                   f"{int(msg.header[H.SET])}")
            msg.unpack()
            self.plan.put(h, msg.payload, params)
            self.versions[h] = msg.header[H.VERSION]
            self.bytes_received += msg.buf.nbytes
        self.bytes_sent += self._ask[0].buf.nbytes * self.S
        hd = self._params[0].header
        self.last_reply = {"step": int(hd[H.STEPS]), "loss": float(hd[H.LOSS_SUM]),
                           "staleness": float(hd[H.STALENESS]),
                           "max_staleness": float(hd[H.MAX_STALENESS]),
                           "clock": float(hd[H.CLOCK]), "unpersisted": 0,
                           "stopping": any(m.header[H.STOP] for m in self._params)}
        return self.last_reply

    def _slot(self, h: int, slot: int):
        """Set ``h``'s push buffer in ``slot`` once the push it held is committed."""
        def free() -> bool:
            return self._push_seq[h][slot] <= self.acked[h] and done(self._push_req[h][slot])
        self._wait(free, lambda: f"server rank {self.route[h]} to commit push "
                   f"{self._push_seq[h][slot]} of set {h}")
        msg = self._push[h][slot]
        hd = msg.header
        hd[H.VERSION], hd[H.SENDER], hd[H.SET], hd[H.SEQ] = (self.versions[h], self.replica,
                                                             h, self.seq)
        return msg

    def _send(self, h: int, slot: int, data, tag: int) -> None:
        self._push_seq[h][slot] = self.seq
        self._push_out[h][slot] = (data, tag)
        self._push_req[h][slot] = self.net.send_nowait(data, self.route[h], tag)
        self.bytes_sent += data.nbytes

    def push(self, grad: np.ndarray, steps: int, loss_sum: float) -> None:
        self._events()
        self.seq += 1
        slot = self.seq & 1
        for h in range(self.S):
            msg = self._slot(h, slot)
            msg.header[H.STEPS], msg.header[H.LOSS_SUM] = steps, loss_sum
            self.plan.take(h, grad, out=msg.payload)
            msg.pack()
            self._send(h, slot, msg.buf, Tag.PUSH)

    def push_packed(self, bodies, steps: int, loss_sum: float, tag: int = Tag.PUSH_COMPRESSED,
                    rows: int = 0) -> None:
        self._events()
        self.seq += 1
        slot = self.seq & 1
        for h, body in enumerate(bodies):
            data = fill_packed(self._slot(h, slot), body, steps, loss_sum, rows, f"set {h}")
            self._send(h, slot, data, tag)

    def done(self, stop: bool = False) -> None:
        """Wait until every push is committed, then tell every live shard (``stop``: rank 0
        stopped the run early, and the shards tell the other replicas to end)."""
        self._done_msg.header[H.STOP] = float(stop)
        self._wait(lambda: all(a >= self.seq for a in self.acked) and all(
            done(r) for pair in self._push_req for r in pair),
            lambda: f"server ranks {self.route} to commit the last pushes")
        for j, rank in enumerate(self.shard_ranks):  # the spares too: any may hold a set
            if j not in self.dead:
                self.net.send_eager(self._done_msg.buf, rank, Tag.DONE)

    def figures(self) -> dict:
        return {"pushes_committed": self.seq, "resent_pushes": self.resent,
                "reroutes": self.reroutes}


def receive_final(comm, plan, keys, shard_ranks, heartbeat_timeout: float,
                  timeout: float, replicas: int) -> tuple:
    """On the chief: every set's final state, from whichever shard is its primary at the end,
    then FINAL_DONE to every shard. Returns (global params, global state, step, pushes applied
    to each set, and for each set each replica's pushes it applied: the last SEQ its copies
    took from each of the ``replicas`` replica indices, the dead ones' included). A set sent
    twice (its primary died as it ended, and a secondary took over) is taken once; a message
    that breaks off (its sender died) is dropped."""
    parts: dict[int, np.ndarray] = {}
    steps, applied = [], {}
    net = Transport(comm)
    st = status()
    since = time.monotonic()  # one timeout for every set, not one each
    while len(parts) < plan.n_shards:
        wait_until(lambda: net.probe(st, Tag.FINAL_SET), timeout,
                   lambda: "the final state of chunk sets "
                   f"{sorted(set(range(plan.n_shards)) - set(parts))}", since=since)
        msg = np.empty(size_of(st), dtype=np.uint8)
        if not net.take_by(msg, st.Get_source(), Tag.FINAL_SET,
                           time.monotonic() + heartbeat_timeout):
            continue
        header = msg[:HEADER_BYTES].view(np.float64)
        h = int(header[H.SET])
        if h not in parts:
            parts[h] = msg[HEADER_BYTES:].view(np.float32)
            steps.append(int(header[H.STEPS]))
            applied[h] = int(header[H.PEER])
    bye = Message(0)
    # to every shard at once (header only): one that ends stops beating, so the others must
    # hear it too before they could take it for dead; sends to dead ones are given up
    reqs = [net.send_nowait(bye.buf, rank, Tag.FINAL_DONE) for rank in shard_ranks]
    deadline = time.monotonic() + 1.0
    while not all(done(r) for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.001)
    params, state = assemble(plan, parts, keys)
    by_replica = []
    for h in range(plan.n_shards):
        start = plan.sizes[h] * (1 + len(keys))
        by_replica.append([int(v) for v in parts[h][start:start + replicas]])
    return (params, state, min(steps), [applied[h] for h in range(plan.n_shards)],
            by_replica)
