"""Hogwild training of a :class:`hpcps.model.convnet.ConvNet` inside one rank (``--threads T``).

The same contract as :class:`hpcps.engine.hogwild.HogwildEngine` (``train``, ``gradient_sum``,
``loss_and_grad``), so the strategies call either without knowing which model they train:
:func:`engine_for` picks the engine for a model. T threads each train on their own
mini-batches and add their updates into the shared parameter vector without a lock (Project
Adam, section 3.2; the races this allows, and why training tolerates them, are described in
:mod:`hpcps.engine.hogwild`).

The threads run the compiled engine (``ext/convnet.pyx``: the layers, the mini-batch loop and
the update in nogil code, convolutions as im2col and ``sgemm`` a few examples at a time), built
from the model by :func:`op_table`. Without the extension (not built, or
``HPCPS_NO_EXTENSION=1``) they run the model's NumPy code, the reference the tests compare the
compiled engine with: NumPy's BLAS releases the GIL during each GEMM and each large
elementwise operation, so the threads overlap there and serialize in the Python between them.
"""
from __future__ import annotations

import functools
import operator
import threading

import numpy as np

from hpcps.blocks import block_range
from hpcps.model.convnet import ConvNet, drop_threshold, thread_key
from hpcps.kernels import blas, load_extension

_compiled, _ = load_extension("_convnet", None, "hpcps.engine.conv_hogwild")
HAVE_EXTENSION = _compiled is not None

# op kinds and the op table's columns: ext/convnet.pyx's K_* and O_* enums
K_CONV, K_POOL, K_FLAT, K_FC = range(4)
CHUNK_FLOATS = 65536  # ext/convnet.pyx: the largest im2col chunk, in floats
COLUMNS = ("kind", "c", "h", "w", "oc", "oh", "ow", "kh", "kw", "stride", "pad", "w_off",
           "b_off", "act", "dx", "out", "arg", "chunk", "wt", "drop", "layer", "dout")


def op_table(model: ConvNet) -> np.ndarray:
    """The compiled engine's description of ``model``: one int64 row per layer (columns
    :data:`COLUMNS`; ``out``, ``arg``, ``chunk``, ``wt`` and ``dout`` are the engine's to
    fill; ``drop`` is a hidden fc layer's dropout threshold, 0 without dropout). An fc layer
    on maps gets the flatten before it as a row of its own; a flatten of a vector is
    dropped. ``dx`` marks the layers whose input error is needed (some layer before them
    has parameters)."""
    offsets = {name: off for name, _, off in model.layout}
    rows, below = [], False

    def row(kind, ins, outs, **kw):
        r = dict.fromkeys(COLUMNS, 0)
        r.update(kind=kind, c=ins[0], h=ins[1], w=ins[2], oc=outs[0], oh=outs[1], ow=outs[2],
                 dx=int(below), **kw)
        rows.append([int(r[c]) for c in COLUMNS])

    for op in model.ops:
        s = op.spec
        ins = tuple(op.in_shape) + (1,) * (3 - len(op.in_shape))
        if s.kind == "flatten" or (s.kind == "fc" and len(op.in_shape) == 3):
            if len(op.in_shape) == 3:
                n = int(np.prod(op.in_shape))
                row(K_FLAT, ins, (n, 1, 1))
                ins = (n, 1, 1)
            if s.kind == "flatten":
                continue
        if s.kind == "pool":
            row(K_POOL, ins, op.out_shape, kh=s.kh, kw=s.kh, stride=s.stride)
            continue
        params = dict(w_off=offsets[f"layer{op.param}/W"], b_off=offsets[f"layer{op.param}/b"])
        if s.kind == "conv":
            row(K_CONV, ins, op.out_shape, kh=s.kh, kw=s.kw, stride=s.stride, pad=s.pad,
                act=1, **params)
        else:
            drop = drop_threshold(model.dropout) if model.dropout and not op.last else 0
            row(K_FC, ins, (s.out, 1, 1), act=int(not op.last), drop=drop, layer=op.param,
                **params)
        below = True
    return np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))


