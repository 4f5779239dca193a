"""Replicated server shards (``--ps-copies C``): every chunk on C shard ranks, a primary that
applies and secondaries that follow, and a secondary that takes over when its primary dies
(Project Adam, section 3.3).

**Sets and holders.** The chunk plan (:mod:`hpcps.ps.chunks`) gives each of the S shards its
*home set* of chunks. Set ``h`` is held by shards ``h, h+1, ..., h+C-1`` (mod S), in that
order; the first of them alive is the set's *primary*, the others its *secondaries*. Every
shard is the primary of its own home set while it lives and a secondary of the C-1 sets
before it, so copies add the same load to every shard; when shard ``h`` dies, shard ``h+1``
serves set ``h`` besides its own. The rule needs no vote: every rank that agrees on which
shards are dead agrees on every primary (:func:`primary`).

**A push and its commit.** A replica sends its gradient slice for set ``h`` to the set's
primary with its push count ``SEQ`` (1, 2, ...). The primary applies it, forwards the message
as received to each live secondary (``REPLICATE``), which applies the same update to its copy
and answers ``REPL_ACK`` with its copy's version (updates applied). Every copy applies the same
pushes in the same order (one channel per primary-secondary pair, and MPI does not reorder
messages between two ranks), so the copies are equal. A push is **committed** once every live
secondary has acknowledged a version at or past it; only then does the primary send
``PUSH_ACK`` to the replica. A replica keeps each push until it is acknowledged, with at most
two in flight per set.

**Failover.** Every shard sends every other shard a heartbeat 5 times per
``--heartbeat-timeout`` (from a thread of its own, as replicas do); a shard silent for the
timeout is dead to the shard that noticed. The first live holder of each of its sets becomes
the primary, tells every replica and shard (``NEW_PRIMARY``: the set, and which shard is dead)
and sends its copy to the set's other live holders (``SET_STATE``), which replace theirs: a
secondary may have applied a push the old primary forwarded to it alone, which is not
committed. A replica that hears ``NEW_PRIMARY`` sends its waiting fetch and every push not
yet acknowledged to the new primary. Copies remember each replica's last ``SEQ`` applied, so a
push the new primary already holds is acknowledged without being applied again. So **no
committed push is lost** (every live copy holds it), **none is applied twice**, and an
uncommitted one is sent again: at the end, each set has applied exactly the pushes its
replicas saw committed. A shard that hears it was declared dead leaves the run.

**The end.** A set's primary, once every replica has finished (or been lost) and every push
is committed, sends the set's final state to the chief (``FINAL_SET``). The chief keeps the
first copy of each set it receives (a primary that dies as it ends is followed by its
successor, which sends the set again) and, once it holds all S, tells every shard to leave
(``FINAL_DONE``). Nothing waits in a collective over the shards, so a dead shard blocks
nothing. Periodic checkpoints
(``--checkpoint-every``) go the same way: each set's primary sends its state at a boundary
to the *collector*, the live shard of lowest index, which writes the checkpoint once it holds
every set at that step (a boundary crossed while a set's primary died is skipped).

Losing every copy of a set ends the job with an error naming the set.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np
from mpi4py import MPI

from hpcps.mpi.comm import PeerTimeout, Poller
from hpcps.mpi.protocol import HEADER_BYTES, ByteMessage, H, Message, Tag
from hpcps.ps.client import fill_packed
from hpcps.ps.gradient_shard import ShardPolicy
from hpcps.ps.liveness import HEARTBEATS_PER_TIMEOUT, HeartbeatThread, Liveness, finished_by
from hpcps.ps.serve import serve


# -- who holds what: pure ------------------------------------------------------------------------
def holders(h: int, n_shards: int, copies: int) -> list[int]:
    """Shards holding set ``h``, in succession order: the primary while all live, first."""
    return [(h + i) % n_shards for i in range(copies)]


def sets_of(s: int, n_shards: int, copies: int) -> list[int]:
    """Sets shard ``s`` holds: its home set and the C-1 sets before it."""
    return sorted({(s - i) % n_shards for i in range(copies)})


def primary(h: int, n_shards: int, copies: int, dead) -> int | None:
    """The first live holder of set ``h`` (None: every copy is lost)."""
    return next((x for x in holders(h, n_shards, copies) if x not in dead), None)


def collector(n_shards: int, dead) -> int:
    """The live shard that assembles periodic checkpoints: the one of lowest index."""
    return min(x for x in range(n_shards) if x not in dead)


def state_size(n: int, n_keys: int, n_replicas: int) -> int:
    """float32 values of a set's state message: parameters, each optimizer state vector, and
    each replica's last push applied."""
    return n * (1 + n_keys) + n_replicas


