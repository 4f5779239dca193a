"""A shard of replicated server shards: serve every set it holds, as primary or secondary,
take over a set whose primary died, and send the sets' final state to the chief (the protocol
is described in :mod:`hpcps.ps.replicated`)."""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from hpcps.compress import bf16
from hpcps.compress.bf16 import FP32, Wire
from hpcps.mpi.comm import PeerTimeout, Transport, abandon, size_of, status, test
from hpcps.mpi.protocol import HEADER_BYTES, ByteMessage, H, Message, Tag
from hpcps.ps.gradient_shard import ShardPolicy
from hpcps.ps.liveness import (HEARTBEATS_PER_TIMEOUT, Dismissed, HeartbeatThread, Liveness,
                               send_dropped, take_heartbeats)
from hpcps.ps.serve import serve
from hpcps.ps.replicated.placement import holders, primary, state_size


class SetPolicy(ShardPolicy):
    """The policy of one set's copy: ``inner`` (Downpour's by default, or a consistency
    model of :mod:`hpcps.ps.consistency`), whose every call it passes on, and a fetch reply
    that names the set.

    Every copy runs the same deterministic ``inner`` on the same pushes in the primary's order
    (state-machine replication), so the copies stay equal, the policy's own state included
    (a softsync buffer, SSP clocks); ``snapshot``/``restore`` carry that state in
    ``SET_STATE``. What does not come in that order is kept out of it: the end-of-run flush
    (``on_end``) runs on the primary alone as the set closes, not on a DONE, which reaches
    each copy at its own point of the push order (the replicated server keeps the set's
    ``done`` apart, so ``inner.on_done`` never sees every replica done).
    """

    def __init__(self, h: int, inner: ShardPolicy | None = None):
        self.h = h
        self.inner = inner if inner is not None else ShardPolicy()

    def on_push(self, shard, sender, header, grad) -> None:
        self.inner.on_push(shard, sender, header, grad)

    def may_answer(self, shard, sender) -> bool:
        return self.inner.may_answer(shard, sender)

    def on_done(self, shard, sender) -> None:
        self.inner.on_done(shard, sender)

    def on_answer(self, shard, sender, header) -> None:
        self.inner.on_answer(shard, sender, header)
        header[H.SET] = self.h

    def on_end(self, shard) -> None:
        self.inner.on_end(shard)

    def snapshot(self) -> np.ndarray:
        return self.inner.snapshot()

    def restore(self, values: np.ndarray) -> None:
        self.inner.restore(values)


