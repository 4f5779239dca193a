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

A partition of a model-parallel ConvNet (``--partitions P``) runs on the same engine:
:func:`partition_op_table` describes its slice of every layer, with an exchange op before each
layer that mixes maps, and :class:`CompiledPartition` runs the layers between two exchanges in
the engine and the exchanges (the model's own) between them; :func:`compiled_partition` picks
it for a partition when the extension is built.
"""
from __future__ import annotations

import functools
import operator
import threading

import numpy as np

from hpcps.blocks import block_range
from hpcps.model.convnet import ConvNet, PartitionedConvNet, SoftmaxOutput, drop_threshold, \
    thread_key
from hpcps.model.mlp import MLP
from hpcps.kernels import blas, load_extension

_compiled, _ = load_extension("_convnet", None, "hpcps.engine.conv_hogwild")
HAVE_EXTENSION = _compiled is not None

# op kinds and the op table's columns: ext/convnet.pyx's K_* and O_* enums
K_CONV, K_POOL, K_FLAT, K_FC, K_EXCH = range(5)
CHUNK_FLOATS = 65536  # ext/convnet.pyx: the largest im2col chunk, in floats
COLUMNS = ("kind", "c", "h", "w", "oc", "oh", "ow", "kh", "kw", "stride", "pad", "w_off",
           "b_off", "act", "dx", "out", "arg", "chunk", "wt", "drop", "layer", "dout", "ulo",
           "uall")


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
                uall=s.out, **params)
        below = True
    return np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))


def partition_op_table(model: PartitionedConvNet) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The compiled engine's description of partition ``model.part`` of a model-parallel
    ConvNet, and its segments: the op ranges [lo, hi) between two exchanges.

    Rows as :func:`op_table`'s, for this partition's slice: a conv layer's ``oc`` is its
    own maps over all ``c`` input maps, an fc layer's its own units (``ulo`` the first, of
    ``uall``: where its dropout masks start), offsets in the local vector; pooling works
    on the local maps. Before every layer that mixes maps or units but the first a
    K_EXCH row stands for the exchange: its output is the whole input of the layer, which
    the caller writes (the maps in NHWC, or the flattened C, H, W values before an fc
    layer: what the gathered blocks are, so no flatten row follows a partitioned layer).
    Every segment but the first starts with a K_EXCH row."""
    offsets, off = {}, 0
    for name, shape in model._shapes(model.part):
        offsets[name] = off
        off += int(np.prod(shape))
    rows: list[list[int]] = []
    starts = [0]
    shape = tuple(model.input_shape)   # what the engine holds per example, (C, H, W)
    local, below, l = False, False, -1

    def row(kind, ins, outs, **kw):
        r = dict.fromkeys(COLUMNS, 0)
        r.update(kind=kind, c=ins[0], h=ins[1], w=ins[2], oc=outs[0], oh=outs[1], ow=outs[2],
                 dx=int(below), **kw)
        rows.append([int(r[c]) for c in COLUMNS])

    for op in model.full.ops:
        s = op.spec
        if s.kind == "pool":
            out = (shape[0],) + tuple(op.out_shape[1:])
            row(K_POOL, shape, out, kh=s.kh, kw=s.kh, stride=s.stride)
            shape = out
            continue
        if s.kind == "flatten" or (s.kind == "fc" and not local and shape[1:] != (1, 1)):
            if not local and shape[1:] != (1, 1):   # flatten the whole input's maps
                n = int(np.prod(shape))
                row(K_FLAT, shape, (n, 1, 1))
                shape = (n, 1, 1)
            if s.kind == "flatten":
                continue
        l += 1
        lo, hi = model.cols[l][model.part]
        if local:   # every partition's block of the layer's input, gathered by the caller
            starts.append(len(rows))
            shape = tuple(op.in_shape) if s.kind == "conv" else (int(np.prod(op.in_shape)), 1, 1)
            row(K_EXCH, shape, shape)
        params = dict(w_off=offsets[f"layer{l}/W"], b_off=offsets[f"layer{l}/b"])
        if s.kind == "conv":
            out = (hi - lo,) + tuple(op.out_shape[1:])
            row(K_CONV, shape, out, kh=s.kh, kw=s.kw, stride=s.stride, pad=s.pad, act=1,
                **params)
        else:
            out = (hi - lo, 1, 1)
            drop = drop_threshold(model.dropout) if model.dropout and not op.last else 0
            row(K_FC, shape, out, act=int(not op.last), drop=drop, layer=l, ulo=lo,
                uall=s.out, **params)
        shape, local, below = out, True, True
    bounds = starts + [len(rows)]
    table = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    return table, list(zip(bounds[:-1], bounds[1:]))


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


def _swap(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a`` (I, J, K) with its first and last axes swapped, into ``out`` (K, J, I) or a new
    array: the compiled kernel, which releases the GIL (Hogwild threads overlap there)."""
    if out is None:
        out = np.empty(a.shape[::-1], dtype=np.float32)
    _compiled.swap_outer(np.ascontiguousarray(a, dtype=np.float32), out)
    return out


class CompiledPartition(SoftmaxOutput):
    """One partition of a model-parallel ConvNet computed by the compiled engine.

    ``model`` (a :class:`~hpcps.model.convnet.PartitionedConvNet`) is the partition: its
    slices, its exchange, its dropout stream; this computes what its ``loss_and_grad`` and
    forward pass compute, with the layers between two exchanges run by
    ``ext/convnet.pyx`` (:meth:`ConvEngine.part_forward` and ``part_backward``, nogil, over
    the ops of :func:`partition_op_table`) and the exchanges in between unchanged: the
    same ``gather`` and ``scatter_sum`` of the same (values, batch) blocks. The softmax of
    the gathered logits is NumPy's (B x classes). Each instance owns one engine context:
    one per Hogwild thread (:class:`hpcps.engine.partitioned_hogwild.PartitionedHogwild`
    makes a model per thread). A float64 vector goes to ``model``'s NumPy code.

    Parameters
    ----------
    model : the partition.
    batch : examples per call the engine is sized for (it grows for a larger mini-batch;
        forward passes alone run in chunks of it).
    """

    def __init__(self, model: PartitionedConvNet, batch: int = 128):
        if not HAVE_EXTENSION:
            raise ValueError("the compiled conv engine is not built")
        self.model = model
        self.exchange = model.exchange
        self.n_params = model.n_params
        self.input_shape = model.input_shape
        self.n_features = model.n_features
        self.table, self.segments = partition_op_table(model)
        self._engine = None
        self._batch = 0
        self._grow(max(1, int(batch)))

    def _grow(self, batch: int) -> None:
        m = self.model
        self._engine = _compiled.ConvEngine(self.table, m.n_params, m.input_shape, 1, batch,
                                            m.activation, m.dropout)
        ops = self._engine.table()  # with the offsets of every op's output
        self._ops = {name: [int(v) for v in ops[:, i]] for i, name in enumerate(COLUMNS)}
        self._batch = batch

    def _out(self, i: int, nb: int, dropped: bool) -> np.ndarray:
        """Op i's output (nb, positions, maps): its dropped copy after a training pass."""
        ops = self._ops
        c, hw = ops["oc"][i], ops["oh"][i] * ops["ow"][i]
        off = ops["dout" if dropped and ops["drop"][i] else "out"][i]
        return self._engine.region(0, off, nb * hw * c).reshape(nb, hw, c)

    def _forward(self, flat, x, draw: int | None) -> np.ndarray:
        """The whole logits of ``x`` (at most the engine's batch), gathered; with dropout
        (training) when ``draw`` is given."""
        nb, eng, m = len(x), self._engine, self.model
        train = draw is not None
        key = m.full.dropout_key
        last = len(self.segments) - 1
        for k, (lo, hi) in enumerate(self.segments):
            eng.part_forward(0, flat, x, lo, hi, nb, key, draw or 0, train)
            out = self._out(hi - 1, nb, train)      # this partition's maps or units
            whole = self.exchange.gather(_swap(out).reshape(-1, nb), m.widths[k])
            if k == last:
                return np.ascontiguousarray(whole.T)
            nxt = self.segments[k + 1][0]             # its K_EXCH op takes the whole input
            dst = self._out(nxt, nb, False)
            _swap(whole.reshape(dst.shape[::-1]), dst)
        raise AssertionError("unreachable: a model has at least one segment")

    def _check(self, flat, x):
        if flat.shape != (self.n_params,):
            raise ValueError(f"local vector has shape {flat.shape}, partition "
                             f"{self.model.part} needs ({self.n_params},)")
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise ValueError(f"x has shape {x.shape}; this model takes (B, {self.n_features})")

    def _run(self, flat, x, keep: bool = False, draw: int | None = None):
        """(whole logits, None): forward passes only, in chunks of the engine's batch."""
        if flat.dtype != np.float32:
            return self.model._run(flat, x, keep, draw)
        self._check(flat, x)
        x = _rows(x)
        chunks = [self._forward(flat, x[lo:lo + self._batch], None)
                  for lo in range(0, len(x), self._batch)] or [self.model._run(flat, x, False)[0]]
        return (chunks[0] if len(chunks) == 1 else np.concatenate(chunks)), None

    def forward(self, flat, x) -> list[np.ndarray]:
        return [x, self._run(flat, x)[0]]

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray | None = None, draw: int | None = None
                      ) -> tuple[float, np.ndarray]:
        """As :meth:`PartitionedConvNet.loss_and_grad`: the mean loss of the whole replica
        and this partition's gradient (``grad`` overwritten), dropout masks of ``draw``
        (default the stream's next)."""
        m = self.model
        if flat.dtype != np.float32:
            return m.loss_and_grad(flat, x, y, grad, draw)
        self._check(flat, x)
        if grad is None:
            grad = np.empty(self.n_params, dtype=np.float32)
        if grad.dtype != np.float32 or grad.shape != flat.shape or not grad.flags.c_contiguous:
            raise ValueError("grad must be a contiguous float32 vector like flat")
        nb = len(x)
        if nb > self._batch:
            self._grow(nb)
        if m.dropout and draw is None:
            draw = m.full.next_draw()
        logits = self._forward(flat, _rows(x), 0 if draw is None else draw)
        loss, probs = MLP._softmax_xent_grad(logits, np.asarray(y))
        eng, d0 = self._engine, self._engine.d0_off
        lo, hi = m.cols[-1][m.part]
        eng.region(0, d0, nb * (hi - lo)).reshape(nb, hi - lo)[...] = probs[:, lo:hi]
        for k in range(len(self.segments) - 1, -1, -1):
            first, end = self.segments[k]
            off = eng.part_backward(0, flat, first, end, nb, grad)
            if k == 0:
                break
            # the error at the whole input of op `first`: each partition's share, summed,
            # each keeping its own block (the NumPy path's reduce-scatter)
            c, hw = self._ops["oc"][first], self._ops["oh"][first] * self._ops["ow"][first]
            err = eng.region(0, off, nb * hw * c).reshape(nb, hw, c)
            mine = self.exchange.scatter_sum(_swap(err).reshape(-1, nb), m.widths[k - 1])
            prev = self.segments[k - 1][1] - 1        # the op whose output that block is
            cq = self._ops["oc"][prev]
            dst = eng.region(0, d0, mine.size).reshape(nb, -1, cq)
            _swap(mine.reshape(dst.shape[::-1]), dst)
        return loss, grad


def compiled_partition(model, batch: int = 128):
    """``model`` computed by the compiled engine where there is one for it: a
    :class:`CompiledPartition` of a :class:`PartitionedConvNet` when the extension is built,
    else ``model`` itself (an MLP's partition, or the NumPy reference)."""
    if isinstance(model, PartitionedConvNet) and HAVE_EXTENSION:
        return CompiledPartition(model, batch)
    return model
