"""Hogwild training inside one rank: T threads, shared weights, no locks (``--threads T``).

Project Adam (Chilimbi et al., OSDI 2014, section 3.2) trains each replica with several
threads in one process: every thread takes its own examples, runs forward and backward
passes in a training context it allocated once (activations, errors, scratch), and writes
its weight update straight into the shared weights without taking a lock. This module is
that loop for :class:`hpcps.model.mlp.MLP`: the compiled engine (``ext/hogwild.pyx``) runs each
thread in ``nogil`` Cython code calling single-threaded ``sgemm``, so T threads use T
cores, and one train() call allocates nothing per step.

Usage::

    engine = HogwildEngine((784, 512, 512, 10), "relu", threads=2, batch=128)
    loss_sum, n = engine.train(params, x, y, order, lr=0.05)          # one pass over order
    loss_sum, n = engine.train(params, x, y, order, lr, steps_per_thread=10, delta=acc)

Strategies
----------
``params`` is the replica's flat parameter vector (``MLP`` layout), updated in place.
``delta``, when given, receives the sum of every update the threads applied
(``-lr * grad`` of each step): that is what a downpour replica pushes to its servers after
``n_push`` steps, what an averaging replica accumulates between rounds, and what a dead-
reckoning worker feeds its residual. So every strategy can use T threads: it calls
``train`` where it called one SGD step, with ``steps_per_thread`` steps per thread, and
ships ``delta`` (or the new ``params``) exactly as before.

The races this allows, and why training tolerates them
------------------------------------------------------
No thread waits for another, and nothing is locked. Three things can happen that a
sequential run never sees:

1. **Lost updates.** ``w += u`` is a load, an add and a store. If two threads do it to the
   same weight at once, both load the old value and the later store wins: one thread's
   step for that weight is lost. The same holds for ``delta``, so under contention
   ``delta`` can differ slightly from ``params_after - params_before`` (each records what
   its thread believed it applied).
2. **Torn reads across a matrix.** A thread's forward pass reads a layer while another
   thread's GEMM is halfway through writing its update to it: some rows are new, some old.
   The gradient is then computed at a point that no sequential run ever visited.
   Individual floats are never torn (aligned 4-byte loads and stores are atomic on x86 and
   the other 64-bit targets we build for), so every value read is one some thread wrote.
3. **Stale gradients.** A thread's gradient is computed at weights that other threads have
   moved since (by at most the updates of T-1 concurrent steps); it is applied anyway.

Hogwild! (Niu, Recht, Re and Wright, NIPS 2011) proves SGD still converges at nearly the
sequential rate when updates are sparse, so two threads rarely touch the same weight. Our
layers are dense: every step writes every weight, so conflicts are real, as in Adam, which
relies instead on updates being additive, commutative and small (section 3.2.2). Each
conflict costs at most one thread's step for some weights (a lost or stale step of size
``lr * |g|``), staleness is bounded by T-1 steps, and the error they add is of the order of
the noise SGD's sampling already adds; with T small (a rank has a few cores) and a learning
rate that suits ``T * batch`` examples in flight, training converges to the same accuracy
(``tests/test_hogwild.py`` trains digits with T = 2 and 4). What is not tolerated, and not
done: reading a half-written float, or resizing/reallocating buffers while threads run.

Threads and BLAS
----------------
Every thread calls ``sgemm`` itself, so BLAS must not start threads of its own (T threads
each asking OpenBLAS for 2 would oversubscribe the cores and serialize on its pool). Set
``OPENBLAS_NUM_THREADS=1`` before numpy/scipy load; where ``threadpoolctl`` is installed,
``train`` also limits BLAS to one thread for the duration of the call. That sgemm is
OpenBLAS's (scipy's) or Intel MKL's, loaded sequential, when ``hpcps.kernels.blas`` chooses
it (``HPCPS_BLAS``, read when the first engine is created).

Zero skipping
-------------
Many inputs are mostly zeros (81% of MNIST's pixels), and a dense GEMM multiplies them all.
On CPUs with AVX2 and FMA, or AVX-512F (the best is chosen at run time:
``hpcps.kernels.gemm.ZERO_SKIP_ISA``), the first layer's forward product and weight update
use the kernels of ``ext/zero_skip.h`` instead of BLAS: register-blocked GEMM micro-kernels
that visit, for each block of 4 rows (forward) or 4 input columns (update), only the inputs
nonzero somewhere in the block. Each step lists the blocks' nonzero patterns once (a few percent of
a step) and uses the kernels when they do at most ``zero_skip`` of the dense work
(default ``ZERO_SKIP``); the sums are the dense product's minus terms that are zero, so
results agree with BLAS to rounding. Other layers always use BLAS: hidden activations of
a ReLU net are about half zeros, scattered, which leaves too little to skip.

Which first layer is fastest depends on the CPU and the data: AMD's Zen 4 runs 512-bit
instructions as two 256-bit halves, so its AVX-512 kernels need not beat its AVX2 ones, and
dense inputs leave nothing to skip. So unless ``HPCPS_ZERO_SKIP_ISA`` names one, the first
call that trains or takes a gradient times every way this CPU has (each instruction set's
kernels, and BLAS alone) on the rows it was given, :data:`CHOICE_STEPS` mini-batches each
(a train on a scratch copy of the weights, at the caller's rate: BLAS skips a product
scaled by 0, so a rate of 0 would flatter it), in rounds that turn their order,
and keeps the fastest at its best round if it beats the usual way (the best instruction
set) by :data:`CHOICE_MARGIN`: once per process, model shape and call, in 0.05-0.5 s
(:data:`CHOICE_BUDGET_S`). :attr:`HogwildEngine.first_layer` says what was chosen and the
times that chose it.

Attributes
----------
HAVE_EXTENSION : bool
    True when the compiled engine is in use. Without it (not built, or
    ``HPCPS_NO_EXTENSION=1``) :class:`HogwildEngine` runs the NumPy reference: the same
    math, one thread, slower, with a warning at import.
"""
from __future__ import annotations

