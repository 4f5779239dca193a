"""Dead reckoning with thresholded 1-bit updates (Strom 2015, sections 2.3-2.6). No servers.

Every replica keeps a full copy of the model and a per-weight *residual*. After each
mini-batch it adds its SGD step (-lr * gradient) to the residual, and every element whose
residual passed +-tau becomes one 32-bit word (index and sign) of a message, with +-tau taken
out of the residual (the rest, quantization error included, waits for later steps). The
message, Golomb-Rice coded, goes to every peer of the partition communicator with
non-blocking sends, and the replica applies it to its own copy. Before each mini-batch it
applies whatever messages have arrived from peers, without waiting for any: a slow peer
never stalls the others.

Every replica applies the same deltas, in different orders. Adding +-tau to float32 weights
in different orders would round differently, so a replica keeps, per weight, the net number
of +tau steps applied (an integer: order does not matter) and sets a touched weight to
``w0 + tau * count``. Once all messages are drained, every replica holds bit-identical
weights; the summary reports a checksum per replica to show it.

At the end each replica's residual (deltas smaller than tau that were never sent) is dropped,
as in the paper: it is at most tau per weight.
"""
from __future__ import annotations

import time
import zlib
from collections import deque

import numpy as np
from mpi4py import MPI

from hpcps import compress
from hpcps.data import Batches, Prefetcher
from hpcps.protocol import Tag
from hpcps.ps.waiting import Poller, PeerTimeout, wait_all
from hpcps.strategies.common import (Context, GradientSource, barrier, crossed, evaluate,
                                     model_parallel_figures, rate, save_checkpoint,
                                     steps_for_replica)


STEP_BYTES = 8  # int64 sender step in front of each update message
ENTROPY_EVERY = 16  # measure the index-gap entropy of every 16th message (for the metrics)


class Reckoner:
    """One replica's model copy, kept as ``w0 + tau * counts`` wherever a delta landed."""

    def __init__(self, params: np.ndarray, tau: float):
        self.params = params
        self.base = params.copy()
        self.counts = np.zeros(len(params), dtype=np.int32)
        self.tau = np.float32(tau)
        self.applied_words = 0

    def apply(self, words: np.ndarray) -> None:
        """Apply one message's words (indices unique within a message, as threshold emits)."""
        if len(words) == 0:
            return
        idx = (words >> 1).astype(np.intp)
        self.counts[idx] += 1 - 2 * (words & 1).astype(np.int32)
        self.params[idx] = self.base[idx] + self.tau * self.counts[idx].astype(np.float32)
        self.applied_words += len(words)


class Peers:
    """Non-blocking exchange of messages with every other replica of the communicator."""

    def __init__(self, comm, n: int, timeout: float):
        self.comm = comm
        self.n = n
        self.timeout = timeout
        self.peers = [p for p in range(comm.Get_size()) if p != comm.Get_rank()]
        self.rx = np.empty(STEP_BYTES + compress.max_message_bytes(n), dtype=np.uint8)
        self.local_step = 0   # this replica's steps so far (set by the training loop)
        self.lag_sum = 0      # sum over received messages of (our step - sender's step)
        self.pending: deque = deque()   # (requests, buffer) of sends still in flight
        self.done_from: set[int] = set()
        self.received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._status = MPI.Status()

    def send(self, msg: np.ndarray, step: int) -> None:
        """Send one message to every peer; the buffer is kept alive until the sends finish.

        The sender's local step rides in front of the message (8 bytes), so a receiver can
        tell how far behind it the update is (the staleness reported in progress lines).
        """
        if not self.peers:
            return
        buf = np.empty(STEP_BYTES + len(msg), dtype=np.uint8)
        buf[:STEP_BYTES].view(np.int64)[0] = step
        buf[STEP_BYTES:] = msg
        reqs = [self.comm.Isend(buf, dest=p, tag=Tag.DR_UPDATE) for p in self.peers]
        self.pending.append((reqs, buf))
        self.bytes_sent += buf.nbytes * len(self.peers)
        while self.pending and MPI.Request.Testall(self.pending[0][0]):
            self.pending.popleft()

    def poll(self, on_words) -> int:
        """Receive and apply every message that has already arrived; never waits."""
        got = 0
        st = self._status
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, st):
            got += self._receive(st, on_words)
        return got

    def _receive(self, st, on_words) -> int:
        src, tag = st.Get_source(), st.Get_tag()
        if tag == Tag.DR_DONE:
            self.comm.Recv(self.rx[:0], source=src, tag=Tag.DR_DONE)
            self.done_from.add(src)
            return 0
        if tag != Tag.DR_UPDATE:
            raise RuntimeError(f"deadreckon got unexpected tag {tag} from replica {src}")
        size = st.Get_count(MPI.BYTE)
        if not STEP_BYTES <= size <= len(self.rx):
            raise compress.CodecError(f"message of {size} bytes from replica {src} is larger "
                                      f"than any valid message for {self.n} weights")
        self.comm.Recv(self.rx[:size], source=src, tag=Tag.DR_UPDATE)
        on_words(compress.decode(self.rx[STEP_BYTES:size], self.n))
        self.lag_sum += self.local_step - int(self.rx[:STEP_BYTES].view(np.int64)[0])
        self.received += 1
        self.bytes_received += size
        return 1

    def finish(self, on_words) -> None:
        """Tell every peer we are done, then apply messages until every peer said the same."""
        done_reqs = [self.comm.Isend(self.rx[:0], dest=p, tag=Tag.DR_DONE) for p in self.peers]
        deadline = time.monotonic() + self.timeout
        poll = Poller()
        st = self._status
        while len(self.done_from) < len(self.peers):
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, st):
                self._receive(st, on_words)
                poll.reset()
                deadline = time.monotonic() + self.timeout
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(self.peers) - self.done_from)
                raise PeerTimeout(f"waited {self.timeout:.0f} s for replicas {missing} of the "
                                  "partition communicator to finish sending their updates")
            poll.pause()
        wait_all(done_reqs + [r for reqs, _ in self.pending for r in reqs], self.timeout,
                 "peer replicas to take the last updates")
        self.pending.clear()


