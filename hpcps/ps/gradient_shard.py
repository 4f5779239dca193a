"""A parameter-server shard that applies pushed gradients: Downpour's, and the base of the
consistency models that differ only in when a push is applied or a fetch answered.

The shard owns a contiguous slice of the flat parameter vector and the optimizer state for it.
It is handed the update rule as a callable (``apply(w, g, state)``, from :mod:`hpcps.model.optim`)
and knows nothing of its internals. It serves replicas through the polling loop of
:mod:`hpcps.ps.serve` until every replica has sent DONE. Every message kind is a
:class:`hpcps.mpi.protocol.Tag`.

What a push and a fetch *do* is the shard's **policy** (:class:`ShardPolicy` itself is Downpour's:
apply every push on arrival, answer every fetch at once, so no replica waits for another).
A policy may instead buffer pushes and apply their combination later, or hold a fetch reply
until a condition holds (stale-synchronous parallel: until the slowest replica is close
enough); held fetches are looked at again after every push and every DONE.

Staleness of a push = updates this shard applied between the replica's fetch and its push.

Replicas that may die (``liveness`` given, ``--heartbeat-timeout``): the shard also takes
heartbeats, and a replica silent for the timeout is *lost*: the shard stops waiting for it
(for the policies, as if it had sent DONE), drops its held fetches, and from then on discards
its pushes. Receiving a push and sending a fetch reply wait only until the timeout, so a
replica that dies half-way through a message is lost too instead of hanging the shard
(:mod:`hpcps.ps.liveness`). Losing a replica in ``fatal`` (the chief, which evaluates and
reports) ends the job.

Numerical health, for every policy: a push whose training loss (a header scalar) is NaN or
infinite is refused before anything is applied, naming the replica that sent it, and the
shard's parameters are checked every ``HEALTH_EVERY`` updates (one pass over the slice,
amortized to a small fraction of the updates' own passes). Either raises
:class:`~hpcps.errors.NonFiniteError`, which ends the job.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import math

import numpy as np

from hpcps import trace
from hpcps.compress.bf16 import FP32, Wire
from hpcps.mpi.comm import PeerTimeout, Poller, Transport, abandon, size_of, status, test
from hpcps.errors import NonFiniteError
from hpcps.mpi.protocol import HEADER_BYTES, ByteMessage, H, Message, Tag
from hpcps.ps.liveness import Liveness, send_dropped, take_heartbeats
from hpcps.ps.serve import serve


STALENESS_BINS = 10  # histogram bins: 0, 1, 2-3, 4-7, ..., 128-255, 256 and more
HEALTH_EVERY = 64    # updates between two checks that the shard's parameters are finite


def staleness_bin(stale: float) -> int:
    """Histogram bin of a staleness: 0 for 0, then one bin per power of two."""
    return min(STALENESS_BINS - 1, int(stale).bit_length()) if stale > 0 else 0


@dataclass
class ShardStats:
    """What a shard saw, for metrics and the bench."""

    pushes: int = 0
    fetches: int = 0
    held_fetches: int = 0
    held_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    # pushes by staleness: 0, 1, 2-3, 4-7, ..., 2**(k-1) and more (STALENESS_BINS counts)
    staleness_hist: list[int] = field(default_factory=lambda: [0] * STALENESS_BINS)
    wall_s: float = 0.0
    done_replicas: list[int] = field(default_factory=list)
    lost_replicas: dict[int, str] = field(default_factory=dict)  # replica -> why
    lost_after_s: dict[int, float] = field(default_factory=dict)  # replica -> silence at drop
    discarded_pushes: int = 0  # pushes that arrived from replicas already lost


class ShardPolicy:
    """What a push and a fetch do on the shard. This base class is Downpour's policy: apply
    each push as it arrives, answer each fetch at once. A policy overrides what it changes."""

    def on_push(self, shard: "GradientShard", sender: int, header: np.ndarray,
                grad: np.ndarray | None) -> None:
        shard.apply_push(header, grad)

    def may_answer(self, shard: "GradientShard", sender: int) -> bool:
        return True

    def on_done(self, shard: "GradientShard", sender: int) -> None:
        return None

    def on_answer(self, shard: "GradientShard", sender: int, header: np.ndarray) -> None:
        """Called as a fetch is answered, to add the policy's figures to the reply header."""
        return None

    def on_end(self, shard: "GradientShard") -> None:
        """Every replica is done: apply whatever is still buffered. A replicated set
        (``--ps-copies``) calls it on its primary as the set closes, after every push."""
        return None

    def snapshot(self) -> np.ndarray:
        """The policy's state that pushes change (float64), which a copy of a replicated set
        must hold to go on as the copy it replaces would have: sent in ``SET_STATE``."""
        return np.zeros(0)

    def restore(self, values: np.ndarray) -> None:
        """Take the state :meth:`snapshot` returned on another copy."""
        return None


