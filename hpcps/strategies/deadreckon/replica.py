"""A dead-reckoning replica: its residual, its messages to every peer and its peers' messages
applied to its own copy (the method: :mod:`hpcps.strategies.deadreckon`)."""
from __future__ import annotations

import math
import zlib
from collections import deque

import numpy as np

from hpcps import trace

from hpcps.compress import codec as compress
from hpcps.mpi.comm import (LAND, SUM, Transport, all_done, allreduce_obj, barrier, bcast,
                             gather_obj, reduce_obj, size_of, source_of, status, tag_of,
                             wait_all)
from hpcps.options import (
    AUTO,
)
from hpcps.ps.serve import serve
from hpcps.strategies.context import Context, finish_on_chief, steps_for_replica
from hpcps.strategies.deadreckon import Tag, replica_lr
from hpcps.strategies.loop import ReplicaLoop
from hpcps.compress.threshold import (
    ResidualWatch,
    Threshold,
    Velocity,
    clip_norm,
)

# in front of each update message: the sender's step and its tau in units (int64 each)
PREFIX_BYTES = 16
START_TAU = 0.002  # where --tau auto (the default) starts, in weight units
ENTROPY_EVERY = 16  # measure the index-gap entropy of every 16th message (for the metrics)


class Reckoner:
    """One replica's model copy, kept as ``w0 + unit * counts`` wherever a delta landed.

    ``counts`` are int64 sums of each word's ``+-m`` (its sender's tau in units): the same
    in any order. A weight is rounded to float32 once from ``w0 + unit * count`` in float64,
    so equal counts give equal bits on every replica.
    """

    def __init__(self, params: np.ndarray, unit: float):
        self.params = params
        self.base = params.copy()
        self.counts = np.zeros(len(params), dtype=np.int64)
        self.unit = float(unit)
        self.applied_words = 0

    def restart(self) -> None:
        """Take the current weights as ``w0``, with no delta applied yet (after the warm
        start's broadcast, so that every replica counts from the same weights)."""
        self.base[:] = self.params
        self.counts[:] = 0

    def apply(self, words: np.ndarray, multiple: int) -> None:
        """Apply one message's words, each ``+-multiple`` units (indices unique within a
        message, as threshold emits)."""
        if len(words) == 0:
            return
        compress.apply_counts(self.params, self.base, self.counts, words, multiple, self.unit)
        self.applied_words += len(words)