def assemble(plan, parts: dict, keys) -> tuple[np.ndarray, dict]:
    """The global parameter and optimizer-state vectors from every set's state payload."""
    params = np.empty(plan.n, dtype=np.float32)
    state = {k: np.empty(plan.n, dtype=np.float32) for k in keys}
    for h, payload in parts.items():
        n = plan.sizes[h]
        plan.put(h, payload[:n], params)
        for i, k in enumerate(keys):
            plan.put(h, payload[(i + 1) * n:(i + 2) * n], state[k])
    return params, state


class SetPolicy(ShardPolicy):
    """Downpour's policy for one set's copy; a fetch reply names the set."""

    def __init__(self, h: int):
        self.h = h

    def on_answer(self, shard, sender, header) -> None:
        header[H.SET] = self.h


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
    """

    def __init__(self, comm, me: int, shard_ranks, replica_ranks, copies: int, sets: dict,
                 keys, heartbeat_timeout: float, timeout: float, save=None, chief: int = 0):
        self.comm, self.me = comm, me
        self.shard_ranks, self.replica_ranks = list(shard_ranks), list(replica_ranks)
        self.S, self.R, self.C = len(self.shard_ranks), len(self.replica_ranks), copies
        self.sets = sets
        self.keys = list(keys)
        self.hb = heartbeat_timeout
        self.timeout = timeout
        self.save = save
        self.chief = chief
        self.shard_of = {rank: j for j, rank in enumerate(self.shard_ranks)}
        self.replica_of = {rank: r for r, rank in enumerate(self.replica_ranks)}
        self.replicas = next(iter(sets.values())).liveness  # shared by the sets' copies
        self.peers = Liveness(self.S, heartbeat_timeout)
        self.dead: set[int] = set()
        self.done: set[int] = set()  # replicas finished or lost
        self.lost_replicas: dict[int, str] = {}
        self.lost_after_s: dict[int, float] = {}
        self.lost_shards: dict[int, str] = {}
        self.role = {h: "primary" if primary(h, self.S, copies, ()) == me else "secondary"
                     for h in sets}
        self.last_seq = {h: {} for h in sets}
        self.applied = {h: 0 for h in sets}      # pushes applied to the set (all copies agree)
        self.committed = {h: 0 for h in sets}    # pushes acknowledged by this shard as primary
        self.acked = {h: {x: 0 for x in holders(h, self.S, copies) if x != me} for h in sets}
        self.pending = {h: deque() for h in sets}  # (version, replica rank, seq) to acknowledge
        self.final_sent: set[int] = set()  # sets whose final state went to the chief
        self.ended = False                 # the chief holds every set: leave
        self.sends: list[tuple[object, object, int]] = []  # (request, buffer, dest rank)
        self.ckpt: dict[int, dict[int, np.ndarray]] = {}
        self.takeovers: list[dict] = []
        self._first_served: dict[int, int] = {}  # set -> index in takeovers, until served
        self.replicated = 0  # pushes applied as a secondary
        self.discarded = 0   # pushes from replicas already lost
        self.abandoned = 0   # sends given up because their destination died
        biggest = max(len(cs.params) for cs in sets.values())
        self._inbox = Message(biggest)
        packed = [cs for cs in sets.values() if cs._packed is not None]
        self._packed_bound = max(len(cs._packed.buf) for cs in packed) if packed else 0
        self._inbox_packed = ByteMessage(self._packed_bound) if packed else None
        self._small = Message(0)
        self.heartbeat = HeartbeatThread(comm, [r for j, r in enumerate(self.shard_ranks)
                                                if j != me], me,
                                         heartbeat_timeout / HEARTBEATS_PER_TIMEOUT)

    # -- views ---------------------------------------------------------------------------------
    def primary_of(self, h: int) -> int | None:
        return primary(h, self.S, self.C, self.dead)

    def secondaries(self, h: int) -> list[int]:
        return [x for x in holders(h, self.S, self.C) if x != self.me and x not in self.dead]

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
                    Tag.CKPT_SET: self._recv_ckpt}
        self.heartbeat.start()
        try:
            serve(self.comm, handlers, self.timeout, self._waiting_for, self._tick)
        finally:
            self.heartbeat.stop()

    def _waiting_for(self) -> str:
        return (f"replicas {sorted(set(range(self.R)) - self.done)} to finish, then the "
                "chief to take every set's final state")

    def _finished(self) -> bool:
        self._reap()
        return self.ended

    def _tick(self) -> bool:
        for r in self.replicas.silent([r for r in range(self.R) if r not in self.done]):
            self._lose_replica(r, f"silent for more than {self.hb:g} s")
        for x in self.peers.silent([x for x in range(self.S) if x != self.me
                                    and x not in self.dead]):
            self._shard_lost(x, f"silent for more than {self.hb:g} s")
        self._close_sets()
        return self._finished()

    def _reap(self) -> None:
        """Forget finished sends, and give up those to a rank now dead."""
        still = []
        for req, buf, dest in self.sends:
            try:
                if req.Test():
                    continue
            except MPI.Exception:
                self.abandoned += 1
                continue
            if self._dest_dead(dest):
                self.abandoned += 1
                continue
            still.append((req, buf, dest))
        self.sends = still

    def _send(self, buf, dest: int, tag: int):
        req = self.comm.Isend(buf, dest=dest, tag=tag)
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
        req = self.comm.Irecv(buf, source=src, tag=tag)
        if finished_by(req, time.monotonic() + self.hb):
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
        tag, size = status.Get_tag(), status.Get_count(MPI.BYTE)
        box, dense = self._inbox_for(tag, size, src)
        if not self._receive(box.buf[:size], src, tag):
            if dense:
                self._inbox = Message(len(self._inbox))
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
            grad = body.view(np.float32)
            if len(grad) != len(cs.params):
                raise RuntimeError(f"set {h}: a push of {len(grad)} values for "
                                   f"{len(cs.params)} parameters")
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
        self.pending[h].append((self.sets[h].version, src, int(header[H.SEQ])))
        self._commit(h)
        return False

    def _commit(self, h: int) -> None:
        """Acknowledge every push of set ``h`` that every live secondary holds."""
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
            return False  # a late message from a shard found dead
        self.peers.heard(q)
        if h not in self.sets or self.primary_of(h) != q:
            raise RuntimeError(f"shard {q} forwarded a push of set {h} to shard {self.me}, "
                               f"whose primary for it is {self.primary_of(h)}")
        if self._apply(h, header, body, dense):
            self.replicated += 1
        self._send_small(src, Tag.REPL_ACK, SET=h, VERSION=self.sets[h].version)
        return False

    def _recv_repl_ack(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.REPL_ACK)
        q, h = self.shard_of[src], int(self._small.header[H.SET])
        if q in self.dead or h not in self.sets:
            return False
        self.peers.heard(q)
        self.acked[h][q] = int(self._small.header[H.VERSION])
        self._commit(h)
        self._close_sets()
        return self._finished()

    def _recv_fetch(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.FETCH)
        h, sender = int(self._small.header[H.SET]), int(self._small.header[H.SENDER])
        if h not in self.sets or self.role[h] != "primary":
            raise RuntimeError(f"replica {sender} (rank {src}) asked shard {self.me} for set "
                               f"{h}, whose primary it is not")
        if sender not in self.lost_replicas:
            self.replicas.heard(sender)
        self._served(h)
        cs = self.sets[h]
        cs.answer_fetch(src, sender)
        if sender in cs.stats.lost_replicas and sender not in self.lost_replicas:
            self._lose_replica(sender, cs.stats.lost_replicas[sender])
        return self._finished()

    def _recv_done(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.DONE)
        self.done.add(int(self._small.header[H.SENDER]))
        self._close_sets()
        return self._finished()

    def _recv_heartbeat(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.HEARTBEAT)
        if src in self.shard_of:
            self.peers.heard(self.shard_of[src])
        else:
            self.replicas.heard(int(self._small.header[H.SENDER]))
        return False

    def _recv_new_primary(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.NEW_PRIMARY)
        hd = self._small.header
        a, h, d = int(hd[H.SENDER]), int(hd[H.SET]), int(hd[H.PEER])
        if a in self.dead:
            return False
        if d == self.me:
            raise PeerTimeout(f"shard {a} took over set {h} from this shard {self.me}: it heard "
                              f"nothing from it for {self.hb:g} s (--heartbeat-timeout); this "
                              "shard leaves the run")
        self._shard_lost(d, f"shard {a} found it dead")
        return self._finished()

    def _recv_set_state(self, src: int, status) -> bool:
        size = status.Get_count(MPI.BYTE)
        msg = np.empty(size, dtype=np.uint8)
        q = self.shard_of[src]
        if not self._receive(msg, src, Tag.SET_STATE):
            return self._finished()
        header = msg[:HEADER_BYTES].view(np.float64)
        payload = msg[HEADER_BYTES:].view(np.float32)
        h = int(header[H.SET])
        if q in self.dead or h not in self.sets:
            return False
        cs, n = self.sets[h], len(self.sets[h].params)
        cs.params[:] = payload[:n]
        for i, k in enumerate(self.keys):
            cs.state[k][:] = payload[(i + 1) * n:(i + 2) * n]
        tail = payload[n * (1 + len(self.keys)):]
        self.last_seq[h] = {r: int(v) for r, v in enumerate(tail) if v > 0}
        cs.step, cs.version = int(header[H.STEPS]), int(header[H.VERSION])
        self.applied[h] = int(header[H.PEER])
        self._send_small(src, Tag.REPL_ACK, SET=h, VERSION=cs.version)
        return False

    def _recv_final_done(self, src: int, status) -> bool:
        self.comm.Recv(self._small.buf, source=src, tag=Tag.FINAL_DONE)
        self.ended = True  # sends still pending (a set sent twice, a checkpoint) are dropped
        return True

    def _recv_ckpt(self, src: int, status) -> bool:
        size = status.Get_count(MPI.BYTE)
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
        msg = Message(state_size(n, len(self.keys), self.R))
        msg.payload[:n] = cs.params
        for i, k in enumerate(self.keys):
            msg.payload[(i + 1) * n:(i + 2) * n] = cs.state[k]
        tail = msg.payload[n * (1 + len(self.keys)):]
        tail[:] = 0.0
        for r, seq in self.last_seq[h].items():
            tail[r] = seq
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
        dest = collector(self.S, self.dead)
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
                self._send(self.state_message(h).buf, self.chief, Tag.FINAL_SET)
                self.final_sent.add(h)

    # -- losses --------------------------------------------------------------------------------
    def _lose_replica(self, r: int, why: str) -> None:
        if r < 0 or r in self.lost_replicas:
            return
        if r == 0:
            raise PeerTimeout(f"replica 0 (world rank 0, the chief: it evaluates, writes the "
                              f"final checkpoint and reports) is lost: {why}; the run cannot "
                              "finish without it")
        if r not in self.done:
            self.replicas.drop(r)
            self.lost_after_s[r] = self.replicas.lost[r]
            self.lost_replicas[r] = why
            self.done.add(r)
        for cs in self.sets.values():
            if r not in cs.stats.lost_replicas:
                cs.stats.lost_replicas[r] = why
        self._close_sets()

    def _shard_lost(self, d: int, why: str) -> None:
        if d in self.dead or d == self.me:
            return
        self.peers.drop(d)
        silent = self.peers.lost[d]
        self.dead.add(d)
        self.lost_shards[d] = why
        self.heartbeat.dests = [r for j, r in enumerate(self.shard_ranks)
                                if j != self.me and j not in self.dead]
        for h in range(self.S):
            if self.primary_of(h) is None:
                raise PeerTimeout(f"every copy of chunk set {h} (shards "
                                  f"{holders(h, self.S, self.C)}) is lost: the run cannot go "
                                  "on (raise --ps-copies to survive more failures)")
        for h in self.sets:
            if self.role[h] == "secondary" and self.primary_of(h) == self.me:
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
        for x in range(self.S):
            if x != self.me and x not in self.dead:
                self._send_small(self.shard_ranks[x], Tag.NEW_PRIMARY, SET=h, PEER=d)
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
                "takeovers": self.takeovers, "lost_shard_ranks": lost,
                "abandoned_sends": self.abandoned, "discarded_pushes": self.discarded}


# -- the replica's side --------------------------------------------------------------------------
class ReplicatedClient:
    """A replica's fetches and pushes when every set has a primary and secondaries.

    The same calls as :class:`hpcps.ps.client.Client`; in addition it listens, while it waits,
    for ``PUSH_ACK`` (a push committed) and ``NEW_PRIMARY`` (send what is still outstanding
    for that set to its new primary).
    """

    def __init__(self, comm, shard_ranks, plan, replica: int, timeout: float, copies: int,
                 packed_bytes: list[int] | None = None):
        self.comm = comm
        self.shard_ranks = list(shard_ranks)
        self.S, self.C = len(self.shard_ranks), copies
        self.plan = plan
        self.replica = replica
        self.timeout = timeout
        self.dead: set[int] = set()
        self.route = [self.shard_ranks[primary(h, self.S, copies, ())] for h in range(self.S)]
        sizes = plan.sizes
        self._params = [Message(n) for n in sizes]
        self._fetch_req = [MPI.REQUEST_NULL] * self.S
        self._ask = []
        for h in range(self.S):
            ask = Message(0)
            ask.header[H.SENDER], ask.header[H.SET] = replica, h
            self._ask.append(ask)
        if packed_bytes is None:
            self._push = [[Message(n), Message(n)] for n in sizes]
        else:
            self._push = [[ByteMessage(b), ByteMessage(b)] for b in packed_bytes]
        self._push_req = [[MPI.REQUEST_NULL, MPI.REQUEST_NULL] for _ in range(self.S)]
        self._push_seq = [[0, 0] for _ in range(self.S)]
        self._push_out = [[None, None] for _ in range(self.S)]  # (bytes view, tag) as sent
        self.seq = 0
        self.acked = [0] * self.S
        self._small = Message(0)
        self._done_msg = Message(0)
        self._done_msg.header[H.SENDER] = replica
        self.heartbeat: HeartbeatThread | None = None
        self.versions = np.zeros(self.S)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.resent = 0
        self.reroutes = 0
        self.last_reply: dict[str, float] = {}

    # -- events --------------------------------------------------------------------------------
    def _events(self) -> bool:
        """Take acknowledgements and role changes; True if a set was re-routed."""
        st = MPI.Status()
        moved = False
        while self.comm.Iprobe(MPI.ANY_SOURCE, Tag.PUSH_ACK, st):
            self.comm.Recv(self._small.buf, source=st.Get_source(), tag=Tag.PUSH_ACK)
            h, seq = int(self._small.header[H.SET]), int(self._small.header[H.SEQ])
            self.acked[h] = max(self.acked[h], seq)
        while self.comm.Iprobe(MPI.ANY_SOURCE, Tag.NEW_PRIMARY, st):
            self.comm.Recv(self._small.buf, source=st.Get_source(), tag=Tag.NEW_PRIMARY)
            hd = self._small.header
            moved |= self._reroute(int(hd[H.SET]), int(hd[H.SENDER]), int(hd[H.PEER]))
        return moved

    def _reroute(self, h: int, a: int, d: int) -> bool:
        self.dead.add(d)
        if self.heartbeat is not None:
            self.heartbeat.dests = [r for j, r in enumerate(self.shard_ranks)
                                    if j not in self.dead]
        new = self.shard_ranks[a]
        if self.route[h] == new:
            return False
        self.route[h] = new
        self.reroutes += 1
        req = self._fetch_req[h]
        if req != MPI.REQUEST_NULL and not _test(req):  # a fetch of h in flight
            req.Cancel()
            if not finished_by(req, time.monotonic() + 1.0):
                self._params[h] = Message(len(self._params[h]))  # MPI may still write there
            self._fetch_req[h] = self.comm.Irecv(self._params[h].buf, source=new,
                                                 tag=Tag.PARAMS)
            self.comm.Send(self._ask[h].buf, dest=new, tag=Tag.FETCH)
        for slot in sorted((0, 1), key=lambda k: self._push_seq[h][k]):
            if self._push_seq[h][slot] <= self.acked[h] or self._push_out[h][slot] is None:
                continue
            data, tag = self._push_out[h][slot]
            req = self._push_req[h][slot]
            if req != MPI.REQUEST_NULL and not _test(req):  # to the dead: its buffer stays
                old = self._push[h][slot]
                fresh = Message(len(old)) if isinstance(old, Message) else \
                    ByteMessage(len(old.body))
                fresh.buf[:len(data)] = data
                self._push[h][slot] = fresh
                data = fresh.buf[:len(data)]
                self._push_out[h][slot] = (data, tag)
            self._push_req[h][slot] = self.comm.Isend(data, dest=new, tag=tag)
            self.resent += 1
        return True

    def _wait(self, ready, what) -> None:
        deadline = time.monotonic() + self.timeout
        poll = Poller()
        while not ready():
            if self._events():
                deadline = time.monotonic() + self.timeout
                continue
            if time.monotonic() > deadline:
                raise PeerTimeout(f"waited {self.timeout:.0f} s for {what()}; no shard took "
                                  "over (raise --timeout if it is only slow)")
            poll.pause()

    # -- the calls ------------------------------------------------------------------------------
    def fetch(self, params: np.ndarray) -> dict[str, float]:
        self._events()
        for h in range(self.S):
            self._fetch_req[h] = self.comm.Irecv(self._params[h].buf, source=self.route[h],
                                                 tag=Tag.PARAMS)
        for h in range(self.S):
            self.comm.Send(self._ask[h].buf, dest=self.route[h], tag=Tag.FETCH)
        self._wait(lambda: all(_test(r) for r in self._fetch_req),
                   lambda: f"parameters from server ranks {self.route}")
        for h in range(self.S):
            msg = self._params[h]
            if int(msg.header[H.SET]) != h:
                raise RuntimeError(f"asked rank {self.route[h]} for set {h}, got set "
                                   f"{int(msg.header[H.SET])}")
            self.plan.put(h, msg.payload, params)
            self.versions[h] = msg.header[H.VERSION]
            self.bytes_received += msg.buf.nbytes
        self.bytes_sent += self._ask[0].buf.nbytes * self.S
        hd = self._params[0].header
        self.last_reply = {"step": int(hd[H.STEPS]), "loss": float(hd[H.LOSS_SUM]),
                           "staleness": float(hd[H.STALENESS]),
                           "max_staleness": float(hd[H.MAX_STALENESS]),
                           "clock": float(hd[H.CLOCK]), "unpersisted": 0}
        return self.last_reply

    def _slot(self, h: int, slot: int):
        """Set ``h``'s push buffer in ``slot`` once the push it held is committed."""
        def free() -> bool:
            return self._push_seq[h][slot] <= self.acked[h] and _test(self._push_req[h][slot])
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
        self._push_req[h][slot] = self.comm.Isend(data, dest=self.route[h], tag=tag)
        self.bytes_sent += data.nbytes

    def push(self, grad: np.ndarray, steps: int, loss_sum: float) -> None:
        self._events()
        self.seq += 1
        slot = self.seq & 1
        for h in range(self.S):
            msg = self._slot(h, slot)
            msg.header[H.STEPS], msg.header[H.LOSS_SUM] = steps, loss_sum
            self.plan.take(h, grad, out=msg.payload)
            self._send(h, slot, msg.buf, Tag.PUSH)

    def push_packed(self, bodies, steps: int, loss_sum: float, tag: int = Tag.PUSH_COMPRESSED,
                    rows: int = 0) -> None:
        self._events()
        self.seq += 1
        slot = self.seq & 1
        for h, body in enumerate(bodies):
            data = fill_packed(self._slot(h, slot), body, steps, loss_sum, rows, f"set {h}")
            self._send(h, slot, data, tag)

    def done(self) -> None:
        """Wait until every push is committed, then tell every live shard."""
        self._wait(lambda: all(a >= self.seq for a in self.acked) and all(
            _test(r) for pair in self._push_req for r in pair),
            lambda: f"server ranks {self.route} to commit the last pushes")
        for j, rank in enumerate(self.shard_ranks):
            if j not in self.dead:
                self.comm.Send(self._done_msg.buf, dest=rank, tag=Tag.DONE)

    def figures(self) -> dict:
        return {"pushes_committed": self.seq, "resent_pushes": self.resent,
                "reroutes": self.reroutes}


