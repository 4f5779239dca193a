"""Hogwild threads inside one partition of a model-parallel replica (``--threads T
--partitions P``). No MPI: the exchanges are handed in.

With P = 1 the compiled engine (:mod:`hpcps.engine.hogwild`) trains the whole model in one rank.
With P > 1 every forward and backward pass needs the other P-1 ranks of the replica at every
layer, so each of the T threads here runs its own mini-batch through its own partition (a
:class:`~hpcps.model.mlp.PartitionedMLP`, or what ``make_model`` builds: for a conv model a
:class:`hpcps.engine.conv_hogwild.CompiledPartition`, whose layers run in the compiled
engine without the GIL), whose exchange is the thread's own: thread t of every
partition rank talks only to thread t of the others (over its own duplicate of the replica
communicator, see :class:`hpcps.strategies.gradients.GradientSource`), so the collectives of
different threads never mix. Each partition rank splits the rows it is given the same way
(thread t takes the t-th block), and every rank of a replica is given the same rows, so
thread t computes one mini-batch jointly across the P ranks.

The threads share this rank's parameter slice and write their SGD steps into it without a
lock (NumPy in-place adds, which release the GIL): the same races as :mod:`hpcps.engine.hogwild`
describes (lost updates, torn reads across a matrix, stale gradients), and one more that
model parallelism adds: thread t's forward pass on partition p may read p's weights after
p's thread t' applied its step while partition q's thread t read q's weights before q's
thread t' did. That is a torn read across the replica instead of across one matrix, of the
same size (one concurrent step) and tolerated for the same reasons.

NumPy's matmul (and the compiled conv engine) releases the GIL, so the threads' GEMMs
overlap; Python between them does not. BLAS must run one thread per calling thread
(``OPENBLAS_NUM_THREADS=1``, which ``train.py`` sets; with ``threadpoolctl`` installed
:meth:`PartitionedHogwild.train` also limits it for the call).

Failure: the calling thread runs thread 0's mini-batch itself and the T-1 others run in
daemon worker threads. An exception in any thread is raised by :meth:`train` (annotated
with the thread) once the calling thread's own mini-batch is done, without waiting for the
others; a worker that neither finishes nor fails within the bound raises
:class:`HogwildThreadTimeout`. A stuck worker never keeps the process alive (daemon).
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np

from hpcps.errors import ConfigError, HpcpsError
from hpcps.kernels import blas
from hpcps.model.mlp import PartitionedMLP

__all__ = ["HogwildThreadTimeout", "PartitionedHogwild", "thread_rows"]


class HogwildThreadTimeout(HpcpsError):
    """A Hogwild thread of this rank neither finished nor failed in time."""

    exit_code = 5


def thread_rows(n: int, threads: int, t: int) -> tuple[int, int]:
    """Rows [lo, hi) of an ``n``-row batch that thread ``t`` of ``threads`` takes: the t-th of
    T blocks as even as possible; with n = T * batch, exactly rows t*batch .. (t+1)*batch
    (as the compiled engine assigns them)."""
    return t * n // threads, (t + 1) * n // threads


class PartitionedHogwild:
    """T threads training partition ``part`` of a ``parts``-way partitioned MLP, lock-free.

    Parameters
    ----------
    sizes, activation, parts, part : as for :class:`~hpcps.model.mlp.PartitionedMLP`.
    exchanges : one exchange per thread (T = len(exchanges)); exchange t must connect thread
        t of every partition of the replica, and nothing else.
    timeout : seconds a worker thread's mini-batch may take before :meth:`train` gives up on
        it (each exchange wait inside it has its own timeout naming the peer; this is the
        backstop when a thread is stuck elsewhere).
    make_model : ``make_model(exchange)``, the partition of another model to train instead
        of the MLP of ``sizes`` (a :class:`hpcps.engine.conv_hogwild.CompiledPartition`, or a
        :class:`hpcps.model.convnet.PartitionedConvNet` without the extension).
    """

    def __init__(self, sizes, activation: str, parts: int, part: int, exchanges,
                 timeout: float, make_model=None):
        exchanges = list(exchanges)
        if not exchanges:
            raise ConfigError("PartitionedHogwild needs at least one exchange (one per thread)")
        self.threads = len(exchanges)
        self.exchanges = exchanges
        if make_model is None:
            def make_model(ex):
                return PartitionedMLP(sizes, activation, parts, part, ex)
        self.models = [make_model(ex) for ex in exchanges]
        self.n_params = self.models[0].n_params
        self.grads = [np.empty(self.n_params, dtype=np.float32) for _ in exchanges]
        self._updates = [np.empty(self.n_params, dtype=np.float32) for _ in exchanges]
        self.timeout = float(timeout)
        self._inboxes = [queue.SimpleQueue() for _ in range(self.threads - 1)]
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._generation = 0
        self._blas_one_thread = blas.OneThread()

    # -- worker threads -------------------------------------------------------------------
    def _start(self) -> None:
        if self._workers:
            return
        for t in range(1, self.threads):
            w = threading.Thread(target=self._serve, args=(t,), daemon=True,
                                 name=f"hpcps-hogwild-{t}")
            w.start()
            self._workers.append(w)

    def _serve(self, t: int) -> None:
        inbox = self._inboxes[t - 1]
        while True:
            job = inbox.get()
            if job is None:
                return
            gen, args = job
            try:
                self._results.put((gen, t, self._step(t, *args), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                self._results.put((gen, t, None, exc))

    def close(self) -> None:
        """Stop the worker threads (idle ones exit at once; they are daemons anyway)."""
        for inbox in self._inboxes:
            inbox.put(None)
        self._workers = []

    def _step(self, t: int, params, x, y, lr32, delta) -> float:
        """Thread t's SGD step on its rows, applied lock-free; returns its loss sum."""
        loss, g = self.models[t].loss_and_grad(params, x, y, grad=self.grads[t])
        u = np.multiply(g, -lr32, out=self._updates[t])
        params += u
        if delta is not None:
            delta += u
        return loss * len(y)

    # -- training -------------------------------------------------------------------------
    def train(self, params: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float,
              delta: np.ndarray | None = None) -> tuple[float, int]:
        """One SGD step per thread, thread t on rows :func:`thread_rows` (n, T, t) of x, y.

        ``params`` (this partition's slice, float32) is updated in place by every thread;
        ``delta``, when given, receives every applied update ``-lr * grad`` added to it (not
        cleared first). After the call ``grads[t]`` holds the local gradient thread t
        applied. Collective: every partition rank of the replica calls it with the same
        rows. Returns (sum over the rows of their loss, rows).
        """
        n, T = len(y), self.threads
        if n < T:
            raise ValueError(f"{n} rows cannot give each of {T} threads a mini-batch")
        if params.dtype != np.float32 or params.shape != (self.n_params,):
            raise ValueError(f"params must be float32 of shape ({self.n_params},), got "
                             f"{params.dtype} {params.shape}")
        lr32 = np.float32(lr)
        self._generation += 1
        gen = self._generation
        jobs = []
        for t in range(T):
            lo, hi = thread_rows(n, T, t)
            jobs.append((params, x[lo:hi], y[lo:hi], lr32, delta))
        with self._blas_one_thread():
            self._start()
            for t in range(1, T):
                self._inboxes[t - 1].put((gen, jobs[t]))
            loss_sum = self._step(0, *jobs[0])
            loss_sum += self._collect(gen)
        return float(loss_sum), n

    def _collect(self, gen: int) -> float:
        """Wait for the T-1 workers' results of this call; raise the first failure."""
        pending = set(range(1, self.threads))
        total = 0.0
        deadline = time.monotonic() + self.timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ts = ", ".join(str(t) for t in sorted(pending))
                raise HogwildThreadTimeout(
                    f"Hogwild thread(s) {ts} of this rank did not finish a mini-batch in "
                    f"{self.timeout:.0f} s (thread t waits on thread t of the other "
                    "partitions of this replica: look for their errors; raise --timeout if "
                    "they are only slow)")
            try:
                got, t, loss, exc = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if got != gen:  # left over from a call that failed early: ignore
                continue
            if exc is not None:
                where = f"(in Hogwild thread {t} of {self.threads} of this rank)"
                if isinstance(exc, HpcpsError) and len(exc.args) == 1:
                    exc.args = (f"{exc.args[0]} {where}",)  # train.py prints str(exc)
                elif hasattr(exc, "add_note"):
                    exc.add_note(where)  # printed with the traceback
                raise exc
            pending.discard(t)
            total += loss
        return total
