"""Where a replica's gradient comes from: the compiled engine, NumPy, or Hogwild threads."""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from hpcps import trace
from hpcps.compress.bf16 import Wire
from hpcps.io.data.categorical import Features
from hpcps.io.data.stream import EVAL_ROWS, chunks
from hpcps.mpi.comm import ReplicaExchange, dup_comm
from hpcps.model.metrics import binary_metrics
from hpcps.strategies.context import VAL, Context


class PassTimer:
    """The seconds and CPU time of a replica's gradient passes (``pass_s``, ``pass_cpu_s``),
    and their spans in the trace. The CPU time is the calling thread's with one thread (the
    prefetcher, preparing the next mini-batch meanwhile, is not the pass), the process's
    with ``threads`` > 1 (the Hogwild threads compute it)."""

    pass_s = pass_cpu_s = 0.0
    threads = 1

    @contextmanager
    def timed(self, examples: int):
        """Count the block as the replica's pass (``pass_s``, ``pass_cpu_s``, the trace's
        compute span): every pass goes through here, also one a strategy computes itself
        (downpour's ``--push activations`` keeps layer inputs and errors instead)."""
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        clock = time.thread_time if self.threads == 1 else time.process_time
        start, cpu = time.perf_counter(), clock()
        try:
            yield
        finally:
            self.pass_s += time.perf_counter() - start
            self.pass_cpu_s += clock() - cpu
            if tr is not None:
                tr.span(trace.COMPUTE, "gradient", t0, {"examples": examples})