import operator

import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import ConfigError
from hpcps.kernels import blas, load_extension
from hpcps.model.mlp import MLP

_compiled, _ = load_extension("_hogwild", None, "hpcps.engine.hogwild")

HAVE_EXTENSION = _compiled is not None
BACKENDS = ("threads", "openmp")
# Skip zeros in the first layer when a mini-batch's zero-skipping product would do at most
# this fraction of the dense product's work (see "Zero skipping" above).
ZERO_SKIP = 0.75
# The first layer's timed choice: mini-batches per way and round, rounds, seconds
CHOICE_STEPS = 4
CHOICE_ROUNDS = (3, 15)  # at least, at most
CHOICE_BUDGET_S = 0.2
# another way replaces the best instruction set only when it is this much faster: ways that
# time within noise of each other keep the usual one (and runs their bits)
CHOICE_MARGIN = 0.1
BLAS_WAY = "blas"  # the first layer in BLAS like the others (no zero skipping)
_CHOSEN: dict = {}  # (sizes, activation, threads, batch, backend, zero_skip) -> choice

__all__ = ["BACKENDS", "BLAS_WAY", "HAVE_EXTENSION", "ZERO_SKIP", "HogwildEngine", "chosen",
           "time_ways"]


def _positive_int(name, v):
    try:
        v = operator.index(v)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {v!r}") from None
    if v < 1:
        raise ConfigError(f"{name} must be >= 1, got {v}")
    return v


def _vector(name, a, n, writable):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype != np.float32 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a 1-D C-contiguous float32 array, got "
                         f"{a.dtype} with shape {a.shape}")
    if a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} elements, the model has {n} parameters")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is updated in place but is read-only")