class Peers:
    """Non-blocking exchange of messages with every other replica of the communicator."""

    def __init__(self, comm, n: int, timeout: float, tick=None):
        self.comm = comm
        self.net = Transport(comm)
        self.tick = tick  # the job's stop vote, while draining (hpcps.runtime.stop)
        self.n = n
        self.timeout = timeout
        self.peers = [p for p in range(comm.Get_size()) if p != comm.Get_rank()]
        self.rx = np.empty(PREFIX_BYTES + compress.max_message_bytes(n), dtype=np.uint8)
        self.local_step = 0   # this replica's steps so far (set by the training loop)
        self.lag_sum = 0      # sum over received messages of max(0, our step - sender's step)
        self.pending: deque = deque()   # (requests, buffer) of sends still in flight
        self.done_from: set[int] = set()
        self.received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._status = status()

    def send(self, msg: np.ndarray, step: int, multiple: int) -> None:
        """Send one message to every peer; the buffer is kept alive until the sends finish.

        The sender's local step rides in front of the message (8 bytes), so a receiver can
        tell how far behind it the update is (the staleness reported in progress lines),
        then its tau in units (8 bytes), which every word of the message moves a weight by.
        """
        if not self.peers:
            return
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        buf = np.empty(PREFIX_BYTES + len(msg), dtype=np.uint8)
        buf[:PREFIX_BYTES].view(np.int64)[:] = (step, multiple)
        buf[PREFIX_BYTES:] = msg
        reqs = [self.net.send_nowait(buf, p, Tag.UPDATE) for p in self.peers]
        self.pending.append((reqs, buf))
        self.bytes_sent += buf.nbytes * len(self.peers)
        if tr is not None:
            tr.message(f"send update to {len(self.peers)} peers", buf.nbytes * len(self.peers),
                       t0, peers=list(self.peers))
        while self.pending and all_done(self.pending[0][0]):
            self.pending.popleft()

    def poll(self, on_words) -> int:
        """Receive and apply every message that has already arrived; never waits.

        An ``Iprobe`` that finds nothing does not mean that nothing has arrived: MPICH's
        non-blocking progress moves about one message per call out of its shared-memory
        queues (pmodels/mpich#1087). Stopping at the first miss drained about two messages per
        step while R - 1 peers each sent one, so the backlog, and the age of the updates
        applied, grew for the whole run (seconds at 8 replicas; the model diverged). So a
        poll ends only after as many misses in a row as there are peers, plus one.
        """
        got = misses = 0
        st = self._status
        while misses <= len(self.peers):
            if self.net.probe(st):
                got += self._receive(st, on_words)
                misses = 0
            else:
                misses += 1
        return got

    def _receive(self, st, on_words) -> int:
        src, tag = source_of(st), tag_of(st)
        if tag == Tag.DONE:
            self.net.take(self.rx[:0], src, Tag.DONE)
            self.done_from.add(src)
            return 0
        if tag != Tag.UPDATE:
            raise RuntimeError(f"deadreckon got unexpected tag {tag} from replica {src}")
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        size = size_of(st)
        if not PREFIX_BYTES <= size <= len(self.rx):
            raise compress.CodecError(f"message of {size} bytes from replica {src} is larger "
                                      f"than any valid message for {self.n} weights")
        self.net.take(self.rx[:size], src, Tag.UPDATE)
        step, multiple = (int(v) for v in self.rx[:PREFIX_BYTES].view(np.int64))
        if multiple < 1:
            raise compress.CodecError(f"message from replica {src} carries tau = {multiple} "
                                      "units; it must be at least 1")
        on_words(compress.decode(self.rx[PREFIX_BYTES:size], self.n), multiple)
        # an update is late by the steps we took since its sender's step; one from a sender
        # ahead of us (we were descheduled, or still warming up) is not late at all
        self.lag_sum += max(0, self.local_step - step)
        self.received += 1
        self.bytes_received += size
        if tr is not None:  # receiving, decoding and applying it
            tr.message(f"receive update from peer {src}", size, t0, source=src)
        return 1

    def finish(self, on_words) -> None:
        """Tell every peer we are done, then apply messages until every peer said the same."""
        done_reqs = [self.net.send_nowait(self.rx[:0], p, Tag.DONE) for p in self.peers]

        def receive(src: int, status) -> bool:
            self._receive(status, on_words)
            return len(self.done_from) >= len(self.peers)

        if len(self.done_from) < len(self.peers):
            serve(self.comm, {Tag.UPDATE: receive, Tag.DONE: receive}, self.timeout,
                  lambda: f"replicas {sorted(set(self.peers) - self.done_from)} of the "
                          "partition communicator to finish sending their updates",
                  self.tick)
        wait_all(done_reqs + [r for reqs, _ in self.pending for r in reqs], self.timeout,
                 "peer replicas to take the last updates")
        self.pending.clear()