def conv_shapes(table: np.ndarray, batch: int) -> tuple:
    """The sgemm calls of one compiled training step of the model whose :func:`op_table` is
    ``table``, in :func:`hpcps.kernels.blas.mlp_shapes`' form (what ``HPCPS_BLAS=auto``
    times): per conv layer its forward, weight-gradient and input-gradient products of one
    im2col chunk (``ext/convnet.pyx``'s ``CHUNK_FLOATS``), per fc layer the MLP's three."""
    shapes = []
    for r in table:
        k = dict(zip(COLUMNS, (int(v) for v in r)))
        if k["kind"] == K_CONV:
            K, O = k["c"] * k["kh"] * k["kw"], k["oc"]
            per = k["oh"] * k["ow"] * K
            M = max(1, min(batch, CHUNK_FLOATS // per)) * k["oh"] * k["ow"]
            calls = [(M, K, O, False, True, 1.0), (O, M, K, True, False, 0.0)]
        elif k["kind"] == K_FC:
            calls = list(blas.mlp_shapes((k["c"], k["oc"]), batch))
        else:
            continue
        if k["dx"] and k["kind"] == K_CONV:
            calls.append((M, O, K, False, False, 0.0))
        elif k["dx"]:
            calls.append((batch, k["oc"], k["c"], False, True, 0.0))
        shapes += [c for c in calls if c not in shapes]
    return tuple((min(m, blas.MAX_DIM), min(kk, blas.MAX_DIM), min(n, blas.MAX_DIM), ta, tb, b)
                 for m, kk, n, ta, tb, b in shapes)


EVAL_BATCH = 500  # examples per forward pass of an evaluation


@functools.lru_cache(maxsize=4)
def _evaluator(model: ConvNet) -> "ConvHogwild":
    return ConvHogwild(model, threads=1, batch=EVAL_BATCH)


def evaluate(model, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean loss, accuracy) of ``params`` over all of x, y: for a :class:`ConvNet` with the
    compiled engine's forward pass when it is built (one engine per model, kept), else
    ``model.evaluate`` (an MLP's NumPy forward pass is BLAS already)."""
    if isinstance(model, ConvNet) and HAVE_EXTENSION and params.dtype == np.float32:
        return _evaluator(model).evaluate(params, x, y)
    return model.evaluate(params, x, y)


def engine_for(model, activation: str, threads: int, batch: int):
    """The Hogwild engine for ``model``: :class:`ConvHogwild` for a :class:`ConvNet`, the
    compiled :class:`hpcps.engine.hogwild.HogwildEngine` for an MLP."""
    if isinstance(model, ConvNet):
        return ConvHogwild(model, threads=threads, batch=batch)
    from hpcps.engine.hogwild import HogwildEngine
    return HogwildEngine(model.sizes, activation, threads=threads, batch=batch)


def _run_threads(fn, T: int) -> None:
    """Run ``fn(t)`` for t in 0..T-1, on T-1 extra threads and this one; re-raise the first
    failure after every thread has ended (a thread never outlives the call)."""
    errors: list[BaseException] = []

    def guarded(t):
        try:
            fn(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    workers = [threading.Thread(target=guarded, args=(t,), name=f"hpcps-conv-hogwild-{t}")
               for t in range(1, T)]
    for w in workers:
        w.start()
    guarded(0)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _rows(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _labels(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y, dtype=np.int64)


class ConvHogwild:
    """T threads training one :class:`ConvNet`'s shared flat parameters, lock-free.

    Parameters
    ----------
    model : the ConvNet.
    threads : T >= 1.
    batch : examples per mini-batch of each thread.
    compiled : None (default) for the compiled engine when it is built, False for the
        NumPy reference.
    """

    def __init__(self, model: ConvNet, threads: int = 1, batch: int = 128,
                 compiled: bool | None = None):
        for name, v in (("threads", threads), ("batch", batch)):
            if operator.index(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.model = model
        self.threads = int(threads)
        self.batch = int(batch)
        self.n_params = model.n_params
        self.compiled = HAVE_EXTENSION if compiled is None else bool(compiled)
        if self.compiled and not HAVE_EXTENSION:
            raise ValueError("the compiled conv engine is not built")
        self._engine = None
        if self.compiled:
            table = op_table(model)
            self._engine = _compiled.ConvEngine(table, model.n_params, model.input_shape,
                                                self.threads, self.batch, model.activation,
                                                model.dropout)
            for t in range(self.threads):  # thread t's dropout masks (hpcps.model.convnet)
                self._engine.seed_dropout(t, thread_key(model.dropout_key, t),
                                          model.first_draw)
            blas.ensure(conv_shapes(table, self.batch))
        # one gradient buffer per thread, allocated once (the NumPy path)
        self._grads = [] if self.compiled else \
            [np.empty(model.n_params, dtype=np.float32) for _ in range(self.threads)]

    def _check(self, params, x, y, writable=True):
        if not isinstance(params, np.ndarray) or params.dtype != np.float32 \
                or params.shape != (self.n_params,):
            raise ValueError(f"params must be a float32 vector of {self.n_params} elements")
        if writable and not params.flags.writeable:
            raise ValueError("params is read-only")
        if x.ndim != 2 or x.shape[1] != self.model.n_features or len(y) != len(x):
            raise ValueError(f"x must be (N, {self.model.n_features}) with one label per row")

    def _order(self, order, x, y) -> np.ndarray:
        """``order`` as int64, checked (the compiled engine trusts its indices and labels)."""
        order = np.ascontiguousarray(order, dtype=np.int64)
        if len(order) and (order.min() < 0 or order.max() >= len(x)):
            raise IndexError(f"an index of order is outside the {len(x)} rows of x")
        labels = np.asarray(y)[order]
        if len(labels) and (labels.min() < 0 or labels.max() >= self.model.n_classes):
            raise ValueError(f"labels must be in 0..{self.model.n_classes - 1}")
        return order

    def train(self, params, x, y, order, lr, steps_per_thread=None, delta=None):
        """Train in place, T threads, each on its part of ``order`` (as
        :meth:`hpcps.engine.hogwild.HogwildEngine.train`: with ``steps_per_thread = S`` thread t
        takes ``order[t*S*batch:(t+1)*S*batch]``, else ``order`` is split into T parts).
        Each step applies ``params -= lr * grad``; ``delta`` (when given) receives the sum of
        the updates applied. Returns (loss_sum, examples)."""
        self._check(params, x, y)
        if delta is not None and (delta.shape != params.shape or
                                  np.may_share_memory(params, delta)):
            raise ValueError("delta must be a separate vector like params")
        lr = float(lr)
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be finite and >= 0, got {lr}")
        order = self._order(order, x, y)
        T, B = self.threads, self.batch
        S = 0 if steps_per_thread is None else operator.index(steps_per_thread)
        if steps_per_thread is not None and (S < 1 or len(order) < T * S * B):
            raise ValueError(f"order has {len(order)} indices; {T} threads x {S} steps "
                             f"x batch {B} need {T * S * B}")
        if self.compiled:
            return self._engine.train(params, _rows(x), _labels(y), order, lr, S, delta)
        if S == 0:
            parts = [order[slice(*block_range(len(order), T, t))] for t in range(T)]
        else:
            parts = [order[t * S * B:(t + 1) * S * B] for t in range(T)]
        losses = [0.0] * T
        neg_lr = np.float32(-lr)

        def work(t):
            g = self._grads[t]
            part = parts[t]
            for lo in range(0, len(part), B):
                idx = part[lo:lo + B]
                loss, _ = self.model.loss_and_grad(params, x[idx], y[idx], g)
                losses[t] += loss * len(idx)
                g *= neg_lr
                # lock-free: another thread may add to the same weights at the same time
                np.add(params, g, out=params)
                if delta is not None:
                    np.add(delta, g, out=delta)

        _run_threads(work, T)
        return float(sum(losses)), int(sum(len(p) for p in parts))

    def gradient_sum(self, params, x, y, rows, grad=None):
        """(loss_sum, grad_sum, examples) over ``rows``: T threads each sum their even share
        in mini-batches into their own buffer; the sums are added in thread order, so the
        result is deterministic for a given T and batch."""
        self._check(params, x, y, writable=False)
        if grad is None:
            grad = np.empty(self.n_params, dtype=np.float32)
        rows = self._order(rows, x, y)
        if self.compiled:
            loss_sum, n = self._engine.gradient_sum(params, _rows(x), _labels(y), rows, grad)
            return loss_sum, grad, n
        T, B = self.threads, self.batch
        sums = [np.zeros(self.n_params, dtype=np.float32) for _ in range(T)]
        losses = [0.0] * T

        def work(t):
            lo_t, hi_t = block_range(len(rows), T, t)
            g = self._grads[t]
            for lo in range(lo_t, hi_t, B):
                idx = rows[lo:min(lo + B, hi_t)]
                loss, _ = self.model.loss_and_grad(params, x[idx], y[idx], g)
                losses[t] += loss * len(idx)
                g *= np.float32(len(idx))
                sums[t] += g

        _run_threads(work, T)
        grad[...] = 0.0
        for s in sums:
            grad += s
        return float(sum(losses)), grad, int(len(rows))

    def evaluate(self, params, x, y) -> tuple[float, float]:
        """(mean loss, accuracy) over all rows of x, forward passes only (as
        ``ConvNet.evaluate``), one thread."""
        self._check(params, x, y, writable=False)
        n = len(x)
        if not self.compiled:
            return self.model.evaluate(params, x, y)
        self._order(np.arange(n), x, y)
        loss_sum, correct = self._engine.evaluate(params, _rows(x), _labels(y))
        return loss_sum / max(1, n), correct / max(1, n)

    def loss_and_grad(self, params, x, y, grad=None):
        """Mean loss over the rows of x and its gradient, one thread; with the compiled
        engine at most ``batch`` rows."""
        self._check(params, x, y, writable=False)
        if self.compiled:
            if len(x) > self.batch:
                raise ValueError(f"{len(x)} rows, more than the engine's batch {self.batch}")
            if grad is None:
                grad = np.empty(self.n_params, dtype=np.float32)
            self._order(np.arange(len(x)), x, y)
            return self._engine.loss_and_grad(params, _rows(x), _labels(y), grad), grad
        return self.model.loss_and_grad(params, x, y, grad)
