"""Convolutional networks on NumPy arrays: conv2d, max-pooling, fully connected, softmax. No MPI.

A model is given as a spec, a comma-separated list of layers (``docs/conv.md``)::

    convKHxKWxN[sS][pP]   2-D convolution, N output maps, kernel KH x KW, stride S (1),
                          zero padding P (0) on every side; any number of input maps
    poolK[sS]             K x K max-pooling, stride S (default K), no padding, floor mode
    flatten               optional: C x H x W -> C*H*W, implied before the first fc
    fcN                   fully connected, N units; the last layer is an fc of n_classes

The hidden activation (``--activation``) follows every conv and every fc but the last, whose
outputs are the logits of the softmax cross-entropy. Presets (:data:`PRESETS`) name specs:
``adam-mnist`` is Project Adam's MNIST network (Chilimbi et al. 2014, section 5.1).

:class:`ConvNet` has the interface the strategies use for :class:`hpcps.model.mlp.MLP`: one flat
parameter vector (``n_params``, ``layout``, ``views``, ``flatten``, ``init_params``),
``forward``, ``loss_and_grad``, ``loss`` and ``evaluate``, so a strategy needs no per-model
code. Parameters are numbered over the layers that have them (``layer0`` the first conv, ...).
A conv kernel is stored ``(out, in, kh, kw)`` in the flat vector and in checkpoints: the
convention of ONNX and PyTorch (``torch.nn.Conv2d.weight``), so a checkpoint's kernels load
elsewhere without a transpose. An fc layer's W is ``(fan_in, fan_out)`` as in the MLP, its
input the flattened maps in C, H, W order (PyTorch's ``flatten``; ``nn.Linear.weight`` is
W transposed).

The computation works on NHWC arrays (maps last) so that a convolution is one GEMM; the layers'
arithmetic (im2col, pooling, dropout masks, each layer kind's forward and backward) is
:mod:`hpcps.model.layers`, shared by :class:`ConvNet` and :class:`PartitionedConvNet`.
Everything follows the dtype of the parameter vector (float32 in training, float64 for the
finite-difference tests).
"""
from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Any
from dataclasses import dataclass

import numpy as np

from hpcps.errors import ConfigError
from hpcps.options import DROPOUT
from hpcps.model.layers import (  # noqa: F401 (im2col, col2im, drop_threshold: this module's API)
    col2im, conv_backward, conv_forward, drop_threshold, dropout_key, dropout_scale, fc_backward,
    fc_forward, flatten_maps, im2col, maxpool, maxpool_back)
from hpcps.model.mlp import ACTIVATIONS, MLP, flatten_named, local_views
from hpcps.model.spec import (LayerSpec, is_conv_spec, is_embedding_spec,  # noqa: F401
                              parse_spec, resolve)

if TYPE_CHECKING:  # an embedding model's class, imported when build() makes one
    from hpcps.model.ctr import CtrModel


@dataclass(frozen=True)
class Op:
    """One layer with its shapes: ``in_shape``/``out_shape`` are (C, H, W) or (n,)."""

    spec: LayerSpec
    in_shape: tuple
    out_shape: tuple
    param: int = -1        # index of its parameters (layer{param}/W, /b), -1 for none
    last: bool = False     # the output layer (no activation: logits)


def _macs(op) -> int:
    """Multiply-adds of one example's forward pass through a conv or fc layer ``op``."""
    s = op.spec
    if s.kind == "conv":
        return int(np.prod(op.out_shape)) * op.in_shape[0] * s.kh * s.kw
    return int(np.prod(op.in_shape)) * s.out