def run(ctx: Context) -> dict:
    cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
    comm = grid.partition_comm
    R, me = comm.Get_size(), comm.Get_rank()
    n = model.n_params
    source = GradientSource(ctx)
    T = source.threads  # mini-batches per iteration (Hogwild threads)
    iterations = -(-steps_for_replica(ctx.remaining_steps, R, me) // T)
    my_steps = iterations * T
    batches = Prefetcher(Batches(ctx.train_x, ctx.train_y, source.batch,
                                 ctx.batch_seed(grid.role.replica)), cfg.prefetch)
    reckon = Reckoner(ctx.params, cfg.tau)
    comp = compress.Compressor(n, cfg.tau, golomb=cfg.golomb == "on")
    peers = Peers(comm, n, cfg.timeout)
    grad = np.empty(n, dtype=np.float32)
    lr = np.float32(cfg.lr)
    m = ctx.metrics
    dense_bytes = 4 * ctx.full_model.n_params  # a replica's dense gradient, all partitions
    sent_words = sent_bytes = sent_msgs = 0
    entropy_sum = entropy_words = 0.0  # gap entropy over a sample of this replica's messages
    t0 = time.perf_counter()
    last_t, last_step = t0, ctx.start_step
    loss_win = n_win = words_win = bytes_win = 0
    lag_mark = [0, 0]  # (lag_sum, received) at the last report

    def global_step() -> int:
        # (partition 0's count: the partitions of a replica run the same steps)
        # every message from a peer stands for one of its mini-batches
        return ctx.start_step + t_done + peers.received * T

    def report() -> None:
        nonlocal last_t, last_step, loss_win, n_win, words_win, bytes_win
        step, now = global_step(), time.perf_counter()
        m.record("progress", step=step, epoch=round(ctx.epochs(step), 3),
                 examples_per_s=round(rate((step - last_step) * cfg.batch_size, now - last_t), 1),
                 loss=loss_win / max(1, n_win),
                 staleness=round((peers.lag_sum - lag_mark[0])
                                 / max(1, peers.received - lag_mark[1]), 2),
                 updates_per_step=round(words_win / max(1, n_win * T), 1),
                 # each message goes to the R-1 peers; compression: this rank's slice of the
                 # dense gradient over its message
                 bytes_per_step=round(bytes_win / max(1, n_win * T) * (R - 1)),
                 compression=round(4 * n / max(1.0, bytes_win / max(1, n_win)), 1),
                 **model_parallel_figures(ctx, t_done, now - t0))
        last_t, last_step = now, step
        loss_win = n_win = words_win = bytes_win = 0
        lag_mark[:] = [peers.lag_sum, peers.received]

    # replica 0 evaluates and checkpoints every eval_every/R (checkpoint_every/R) of its own
    # steps: a schedule all its partitions compute alike, so they can gather the model together
    eval_local = max(1, -(-cfg.eval_every // R)) if cfg.eval_every else 0
    ckpt_local = max(1, -(-cfg.checkpoint_every // R)) if cfg.checkpoint_every else 0
    first = grid.role.replica == 0
    t_done = 0
    step_scale = -lr * np.float32(T)
    for t in range(iterations):
        peers.poll(reckon.apply)
        x, y = next(batches)
        loss = source(reckon.params, x, y, grad)
        grad *= step_scale  # the SGD steps (T with Hogwild threads) this replica would take
        msg, words = comp.compress(grad)
        peers.local_step = t + 1
        peers.send(msg, t + 1)
        reckon.apply(words)
        sent_words += len(words)
        sent_bytes += len(msg)
        sent_msgs += 1
        if t % ENTROPY_EVERY == 0 and len(words) > 1:
            entropy_sum += compress.gap_entropy_bits(words) * len(words)
            entropy_words += len(words)
        loss_win += loss
        n_win += 1
        words_win += len(words)
        bytes_win += len(msg)
        t_done = (t + 1) * T
        if grid.is_chief and m.due():
            report()
        evaluating = first and crossed(t_done, T, eval_local)
        saving = first and crossed(t_done, T, ckpt_local)
        if evaluating or saving:
            full = ctx.gather_full(reckon.params)
            if grid.is_chief:
                step = global_step()
                if evaluating:
                    test_loss, test_acc = evaluate(ctx, full)
                    m.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                             test_accuracy=test_acc, test_loss=test_loss)
                if saving:
                    # replica 0's copy: every delta it has applied so far (not yet drained)
                    path = save_checkpoint(ctx, full, {}, step, {"train_loss": loss})
                    m.record("checkpoint", echo=False, step=step, path=str(path))
    if n_win and grid.is_chief:
        report()
    peers.finish(reckon.apply)
    train_s = time.perf_counter() - t0
    batches.close()
    barrier(comm, cfg.timeout, "every replica to drain its messages")
    checksums = comm.gather(zlib.crc32(reckon.params.tobytes()), root=0)
    steps_all = comm.reduce(my_steps, op=MPI.SUM, root=0)
    totals = comm.reduce(np.array([sent_words, sent_bytes, sent_msgs, entropy_sum,
                                   entropy_words, peers.lag_sum, peers.received], np.float64),
                         op=MPI.SUM, root=0)
    result = {"train_s": train_s, **model_parallel_figures(ctx, my_steps, train_s)}
    if not first:
        return result
    # replica 0's ranks hold the totals of their partition; add up the partitions
    identical = len(set(checksums)) == 1
    if ctx.partitioned:
        rc = grid.replica_comm
        totals = rc.reduce(totals, op=MPI.SUM, root=0)
        identical = rc.allreduce(identical, op=MPI.LAND)
        checksums = rc.gather(checksums, root=0)
        checksums = [c for part in checksums for c in part] if checksums else checksums
    full = ctx.gather_full(reckon.params)
    if grid.is_chief:
        words_all, bytes_all, msgs_all, ent_sum, ent_words, lag_all, received_all = totals
        step = ctx.start_step + steps_all
        test_loss, test_acc = evaluate(ctx, full)
        path = save_checkpoint(ctx, full, {}, step,
                               {"test_accuracy": test_acc, "test_loss": test_loss})
        ent = (ent_sum, ent_words)
        per_step = bytes_all / max(1, steps_all)
        result.update(
            step=step, test_accuracy=test_acc, test_loss=test_loss, checkpoint=str(path),
            examples_per_s=rate(steps_all * cfg.batch_size, train_s),
            # every message goes to R-1 peers
            bytes_per_step=per_step * (R - 1),
            updates_per_step=words_all / max(1, steps_all),
            compression_ratio=dense_bytes * msgs_all / bytes_all if bytes_all else float("inf"),
            bits_per_update=8 * bytes_all / max(1, words_all),
            # without the 16-byte message headers: what compares with the gap entropy
            payload_bits_per_update=8 * (bytes_all - compress.HEADER_BYTES * msgs_all)
            / max(1, words_all),
            # the same messages as raw 32-bit words: header + 4 bytes per word
            raw_bits_per_update=8 * (compress.HEADER_BYTES * msgs_all + 4 * words_all)
            / max(1, words_all),
            gap_entropy_bits=ent[0] / ent[1] if ent[1] else float("nan"),
            mean_staleness=lag_all / max(1, received_all),
            replicas_identical=bool(identical),
            replica_checksums=[f"{c:08x}" for c in checksums])
    return result