class DeadReckonReplica(ReplicaLoop):
    """Apply what peers sent, step, threshold the step into a message, send it, apply it.

    With a warm start, replica 0 first takes plain SGD steps alone and the others wait in
    :meth:`_warm_start_weights`; partition p of replica 0 then broadcasts its slice to
    partition p of every replica (each partition rank waits only for its own counterpart, so
    every partition of every replica is released).
    """

    def __init__(self, ctx: Context):
        comm = ctx.grid.partition_comm
        self.comm = comm
        self.R = comm.Get_size()
        cfg = ctx.cfg
        self.warmup = cfg.warmup_steps if ctx.start_step == 0 and self.R > 1 else 0
        super().__init__(ctx, steps_for_replica(ctx.remaining_steps, self.R, comm.Get_rank(),
                                                self.warmup))
        n = ctx.model.n_params
        self.n = n
        # an adaptive tau resumes where replica 0's was at the checkpoint (each replica then
        # adapts its own again); residuals start empty, as they always did on resume
        self.resumed_tau = (ctx.resumed or {}).get("tau") if cfg.tau == AUTO else None
        self.thr = Threshold.from_config(cfg, n, self.resumed_tau or START_TAU)
        self.reckon = Reckoner(ctx.params, self.thr.unit)
        self.params = self.reckon.params
        self.comp = compress.Compressor(n, self.thr.tau, golomb=cfg.golomb == "on")
        self.velocity = Velocity(n, cfg.momentum) if cfg.optimizer == "momentum" else None
        if self.velocity is not None and "velocity" in ctx.opt_state:
            self.velocity.v[:] = ctx.opt_state["velocity"]  # resumed: replica 0's, saved
        self.grad_clip = (cfg.grad_clip or 0.0) / math.sqrt(self.R)
        self.residual_watch = ResidualWatch(adaptive=self.thr.density is not None)
        self.peers = Peers(comm, n, cfg.timeout, ctx.stop_tick)
        self.grad = np.empty(n, dtype=np.float32)
        self.lr = replica_lr(cfg.lr, self.R, cfg.lr_scaling)
        self.step_scale = -np.float32(self.lr) * np.float32(self.T)
        self.warm_scale = -np.float32(cfg.lr) * np.float32(self.T)  # replica 0 alone: R = 1
        self.released = self.warmup == 0
        self.warm_done = 0       # mini-batches replica 0 took alone (0 on the others)
        # totals of this rank's messages, and the index-gap entropy over a sample of them
        self.sent = np.zeros(5)  # words, bytes, messages, entropy sum, entropy words
        self._win = [0, 0, 0]    # words, bytes, iterations since the last progress record
        self._lag_mark = (0, 0)  # (lag_sum, received) at the last progress record

    def run(self) -> dict:
        m = self.ctx.metrics
        if self.resumed_tau and self.first:
            m.message(f"--tau auto resumes from the checkpoint's tau {self.resumed_tau:.6g}")
        if self.cfg.lr_scaling != "sum":
            m.message(f"{self.R} replicas apply each other's steps: each thresholds "
                      f"lr {self.cfg.lr:g} scaled {self.cfg.lr_scaling} = {self.lr:.4g}")
        if not self.released:
            if self.first:
                m.message(f"warm start: replica 0 trains alone for {self.warmup} steps")
            else:
                self._warm_start_weights()
        return super().run()

    def _warm_start_weights(self) -> None:
        """Collective over the partition communicator: replica 0's weights to every replica,
        and every replica's dead reckoning restarts from them."""
        grid = self.ctx.grid
        root = self.comm.Get_rank() == 0
        leader = grid.layout.replica_rank(0, grid.role.partition)
        what = ("the other replicas to take replica 0's warm-start weights" if root else
                f"replica 0 (rank {leader}) to finish its {self.warmup}-step warm start")
        bcast(self.comm, self.params, 0, self.cfg.timeout, what)
        self.reckon.restart()
        self.comp.residual[:] = 0.0
        if self.velocity is not None:
            self.velocity.v[:] = 0.0
        self.warm_done = self.done
        self.released = True
        if root:
            self.ctx.metrics.message("warm start done: all replicas train now")

    def before_step(self) -> None:
        self.peers.poll(self.reckon.apply)

    def step(self, x, y) -> float:
        loss = self.source(self.params, x, y, self.grad)
        if not self.released:  # replica 0 alone: plain SGD, nothing to send
            self.grad *= self.warm_scale * np.float32(self.lr_factor())
            self.params += self.grad
            if self.done + self.T >= self.warmup:
                self._warm_start_weights()
            return loss
        if self.grad_clip > 0:
            clip_norm(self.grad, self.grad_clip)
        if self.velocity is not None:
            self.velocity.accumulate(self.grad)
        # the SGD steps (T with threads) this replica would take, at the scheduled rate (an
        # overflow is the divergence the loss check reports in one message, not a warning)
        with np.errstate(over="ignore", invalid="ignore"):
            self.grad *= self.step_scale * np.float32(self.lr_factor())
        thr = self.thr
        multiple = thr.multiple
        self.comp.tau = thr.tau
        msg, words = self.comp.compress(self.grad)
        t = (self.done - self.warm_done) // self.T + 1  # steps since all replicas started
        self.peers.local_step = t
        self.peers.send(msg, t, multiple)
        self.reckon.apply(words, multiple)
        if self.velocity is not None:
            self.velocity.mask(words)
        thr.after_pass(self.comp.residual, len(words))
        self.sent[:3] += (len(words), len(msg), 1)
        if (t - 1) % ENTROPY_EVERY == 0 and len(words) > 1:
            self.sent[3:] += (compress.gap_entropy_bits(words) * len(words), len(words))
        self._win = [self._win[0] + len(words), self._win[1] + len(msg), self._win[2] + 1]
        return loss

    def global_step(self) -> int:
        # every message from a peer stands for one of its iterations (partition 0's count:
        # the partitions of a replica run the same steps)
        return self.ctx.start_step + self.done + self.peers.received * self.T

    def progress_fields(self) -> dict:
        words, nbytes, iters = self._win
        lag, got = self._lag_mark
        per = max(1, iters * self.T)
        out = {"staleness": round((self.peers.lag_sum - lag)
                                  / max(1, self.peers.received - got), 2),
               "updates_per_step": round(words / per, 1),
               # each message goes to the R-1 peers
               "bytes_per_step": round(nbytes / per * (self.R - 1)),
               "compression": compression_ratio(4 * self.n * iters, nbytes, digits=1),
               **self.thr.fields(self.comp.residual)}
        warning = self.residual_watch.update(out["residual_norm"], out["tau"])
        if warning:
            self.ctx.metrics.message(warning)
        self._win = [0, 0, 0]
        self._lag_mark = (self.peers.lag_sum, self.peers.received)
        return out

    def checkpoint_state(self) -> dict:
        # replica 0's copy holds every delta it has applied so far; with momentum, its
        # velocity is saved too (every replica resumes with it)
        return {"velocity": self.velocity.v} if self.velocity is not None else {}

    def checkpoint_metrics(self) -> dict:
        return {"tau": self.thr.tau} if self.thr.adaptive else {}

    def after_loop(self) -> None:
        if not self.released:  # the run was no longer than the warm start
            self._warm_start_weights()
        self.peers.finish(self.reckon.apply)

    def finish(self, train_s: float) -> dict:
        """Every replica drained: compare checksums, add up the message figures."""
        ctx, comm, grid = self.ctx, self.comm, self.ctx.grid
        barrier(comm, self.cfg.timeout, "every replica to drain its messages")
        checksums = gather_obj(comm, zlib.crc32(self.params.tobytes()))
        steps_all = reduce_obj(comm, self.done, SUM)
        # the dense bytes this rank's messages stand for: its slice, 4 bytes a weight, each
        dense = 4 * self.n * self.sent[2]
        totals = reduce_obj(comm, np.array([*self.sent, dense, self.peers.lag_sum,
                                            self.peers.received], np.float64), SUM)
        if not self.first:
            return {}
        # replica 0's ranks hold the totals of their partition; add up the partitions
        identical = len(set(checksums)) == 1
        if ctx.partitioned:
            rc = grid.replica_comm
            totals = reduce_obj(rc, totals, SUM)
            identical = allreduce_obj(rc, identical, LAND)
            checksums = gather_obj(rc, checksums)
            checksums = [c for part in checksums for c in part] if checksums else checksums
        full = ctx.gather_full(self.params)
        state = {k: ctx.gather_full(v) for k, v in self.checkpoint_state().items()}
        if not grid.is_chief:
            return {}
        out = finish_on_chief(ctx, full, state, ctx.start_step + steps_all, train_s,
                              self.checkpoint_metrics())
        out["figures"] = message_figures(totals, steps_all, self.R)
        out["figures"].update(replicas_identical=bool(identical),
                              replica_checksums=[f"{c:08x}" for c in checksums],
                              final_tau=self.thr.tau,
                              residual_warning=self.residual_watch.fired)
        return out