class SoftmaxOutput:
    """``loss`` and ``evaluate`` of a model whose ``_run(flat, x, keep)`` returns the whole
    logits first (a :class:`ConvNet`, or a :class:`PartitionedConvNet`, whose partitions
    compute them jointly)."""

    input_shape: tuple[int, int, int]  # set by the subclass
    _run: Any  # the subclass's forward pass

    def _images(self, x: np.ndarray) -> np.ndarray:
        """Rows of flattened C x H x W images as an NHWC array (a view)."""
        C, H, W = self.input_shape
        if x.ndim != 2 or x.shape[1] != C * H * W:
            raise ValueError(f"x has shape {x.shape}; this model takes (B, {C * H * W}) rows "
                             f"of {C}x{H}x{W} images")
        return x.reshape(x.shape[0], C, H, W).transpose(0, 2, 3, 1)

    def loss(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        return MLP._softmax_xent(self._run(flat, x, keep=False)[0], y)[0]

    def evaluate(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch: int = 1000) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole split, in batches to bound memory."""
        total_loss, correct = 0.0, 0
        for lo in range(0, len(y), batch):
            logits = self._run(flat, x[lo:lo + batch], keep=False)[0]
            loss, _ = MLP._softmax_xent(logits, y[lo:lo + batch])
            total_loss += loss * len(logits)
            correct += int(np.sum(np.argmax(logits, axis=1) == y[lo:lo + batch]))
        n = max(1, len(y))
        return total_loss / n, correct / n


class ConvNet(SoftmaxOutput):
    """A network of conv, pool and fc layers on C x H x W images, softmax output.

    Parameters
    ----------
    spec : the layers (see the module docstring) or a preset name.
    input_shape : (C, H, W) of one example (the dataset's ``image_shape``).
    activation : relu, tanh or sigmoid, after every conv and every fc but the last.
    dropout : rate p of dropout on the outputs of every hidden fc layer, in training only
        (``loss_and_grad``; inverted: kept units are scaled by 1/(1-p), so evaluation uses
        the weights as they are). Masks come from :func:`dropout_scale`, keyed by
        ``dropout_key`` (set with :meth:`seed_dropout`) and a draw per call.

    Raises ConfigError when the shapes do not fit (a kernel larger than its padded input, a
    pool larger than its input).
    """

    def __init__(self, spec: str, input_shape, activation: str = "relu", dropout: float = 0.0):
        if activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {activation!r}; choose one of {ACTIVATIONS}")
        self.dropout = float(dropout)
        DROPOUT.check_value(self.dropout)
        self.seed_dropout(dropout_key(0, 0))
        self.spec_text = resolve(spec)
        self.specs = parse_spec(spec)
        shape = tuple(int(n) for n in input_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ConfigError(f"a conv model needs an input of C x H x W, got {shape}")
        self.input_shape = shape
        self.activation = activation
        self.ops: list[Op] = []
        self.layout: list[tuple[str, tuple[int, ...], int]] = []
        off, n_param = 0, 0
        for i, s in enumerate(self.specs):
            out = self._out_shape(s, shape)
            param = -1
            if s.kind in ("conv", "fc"):
                param = n_param
                n_param += 1
                w_shape = (s.out, shape[0], s.kh, s.kw) if s.kind == "conv" \
                    else (int(np.prod(shape)), s.out)
                for name, sh in ((f"layer{param}/W", w_shape), (f"layer{param}/b", (s.out,))):
                    self.layout.append((name, sh, off))
                    off += int(np.prod(sh))
            self.ops.append(Op(s, shape, out, param, i == len(self.specs) - 1))
            shape = out
        self.n_params = off
        self.n_classes = self.specs[-1].out
        self.n_features = int(np.prod(self.input_shape))
        # units at the input and at the output of each layer with parameters (conv: maps x
        # positions before pooling): what a checkpoint's layer_sizes attribute holds
        self.sizes = [self.n_features] + [int(np.prod(op.out_shape)) for op in self.ops
                                          if op.param >= 0]

    def seed_dropout(self, key: int, first_draw: int = 0) -> None:
        """Start the dropout stream ``key`` at draw ``first_draw``: each training call of
        :meth:`loss_and_grad` without an explicit ``draw`` takes the next one (a thread-safe
        counter, shared by threads that share the model)."""
        self.dropout_key = int(key)
        self.first_draw = int(first_draw)
        self._draws = itertools.count(self.first_draw)

    def next_draw(self) -> int:
        return next(self._draws)

    def _out_shape(self, s: LayerSpec, shape: tuple) -> tuple:
        if s.kind in ("fc", "flatten"):
            return (s.out,) if s.kind == "fc" else (int(np.prod(shape)),)
        C, H, W = shape
        pad = s.pad if s.kind == "conv" else 0
        ho = (H + 2 * pad - s.kh) // s.stride + 1
        wo = (W + 2 * pad - s.kw) // s.stride + 1
        if H + 2 * pad < s.kh or W + 2 * pad < s.kw:
            raise ConfigError(
                f"--model {self.spec_text!r}: layer {s.text} needs an input of at least "
                f"{s.kh}x{s.kw} but gets {C}x{H}x{W}"
                + (f" (padded to {H + 2 * pad}x{W + 2 * pad})" if pad else "")
                + ": the spec does not fit the images")
        return (s.out if s.kind == "conv" else C, ho, wo)

    # -- description -------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """One line per layer: kind, shapes, parameters."""
        lines = []
        for op in self.ops:
            what = "x".join(map(str, op.out_shape))
            extra = ""
            if op.param >= 0:
                w = dict((n, sh) for n, sh, _ in self.layout)[f"layer{op.param}/W"]
                extra = f"  layer{op.param}/W {w}"
            act = "" if op.last or op.spec.kind in ("pool", "flatten") else f" {self.activation}"
            lines.append(f"{op.spec.text:<14} -> {what}{act}{extra}")
        return lines

    def __repr__(self) -> str:
        return (f"ConvNet({self.spec_text!r}, {self.input_shape}, {self.activation!r}, "
                f"{self.n_params} parameters)")

    # -- parameters --------------------------------------------------------------------------
    def init_params(self, seed: int) -> np.ndarray:
        """He-normal weights for relu (Glorot-uniform otherwise), fan-in of a conv kernel
        in*kh*kw; zero biases."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.n_params, dtype=np.float32)
        v = self.views(flat)
        for op in self.ops:
            if op.param < 0:
                continue
            W = v[f"layer{op.param}/W"]
            if op.spec.kind == "conv":
                fan_in = W.shape[1] * W.shape[2] * W.shape[3]
                fan_out = W.shape[0] * W.shape[2] * W.shape[3]
            else:
                fan_in, fan_out = W.shape
            if self.activation == "relu":
                W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / fan_in)
            else:
                lim = np.sqrt(6.0 / (fan_in + fan_out))
                W[...] = rng.uniform(-lim, lim, W.shape)
        return flat

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named views (no copy) into a flat vector of this model's length."""
        if flat.shape != (self.n_params,):
            raise ValueError(f"flat vector has shape {flat.shape}, model needs ({self.n_params},)")
        return {name: flat[off:off + int(np.prod(shape))].reshape(shape)
                for name, shape, off in self.layout}

    def flatten(self, named: dict[str, np.ndarray]) -> np.ndarray:
        """The inverse of :meth:`views`: a new flat vector from named arrays."""
        return flatten_named(self, named)

    # -- computation -------------------------------------------------------------------------
    def _run(self, flat: np.ndarray, x: np.ndarray, keep: bool, draw: int | None = None):
        """Forward pass: (logits, per-layer caches for the backward pass, or None); with
        dropout when ``draw`` is given."""
        v = self.views(flat)
        B = x.shape[0]
        a = self._images(x)
        caches: list | None = [] if keep else None
        for op in self.ops:
            s = op.spec
            cache = None
            if s.kind == "conv":
                a, cache = conv_forward(a, v[f"layer{op.param}/W"], v[f"layer{op.param}/b"], s,
                                        op.out_shape, self.activation)
            elif s.kind == "pool":
                _, ho, wo = op.out_shape
                out = maxpool(a, s.kh, s.stride, ho, wo)
                cache = (a, out)
                a = out
            elif s.kind == "flatten" or (s.kind == "fc" and a.ndim == 4):
                if caches is not None:
                    caches.append((op, "flat", a.shape))
                a = flatten_maps(a)
            if s.kind == "fc":
                W = v[f"layer{op.param}/W"]
                m = None
                if draw is not None and self.dropout and not op.last:
                    m = dropout_scale(self.dropout, self.dropout_key, draw, op.param, B, s.out,
                                      dtype=np.result_type(a, W))
                a, cache = fc_forward(a, W, v[f"layer{op.param}/b"], self.activation, op.last,
                                      m)
            if caches is not None and cache is not None:
                caches.append((op, s.kind, cache))
        return a, caches

    def forward(self, flat: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        """``[x, logits]`` (the MLP's list ends with the logits too)."""
        return [x, self._run(flat, x, keep=False)[0]]

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray | None = None,
                      parts: dict | None = None, draw: int | None = None
                      ) -> tuple[float, np.ndarray]:
        """Mean softmax cross-entropy over the batch and its gradient (flat, dtype of flat).

        ``grad``, when given, receives the gradient (overwritten, not accumulated). With
        dropout, ``draw`` picks the masks (default: the stream's next draw).
        ``parts``, when given, receives for each fully connected layer ``{param layer: (its
        inputs (B, fan_in), the errors at its output (B, fan_out))}``, whose product is its
        W gradient (Project Adam's activation pushes, :mod:`hpcps.ps.activations`).
        """
        if grad is None:
            grad = np.empty(self.n_params, dtype=flat.dtype)
        if self.dropout and draw is None:
            draw = self.next_draw()
        logits, caches = self._run(flat, x, keep=True, draw=draw)
        loss, delta = MLP._softmax_xent_grad(logits, y)
        g = self.views(grad)
        w = self.views(flat)
        for op, kind, cache in reversed(caches):
            first = op is self.ops[0]   # no gradient needed at the input of the first layer
            if kind == "fc":
                out_err, below = fc_backward(cache, delta, self.activation, op.last,
                                             g[f"layer{op.param}/W"], g[f"layer{op.param}/b"],
                                             None if first else w[f"layer{op.param}/W"])
                if parts is not None:
                    parts[op.param] = (cache[0].copy(), out_err.copy())
                delta = out_err if first else below
            elif kind == "flat":
                if first:   # the first layer's own flatten: no error below it to compute
                    break
                B, h, wd, c = cache
                delta = delta.reshape(B, c, h, wd).transpose(0, 2, 3, 1)
            elif kind == "pool":
                a_in, out = cache
                delta = maxpool_back(delta, a_in, out, op.spec.kh, op.spec.stride)
            else:  # conv
                below = conv_backward(cache, delta, op.spec, op.out_shape, self.activation,
                                      g[f"layer{op.param}/W"], g[f"layer{op.param}/b"],
                                      not first)
                if below is not None:  # None for the first layer: nothing below it
                    delta = below
        return loss, grad

    def loss_grad_and_parts(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                            grad: np.ndarray | None = None):
        """(mean loss, inputs, errors, gradient): per layer with parameters, the inputs and
        output errors of a fully connected layer (None for a conv layer), and the whole
        gradient (of which the conv layers' parts are pushed as they are)."""
        parts: dict = {}
        loss, grad = self.loss_and_grad(flat, x, y, grad, parts)
        n = sum(1 for op in self.ops if op.param >= 0)
        inputs = [parts[p][0] if p in parts else None for p in range(n)]
        errors = [parts[p][1] if p in parts else None for p in range(n)]
        return loss, inputs, errors, grad

    # -- cost ----------------------------------------------------------------------------------
    def flops_per_example(self) -> int:
        """Multiply-adds x 2 of one example's forward and backward pass in the conv and fc
        layers (forward GEMM, weight-gradient GEMM, input-gradient GEMM but for the first
        layer)."""
        return sum(2 * _macs(op) * (2 if op is self.ops[0] else 3)
                   for op in self.ops if op.param >= 0)

    def connections(self) -> int:
        """Connections of one forward pass (a weight used at one position counts once per
        position): Project Adam's unit for "connections trained per second"."""
        return sum(_macs(op) for op in self.ops if op.param >= 0)


def build(cfg, info) -> "ConvNet | MLP | CtrModel":
    """The whole model a run's config asks for on its dataset: a :class:`ConvNet` for
    ``--model``, a :class:`hpcps.model.ctr.CtrModel` for an embedding ``--model`` (on a
    categorical dataset), else the :class:`MLP` of ``--layers``.

    Raises ConfigError when a conv model meets a dataset without an ``image_shape``, or the
    spec does not fit the images or the classes.
    """
    if cfg.model is None:
        return MLP(cfg.layers, cfg.activation)
    if is_embedding_spec(cfg.model):
        if not hasattr(info, "fields"):
            raise ConfigError(f"--model {cfg.model} is an embedding model: it reads categorical "
                              f"ids (layout 2, docs/formats.md), and {info.path} holds dense "
                              "features; prepare one with python -m hpcps.data prepare "
                              "movielens|synthetic-ctr")
        if info.label_kind != "binary":
            raise ConfigError(f"--model {cfg.model} ends in one logistic unit, but {info.path} "
                              f"has {info.label_kind} labels, not 0/1")
        from hpcps.model.ctr import CtrModel
        return CtrModel.for_fields(cfg.model, info.fields, info.n_dense, cfg.activation)
    shape = info.image_shape
    if shape is None:
        if is_conv_spec(cfg.model):
            raise ConfigError(
                f"--model {cfg.model} has conv layers but dataset {info.path} declares no image "
                "shape (its rows are flat vectors): a dataset for conv models has a root "
                "attribute image_shape = [C, H, W] (docs/formats.md); prepare it again with "
                "python -m hpcps.data prepare mnist|digits, or set the attribute with h5py")
        shape = (info.n_features, 1, 1)
    model = ConvNet(cfg.model, shape, cfg.activation, cfg.dropout or 0.0)
    if model.n_classes != info.n_classes:
        raise ConfigError(f"--model {cfg.model} ends with {model.specs[-1].text}, but dataset "
                          f"{info.path} has {info.n_classes} classes: the last layer must be "
                          f"fc{info.n_classes}")
    return model


def thread_key(key: int, thread: int) -> int:
    """The dropout key of Hogwild thread ``thread`` of a replica whose key is ``key`` (thread 0
    keeps the replica's)."""
    return key if thread == 0 else dropout_key(key, 0, 0, thread)


def build_partition(cfg, full, parts: int, part: int, exchange=None, thread: int = 0):
    """Partition ``part`` of ``parts`` of the whole model ``full`` (:func:`build`'s): a
    :class:`PartitionedConvNet` or a :class:`hpcps.model.mlp.PartitionedMLP`. Raises ConfigError
    when a layer is narrower than ``parts``. A conv model's dropout stream is ``full``'s, or
    that of Hogwild thread ``thread`` of it."""
    from hpcps.model.mlp import PartitionedMLP, SingleExchange
    exchange = exchange if exchange is not None else SingleExchange
    if isinstance(full, ConvNet):
        model = PartitionedConvNet(cfg.model, full.input_shape, cfg.activation, parts, part,
                                   exchange, full.dropout)
        model.seed_dropout(thread_key(full.dropout_key, thread), full.first_draw)
        return model
    return PartitionedMLP(cfg.layers, cfg.activation, parts, part, exchange)


def describe_model(model) -> str:
    """The model in a few words for the start line."""
    if isinstance(model, ConvNet):
        drop = f", dropout {model.dropout:g}" if model.dropout else ""
        return f"{model.spec_text} on {'x'.join(map(str, model.input_shape))} images{drop}"
    ctr = sys.modules.get("hpcps.model.ctr")  # loaded by build() if there is such a model
    if ctr is not None and isinstance(model, ctr.CtrModel):
        return f"{model.spec_text} on {model.n_fields} fields + {model.n_dense} dense"
    return ",".join(map(str, model.sizes))


# -- model parallelism ---------------------------------------------------------------------------
class PartitionedConvNet(SoftmaxOutput):
    """Partition ``part`` of ``parts`` of a :class:`ConvNet` (Project Adam's vertical
    partitioning, section 3.1).

    Every layer with parameters is split by its outputs: a conv layer by output maps (this
    rank holds kernels ``W[lo:hi]`` over *all* input maps, and ``b[lo:hi]``), an fc layer by
    units (columns ``W[:, lo:hi]``), split as :func:`hpcps.model.mlp.partition_widths` splits an
    MLP's layers. A rank computes only its own maps and units; pooling and activations work map
    by map, so they need nothing from the other partitions. The exchange happens where a layer
    mixes maps: at the input of every conv and fc layer but the first, each partition's block
    of activations goes to every other (``exchange.gather``), *after* the pooling layers
    between them, which are applied to the local maps first (a 2x2 pool makes the exchange
    4x smaller than the conv output it follows). Backward, each partition's error terms
    contribute to every input map of its layer; those are summed and each partition receives
    the maps it owns (``exchange.scatter_sum``). The logits are gathered too, so every
    partition computes the loss.

    Blocks travel as (values, batch): a block of maps is (maps, H, W) per example, maps first,
    so the gathered block is the whole input in (C, H, W) order, which is also the order in
    which the first fc layer reads the flattened maps. ``exchange`` is any object with
    ``gather`` and ``scatter_sum`` (:class:`hpcps.mpi.comm.ReplicaExchange` between ranks,
    :class:`hpcps.model.mlp.SingleExchange` for P = 1, a thread exchange in the tests); with
    ``parts == 1`` this computes what :class:`ConvNet` does. This is the NumPy reference of
    a partition; training runs its compiled counterpart where the extension is built
    (:class:`hpcps.engine.conv_hogwild.CompiledPartition`, which uses this object's slices,
    exchange and dropout stream).

    Bytes one rank p sends per mini-batch of B examples (float32), where n_l is the number of
    values per example at the input of the l-th layer with parameters (l = 1 .. L-1; n_L: the
    logits) and w_p(l) is p's share of them: forward ``sum_{l=1..L} w_p(l) * B * 4 * (P-1)``,
    backward ``sum_{l=1..L-1} (n_l - w_p(l)) * B * 4`` (:meth:`exchange_bytes`): the MLP's
    formula with the pooled maps in place of a layer's neurons.
    """

    def __init__(self, spec: str, input_shape, activation: str, parts: int, part: int,
                 exchange=None, dropout: float = 0.0):
        from hpcps.model.mlp import SingleExchange, partition_widths
        self.full = ConvNet(spec, input_shape, activation, dropout)
        self.dropout = self.full.dropout
        self.seed_dropout = self.full.seed_dropout  # one stream: the whole model's
        self.activation = activation
        self.input_shape = self.full.input_shape
        self.n_features = self.full.n_features
        self.n_classes = self.full.n_classes
        self.spec_text = self.full.spec_text
        if not 0 <= part < parts:
            raise ValueError(f"partition {part} outside 0..{parts - 1}")
        self.parts, self.part = parts, part
        self.exchange = exchange if exchange is not None else SingleExchange
        self.param_ops = [op for op in self.full.ops if op.param >= 0]
        self.n_layers = len(self.param_ops)
        # cols[l][q]: outputs (maps or units) of parameter layer l held by partition q
        self.cols = []
        for op in self.param_ops:
            try:
                self.cols.append(partition_widths(op.spec.out, parts, op.param))
            except ConfigError:
                kind = "maps" if op.spec.kind == "conv" else "units"
                raise ConfigError(f"--model {self.spec_text!r}: layer {op.spec.text} has "
                                  f"{op.spec.out} {kind}, fewer than --partitions {parts}: "
                                  f"every partition must hold at least one of every layer's "
                                  f"{kind}") from None
        self.part_sizes = [self._local_size(q) for q in range(parts)]
        self.n_params = self.part_sizes[part]
        # values per example each partition holds at the input of parameter layer l >= 1
        # (after the pools that follow layer l-1), and of the logits at the end
        self.widths = []
        for i, op in enumerate(self.param_ops):
            nxt = self.param_ops[i + 1] if i + 1 < len(self.param_ops) else None
            shape = nxt.in_shape if nxt is not None else op.out_shape
            # a conv layer's maps, pooled (and perhaps flattened): values per map
            per_map = int(np.prod(shape)) // op.spec.out if op.spec.kind == "conv" else 1
            self.widths.append([(hi - lo) * per_map for lo, hi in self.cols[i]])

    # -- parameters --------------------------------------------------------------------------
    def _shapes(self, q: int):
        for l, op in enumerate(self.param_ops):
            lo, hi = self.cols[l][q]
            if op.spec.kind == "conv":
                yield f"layer{l}/W", (hi - lo, op.in_shape[0], op.spec.kh, op.spec.kw)
            else:
                yield f"layer{l}/W", (int(np.prod(op.in_shape)), hi - lo)
            yield f"layer{l}/b", (hi - lo,)

    def _local_size(self, q: int) -> int:
        return sum(int(np.prod(shape)) for _, shape in self._shapes(q))

    def views(self, flat: np.ndarray, q: int | None = None) -> dict[str, np.ndarray]:
        """Named views of a partition's local vector (this rank's unless ``q`` is given)."""
        return local_views(self, flat, self.part if q is None else q)

    def axis(self, name: str) -> int:
        """The axis of whole array ``name`` along which partitions hold slices: output maps
        (axis 0) of a conv kernel, columns (the last) of an fc layer's W, entries of b."""
        l = int(name.split("/")[0][5:])
        return 0 if name.endswith("/W") and self.param_ops[l].spec.kind == "conv" else -1

    @staticmethod
    def _cut(name: str, kind: str, lo: int, hi: int):
        """The index of partition slice [lo, hi) in the whole array ``name``."""
        if name.endswith("/b") or kind == "conv":
            return slice(lo, hi)  # conv kernels: output maps first; biases
        return (slice(None), slice(lo, hi))  # fc: columns

    def local_from_full(self, named: dict[str, np.ndarray], q: int | None = None) -> np.ndarray:
        """Partition ``q``'s local vector cut out of whole-layer arrays."""
        q = self.part if q is None else q
        flat = np.empty(self.part_sizes[q], dtype=named["layer0/W"].dtype)
        mine = self.views(flat, q)
        for l, op in enumerate(self.param_ops):
            lo, hi = self.cols[l][q]
            for name in (f"layer{l}/W", f"layer{l}/b"):
                mine[name][...] = named[name][self._cut(name, op.spec.kind, lo, hi)]
        return flat

    def full_from_parts(self, locals_) -> np.ndarray:
        """The whole model's flat vector (:class:`ConvNet` layout) from every partition's."""
        locals_ = list(locals_)
        flat = np.empty(self.full.n_params, dtype=locals_[0].dtype)
        whole = self.full.views(flat)
        for q, local in enumerate(locals_):
            part = self.views(local, q)
            for l, op in enumerate(self.param_ops):
                lo, hi = self.cols[l][q]
                for name in (f"layer{l}/W", f"layer{l}/b"):
                    whole[name][self._cut(name, op.spec.kind, lo, hi)] = part[name]
        return flat

    def init_params(self, seed: int) -> np.ndarray:
        """This partition's slice of ``ConvNet.init_params(seed)``: the same model whatever
        P is (conv models are small, so the whole is drawn and cut)."""
        return self.local_from_full(self.full.views(self.full.init_params(seed)))

    def exchange_bytes(self, batch: int, q: int | None = None) -> int:
        """Bytes partition ``q`` sends per mini-batch of ``batch`` examples (the formula in
        the class docstring)."""
        q = self.part if q is None else q
        P = self.parts
        fwd = sum(w[q] for w in self.widths) * batch * 4 * (P - 1)
        bwd = sum(sum(w) - w[q] for w in self.widths[:-1]) * batch * 4
        return fwd + bwd

    # -- computation -------------------------------------------------------------------------
    def _gather_maps(self, a: np.ndarray, widths) -> np.ndarray:
        """Local maps (B, H, W, c_q) -> every partition's, (B, H, W, C)."""
        B, h, w, _ = a.shape
        whole = self.exchange.gather(np.ascontiguousarray(a.transpose(3, 1, 2, 0)).reshape(
            -1, B), widths)
        return whole.reshape(-1, h, w, B).transpose(3, 1, 2, 0)

    def _run(self, flat: np.ndarray, x: np.ndarray, keep: bool, draw: int | None = None):
        """Forward pass: (whole logits, caches for the backward pass, or None); with dropout
        of this partition's units when ``draw`` is given (the masks the whole model draws)."""
        v = self.views(flat)
        B = x.shape[0]
        a = self._images(x)  # whole on every partition
        local = False  # whether `a` holds only this partition's maps or units
        caches: list | None = [] if keep else None
        l = -1
        for op in self.full.ops:
            s = op.spec
            if s.kind == "pool":
                _, ho, wo = op.out_shape
                out = maxpool(a, s.kh, s.stride, ho, wo)
                if caches is not None:
                    caches.append((op, "pool", (a, out)))
                a = out
                continue
            if s.kind == "flatten":
                continue
            l += 1
            lo, hi = self.cols[l][self.part]
            if local:  # a layer that mixes maps or units: every partition's block first
                shape = a.shape
                a = self._gather_maps(a, self.widths[l - 1]) if a.ndim == 4 else \
                    self.exchange.gather(np.ascontiguousarray(a.T), self.widths[l - 1]).T
                if caches is not None:
                    caches.append((op, "gather", shape))
            if s.kind == "conv":
                a, cache = conv_forward(a, v[f"layer{l}/W"], v[f"layer{l}/b"], s, op.out_shape,
                                        self.activation)
                if caches is not None:
                    caches.append((op, "conv", cache))
            else:  # fc: its input is whole here
                if a.ndim == 4:
                    a = flatten_maps(a)
                W = v[f"layer{l}/W"]
                m = None
                if draw is not None and self.dropout and not op.last:
                    m = dropout_scale(self.dropout, self.full.dropout_key, draw, l, B, s.out, lo,
                                      hi, dtype=np.result_type(a, W))
                a, cache = fc_forward(a, W, v[f"layer{l}/b"], self.activation, op.last, m)
                if caches is not None:
                    caches.append((op, "fc", cache))
            local = True
        logits = self.exchange.gather(np.ascontiguousarray(a.T), self.widths[-1]).T
        return logits, caches

    def forward(self, flat: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        return [x, self._run(flat, x, keep=False)[0]]

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray | None = None, draw: int | None = None
                      ) -> tuple[float, np.ndarray]:
        """Mean softmax cross-entropy of the whole replica and this partition's gradient
        (with dropout: the masks of ``draw``, default the stream's next)."""
        if grad is None:
            grad = np.empty(self.n_params, dtype=flat.dtype)
        if self.dropout and draw is None:
            draw = self.full.next_draw()
        logits, caches = self._run(flat, x, keep=True, draw=draw)
        loss, probs = MLP._softmax_xent_grad(logits, y)
        lo, hi = self.cols[-1][self.part]
        delta = np.ascontiguousarray(probs[:, lo:hi])
        g = self.views(grad)
        w = self.views(flat)
        l = self.n_layers
        for op, kind, cache in reversed(caches):
            if kind == "gather":
                # `delta`: this partition's share of the error at every input of the layer
                # (NHWC maps at a conv's input, (B, n) at an fc's, maps in C, H, W order);
                # summed over the partitions, each keeps its own maps or units, shaped as
                # they were before the gather
                B = delta.shape[0]
                partial_t = np.ascontiguousarray(delta.transpose(3, 1, 2, 0) if delta.ndim == 4
                                                 else delta.T).reshape(-1, B)
                mine_t = self.exchange.scatter_sum(partial_t, self.widths[l - 1])
                if len(cache) == 4:  # local maps (B, h, w, c_q)
                    _, h, wd, c = cache
                    delta = np.ascontiguousarray(mine_t.reshape(c, h, wd, B).transpose(3, 1, 2, 0))
                else:
                    delta = np.ascontiguousarray(mine_t.T)
                continue
            if kind == "pool":
                a_in, out = cache
                delta = maxpool_back(delta, a_in, out, op.spec.kh, op.spec.stride)
                continue
            l -= 1
            first = l == 0
            if kind == "fc":
                _, below = fc_backward(cache, delta, self.activation, op.last, g[f"layer{l}/W"],
                                       g[f"layer{l}/b"], None if first else w[f"layer{l}/W"])
            else:  # conv
                below = conv_backward(cache, delta, op.spec, op.out_shape, self.activation,
                                      g[f"layer{l}/W"], g[f"layer{l}/b"], not first)
            if not first:
                delta = below  # fc: (B, whole input); conv: this partition's share, NHWC
        return loss, grad