class GradientShard:
    """Serve one shard's slice until all ``n_replicas`` replicas have sent DONE.

    Parameters
    ----------
    comm : communicator shared with the replicas (the world duplicate).
    params, state : this shard's slice of the parameters and of the optimizer state (updated
        in place).
    apply : ``apply(params, grad, state)``, the update rule.
    n_replicas : how many replicas will send DONE.
    step : global step (mini-batches applied) the shard starts from (non-zero on resume).
    timeout : seconds without any message before failing, naming the replicas still expected.
    on_boundary : called as ``on_boundary(step_boundary)`` each time the global step crosses a
        multiple of ``boundary_every`` (used for checkpoints; every shard crosses the same
        boundaries because every push goes to every shard, so a collective inside is safe).
    packed : for variable-size pushes, ``(max_bytes, tag, handle(header, body))``: the largest
        message body to accept, the tag such pushes carry, and a callable that turns a
        received body into a dense gradient for ``apply`` (compressed pushes), or applies the
        update itself and returns None (activation pushes). The strategy builds it; the
        shard only knows bytes come in.
    policy : what a push and a fetch do (default :class:`ShardPolicy`: Downpour's).
    tick : called by the serving loop now and then (the job's stop vote, :mod:`hpcps.runtime.stop`).
    liveness : when replicas may die: their heartbeats and silences, their ranks and the
        replica whose loss ends the job (:class:`hpcps.ps.liveness.Liveness`; None: every
        replica is waited for until DONE).
    epochs : on server shard 0 with ``--epoch-quorum``: the keeper of the epochs' ends
        (:class:`hpcps.ps.epochs.EpochKeeper`), told of every EPOCH_DONE, DONE and loss.
    persist : with ``--persist-every``: the shard's write-back cache
        (:class:`hpcps.ps.persist.Persister`), told of every update and asked between
        messages whether a flush is due.
    wire : the format of the values of dense pushes and of replies (``--wire-dtype``); the
        parameters and their updates stay float32.
    """

    def __init__(self, comm, params: np.ndarray, state: dict, apply: Callable,
                 n_replicas: int, step: int = 0, timeout: float = 600.0,
                 on_boundary: Callable[[int], None] | None = None, boundary_every: int = 0,
                 packed: tuple[int, int, Callable] | None = None, policy=None,
                 tick: Callable[[], None] | None = None, liveness: Liveness | None = None,
                 epochs=None, persist=None, wire: Wire = FP32):
        self.comm = comm
        self.net = Transport(comm)
        self.params = params
        self.state = state
        self.apply = apply
        self.n_replicas = n_replicas
        self.step = int(step)
        self.version = 0
        self.timeout = timeout
        self.on_boundary = on_boundary
        self.boundary_every = boundary_every
        self.policy = policy or ShardPolicy()
        self.tick = tick
        self.stats = ShardStats()
        self.done: set[int] = set()  # replicas no longer expected: finished, or lost
        self.stopping = False  # rank 0 stopped the run early (its DONE said so)
        self.liveness = liveness
        self.epochs = epochs
        self.persist = persist
        self.applied_step = self.step  # --persist-every: the steps the parameters hold
        # --spares: told of each replica lost (hpcps.ps.spares.report_lost)
        self.on_lost: Callable[[int], None] | None = None
        self.held: list[tuple[int, int, float]] = []  # (rank, replica, since) of held fetches
        n = len(params)
        self._push = Message(n, wire)
        self._reply = Message(n, wire)
        # replicas may die: replies go without waiting; (request, buffer, replica, deadline)
        # of those in flight, and the buffers of those that completed, for the next ones
        self._sending: list[tuple[object, Message, int, float]] = []
        self._reaped_at = time.monotonic()  # the last look at the replies in flight
        self._spare_replies: list[Message] = []
        self._small = Message(0)
        self._hb_status = status()  # heartbeats taken before silence is judged
        self._packed = ByteMessage(packed[0]) if packed else None
        self._packed_tag = packed[1] if packed else None
        self._handle = packed[2] if packed else None
        # recent-window figures reported back with each fetch reply
        self._win_loss = 0.0
        self._win_steps = 0
        self._win_stale = 0.0
        self._win_stale_max = 0.0
        self._win_pushes = 0
        self._last_loss = float("nan")

    def serve(self, more: dict | None = None) -> ShardStats:
        """Serve until every replica is done; ``more``: handlers of other messages the same
        ranks send this shard (an embedding table's rows, :mod:`hpcps.ps.rows`)."""
        handlers = {Tag.PUSH: self._recv_push, Tag.FETCH: self._recv_fetch,
                    Tag.DONE: self._recv_done, **(more or {})}
        if self._packed_tag is not None:
            handlers[self._packed_tag] = self._recv_packed
        if self.liveness is not None:
            handlers[Tag.HEARTBEAT] = self._recv_heartbeat
            handlers[Tag.EXPECT] = self.expect
        if self.epochs is not None:
            handlers[Tag.EPOCH_DONE] = self.epochs.on_epoch_done
        t0 = time.perf_counter()
        if self.n_replicas > 0:
            serve(self.comm, handlers, self.timeout, lambda: (
                f"{self.n_replicas - len(self.done)} replica(s) to finish (done: "
                f"{sorted(self.done)}; held fetches from ranks {[h[0] for h in self.held]})"),
                self._tick, stalled=self.excuse if self.liveness is not None else None,
                stall_s=self.liveness.timeout if self.liveness is not None else 0.0)
        self.drain_replies()
        if self.epochs is not None:
            self.epochs.close(self.timeout)
        if self.persist is not None:  # the final state, on disk before the shard reports
            self.persist.close(self.step)
        self.stats.wall_s = time.perf_counter() - t0
        self.stats.done_replicas = sorted(self.done)
        return self.stats

    # -- message handlers (hpcps.ps.serve calls them) ------------------------------------------
    def _finished(self) -> bool:
        return len(self.done) >= self.n_replicas

    def _receive(self, buf, src: int, tag: int) -> bool:
        """Receive a message whose arrival was probed; False if its sender died half-way
        (then ``buf`` may still be written to: the caller replaces it)."""
        if self.liveness is None:
            self.net.take(buf, src, tag)
            return True
        if self.net.take_by(buf, src, tag, time.monotonic() + self.liveness.timeout):
            return True
        self.lose(self.liveness.replica_of.get(src, -1),
                  f"its message (tag {int(tag)}) broke off")
        return False

    def _from_lost(self, sender: int) -> bool:
        """Whether a push came from a replica already lost (then it is discarded)."""
        if self.liveness is None:
            return False
        if sender in self.liveness.lost:
            self.stats.discarded_pushes += 1
            return True
        self.liveness.heard(sender)
        return False

    def _recv_push(self, src: int, status) -> bool:
        if not self._receive(self._push.buf, src, Tag.PUSH):
            self._push = self._push.fresh()
            self._answer_held()
            return self._finished()
        self._push.unpack()
        h = self._push.header
        self.stats.bytes_in += self._push.buf.nbytes
        if self._from_lost(int(h[H.SENDER])):
            return False
        self.check_push(h)
        self.policy.on_push(self, int(h[H.SENDER]), h, self._push.payload)
        self._answer_held()
        return False

    def _recv_packed(self, src: int, status) -> bool:
        size = size_of(status)
        if size > len(self._packed.buf):
            raise RuntimeError(f"push of {size} bytes from rank {src} is larger than any "
                               "valid message for this shard")
        if not self._receive(self._packed.buf[:size], src, self._packed_tag):
            self._packed = ByteMessage(len(self._packed.body))
            self._answer_held()
            return self._finished()
        h = self._packed.header
        body = self._packed.body[:size - HEADER_BYTES]
        self.stats.bytes_in += size
        if self._from_lost(int(h[H.SENDER])):
            return False
        self.check_push(h)
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        grad = self._handle(h, body)
        if tr is not None:  # decoding (and, for activations, computing) the update
            tr.span(trace.COMPUTE, "decode push", t0, {"bytes": size})
        self.policy.on_push(self, int(h[H.SENDER]), h, grad)
        self._answer_held()
        return False

    def _recv_heartbeat(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.HEARTBEAT)
        self.liveness.heard(int(self._small.header[H.SENDER]))
        return False

    def _tick(self) -> bool:
        """Between messages: the stop vote, and (replicas may die) drop the silent ones."""
        if self.tick is not None:
            self.tick()
        if self.persist is not None:
            self.persist.maybe_flush(self.applied_step)
        if self.liveness is None:
            return False
        self.reap_replies()
        expected = [r for r in range(self.n_replicas) if r not in self.done]
        take_heartbeats(self.net, self._hb_status, self._recv_heartbeat)
        for r in self.liveness.silent(expected):
            self.lose(r, f"silent for more than {self.liveness.timeout:g} s")
        self._answer_held()
        return self._finished()

    def lose(self, replica: int, why: str) -> None:
        """Stop waiting for ``replica``: it is dead or silent past the heartbeat timeout."""
        assert self.liveness is not None  # only a shard whose replicas may die loses one
        if replica in self.liveness.fatal:
            raise PeerTimeout(f"replica {replica} (world rank 0, the chief: it evaluates, writes "
                              f"the final checkpoint and reports) is lost: {why}; the run "
                              "cannot finish without it", lost=(0,))
        if replica < 0 or replica in self.stats.lost_replicas or replica in self.done:
            return
        self.liveness.drop(replica)
        self.stats.lost_replicas[replica] = why
        self.stats.lost_after_s[replica] = self.liveness.lost[replica]
        self.done.add(replica)
        if self.epochs is not None:
            self.epochs.on_lost(replica)
        self.held = [h for h in self.held if h[1] != replica]
        self.policy.on_done(self, replica)  # the caller answers the fetches this released
        if self.on_lost is not None:
            self.on_lost(replica)

    def idle(self, replicas) -> None:
        """--spares: replica indices not expected until a spare takes one (:meth:`expect`)."""
        self.done.update(replicas)

    def expect(self, src: int, status) -> bool:
        """EXPECT from the chief: replica SENDER joins now, at world rank PEER; it is waited
        for, and lost if silent, from now on."""
        self.net.take(self._small.buf, src, Tag.EXPECT)
        r, rank = int(self._small.header[H.SENDER]), int(self._small.header[H.PEER])
        self.done.discard(r)
        if self.liveness is not None:
            self.liveness.moved(r, rank)
        return False

    def _recv_fetch(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.FETCH)
        sender = int(self._small.header[H.SENDER])
        if self.liveness is not None and sender in self.liveness.lost:
            send_dropped(self.net, src)  # alive after all: it leaves rather than wait
            return False
        if self.policy.may_answer(self, sender):
            self.answer_fetch(src, sender)
        else:
            self.held.append((src, sender, time.perf_counter()))
            self.stats.held_fetches += 1
        return False

    def _recv_done(self, src: int, status) -> bool:
        self.net.take(self._small.buf, src, Tag.DONE)
        sender = int(self._small.header[H.SENDER])
        if self._small.header[H.STOP]:  # rank 0 stopped early: the replicas end too
            self.stopping = True
        if self.epochs is not None:  # answered, even if it was (wrongly) taken for lost
            self.epochs.on_done(sender)
        if sender in self.done:  # lost before its DONE arrived
            return False
        self.done.add(sender)
        self.policy.on_done(self, sender)
        self._answer_held()
        return self._finished()

    def _answer_held(self) -> None:
        if not self.held:
            return
        still = []
        for src, sender, since in self.held:
            if sender in self.stats.lost_replicas:
                continue
            if self.policy.may_answer(self, sender):
                self.stats.held_s += time.perf_counter() - since
                self.answer_fetch(src, sender)
            else:
                still.append((src, sender, since))
        self.held = still

    def decode(self, header: np.ndarray, body: np.ndarray) -> np.ndarray | None:
        """A variable-size push's body as a dense gradient (None: applied already)."""
        return self._handle(header, body)

    # -- numerical health ----------------------------------------------------------------------
    def check_push(self, h: np.ndarray) -> None:
        """Refuse a push whose training loss is not finite, before it is applied: its
        gradient came from a NaN or infinite forward pass."""
        loss = h[H.LOSS_SUM]
        if not math.isfinite(loss):
            raise NonFiniteError(self.step, f"received from replica {int(h[H.SENDER])} a "
                                 f"gradient whose training loss is {loss} (not applied)")

    def check_params(self) -> None:
        """Stop if an update left a NaN or infinity in this shard's parameters."""
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.sum(self.params, dtype=np.float64)):
                return  # the float64 sum of float32 values is finite only if every one is
        bad = int(np.count_nonzero(~np.isfinite(self.params)))
        raise NonFiniteError(self.step, f"holds {bad} NaN or infinite parameter(s) after "
                             f"{self.version} updates (a pushed gradient or the optimizer's "
                             "update was not finite)")

    # -- what policies call --------------------------------------------------------------------
    def staleness(self, h: np.ndarray) -> float:
        """Updates this shard applied since the push's sender fetched the parameters."""
        return self.version - h[H.VERSION]

    def apply_push(self, h: np.ndarray, grad: np.ndarray | None) -> None:
        """Apply one push now (``grad`` None: the packed handler applied it already) and
        account for it."""
        stale = self.staleness(h)
        self.apply_update(grad)
        self.account(h, stale)

    def apply_update(self, grad: np.ndarray | None) -> None:
        """Run the optimizer on ``grad`` (one push, or a policy's combination of several);
        the shard's version counts these updates."""
        if grad is not None:
            tr = trace.ACTIVE
            t0 = tr.now() if tr is not None else 0
            self.apply(self.params, grad, self.state)
            if tr is not None:
                tr.span(trace.COMPUTE, "apply update", t0)
        self.version += 1
        if self.version % HEALTH_EVERY == 0:
            self.check_params()
        if self.persist is not None:
            self.persist.touch()
            # the steps in the parameters now: counted pushes (a softsync group's pushes are
            # counted as they arrive, applied together; the push being applied is counted
            # after this), so never more than the updates applied
            self.applied_step = self.step
            self.persist.maybe_flush(self.applied_step)

    def account(self, h: np.ndarray, stale: float) -> None:
        """Count a push (of staleness ``stale``, see :meth:`staleness`): global step,
        staleness figures, the loss window, and the checkpoint boundaries its steps cross."""
        steps = int(h[H.STEPS])
        before = self.step
        self.step += steps
        self.stats.pushes += 1
        self.stats.staleness_sum += stale
        self.stats.staleness_max = max(self.stats.staleness_max, stale)
        self.stats.staleness_hist[staleness_bin(stale)] += 1
        self._win_loss += h[H.LOSS_SUM]
        self._win_steps += steps
        self._win_stale += stale
        self._win_stale_max = max(self._win_stale_max, stale)
        self._win_pushes += 1
        if self.on_boundary is not None and self.boundary_every > 0:
            every = self.boundary_every
            for b in range((before // every + 1) * every, self.step + 1, every):
                self.on_boundary(b)

    def answer_fetch(self, src: int, sender: int) -> None:
        """Send rank ``src`` (replica ``sender``) this shard's parameters as they are now,
        with recent figures."""
        r = self._reply
        r.payload[:] = self.params
        r.pack()
        h = r.header
        h[:] = 0.0
        h[H.VERSION] = self.version
        h[H.STEPS] = self.step
        if self._win_steps:
            self._last_loss = self._win_loss / self._win_steps
        h[H.LOSS_SUM] = self._last_loss
        h[H.STALENESS] = self._win_stale / self._win_pushes if self._win_pushes else 0.0
        h[H.MAX_STALENESS] = self._win_stale_max
        h[H.STOP] = float(self.stopping)
        if self.persist is not None:
            h[H.UNPERSISTED] = self.persist.unpersisted(self.step)  # since the last flush
        self._win_loss = self._win_stale = self._win_stale_max = 0.0
        self._win_steps = self._win_pushes = 0
        self.policy.on_answer(self, sender, h)
        # The replica posted its receive before asking, so this send cannot deadlock.
        if self.liveness is None:
            self.net.send_eager(r.buf, src, Tag.PARAMS)
        else:  # ... unless it died since it asked: then the shard must not wait for it
            self._sending.append((self.net.send_nowait(r.buf, src, Tag.PARAMS), r, sender,
                                  time.monotonic() + self.liveness.timeout))
            self.reap_replies()
            self._reply = self._spare_replies.pop() if self._spare_replies else r.fresh()
        self.stats.fetches += 1
        self.stats.bytes_out += r.buf.nbytes

    def excuse(self, gap: float) -> None:
        """The serving loop did not run for ``gap`` seconds (the rank was stopped or
        starved): the replicas' silence meanwhile and the time do not count against them."""
        self._sending = [(req, msg, sender, deadline + gap)
                         for req, msg, sender, deadline in self._sending]
        if self.liveness is not None:
            self.liveness.heard_all()

    def reap_replies(self) -> None:
        """Replies in flight (replicas may die): keep the buffers of those that completed;
        lose the replica of one that failed or is past its deadline (its buffer is left to
        MPI, which may still read it: :func:`abandon`). A look that comes more than the
        timeout after the last one means this rank did not run meanwhile (stopped, or
        starved, perhaps in the middle of a handler): that time is excused first."""
        still, now = [], time.monotonic()
        if self.liveness is not None and now - self._reaped_at > self.liveness.timeout:
            self.excuse(now - self._reaped_at)
        self._reaped_at = now
        for req, msg, sender, deadline in self._sending:
            ok = test(req)
            if ok:
                self._spare_replies.append(msg)
            elif ok is None or now > deadline:
                abandon(req, msg.buf)
                self.lose(sender, "it died waiting for parameters")
            else:
                still.append((req, msg, sender, deadline))
        self._sending = still

    def drain_replies(self) -> None:
        """Wait until every reply in flight has ended or given up at its deadline."""
        poll = Poller()
        while self._sending:
            self.reap_replies()
            poll.pause()