def _labels(y, n_rows, n_classes):
    """y as a C-contiguous int64 vector (no copy when it already is one), range-checked."""
    if not isinstance(y, np.ndarray) or y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValueError("y must be a 1-D integer numpy array")
    if y.shape[0] != n_rows:
        raise ValueError(f"y has {y.shape[0]} labels, x has {n_rows} rows")
    y = np.ascontiguousarray(y, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise ValueError(f"labels must lie in 0..{n_classes - 1}, got "
                         f"{int(y.min())}..{int(y.max())}")
    return y


def time_ways(make, ways, usual, run, budget_s=CHOICE_BUDGET_S, rounds=CHOICE_ROUNDS) -> dict:
    """Time ``run(engine)`` on an engine of each of ``ways`` (``make(way)``: zero-skipping
    instruction sets, or :data:`BLAS_WAY`): one warm-up each, then rounds that turn the
    order of the ways, until ``rounds[0]`` rounds and ``budget_s`` seconds are spent (at
    most ``rounds[1]``). The fastest way at its best round wins (the round other work
    disturbed least) if it is :data:`CHOICE_MARGIN` faster than ``usual`` (the way taken
    untimed), which wins otherwise. Returns ``{"way", "why", "seconds": {way: best}}``."""
    import time
    engines = {w: make(w) for w in ways}
    best = {w: float("inf") for w in ways}

    def once(w):
        t0 = time.perf_counter()
        run(engines[w])
        return time.perf_counter() - t0

    for w in ways:
        once(w)
    start, done = time.perf_counter(), 0
    while done < rounds[1] and (done < rounds[0] or time.perf_counter() - start < budget_s):
        for w in (ways if done % 2 == 0 else ways[::-1]):
            best[w] = min(best[w], once(w))
        done += 1
    way, fastest = usual, min(ways, key=lambda w: best[w])
    if best[fastest] < (1.0 - CHOICE_MARGIN) * best[usual]:
        way = fastest
    times = ", ".join(f"{w} {best[w] * 1e3 / CHOICE_STEPS:.3g} ms" for w in ways)
    kept = (f"; {fastest} not {CHOICE_MARGIN:.0%} faster, so {usual} is kept"
            if way != fastest else "")
    return {"way": way, "seconds": {w: round(best[w], 6) for w in ways},
            "why": f"timed at start: {times} a mini-batch (best of {done} rounds){kept}"}


def _first_layer_way(way) -> str:
    """``first_layer`` checked: ``auto``, ``blas``, or an instruction set this CPU runs."""
    from hpcps.kernels import gemm
    if way in ("auto", BLAS_WAY) or (way in gemm.ZERO_SKIP_ISAS):
        return way
    raise ConfigError(f"first_layer {way!r}: choose auto, {BLAS_WAY} or one of this CPU's "
                      f"zero-skipping instruction sets {gemm.ZERO_SKIP_ISAS}")


def chosen() -> dict | None:
    """The first layer's way in this process (:attr:`HogwildEngine.first_layer`), as the
    last engine to decide it chose: a replica trains one model. None before any did."""
    return dict(_LAST[0]) if _LAST else None


_LAST: list = []  # the last choice made or taken (chosen())


class HogwildEngine:
    """T threads training one MLP's shared flat parameter vector lock-free.

    Parameters
    ----------
    sizes : sequence of int
        Layer widths, input first (as :class:`hpcps.model.mlp.MLP`; parameters are
        interchangeable with it).
    activation : str
        Hidden activation: ``relu``, ``tanh`` or ``sigmoid``.
    threads : int
        Training threads T (``--threads``); each owns one preallocated context.
    batch : int
        Mini-batch size per thread step (the contexts are sized for it).
    backend : str
        ``threads`` (default: Python threads, each entering nogil code) or ``openmp``
        (one ``prange`` over the threads). Measured equal on this machine; Python threads
        are the default because an idle OpenMP pool spins for a while after each call,
        taking CPU from the other ranks sharing the node.
    zero_skip : float
        Use the zero-skipping first layer for a mini-batch when it does at most this
        fraction of the dense work (0 turns it off; 1 uses it whenever possible). Only
        on CPUs with AVX2 and FMA or AVX-512F; elsewhere every layer uses BLAS.
    first_layer : str
        ``auto`` (default): the way timed at the first call ("Zero skipping" above);
        ``blas``; or an instruction set of ``hpcps.kernels.gemm.ZERO_SKIP_ISAS``, used
        whenever ``zero_skip`` allows.

    Raises
    ------
    ConfigError
        For bad sizes, activation, threads, batch or backend.
    """

    def __init__(self, sizes, activation: str = "relu", threads: int = 1, batch: int = 128,
                 backend: str = "threads", zero_skip: float = ZERO_SKIP,
                 first_layer: str = "auto"):
        self.model = MLP(sizes, activation)          # validates sizes and activation
        self.sizes = self.model.sizes
        self.activation = activation
        self.threads = _positive_int("threads", threads)
        self.batch = _positive_int("batch", batch)
        if backend not in BACKENDS:
            raise ConfigError(f"unknown hogwild backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        try:
            zero_skip = float(zero_skip)
        except (TypeError, ValueError):
            raise ConfigError(f"zero_skip must be a number in [0, 1], got {zero_skip!r}") \
                from None
        if not 0.0 <= zero_skip <= 1.0:
            raise ConfigError(f"zero_skip must be in [0, 1], got {zero_skip}")
        self.n_params = self.model.n_params
        self.compiled = HAVE_EXTENSION
        self.zero_skip = zero_skip
        self._asked = _first_layer_way(first_layer)
        self._choice: dict | None = None  # the first layer's timed choice (first_layer)
        if self.compiled:
            self._engine = _compiled.HogwildEngine(
                self.sizes, activation, self.threads, self.batch,
                0.0 if self._asked == BLAS_WAY else zero_skip,
                isa=None if self._asked in ("auto", BLAS_WAY) else self._asked)
            if not self._ways():
                self._choice = self._fixed()
                _LAST[:] = [self._choice]
            # HPCPS_BLAS, at the first engine: auto times this model's sgemm calls (the first
            # layer's only when it does not skip zeros, or is the only layer)
            blas.ensure(blas.mlp_shapes(self.sizes, self.batch,
                                        first_layer=self._engine.zero_skip_isa is None)
                        or blas.mlp_shapes(self.sizes, self.batch))
        else:
            self._grad = np.empty(self.n_params, dtype=np.float32)
        self._blas_one_thread = blas.OneThread()

    # -- checks -------------------------------------------------------------------------
    def _inputs(self, x, y):
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 \
                or not x.flags.c_contiguous:
            raise ValueError("x must be a 2-D C-contiguous float32 array "
                             f"(got {getattr(x, 'dtype', type(x).__name__)}, "
                             f"shape {getattr(x, 'shape', None)})")
        if x.shape[1] != self.sizes[0]:
            raise ValueError(f"x has {x.shape[1]} features, the model's input is "
                             f"{self.sizes[0]}")
        return _labels(y, x.shape[0], self.sizes[-1])

    def _grad_out(self, params, grad):
        """``grad``, checked (or a new vector when None), separate from ``params``."""
        if grad is None:
            return np.empty(self.n_params, dtype=np.float32)
        _vector("grad", grad, self.n_params, writable=True)
        if np.may_share_memory(params, grad):
            raise ValueError("params and grad overlap in memory; pass separate arrays")
        return grad

    # -- training -----------------------------------------------------------------------
    def train(self, params, x, y, order, lr, steps_per_thread=None, delta=None):
        """Train in place: T threads, each on its own part of ``order``, lock-free.

        Parameters
        ----------
        params : numpy.ndarray
            float32 flat parameter vector (MLP layout), updated in place by every thread.
        x : numpy.ndarray
            (N, sizes[0]) float32 C-contiguous examples.
        y : numpy.ndarray
            (N,) integer labels in ``0..sizes[-1]-1``.
        order : numpy.ndarray
            1-D integer indices into x/y, in the order to visit them. Thread t takes the
            t-th part: with ``steps_per_thread = S`` it is ``order[t*S*batch:(t+1)*S*batch]``
            (S full mini-batches; ``order`` needs at least ``T*S*batch`` entries); with
            ``None`` the whole order is split into T parts by
            :func:`hpcps.blocks.block_range`, each walked in mini-batches of ``batch``
            (the last may be smaller).
        lr : float
            Learning rate; finite, >= 0. Each step applies ``params -= lr * grad`` of
            the mean loss over the mini-batch.
        steps_per_thread : int, optional
            See ``order``.
        delta : numpy.ndarray, optional
            float32 vector like ``params`` (separate memory); every applied update
            ``-lr * grad`` is added to it (lock-free too). Not cleared first.

        Returns
        -------
        (loss_sum, examples) : (float, int)
            Sum over the examples of their cross-entropy (each at the weights its step
            saw) and the number of examples trained on.

        Raises
        ------
        ValueError
            Bad arrays, shapes, dtypes, index or label ranges, overlap, or a too-short
            ``order``.
        """
        _vector("params", params, self.n_params, writable=True)
        if delta is not None:
            _vector("delta", delta, self.n_params, writable=True)
            if np.may_share_memory(params, delta):
                raise ValueError("params and delta overlap in memory; pass separate arrays")
        y = self._inputs(x, y)
        if not isinstance(order, np.ndarray) or order.ndim != 1 or order.dtype.kind not in "iu":
            raise ValueError("order must be a 1-D integer numpy array of indices into x")
        try:
            lr = float(lr)
        except (TypeError, ValueError):
            raise ValueError(f"lr must be a real number, got {lr!r}") from None
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be finite and >= 0, got {lr}")
        if steps_per_thread is None:
            steps = 0
            used = order
        else:
            try:
                steps = operator.index(steps_per_thread)
            except TypeError:
                raise ValueError(f"steps_per_thread must be an integer, got "
                                 f"{steps_per_thread!r}") from None
            if steps < 1:
                raise ValueError(f"steps_per_thread must be >= 1, got {steps}")
            need = self.threads * steps * self.batch
            if order.shape[0] < need:
                raise ValueError(f"order has {order.shape[0]} indices; {self.threads} "
                                 f"threads x {steps} steps x batch {self.batch} need {need}")
            used = order[:need]
        used = np.ascontiguousarray(used, dtype=np.int64)
        if used.size and (used.min() < 0 or used.max() >= x.shape[0]):
            raise ValueError(f"order holds indices outside 0..{x.shape[0] - 1}")
        if used.size == 0:
            return 0.0, 0
        with self._blas_one_thread():
            if self.compiled and self._choice is None:  # the same rows, on a scratch copy
                rows = np.resize(used, self.threads * CHOICE_STEPS * self.batch)
                scratch = params.copy()
                rate = lr or 1e-3  # not 0: BLAS skips a product scaled by 0, zero skipping not
                self._choose("train", lambda e: e.train(scratch, x, y, rows, rate,
                                                        CHOICE_STEPS, None, self.backend))
            if self.compiled:
                return self._engine.train(params, x, y, used, lr, steps, delta, self.backend)
            return self._reference_train(params, x, y, used, lr, steps, delta)

    # -- the first layer's way, timed ---------------------------------------------------
    def _ways(self) -> list[str]:
        """What the first train call times: each zero-skipping instruction set this CPU has
        and BLAS; none when there is no choice (no kernels, ``zero_skip`` 0, or
        ``HPCPS_ZERO_SKIP_ISA`` set: the user's choice)."""
        import os

        from hpcps.kernels import gemm
        if self._asked != "auto" or not gemm.ZERO_SKIP_ISAS or self.zero_skip <= 0.0 \
                or os.environ.get(gemm.ZERO_SKIP_ENV, "").strip():
            return []
        return [*gemm.ZERO_SKIP_ISAS, BLAS_WAY]

    def _fixed(self) -> dict:
        from hpcps.kernels import gemm
        isa = self._engine.zero_skip_isa
        if self._asked != "auto":
            why = "asked for"
        elif isa is None:
            why = ("no zero-skipping kernels for this CPU" if not gemm.ZERO_SKIP_ISAS else
                   "zero skipping off" if self.zero_skip <= 0.0 else
                   f"{gemm.ZERO_SKIP_ENV}=none")
        else:
            why = f"{gemm.ZERO_SKIP_ENV}={isa}"
        return {"way": isa or BLAS_WAY, "why": why, "seconds": {}}

    def _make(self, way: str):
        return _compiled.HogwildEngine(self.sizes, self.activation, self.threads, self.batch,
                                       0.0 if way == BLAS_WAY else self.zero_skip,
                                       isa=None if way == BLAS_WAY else way)

    def _choose(self, op: str, run) -> None:
        """Time every way of :meth:`_ways` doing ``run(engine)`` (:data:`CHOICE_STEPS`
        mini-batches of the call ``op`` on the caller's rows) and keep the fastest, once per
        process for a model shape and call (``_CHOSEN``)."""
        key = (tuple(self.sizes), self.activation, self.threads, self.batch, self.backend,
               self.zero_skip, op)
        if key not in _CHOSEN:
            _CHOSEN[key] = time_ways(self._make, self._ways(),
                                     self._engine.zero_skip_isa or BLAS_WAY, run)
        self._choice = _CHOSEN[key]
        _LAST[:] = [self._choice]
        if self._choice["way"] != (self._engine.zero_skip_isa or BLAS_WAY):
            self._engine = self._make(self._choice["way"])

    @property
    def first_layer(self) -> dict | None:
        """How the first layer computes: ``way`` (an instruction set of the zero-skipping
        kernels, or ``"blas"``), ``why``, and ``seconds`` (each timed way's best round of
        :data:`CHOICE_STEPS` mini-batches, where they were timed); None before the first
        train call decides, and for the NumPy reference."""
        return dict(self._choice) if self.compiled and self._choice is not None else None

    @property
    def zero_skipping(self) -> bool:
        """True when the first layer may skip zeros (compiled, a CPU with AVX2 and FMA or
        AVX-512F, zero_skip > 0)."""
        return self.compiled and self._engine.sparse_below > 0.0

    @property
    def zero_skip_isa(self) -> str | None:
        """``"avx512"`` or ``"avx2"``: the instruction set of the zero-skipping kernels
        this engine uses; None when the first layer always uses BLAS."""
        return self._engine.zero_skip_isa if self.compiled else None

    @property
    def zero_skip_steps(self) -> int:
        """Mini-batches so far (all threads, all calls) whose first layer skipped zeros."""
        return self._engine.sparse_step_count() if self.compiled else 0

    def gradient_sum(self, params, x, y, rows, grad=None):
        """Sum over the examples ``rows`` of their loss and gradient, T threads, no update.

        The rows are split evenly into T parts, each walked in mini-batches of ``batch``;
        each thread sums into its own buffer and the T sums are added in thread order, so
        the result is deterministic for a given T and batch (Sandblaster's replicas use
        this: an L-BFGS step needs the exact gradient of its portion, not Hogwild steps).

        Returns
        -------
        (loss_sum, grad_sum, examples)
        """
        _vector("params", params, self.n_params, writable=False)
        y = self._inputs(x, y)
        if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise ValueError("rows must be a 1-D integer numpy array of indices into x")
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= x.shape[0]):
            raise ValueError(f"rows holds indices outside 0..{x.shape[0] - 1}")
        grad = self._grad_out(params, grad)
        if not self.compiled:
            grad[...] = 0.0
            loss_sum = 0.0
            for lo in range(0, rows.size, self.batch):
                idx = rows[lo:lo + self.batch]
                loss, g = self.model.loss_and_grad(params, x[idx], y[idx], self._grad)
                loss_sum += loss * len(idx)
                grad += g * np.float32(len(idx))
            return loss_sum, grad, int(rows.size)
        with self._blas_one_thread():
            loss_sum, n = self._engine.gradient_sum(params, x, y, rows, grad, self.backend)
        return loss_sum, grad, n

    def _reference_train(self, params, x, y, order, lr, steps, delta):
        """NumPy fallback: the threads' parts visited one after another, one thread."""
        T, B = self.threads, self.batch
        if steps:
            parts = [order[t * steps * B:(t + 1) * steps * B] for t in range(T)]
        else:
            parts = [order[slice(*block_range(len(order), T, t))] for t in range(T)]
        loss_sum, g = 0.0, self._grad
        lr32 = np.float32(lr)
        for part in parts:
            for lo in range(0, len(part), B):
                idx = part[lo:lo + B]
                loss, _ = self.model.loss_and_grad(params, x[idx], y[idx], g)
                loss_sum += loss * len(idx)
                g *= -lr32
                params += g
                if delta is not None:
                    delta += g
        return loss_sum, len(order)

    def loss_and_grad(self, params, x, y, grad=None):
        """Mean loss over all rows of x (at most ``batch``) and its gradient, one thread.

        The compiled engine's own forward/backward (context 0): a replica's gradient pass
        at ``--threads 1``; the same contract as :meth:`hpcps.model.mlp.MLP.loss_and_grad`.
        Not thread-safe with a concurrent :meth:`train` on the same engine.
        """
        _vector("params", params, self.n_params, writable=False)
        y = self._inputs(x, y)
        if not 1 <= x.shape[0] <= self.batch:
            raise ValueError(f"x has {x.shape[0]} rows; loss_and_grad takes 1..{self.batch}")
        grad = self._grad_out(params, grad)
        if not self.compiled:
            return self.model.loss_and_grad(params, x, y, grad)
        with self._blas_one_thread():
            if self._choice is None:
                self._choose("gradient", lambda e: [e.loss_and_grad(params, x, y, grad)
                                                    for _ in range(CHOICE_STEPS)])
            loss = self._engine.loss_and_grad(params, x, y, grad)
        return float(loss), grad
