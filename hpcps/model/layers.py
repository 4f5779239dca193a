"""The arithmetic of a conv network's layers on NHWC arrays (maps last), shared by
:class:`hpcps.model.convnet.ConvNet` and its model-parallel partitions: im2col and col2im,
max-pooling, dropout masks, and one forward and one backward per layer kind. No MPI.

A convolution is one GEMM: the input windows are copied into a matrix of (B*Ho*Wo) rows of
KH*KW*C values (im2col) and multiplied by the kernels seen as a (KH*KW*C, N) matrix; its
backward pass is two GEMMs and a scatter-add of the window gradients back onto the input
(col2im). A whole model and a partition run the same functions: a partition's kernels and
units are simply fewer (N is whatever the W it is given holds).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hpcps.model.mlp import _act, _act_grad_inplace, dense


def _windows(a: np.ndarray, kh: int, kw: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """A strided view (B, Ho, Wo, KH, KW, C) of the windows of a C-contiguous NHWC array."""
    sb, sh, sw, sc = a.strides
    return as_strided(a, (a.shape[0], ho, wo, kh, kw, a.shape[3]),
                      (sb, stride * sh, stride * sw, sh, sw, sc), writeable=False)


def im2col(a: np.ndarray, kh: int, kw: int, stride: int, pad: int, ho: int, wo: int):
    """(B*Ho*Wo, KH*KW*C) matrix of the (zero-padded) input windows, a copy."""
    if pad:
        a = np.pad(a, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    a = np.ascontiguousarray(a)
    w = _windows(a, kh, kw, stride, ho, wo)
    return w.reshape(a.shape[0] * ho * wo, kh * kw * a.shape[3])


def col2im(dcols: np.ndarray, in_shape, kh: int, kw: int, stride: int, pad: int,
           ho: int, wo: int) -> np.ndarray:
    """The input gradient (B, H, W, C): each window's gradient added back where it came from."""
    B, H, W, C = in_shape
    dx = np.zeros((B, H + 2 * pad, W + 2 * pad, C), dtype=dcols.dtype)
    d6 = dcols.reshape(B, ho, wo, kh, kw, C)
    if ho * wo <= 4 * kh * kw:
        # few output positions: one add of a (B, KH, KW, C) block per position, whose rows of
        # KW*C values are contiguous (10x faster than the loop below for conv2 of adam-mnist)
        for i in range(ho):
            for j in range(wo):
                dx[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :] += d6[:, i, j]
    else:
        he, we = stride * (ho - 1) + 1, stride * (wo - 1) + 1
        for i in range(kh):
            for j in range(kw):
                dx[:, i:i + he:stride, j:j + we:stride, :] += d6[:, :, :, i, j, :]
    return dx[:, pad:pad + H, pad:pad + W, :] if pad else dx


def _act_grad(name: str, a: np.ndarray, delta: np.ndarray) -> None:
    """delta *= act'(z) through the output a = act(z); relu by a multiply with the mask a > 0
    (several times faster than the boolean-index assignment of the MLP's version)."""
    if name == "relu":
        np.multiply(delta, a > 0, out=delta)
    else:
        _act_grad_inplace(name, a, delta)


# -- dropout ------------------------------------------------------------------------------------
# Which units a step drops is a pure function of (key, draw, layer, example row, unit): a
# counter-based generator (SplitMix64's output function over a Weyl sequence), so the NumPy
# reference, the compiled engine (ext/convnet.pyx, the same arithmetic in C) and every partition
# of a model-parallel replica (each computing its own units' masks) drop the same units.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
DROP_BITS = 24  # a unit is dropped when the top 24 bits of its draw are below p * 2**24


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (NumPy's uint64 array arithmetic wraps
    mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def drop_threshold(p: float) -> int:
    """The 24-bit threshold of dropout rate ``p``: units whose draw is below it are dropped."""
    return int(round(float(p) * (1 << DROP_BITS)))


def dropout_scale(p: float, key: int, draw: int, layer: int, rows: int, width: int,
                  lo: int = 0, hi: int | None = None, dtype=np.float32) -> np.ndarray:
    """(rows, hi - lo): 0 where unit j of example r is dropped, 1/(1-p) where it is kept
    (inverted dropout: nothing changes at test time), for units lo..hi-1 of a layer of
    ``width`` units. ``key`` names the stream (a replica and thread), ``draw`` the step in
    it, ``layer`` the parameter layer whose outputs are dropped."""
    hi = width if hi is None else hi
    base = _mix(np.array([(key + _GOLDEN * (draw * 256 + layer + 1)) & _MASK64],
                         dtype=np.uint64))[0]
    idx = (np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(width)
           + np.arange(lo, hi, dtype=np.uint64)[None, :] + np.uint64(1))
    u = _mix(base + idx * np.uint64(_GOLDEN)) >> np.uint64(64 - DROP_BITS)
    keep = u >= np.uint64(drop_threshold(p))
    return keep.astype(dtype) * np.asarray(1.0 / (1.0 - p), dtype=dtype)


def dropout_key(seed: int, replica: int, start_step: int = 0, thread: int = 0) -> int:
    """The key of a dropout stream: one per replica (its partitions share it, so they drop
    the same units), Hogwild thread and run segment (a resumed run does not replay the masks
    of the steps before it)."""
    ss = np.random.SeedSequence([int(seed) & _MASK64, int(replica), int(start_step),
                                 int(thread), 0xD0])
    return int(ss.generate_state(1, np.uint64)[0])


def _pool_slices(k: int, stride: int, ho: int, wo: int):
    """For each window position (i, j), row-major: the strided slices of the input that hold
    it for every output."""
    he, we = stride * (ho - 1) + 1, stride * (wo - 1) + 1
    return [(slice(None), slice(i, i + he, stride), slice(j, j + we, stride), slice(None))
            for i in range(k) for j in range(k)]


def maxpool(a: np.ndarray, k: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """Max-pooling of an NHWC array: (B, Ho, Wo, C), the maximum of k*k strided slices (no
    window copy, no argmax: 20x faster than both on adam-mnist's first pool)."""
    sl = _pool_slices(k, stride, ho, wo)
    out = a[sl[0]].copy()
    for s in sl[1:]:
        np.maximum(out, a[s], out=out)
    return out


def maxpool_back(d: np.ndarray, a: np.ndarray, out: np.ndarray, k: int,
                 stride: int) -> np.ndarray:
    """Gradient of max-pooling: each output's gradient goes to the first position (row-major)
    of its window that holds the maximum, as an argmax would choose."""
    B, ho, wo, C = d.shape
    dx = np.zeros(a.shape, dtype=d.dtype)
    taken = np.zeros(out.shape, dtype=bool)
    hit = np.empty(out.shape, dtype=bool)
    part = np.empty(d.shape, dtype=d.dtype)
    for s in _pool_slices(k, stride, ho, wo):
        np.equal(a[s], out, out=hit)
        hit &= ~taken
        taken |= hit
        np.multiply(d, hit, out=part)
        if stride >= k:   # windows do not overlap: each input position is written once
            dx[s] = part
        else:
            dx[s] += part
    return dx


# -- one forward and one backward per layer kind ----------------------------------------------
def flatten_maps(a: np.ndarray) -> np.ndarray:
    """NHWC maps (B, H, W, C) -> (B, C*H*W) in C, H, W order (PyTorch's ``flatten``)."""
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2)).reshape(a.shape[0], -1)