# -- the shard ----------------------------------------------------------------------------------
class ReplicatedServer:
    """Serve every set this shard holds, as primary or secondary, until each has ended.

    Parameters
    ----------
    comm : the world communicator.
    me : this shard's index.
    shard_ranks, replica_ranks : world rank of each shard, of each replica.
    copies : C.
    sets : ``{h: GradientShard}``, this shard's copy of each set it holds (their serving loop
        is not used: this class receives, they apply and answer).
    keys : optimizer state vectors, in message order.
    heartbeat_timeout : seconds of silence after which a replica or a shard is lost.
    timeout : seconds without any message before failing.
    save : ``save(step, {h: payload})`` on the collector, to write a periodic checkpoint.
    chief : world rank of the chief, which takes the final sets.
    n_sets : chunk sets S (default: one per rank of ``shard_ranks``); ranks past them are the
        spares' (``--spares``), shard S + k once the chief makes spare k restore copies.
    make_set : ``make_set(h)``, a new empty copy of set ``h`` (a spare's, filled by the
        state its primary sends); with ``liveness`` and ``inbox`` (the largest dense and
        packed message) when ``sets`` starts empty.
    wire : the format of dense pushes' values (``--wire-dtype``): a push is forwarded to the
        secondaries as it came, so every copy decodes the same values.
    """

    def __init__(self, comm, me: int, shard_ranks, replica_ranks, copies: int, sets: dict,
                 keys, heartbeat_timeout: float, timeout: float, save=None, chief: int = 0,
                 n_sets: int | None = None, make_set=None, liveness=None, inbox=None,
                 wire: Wire = FP32):
        self.comm, self.me = comm, me
        self.net = Transport(comm)
        self.shard_ranks, self.replica_ranks = list(shard_ranks), list(replica_ranks)
        self.S = len(self.shard_ranks) if n_sets is None else n_sets
        self.R, self.C = len(self.replica_ranks), copies
        self.sets = sets
        self.make_set = make_set
        # each set's holders in succession order; a spare restoring a dead shard's copies is
        # appended to each of its sets (every shard applies the chief's HEALs in one order)
        self.holders = {h: holders(h, self.S, copies) for h in range(self.S)}
        self.members = set(range(self.S)) | {me}  # shard indices that serve (or served)
        self.heals: list[dict] = []  # sets this shard, as primary, sent to a spare
        self.filled = set(sets)  # sets whose whole state this copy holds
        self._dismissed: set[int] = set()  # shards found dead and told so
        self.filled_at: dict[int, float] = {}  # a spare's: when each set's state came
        self.keys = list(keys)
        self.hb = heartbeat_timeout
        self.timeout = timeout
        self.save = save
        self.chief = chief
        # ranks that serve as shards: a spare's rank only once it holds sets (before, or
        # instead, it may train as a replica, and its messages are a replica's)
        self.shard_of = {rank: j for j, rank in enumerate(self.shard_ranks)
                         if j < self.S or j == me}
        # the replicas' heartbeats, ranks and the fatal one, shared by the sets' copies
        self.replicas = liveness if liveness is not None else \
            next(iter(sets.values())).liveness
        self.replica_of = self.replicas.replica_of
        self.peers = Liveness(len(self.shard_ranks), heartbeat_timeout)
        self.dead: set[int] = set()
        self.done: set[int] = set()  # replicas finished or lost
        self.lost_replicas: dict[int, str] = {}
        self.lost_after_s: dict[int, float] = {}
        self.lost_shards: dict[int, str] = {}
        self.role = {h: "primary" if primary(h, self.S, copies, ()) == me else "secondary"
                     for h in sets}
        self.last_seq: dict[int, dict] = {h: {} for h in sets}
        self.applied = {h: 0 for h in sets}      # pushes applied to the set (all copies agree)
        self.committed = {h: 0 for h in sets}    # pushes acknowledged by this shard as primary
        self.acked = {h: {x: 0 for x in holders(h, self.S, copies) if x != me} for h in sets}
        self.pending: dict[int, deque] = {h: deque() for h in sets}  # (applied, rank, seq)
        self.held: list[tuple[int, int, int, float]] = []  # fetches (set, rank, replica, since)
        self.final_sent: set[int] = set()  # sets whose final state went to the chief
        self.ended = False                 # the chief holds every set: leave
        self.stopping = False              # rank 0 stopped the run early (its DONE)
        self.sends: list[tuple[object, object, int]] = []  # (request, buffer, dest rank)
        self.ckpt: dict[int, dict[int, np.ndarray]] = {}
        self.takeovers: list[dict] = []
        self._first_served: dict[int, int] = {}  # set -> index in takeovers, until served
        self.replicated = 0  # pushes applied as a secondary
        self.discarded = 0   # pushes from replicas already lost
        self.abandoned = 0   # sends given up because their destination died
        if inbox is None:
            biggest = max(len(cs.params) for cs in sets.values())
            packed = [cs for cs in sets.values() if cs._packed is not None]
            inbox = (biggest, max(len(cs._packed.buf) for cs in packed) if packed else 0)
        self.wire = wire
        self._inbox = Message(inbox[0], wire)
        self._grad = np.empty(inbox[0], np.float32)  # a dense push's values, decoded
        self._packed_bound = inbox[1]
        self._inbox_packed = ByteMessage(self._packed_bound) if self._packed_bound else None
        self._small = Message(0)
        self._hb_status = status()  # heartbeats taken before silence is judged
        self.on_lost = None  # --spares: told of each replica lost (hpcps.ps.spares)
        self.on_shard_lost = None  # --spares: told of each shard found dead
        self.heartbeat = HeartbeatThread(comm, self._peer_ranks(), me,
                                         heartbeat_timeout / HEARTBEATS_PER_TIMEOUT)

    def _peer_ranks(self) -> list[int]:
        return [self.shard_ranks[j] for j in sorted(self.members - self.dead - {self.me})]

    # -- views ---------------------------------------------------------------------------------
    def primary_of(self, h: int) -> int | None:
        return next((x for x in self.holders[h] if x not in self.dead), None)

    def secondaries(self, h: int) -> list[int]:
        return [x for x in self.holders[h] if x != self.me and x not in self.dead]

    def _dest_dead(self, rank: int) -> bool:
        j = self.shard_of.get(rank)
        if j is not None:
            return j in self.dead
        r = self.replica_of.get(rank)
        return r is not None and r in self.lost_replicas

    # -- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        handlers = {Tag.PUSH: self._recv_push, Tag.PUSH_COMPRESSED: self._recv_push,
                    Tag.FETCH: self._recv_fetch, Tag.DONE: self._recv_done,
                    Tag.HEARTBEAT: self._recv_heartbeat,
                    Tag.REPLICATE: self._recv_replicate,
                    Tag.REPLICATE_PACKED: self._recv_replicate,
                    Tag.REPL_ACK: self._recv_repl_ack, Tag.NEW_PRIMARY: self._recv_new_primary,
                    Tag.SET_STATE: self._recv_set_state, Tag.FINAL_DONE: self._recv_final_done,
                    Tag.CKPT_SET: self._recv_ckpt, Tag.EXPECT: self._recv_expect,
                    Tag.HEAL: self._recv_heal}
        self.heartbeat.start()
        try:
            serve(self.comm, handlers, self.timeout, self._waiting_for, self._tick,
                  stalled=self._excuse, stall_s=self.hb)
            for cs in self.sets.values():
                cs.drain_replies()
        finally:
            self.heartbeat.stop()

    def _waiting_for(self) -> str:
        return (f"replicas {sorted(set(range(self.R)) - self.done)} to finish, then the "
                "chief to take every set's final state")

    def _finished(self) -> bool:
        self._reap()
        return self.ended

    def _excuse(self, gap: float) -> None:
        """This loop did not run for ``gap`` seconds (the rank was stopped or starved): the
        others' silence meanwhile says nothing of them, and the time does not count against
        the replies in flight. If the others found this shard dead meanwhile, they say so
        (NEW_PRIMARY naming it) as soon as they hear from it, and it leaves."""
        self.peers.heard_all()
        self.replicas.heard_all()
        for cs in self.sets.values():
            cs.excuse(gap)

    def _tick(self) -> bool:
        for cs in self.sets.values():  # fetch replies in flight: done, or their replica lost
            cs.reap_replies()
            self._losses_of(cs)
        take_heartbeats(self.net, self._hb_status, self._recv_heartbeat)
        if self.me < self.S or "primary" in self.role.values():  # a spare holding only
            # copies hears no heartbeats from the replicas: it judges them once it serves them
            for r in self.replicas.silent([r for r in range(self.R) if r not in self.done]):
                self._lose_replica(r, f"silent for more than {self.hb:g} s")
        for x in self.peers.silent(sorted(self.members - self.dead - {self.me})):
            self._shard_lost(x, f"silent for more than {self.hb:g} s")
        self._close_sets()
        return self._finished()

    def _reap(self) -> None:
        """Forget finished sends, and give up those to a rank now dead."""
        still = []
        for req, buf, dest in self.sends:
            finished = test(req)
            if finished:
                continue
            if finished is None:  # failed: its destination died
                self.abandoned += 1
                continue
            if self._dest_dead(dest):  # (MPI may still read the buffer: abandon keeps it)
                abandon(req, buf)
                self.abandoned += 1
                continue
            still.append((req, buf, dest))
        self.sends = still

    def _send(self, buf, dest: int, tag: int):
        req = self.net.send_nowait(buf, dest, tag)
        self.sends.append((req, buf, dest))
        return req

    def _send_small(self, dest: int, tag: int, **slots) -> None:
        msg = Message(0)
        msg.header[H.SENDER] = self.me
        for name, value in slots.items():
            msg.header[H[name]] = value
        self._send(msg.buf, dest, tag)

    # -- receiving -----------------------------------------------------------------------------
    def _receive(self, buf, src: int, tag: int) -> bool:
        """Receive a probed message; False if its sender died half-way (then it is lost)."""
        if self.net.take_by(buf, src, tag, time.monotonic() + self.hb):
            return True
        if src in self.shard_of:
            self._shard_lost(self.shard_of[src], f"its message (tag {int(tag)}) broke off")
        else:
            self._lose_replica(self.replica_of.get(src, -1),
                               f"its message (tag {int(tag)}) broke off")
        return False

    def _inbox_for(self, tag: int, size: int, src: int):
        dense = tag in (Tag.PUSH, Tag.REPLICATE)
        box = self._inbox if dense else self._inbox_packed
        if box is None or size > len(box.buf):
            raise RuntimeError(f"message of {size} bytes (tag {int(tag)}) from rank {src} is "
                               "larger than any valid one for this shard")
        return box, dense

    def _take(self, src: int, status) -> tuple | None:
        """Receive a push or a forwarded push: (header, dense payload or packed body,
        dense?) or None if it broke off."""
        tag, size = status.Get_tag(), size_of(status)
        box, dense = self._inbox_for(tag, size, src)
        if not self._receive(box.buf[:size], src, tag):
            if dense:
                self._inbox = self._inbox.fresh()
            else:
                self._inbox_packed = ByteMessage(self._packed_bound)
            return None
        body = box.buf[HEADER_BYTES:size]
        return box.header, body, dense, box.buf[:size]

    def _apply(self, h: int, header, body, dense: bool) -> bool:
        """Apply a push to this shard's copy of set ``h`` unless it holds it already."""
        cs = self.sets[h]
        sender, seq = int(header[H.SENDER]), int(header[H.SEQ])
        last = self.last_seq[h].get(sender, 0)
        if seq <= last:
            return False
        if seq != last + 1:
            raise RuntimeError(f"set {h}: push {seq} of replica {sender} follows its push "
                               f"{last}; pushes in between were lost")
        cs.check_push(header)
        if dense:
            grad = body.view(self.wire.dtype)
            if len(grad) != len(cs.params):
                raise RuntimeError(f"set {h}: a push of {len(grad)} values for "
                                   f"{len(cs.params)} parameters")
            if self.wire.bf16:
                grad = bf16.decode(grad, self._grad[:len(grad)])
        else:
            grad = cs.decode(header, body)
        cs.policy.on_push(cs, sender, header, grad)
        self.last_seq[h][sender] = seq
        self.applied[h] += 1
        return True

    def _recv_push(self, src: int, status) -> bool:
        got = self._take(src, status)
        if got is None:
            return self._finished()
        header, body, dense, raw = got
        h, sender = int(header[H.SET]), int(header[H.SENDER])
        if h not in self.sets or self.role[h] != "primary":
            raise RuntimeError(f"replica {sender} (rank {src}) pushed set {h} to shard "
                               f"{self.me}, which is not its primary")
        if sender in self.lost_replicas:  # dropped (silent too long): not applied, but
            self.discarded += 1            # answered, so that it does not wait for it
            self._send_small(src, Tag.PUSH_ACK, SET=h, SEQ=int(header[H.SEQ]))
            return False
        self.replicas.heard(sender)
        self._served(h)
        if self._apply(h, header, body, dense):
            copy = np.array(raw)  # the inbox takes the next message at once
            tag = Tag.REPLICATE if dense else Tag.REPLICATE_PACKED
            for x in self.secondaries(h):
                self._send(copy, self.shard_ranks[x], tag)
        self.pending[h].append((self.applied[h], src, int(header[H.SEQ])))
        self._commit(h)
        self._release()
        return False

    def _commit(self, h: int) -> None:
        """Acknowledge every push of set ``h`` that every live secondary holds. Counted in
        pushes applied, not in versions (updates): a softsync group of pushes is one update,
        so a version says nothing of the pushes buffered."""
        acked = [self.acked[h].get(x, -1) for x in self.secondaries(h)]
        upto = min(acked) if acked else float("inf")
        queue = self.pending[h]
        while queue and queue[0][0] <= upto:
            _, dest, seq = queue.popleft()
            if not self._dest_dead(dest):
                self._send_small(dest, Tag.PUSH_ACK, SET=h, SEQ=seq)
            self.committed[h] += 1

    def _recv_replicate(self, src: int, status) -> bool:
        got = self._take(src, status)
        if got is None:
            return self._finished()
        header, body, dense, _ = got
        q, h = self.shard_of.get(src), int(header[H.SET])
        if q is None or q in self.dead:
            if q is not None:
                self._dismiss(q)
            return False  # a late message from a shard found dead
        self.peers.heard(q)
        if h not in self.sets or self.primary_of(h) != q:
            raise RuntimeError(f"shard {q} forwarded a push of set {h} to shard {self.me}, "
                               f"whose primary for it is {self.primary_of(h)}")
        if h not in self.filled:  # a spare whose copy of h never came (the others found
            return False          # this shard dead meanwhile): nothing to apply it to
        if self._apply(h, header, body, dense):
            self.replicated += 1
        self._send_small(src, Tag.REPL_ACK, SET=h, PEER=self.applied[h])
        return False

    def _recv_repl_ack(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.REPL_ACK)
        q, h = self.shard_of[src], int(self._small.header[H.SET])
        if q in self.dead:
            self._dismiss(q)
            return False
        if h not in self.sets:
            return False
        self.peers.heard(q)
        if self.acked[h].get(q, 0) < 0:  # a spare holds its copy now: C copies again
            for rec in self.heals:
                if rec["set"] == h and rec["to_shard"] == q and rec["restored_at"] is None:
                    rec["restored_at"] = time.time()
        self.acked[h][q] = int(self._small.header[H.PEER])
        self._commit(h)
        self._close_sets()
        return self._finished()

    def _recv_fetch(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.FETCH)
        h, sender = int(self._small.header[H.SET]), int(self._small.header[H.SENDER])
        if h not in self.sets or self.role[h] != "primary":
            raise RuntimeError(f"replica {sender} (rank {src}) asked shard {self.me} for set "
                               f"{h}, whose primary it is not")
        if sender in self.lost_replicas:  # alive after all: it leaves rather than wait
            send_dropped(self.net, src, h)
            return self._finished()
        self.replicas.heard(sender)
        self._served(h)
        self.held.append((h, src, sender, time.perf_counter()))
        self._release()  # answered now, unless --staleness-bound holds it
        if self.held and self.held[-1][:3] == (h, src, sender):
            self.sets[h].stats.held_fetches += 1
        return self._finished()

    def _losses_of(self, cs) -> None:
        """A set's copy lost a replica (its fetch reply broke off): the shard loses it."""
        for r, why in list(cs.stats.lost_replicas.items()):
            if r not in self.lost_replicas:
                self._lose_replica(r, why)

    def _release(self) -> None:
        """Answer the fetches the policy lets through (a push, a DONE or a loss may release
        held ones), in the order they came: a replica matches replies from one shard to its
        receives in the order it posted them, so a shard that serves several sets (after a
        takeover) never answers a replica's later fetch before an earlier one it holds."""
        still, blocked, touched = [], set(), []
        for h, src, sender, since in self.held:
            cs = self.sets[h]
            if sender in self.lost_replicas or sender in cs.stats.lost_replicas:
                continue
            if sender in blocked or not cs.policy.may_answer(cs, sender):
                blocked.add(sender)
                still.append((h, src, sender, since))
                continue
            cs.stats.held_s += time.perf_counter() - since
            cs.answer_fetch(src, sender)
            touched.append(cs)
        self.held = still
        for cs in touched:
            self._losses_of(cs)

    def _recv_done(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.DONE)
        sender = int(self._small.header[H.SENDER])
        if self._small.header[H.STOP]:  # rank 0 stopped early: the replicas end too
            self.stopping = True
            for cs in self.sets.values():
                cs.stopping = True
        if sender not in self.done:
            self.done.add(sender)
            for cs in self.sets.values():  # SSP: no longer waited for (every copy hears it)
                cs.policy.on_done(cs, sender)
            self._release()
        self._close_sets()
        return self._finished()

    def _recv_heartbeat(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.HEARTBEAT)
        if src in self.shard_of:
            if self.shard_of[src] in self.dead:
                self._dismiss(self.shard_of[src])
                return False
            self.peers.heard(self.shard_of[src])
        else:
            self.replicas.heard(int(self._small.header[H.SENDER]))
        return False

    def idle(self, replicas) -> None:
        """--spares: replica indices not expected until a spare takes one."""
        self.done.update(replicas)

    def _recv_expect(self, src: int, status) -> bool:
        """EXPECT from the chief: replica SENDER (a spare) joins now, at world rank PEER."""
        self.net.take(self._small.buf, src, Tag.EXPECT)
        r, rank = int(self._small.header[H.SENDER]), int(self._small.header[H.PEER])
        self.replica_ranks[r] = rank
        self.done.discard(r)
        self.replicas.moved(r, rank)
        return False

    def _recv_new_primary(self, src: int, status) -> bool:
        """NEW_PRIMARY from shard SENDER: it holds set SET as primary now, shard PEER being
        dead; with PEER this shard (and SET -1 when it only answers a message of ours), the
        others found this shard dead: it leaves (they hold what it held)."""
        self.net.take(self._small.buf, src, Tag.NEW_PRIMARY)
        hd = self._small.header
        a, d = int(hd[H.SENDER]), int(hd[H.PEER])
        if d == self.me:
            raise Dismissed(f"shard {a} found this shard {self.me} dead (nothing heard from it "
                            f"for {self.hb:g} s, --heartbeat-timeout: it was stopped or "
                            "starved) and the others hold its chunk sets; it leaves the run")
        if a in self.dead:
            self._dismiss(a)
            return False
        self._shard_lost(d, f"shard {a} found it dead")
        return self._finished()

    def _dismiss(self, q: int) -> None:
        """A message came from shard ``q``, which this shard found dead: tell it so, once (a
        shard that was only stopped past the timeout would serve on beside its successors)."""
        if q not in self._dismissed and q != self.me:
            self._dismissed.add(q)
            self._send_small(self.shard_ranks[q], Tag.NEW_PRIMARY, SET=-1, PEER=q)

    def _recv_set_state(self, src: int, status) -> bool:
        size = size_of(status)
        msg = np.empty(size, dtype=np.uint8)
        q = self.shard_of[src]
        if not self._receive(msg, src, Tag.SET_STATE):
            return self._finished()
        header = msg[:HEADER_BYTES].view(np.float64)
        payload = msg[HEADER_BYTES:].view(np.float32)
        h = int(header[H.SET])
        if q in self.dead:
            self._dismiss(q)
            return False
        if h not in self.sets and self.make_set is not None:  # a spare's first copy of h
            self._add_set(h)
        if h not in self.sets:
            return False
        cs, n = self.sets[h], len(self.sets[h].params)
        cs.params[:] = payload[:n]
        for i, k in enumerate(self.keys):
            cs.state[k][:] = payload[(i + 1) * n:(i + 2) * n]
        end = state_size(n, len(self.keys), self.R)
        tail = payload[n * (1 + len(self.keys)):end]
        self.last_seq[h] = {r: int(v) for r, v in enumerate(tail) if v > 0}
        cs.policy.restore(payload[end:].view(np.float64))
        cs.step, cs.version = int(header[H.STEPS]), int(header[H.VERSION])
        self.applied[h] = int(header[H.PEER])
        if h not in self.filled:
            self.filled_at[h] = time.time()
            if self.me >= self.S:  # a spare: rank 0 keeps when each set was whole again
                msg = Message(0)
                msg.header[H.SENDER], msg.header[H.SET] = self.me, h
                msg.header[H.CLOCK] = self.filled_at[h]
                self._send(msg.buf, self.chief, Tag.RESTORED)
        self.filled.add(h)
        self._send_small(src, Tag.REPL_ACK, SET=h, PEER=self.applied[h])
        return False

    def _add_set(self, h: int) -> None:
        self.sets[h] = self.make_set(h)
        self.sets[h].stopping = self.stopping
        self.role[h] = "secondary"
        self.last_seq[h], self.applied[h], self.committed[h] = {}, 0, 0
        self.acked[h] = {x: 0 for x in self.holders[h] if x != self.me}
        self.pending[h] = deque()

    def learn_heals(self, heals, dead) -> None:
        """A spare made shard: the chief's HEALs so far and the shards dead, before serving."""
        for d in dead:
            self.dead.add(d)
            self.peers.drop(d)
        for d, n in heals:
            self._append_holder(d, n)
        self.heartbeat.dests = self._peer_ranks()  # not the dead, and every spare shard

    def _append_holder(self, d: int, n: int) -> list[int]:
        """Spare shard ``n`` holds a copy of every set dead shard ``d`` held; the sets."""
        self.members.add(n)
        self.shard_of[self.shard_ranks[n]] = n
        got = []
        for h, hs in self.holders.items():
            if d in hs and n not in hs:
                hs.append(n)
                got.append(h)
        return got

    def _recv_heal(self, src: int, status) -> bool:
        """HEAL from the chief: spare shard PEER takes a copy of dead shard SENDER's sets. A
        primary of one of them sends it the set's state (it serves on meanwhile) and then
        forwards it every push; pushes are committed once it has acknowledged the state."""
        self.net.take(self._small.buf, src, Tag.HEAL)
        d, n = int(self._small.header[H.SENDER]), int(self._small.header[H.PEER])
        if n in self.members:
            return False
        self._shard_lost(d, "the chief was told it is dead")
        self.peers.heard(n)
        for h in self._append_holder(d, n):
            if self.role.get(h) == "primary" and n not in self.dead:
                self._send(self.state_message(h).buf, self.shard_ranks[n], Tag.SET_STATE)
                self.acked[h][n] = -1  # until it acknowledges the state
                self.heals.append({"set": h, "to_shard": n, "from_shard": d,
                                   "sent_at": time.time(), "restored_at": None})
        self.heartbeat.dests = self._peer_ranks()
        return self._finished()

    def _recv_final_done(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.FINAL_DONE)
        self.ended = True  # sends still pending (a set sent twice, a checkpoint) are dropped
        return True

    def _recv_ckpt(self, src: int, status) -> bool:
        size = size_of(status)
        msg = np.empty(size, dtype=np.uint8)
        if not self._receive(msg, src, Tag.CKPT_SET):
            return self._finished()
        header = msg[:HEADER_BYTES].view(np.float64)
        self._collect(int(header[H.STEPS]), int(header[H.SET]), msg[HEADER_BYTES:].view(np.float32))
        return False

    # -- state messages, checkpoints, the end ----------------------------------------------------
    def state_message(self, h: int, step: int | None = None) -> Message:
        cs = self.sets[h]
        n = len(cs.params)
        end = state_size(n, len(self.keys), self.R)
        policy = cs.policy.snapshot()  # float64 values, after the float32 state
        msg = Message(end + 2 * len(policy))
        msg.payload[:n] = cs.params
        for i, k in enumerate(self.keys):
            msg.payload[(i + 1) * n:(i + 2) * n] = cs.state[k]
        tail = msg.payload[n * (1 + len(self.keys)):end]
        tail[:] = 0.0
        for r, seq in self.last_seq[h].items():
            tail[r] = seq
        msg.payload[end:].view(np.float64)[:] = policy
        hd = msg.header
        hd[H.SET], hd[H.SENDER] = h, self.me
        hd[H.STEPS] = cs.step if step is None else step
        hd[H.VERSION], hd[H.PEER] = cs.version, self.applied[h]
        return msg

    def boundary(self, h: int, step: int) -> None:
        """Set ``h``'s copy crossed checkpoint boundary ``step``: its primary sends the set to
        the collector."""
        if self.role.get(h) != "primary" or self.save is None:
            return
        msg = self.state_message(h, step)
        dest = min(self.members - self.dead)  # the collector: the live shard of lowest index
        if dest == self.me:
            self._collect(step, h, msg.payload)
        else:
            self._send(msg.buf, self.shard_ranks[dest], Tag.CKPT_SET)

    def _collect(self, step: int, h: int, payload: np.ndarray) -> None:
        got = self.ckpt.setdefault(step, {})
        got[h] = payload
        if len(got) == self.S:
            self.save(step, got)
            self.ckpt = {b: v for b, v in self.ckpt.items() if b > step}

    def _close_sets(self) -> None:
        """Send the chief the final state of every set this shard is primary of, once every
        replica has finished and every push of the set is committed."""
        if len(self.done) < self.R:
            return
        for h in self.sets:
            if h not in self.final_sent and self.role[h] == "primary" and not self.pending[h]:
                cs = self.sets[h]
                cs.policy.on_end(cs)  # after every push: the same point on any primary
                self._send(self.state_message(h).buf, self.chief, Tag.FINAL_SET)
                self.final_sent.add(h)

    # -- losses --------------------------------------------------------------------------------
    def _lost_ranks(self, *more: int) -> list[int]:
        """World ranks of the shards found dead and the replicas dropped, and ``more``: the
        ranks a failure this shard reports need not be asked for their stacks."""
        return [*(self.shard_ranks[x] for x in self.dead),
                *(self.replica_ranks[r] for r in self.lost_replicas), *more]

    def _lose_replica(self, r: int, why: str) -> None:
        if r < 0 or r in self.lost_replicas:
            return
        if r == 0:
            raise PeerTimeout(f"replica 0 (world rank 0, the chief: it evaluates, writes the "
                              f"final checkpoint and reports) is lost: {why}; the run cannot "
                              "finish without it", lost=self._lost_ranks(self.replica_ranks[0]))
        ended = r not in self.done
        if ended:
            self.replicas.drop(r)
            self.lost_after_s[r] = self.replicas.lost[r]
            self.lost_replicas[r] = why
            self.done.add(r)
        for cs in self.sets.values():
            if r not in cs.stats.lost_replicas:
                cs.stats.lost_replicas[r] = why
            if ended:
                cs.policy.on_done(cs, r)
        if ended and self.on_lost is not None:
            self.on_lost(r)
        self._release()
        self._close_sets()

    def _shard_lost(self, d: int, why: str) -> None:
        if d in self.dead or d == self.me:
            return
        self.peers.drop(d)
        silent = self.peers.lost[d]
        self.dead.add(d)
        self.lost_shards[d] = why
        self.heartbeat.dests = self._peer_ranks()
        if self.on_shard_lost is not None:
            self.on_shard_lost(d, silent)
        for h in range(self.S):
            if self.primary_of(h) is None:
                raise PeerTimeout(f"every copy of chunk set {h} (shards "
                                  f"{self.holders[h]}) is lost: the run cannot go "
                                  "on (raise --ps-copies or --spares to survive more failures)",
                                  lost=self._lost_ranks())
        for h in self.sets:
            if self.role[h] == "secondary" and self.primary_of(h) == self.me:
                if h not in self.filled:
                    raise PeerTimeout(f"every full copy of chunk set {h} is lost: this spare "
                                      f"(shard {self.me}) was still receiving it from its "
                                      "primary when the primary died", lost=self._lost_ranks())
                self._take_over(h, d, silent)
            elif self.role[h] == "primary":
                self.acked[h].pop(d, None)
                self._commit(h)
        self._reap()
        self._close_sets()

    def _take_over(self, h: int, d: int, silent: float) -> None:
        """Become set ``h``'s primary: announce it, bring the other copies to this one."""
        self.role[h] = "primary"
        for r, rank in enumerate(self.replica_ranks):
            if r not in self.lost_replicas:
                self._send_small(rank, Tag.NEW_PRIMARY, SET=h, PEER=d)
        for x in sorted(self.members - self.dead - {self.me}):
            self._send_small(self.shard_ranks[x], Tag.NEW_PRIMARY, SET=h, PEER=d)
        if self.me >= self.S:  # a spare heard no replica until it served them: from now
            now = self.replicas.clock()
            self.replicas.last = [now] * len(self.replicas.last)
        for x in self.secondaries(h):
            self._send(self.state_message(h).buf, self.shard_ranks[x], Tag.SET_STATE)
            self.acked[h][x] = -1  # until it acknowledges the state sent
        self._first_served[h] = len(self.takeovers)
        self.takeovers.append({"set": h, "from_shard": d, "by_shard": self.me,
                               "silent_s": silent,
                               "detected_at": time.time(), "first_served_at": None})

    def _served(self, h: int) -> None:
        i = self._first_served.pop(h, None)
        if i is not None:
            self.takeovers[i]["first_served_at"] = time.time()

    def figures(self) -> dict:
        lost = {self.shard_ranks[d]: why for d, why in self.lost_shards.items()}
        return {"ps_copies": self.C, "sets_held": sorted(self.sets),
                "sets_primary": sorted(h for h, role in self.role.items() if role == "primary"),
                "pushes": sum(cs.stats.pushes for cs in self.sets.values()) - self.replicated,
                "replicated_pushes": self.replicated, "committed": dict(self.committed),
                "applied": {h: self.applied[h] for h in self.sets},
                "takeovers": self.takeovers, "lost_shard_ranks": lost, "heals": self.heals,
                "filled_at": self.filled_at,
                "copies_at_end": {h: 1 + sum(self.acked[h].get(x, 0) >= 0
                                             for x in self.secondaries(h))
                                  for h, role in self.role.items() if role == "primary"},
                "abandoned_sends": self.abandoned, "discarded_pushes": self.discarded}
