"""Project Adam's pushes of activations and errors (Chilimbi et al. 2014, section 3.2.2).

For a fully connected layer of M inputs and N outputs, the gradient of k examples is
``A^T E``: A the k rows of the layer's inputs, E the k rows of its output errors. Sending A and
E costs k*(M+N) numbers instead of M*N; when that is smaller (wide layers, few examples per
push) a replica pushes them and the shard computes the update itself. With Adagrad the shard
does it tile by tile (:func:`hpcps.kernels.gemm.fused_outer_adagrad`), so the M*N gradient
exists nowhere. Layers where k*(M+N) >= M*N are pushed as dense gradients, as usual.

This module is the arithmetic both sides share, without MPI: which rows of which layer a
shard holds (shards are cut at row boundaries so each holds whole rows of W), what a message
to a shard contains, how the shard applies it. Per layer the shard receives only the input
columns of the rows it holds and the whole error block (each value sent once to each shard
that needs it).

A conv model (:class:`hpcps.model.convnet.ConvNet`) pushes its conv layers' kernels and biases as
dense gradients, always (Adam, section 3.2: weight sharing makes them small), and its fully
connected layers as above; a conv layer is one unit of the vector (pieces of kind ``dW`` and
``db``), never cut between shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcps.kernels import gemm


@dataclass(frozen=True)
class Piece:
    """A shard's part of one layer: rows r0..r1 of W, or its bias b (r0 = r1 = -1), or a
    conv layer's whole kernels or biases, pushed dense (``dW``, ``db``)."""

    layer: int
    kind: str        # "W", "b" (fully connected), "dW", "db" (conv)
    r0: int
    r1: int
    offset: int      # where the piece starts in the shard's slice
    size: int        # floats


def layer_dims(model) -> list[tuple[int, int] | None]:
    """Per layer with parameters: (fan_in, fan_out) of a fully connected layer, None for a
    conv layer (from the model's layout: an MLP's, or a ConvNet's)."""
    return [(shape[0], shape[1]) if len(shape) == 2 else None
            for name, shape, _ in model.layout if name.endswith("/W")]


def units(model) -> list[tuple[int, str, int, int]]:
    """(layer, kind, row, width) for every row of every fully connected W and every b, and
    each conv layer's kernels and biases as one unit each, in flat order."""
    sizes = {name: int(np.prod(shape)) for name, shape, _ in model.layout}
    out = []
    for l, dims in enumerate(layer_dims(model)):
        if dims is None:
            out += [(l, "dW", -1, sizes[f"layer{l}/W"]), (l, "db", -1, sizes[f"layer{l}/b"])]
            continue
        fan_in, fan_out = dims
        out += [(l, "W", r, fan_out) for r in range(fan_in)]
        out.append((l, "b", -1, fan_out))
    return out