class GradientSource(PassTimer):
    """Where a replica's gradient comes from: one mini-batch, or with ``--threads T``
    (T > 1) T mini-batches trained by T Hogwild threads.

    One mini-batch (T = 1) goes through the compiled engine's forward and backward pass
    (:meth:`hpcps.engine.hogwild.HogwildEngine.loss_and_grad`: BLAS without temporaries, the first
    layer skipping zero inputs; for a conv model
    :meth:`hpcps.engine.conv_hogwild.ConvHogwild.loss_and_grad`) when the model is whole and the
    engine is built, else through ``model.loss_and_grad`` (NumPy). A partition of a conv
    model (P > 1) runs its layers in the compiled engine too
    (:class:`hpcps.engine.conv_hogwild.CompiledPartition`, the exchanges between them as
    the NumPy path's); a partition of an MLP runs NumPy's. Both compute the same gradient,
    to float32 rounding.

    The threads each take one SGD step (rate ``--lr``) on a scratch copy of the parameters,
    lock-free, and record the updates they applied; the mean gradient they stand for,
    ``-updates / (lr * T)``, is what the strategy pushes, allreduces or thresholds, exactly
    where it used one mini-batch's gradient. Each thread's gradient is taken where the shared
    copy stood when it looked (Hogwild: possibly moved by the other threads' steps), so with
    T > 1 results are no longer bit-reproducible.

    With P = 1 the threads are :mod:`hpcps.engine.hogwild`'s compiled nogil engine on the whole
    model (:mod:`hpcps.engine.conv_hogwild`'s for a conv model). With P > 1 they are
    :class:`hpcps.engine.partitioned_hogwild.PartitionedHogwild`: thread t of every partition rank
    of the replica computes one mini-batch (rows t*batch .. (t+1)*batch of the T*batch the
    strategy hands over, the same rows on every partition)
    through its own :class:`ReplicaExchange`, over its own duplicate of the replica
    communicator (made here, once, in thread order, on every partition rank alike), so
    the collectives of different threads never mix. That needs ``MPI_THREAD_MULTIPLE``
    (``train.py`` refuses the run without it).

    ``pass_s`` adds up the seconds spent in calls (the passes, the threads' steps, weight
    decay): the replica's compute, reported per step in the summary; ``pass_cpu_s`` the CPU
    time used in them (this thread's, or with T > 1 every thread's: on cores shared with more
    ranks than cores, what the pass cost without the time it waited for a core).
    """

    def __init__(self, ctx: Context):
        cfg = ctx.cfg
        self.model = ctx.model
        self.threads = cfg.threads
        self.batch = cfg.batch_size * self.threads  # examples per call
        self.partitioned = ctx.partitioned and self.threads > 1
        if self.threads > 1:
            n = ctx.model.n_params
            self.scratch = np.empty(n, dtype=np.float32)
            self.delta = np.empty(n, dtype=np.float32)
            self.lr = float(cfg.lr)
        if self.partitioned:
            from hpcps.engine.conv_hogwild import compiled_partition
            from hpcps.engine.partitioned_hogwild import PartitionedHogwild
            comms = dup_comm(ctx.grid.replica_comm, self.threads, cfg.timeout,
                             "the other partitions of this replica to duplicate the replica "
                             "communicator (one per Hogwild thread)")
            wire = Wire.named(cfg.wire_dtype)
            self.exchanges = [ReplicaExchange(c, cfg.timeout, wire) for c in comms]
            from hpcps.model.convnet import build_partition
            self.engine = PartitionedHogwild(
                cfg.layers, cfg.activation, ctx.model.parts, ctx.model.part, self.exchanges,
                timeout=cfg.timeout * 2 * ctx.model.n_layers,
                make_model=lambda ex: compiled_partition(
                    build_partition(cfg, ctx.full_model, ctx.model.parts, ctx.model.part, ex,
                                    self.exchanges.index(ex)), cfg.batch_size))
            self._seen = (0, 0.0)  # the threads' exchange figures already reported
        elif self.threads > 1:
            from hpcps.engine.conv_hogwild import engine_for
            self.engine = engine_for(ctx.full_model, cfg.activation, threads=self.threads,
                                     batch=cfg.batch_size)
            self.order = np.arange(self.batch)
        self.weight_decay = np.float32(cfg.weight_decay or 0.0)
        self.compiled_one = None
        if self.threads == 1 and ctx.partitioned:
            from hpcps.engine.conv_hogwild import compiled_partition
            one = compiled_partition(ctx.model, cfg.batch_size)
            self.compiled_one = one if one is not ctx.model else None
        elif self.threads == 1:
            from hpcps.engine import conv_hogwild, hogwild
            if cfg.model is None and hogwild.HAVE_EXTENSION:
                self.compiled_one = hogwild.HogwildEngine(cfg.layers, cfg.activation,
                                                          threads=1, batch=cfg.batch_size)
            elif cfg.model is not None and conv_hogwild.HAVE_EXTENSION:
                self.compiled_one = conv_hogwild.ConvHogwild(ctx.full_model, threads=1,
                                                             batch=cfg.batch_size)

    def __call__(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                 grad: np.ndarray) -> float:
        """Mean loss over the examples; ``grad`` receives the mean gradient."""
        with self.timed(len(x)):
            if self.compiled_one is not None:
                loss = self.compiled_one.loss_and_grad(params, x, y, grad=grad)[0]
            elif self.threads == 1:
                loss = self.model.loss_and_grad(params, x, y, grad=grad)[0]
            else:
                loss = self._threads(params, x, y, grad)
            if self.weight_decay:  # + the gradient of weight_decay/2 * |w|^2
                grad += self.weight_decay * params
        return loss

    def _threads(self, params, x, y, grad) -> float:
        """T Hogwild threads, one mini-batch each (see the class docstring)."""
        self.scratch[...] = params
        self.delta[...] = 0.0
        if self.partitioned:
            loss_sum, n = self.engine.train(self.scratch, x, y, self.lr, delta=self.delta)
            self._report_exchange()
        else:
            loss_sum, n = self.engine.train(self.scratch, x, y, self.order, self.lr,
                                            steps_per_thread=1, delta=self.delta)
        np.multiply(self.delta, np.float32(-1.0 / (self.lr * self.threads)), out=grad)
        return loss_sum / n

    def _report_exchange(self) -> None:
        """Add the threads' exchange traffic to the replica's exchange (the figures of the
        progress line): every byte sent, and the seconds spent waiting averaged over the
        threads (they wait at the same time, so that is the wall time lost to waiting)."""
        ex = getattr(self.model, "exchange", None)
        sent = sum(e.bytes_sent for e in self.exchanges)
        waited = sum(e.wait_s for e in self.exchanges) / self.threads
        if isinstance(ex, ReplicaExchange):
            ex.bytes_sent += sent - self._seen[0]
            ex.wait_s += waited - self._seen[1]
        self._seen = (sent, waited)