def compression_ratio(dense_bytes: float, sent_bytes: float, digits: int | None = None):
    """Dense bytes of the slices the messages cover over the bytes sent for them; None when
    nothing was sent (a run or progress interval within the warm start): JSON has no inf."""
    if not sent_bytes:
        return None
    ratio = dense_bytes / sent_bytes
    return ratio if digits is None else round(ratio, digits)


def message_figures(totals, steps: int, replicas: int) -> dict:
    """Summary figures of every replica's messages (``totals`` as :meth:`finish` adds them,
    over replicas and partitions)."""
    words, nbytes, msgs, ent_sum, ent_words, dense, lag, received = totals
    return {
        # every message goes to R-1 peers
        "bytes_per_step": nbytes / max(1, steps) * (replicas - 1),
        "updates_per_step": words / max(1, steps),
        "compression_ratio": compression_ratio(dense, nbytes),
        "bits_per_update": 8 * nbytes / max(1, words),
        # without the 16-byte message headers: what compares with the gap entropy
        "payload_bits_per_update": 8 * (nbytes - compress.HEADER_BYTES * msgs) / max(1, words),
        # the same messages as raw 32-bit words: header + 4 bytes per word
        "raw_bits_per_update": 8 * (compress.HEADER_BYTES * msgs + 4 * words) / max(1, words),
        "gap_entropy_bits": ent_sum / ent_words if ent_words else float("nan"),
        "mean_staleness": lag / max(1, received)}


def run(ctx: Context) -> dict:
    return DeadReckonReplica(ctx).run()