def row_aligned_ranges(model, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous chunks of the flat vector, cut only between rows, as even as possible."""
    bounds = np.cumsum([0] + [w for *_, w in units(model)])
    total = int(bounds[-1])
    if n_shards > len(bounds) - 1:
        raise ValueError(f"{n_shards} shards for only {len(bounds) - 1} rows")
    cuts = [0]
    for s in range(1, n_shards):
        want = s * total / n_shards
        i = int(np.searchsorted(bounds, want))
        i = min(max(i, cuts[-1] + 1), len(bounds) - 1 - (n_shards - s))
        cuts.append(i)
    cuts.append(len(bounds) - 1)
    return [(int(bounds[a]), int(bounds[b])) for a, b in zip(cuts, cuts[1:])]


def pieces(model, lo: int, hi: int) -> list[Piece]:
    """The pieces of the chunk [lo, hi) (which must fall on row boundaries)."""
    out: list[Piece] = []
    pos = 0
    for layer, kind, row, width in units(model):
        if lo <= pos < hi:
            last = out[-1] if out else None
            if kind == "W" and last is not None and last.layer == layer and last.kind == "W":
                out[-1] = Piece(layer, "W", last.r0, row + 1, last.offset, last.size + width)
            else:
                r0, r1 = (row, row + 1) if kind == "W" else (-1, -1)
                out.append(Piece(layer, kind, r0, r1, pos - lo, width))
        pos += width
    return out


def parts(model, flat: np.ndarray, x: np.ndarray, y: np.ndarray, grad: np.ndarray):
    """What a replica pushes is made of: (mean loss, inputs, errors) per layer with
    parameters (None for a conv layer); for a conv model ``grad`` also receives the whole
    gradient, whose conv layers' parts go dense (an MLP's is left alone)."""
    if hasattr(model, "loss_grad_and_parts"):  # a ConvNet
        loss, inputs, errors, _ = model.loss_grad_and_parts(flat, x, y, grad)
        return loss, inputs, errors
    return model.loss_and_parts(flat, x, y)


def activation_layers(model, k: int) -> list[bool]:
    """Per layer: push activations and errors (True) rather than the dense gradient."""
    return [d is not None and k * (d[0] + d[1]) < d[0] * d[1] for d in layer_dims(model)]


def pack(model, chunk: list[Piece], modes, inputs, errors, dense=None) -> np.ndarray:
    """The float32 message for one shard, from k rows of every fully connected layer's inputs
    and errors, and (a conv model) ``dense``: the named gradient arrays of its conv layers."""
    parts = []
    sent_e = set()
    for p in chunk:
        if p.kind in ("dW", "db"):
            parts.append(dense[f"layer{p.layer}/{p.kind[1]}"].ravel())
            continue
        A, E = inputs[p.layer], errors[p.layer]
        if modes[p.layer]:
            if p.kind == "W":
                parts.append(A[:, p.r0:p.r1].ravel())
            if p.layer not in sent_e:  # once per layer, whether for W rows, b or both
                parts.append(E.ravel())
                sent_e.add(p.layer)
        elif p.kind == "W":
            parts.append((A[:, p.r0:p.r1].T @ E).ravel())
        else:
            parts.append(E.sum(axis=0))
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else \
        np.zeros(0, np.float32)


def message_floats(model, chunk: list[Piece], k: int) -> int:
    """Length of :func:`pack`'s message for ``k`` examples (the receiver's bound)."""
    modes = activation_layers(model, k)
    dims = layer_dims(model)
    n, sent_e = 0, set()
    for p in chunk:
        if modes[p.layer]:
            N = dims[p.layer][1]
            n += k * (p.r1 - p.r0) if p.kind == "W" else 0
            if p.layer not in sent_e:
                n += k * N
                sent_e.add(p.layer)
        else:
            n += p.size
    return n


def max_message_bytes(model, chunk: list[Piece], k_max: int) -> int:
    """Bytes no message to this chunk exceeds for up to ``k_max`` examples, in either mode."""
    dims = layer_dims(model)
    return 4 * sum(p.size + (k_max * (p.r1 - p.r0 + dims[p.layer][1])
                             if dims[p.layer] is not None else 0) for p in chunk)


def apply(model, chunk: list[Piece], k: int, payload: np.ndarray, params: np.ndarray,
          state: dict, optimizer) -> None:
    """Apply one message to the shard's slice: the update the dense gradient would give."""
    expected = message_floats(model, chunk, k)
    if len(payload) != expected:
        raise ValueError(f"activation push of {len(payload)} floats for {k} examples, "
                         f"expected {expected}")
    modes = activation_layers(model, k)
    dims = layer_dims(model)
    pos, errors = 0, {}
    adagrad = getattr(optimizer, "name", "") == "adagrad"
    for p in chunk:
        w = params[p.offset:p.offset + p.size]
        st = {key: v[p.offset:p.offset + p.size] for key, v in state.items()}
        if not modes[p.layer]:
            optimizer.apply(w, payload[pos:pos + p.size], st)
            pos += p.size
            continue
        N = dims[p.layer][1]
        A = None
        if p.kind == "W":
            rows = p.r1 - p.r0
            A = payload[pos:pos + k * rows].reshape(k, rows)
            pos += k * rows
        if p.layer not in errors:
            errors[p.layer] = payload[pos:pos + k * N].reshape(k, N)
            pos += k * N
        E = errors[p.layer]
        if p.kind == "b":
            optimizer.apply(w, np.ascontiguousarray(E.sum(axis=0), dtype=np.float32), st)
        elif adagrad:  # tile by tile: the gradient of these rows never exists whole
            gemm.fused_outer_adagrad(w.reshape(rows, N), st["accum"].reshape(rows, N),
                                     np.ascontiguousarray(A), E, optimizer.lr, optimizer.eps)
        else:
            optimizer.apply(w, np.ascontiguousarray((A.T @ E).ravel()), st)