class EmbeddingSource(PassTimer):
    """The gradient of an embedding model's mini-batch (:class:`hpcps.model.ctr.CtrModel`):
    look the batch's ids up, pull each unique row once from the shards that hold it
    (:class:`hpcps.ps.rows.RowClient`), compute, push the rows' gradients back without
    waiting, and hand the dense layers' gradient to the strategy as a dense model's.

    A mini-batch ``x`` is ``(ids, dense)`` (:class:`hpcps.io.data.categorical.Features`).

    With ``--threads T`` (T > 1) an iteration is T mini-batches, as for a dense model: the
    replica pulls the rows of all T at once (each unique row once), and T Hogwild threads
    each take one SGD step (rate ``--lr``) on a scratch copy of the fc layers and of those
    rows, lock-free; what they moved, ``-(scratch - pulled) / (lr * T)``, is the mean
    gradient the replica hands on and pushes, exactly where one mini-batch's went. The
    threads' passes overlap where NumPy's matrix products and the embedding kernels release
    the GIL; a row two threads update at once may lose one update (Hogwild).
    """

    def __init__(self, ctx: Context, rows):
        cfg = ctx.cfg
        self.model = ctx.model
        self.rows = rows
        self.threads = cfg.threads
        self.batch = cfg.batch_size * self.threads  # examples per iteration
        self.eval_batch = max(1024, self.batch)
        self.ctx = ctx
        self.lr = float(cfg.lr)
        self.pool = None
        if self.threads > 1:
            from concurrent.futures import ThreadPoolExecutor
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hpcps-hogwild")

    def __call__(self, params: np.ndarray, x, y: np.ndarray, grad: np.ndarray) -> float:
        ids, dense = x
        batch = self.model.lookup(ids)
        rows = self.rows.pull(batch.uniq)
        with self.timed(len(y)):
            if self.threads == 1:
                loss, _, row_grads = self.model.loss_and_grad(params, rows, batch, y, dense,
                                                              grad=grad)
            else:
                loss, row_grads = self._threads(params, rows, batch, ids, y, dense, grad)
        self.rows.push(row_grads, loss)
        return loss

    def _threads(self, params, rows, batch, ids, y, dense, grad):
        """T Hogwild threads, one mini-batch each (see the class docstring)."""
        model, T, lr = self.model, self.threads, np.float32(self.lr)
        pulled = np.concatenate(rows) if len(rows) > 1 else rows[0]
        scratch, scratch_rows = params.copy(), pulled.copy()
        B = len(y) // T
        # where each thread's unique rows sit among the iteration's: by table, through the
        # sorted order of the iteration's unique ids
        order = [np.argsort(u, kind="stable") for u in batch.uniq]

        def work(t: int) -> float:
            sl = slice(t * B, (t + 1) * B)
            mine = model.lookup(ids[sl])
            where = [order[k][np.searchsorted(batch.uniq[k], u, sorter=order[k])]
                     + batch.starts[k] for k, u in enumerate(mine.uniq)]
            g = np.empty_like(scratch)
            loss, _, row_grads = model.loss_and_grad(
                scratch, [scratch_rows[w] for w in where], mine, y[sl],
                None if dense is None else dense[sl], grad=g)
            scratch[...] -= lr * g  # in place, unlocked: Hogwild
            for w, rg in zip(where, row_grads):
                scratch_rows[w] -= lr * rg
            return loss

        losses = list(self.pool.map(work, range(T)))
        np.multiply(params - scratch, np.float32(1.0 / (lr * T)), out=grad)
        moved = (pulled - scratch_rows) * np.float32(1.0 / (lr * T))
        s = batch.starts
        return float(np.mean(losses)), [moved[s[k]:s[k + 1]] for k in range(len(rows))]

    def logits(self, params: np.ndarray, features) -> np.ndarray:
        """(N,) logits of every row of ``features``, in batches, reading rows without
        creating any (an id never trained reads as its initial row)."""
        n = len(features)
        out = np.empty(n, dtype=np.float64)
        for lo in range(0, n, self.eval_batch):
            ids, dense = features[lo:lo + self.eval_batch]
            batch = self.model.lookup(ids)
            rows = self.rows.pull(batch.uniq, create=False)
            out[lo:lo + len(ids)] = self.model.logits(params, rows, batch, dense)
        return out

    def evaluate(self, params: np.ndarray, split: str) -> dict:
        """``{"loss", "auc"}`` of the chief's ``split`` (for :attr:`Context.evaluator`): in
        memory, or read from the file in chunks when it streams (each row's label and logit
        kept: the AUC ranks them all)."""
        ctx = self.ctx
        x, y, source = (ctx.val_x, ctx.val_y, ctx.val_stream) if split == VAL else \
            (ctx.test_x, ctx.test_y, ctx.test_stream)
        if source is not None:
            ys, logits = [], []
            for (ids, dense), cy in chunks(source, ctx.feed.eval_rows if ctx.feed else
                                           EVAL_ROWS):
                ys.append(cy)
                logits.append(self.logits(params, Features(ids, dense)))
            y, z = np.concatenate(ys), np.concatenate(logits)
        else:
            z = self.logits(params, x)
        figures = binary_metrics(y, z)
        return {"loss": figures["log_loss"], "auc": figures["auc"]}