def conv_forward(a: np.ndarray, W: np.ndarray, b: np.ndarray, spec, out_shape,
                 activation: str) -> tuple[np.ndarray, tuple]:
    """A conv layer on NHWC maps ``a``: (activated output (B, Ho, Wo, N), the cache
    :func:`conv_backward` needs). ``W`` is (N, C, KH, KW), ``spec`` the layer's
    :class:`~hpcps.model.spec.LayerSpec`, ``out_shape`` its (N', Ho, Wo)."""
    _, ho, wo = out_shape
    n = W.shape[0]
    cols = im2col(a, spec.kh, spec.kw, spec.stride, spec.pad, ho, wo)
    # kernels (O, C, KH, KW) -> (KH*KW*C, O), matching the column order of cols
    wm = W.transpose(2, 3, 1, 0).reshape(-1, n)
    z = cols @ wm
    z += b
    _act(activation, z)
    return z.reshape(a.shape[0], ho, wo, n), (a.shape, cols, wm, z)


def conv_backward(cache: tuple, delta: np.ndarray, spec, out_shape, activation: str,
                  gW: np.ndarray, gb: np.ndarray, need_input: bool) -> np.ndarray | None:
    """Fill the kernels' and biases' gradients ``gW``, ``gb`` from the error at the layer's
    output ``delta`` (B, Ho, Wo, N); return the error at its input (None unless
    ``need_input``: the first layer has no error below it to compute)."""
    in_shape, cols, wm, z = cache
    _, ho, wo = out_shape
    n = wm.shape[1]
    dz = np.ascontiguousarray(delta).reshape(-1, n)
    _act_grad(activation, z, dz)
    gw = cols.T @ dz                          # (KH*KW*C, N)
    gW[...] = gw.reshape(spec.kh, spec.kw, in_shape[3], n).transpose(3, 2, 0, 1)
    np.sum(dz, axis=0, out=gb)
    if not need_input:
        return None
    return col2im(dz @ wm.T, in_shape, spec.kh, spec.kw, spec.stride, spec.pad, ho, wo)


def fc_forward(a: np.ndarray, W: np.ndarray, b: np.ndarray, activation: str, last: bool,
               mask: np.ndarray | None = None) -> tuple[np.ndarray, tuple]:
    """A fully connected layer on ``a`` (B, fan_in): (its output, the cache
    :func:`fc_backward` needs). The output layer (``last``) gives logits: no activation, no
    dropout; a hidden one is activated, then multiplied by the dropout ``mask`` if given."""
    z = dense(a, W, b, None if last else activation)
    m = None if last else mask
    return (z if m is None else z * m), (a, z, m)


def fc_backward(cache: tuple, delta: np.ndarray, activation: str, last: bool, gW: np.ndarray,
                gb: np.ndarray, W: np.ndarray | None = None) -> tuple:
    """Fill ``gW``, ``gb`` from the error ``delta`` at the layer's output (B, fan_out),
    taken back through the dropout mask and the activation in place. Returns (that error at
    the output, the error at the layer's input: ``delta @ W.T``, None without ``W``)."""
    a, z, m = cache
    if m is not None:
        delta *= m
    if not last:
        _act_grad(activation, z, delta)
    np.matmul(a.T, delta, out=gW)
    np.sum(delta, axis=0, out=gb)
    return delta, (None if W is None else delta @ W.T)