def _test(req) -> bool:
    """Whether a request has completed (a null request has); an error counts as not."""
    if req == MPI.REQUEST_NULL:
        return True
    try:
        return req.Test()
    except MPI.Exception:
        return False


def receive_final(comm, plan, keys, shard_ranks, heartbeat_timeout: float,
                  timeout: float) -> tuple:
    """On the chief: every set's final state, from whichever shard is its primary at the end,
    then FINAL_DONE to every shard. Returns (global params, global state, step, pushes applied
    to each set). A set sent twice (its primary died as it ended, and a secondary took over)
    is taken once; a message that breaks off (its sender died) is dropped."""
    parts: dict[int, np.ndarray] = {}
    steps, applied = [], {}
    st = MPI.Status()
    deadline = time.monotonic() + timeout
    poll = Poller()
    while len(parts) < plan.n_shards:
        if not comm.Iprobe(MPI.ANY_SOURCE, Tag.FINAL_SET, st):
            if time.monotonic() > deadline:
                raise PeerTimeout(f"waited {timeout:.0f} s for the final state of chunk sets "
                                  f"{sorted(set(range(plan.n_shards)) - set(parts))}")
            poll.pause()
            continue
        msg = np.empty(st.Get_count(MPI.BYTE), dtype=np.uint8)
        req = comm.Irecv(msg, source=st.Get_source(), tag=Tag.FINAL_SET)
        if not finished_by(req, time.monotonic() + heartbeat_timeout):
            continue
        header = msg[:HEADER_BYTES].view(np.float64)
        h = int(header[H.SET])
        if h not in parts:
            parts[h] = msg[HEADER_BYTES:].view(np.float32)
            steps.append(int(header[H.STEPS]))
            applied[h] = int(header[H.PEER])
    done = Message(0)
    for rank in shard_ranks:  # header only: goes eagerly, even to a dead shard
        finished_by(comm.Isend(done.buf, dest=rank, tag=Tag.FINAL_DONE),
                    time.monotonic() + 1.0)
    params, state = assemble(plan, parts, keys)
    return params, state, min(steps), [applied[h] for h in range(plan.n_shards)]
