"""float32 GEMM kernels for layers and server shards: compiled, with a NumPy reference each.

Built from ``ext/gemm.pyx`` into ``hpcps.kernels._gemm`` (``python setup.py build_ext
--inplace``). Where that module is missing, or ``HPCPS_NO_EXTENSION=1`` is set (read once,
at import), the NumPy references below are used, with one warning; results agree to
float32 rounding.

What is here, and why (figures: ``bench/bench_gemm.py``, one core, OpenBLAS limited to one
thread, medians; this machine does ~150 GFLOP/s per core in sgemm when idle, and shares its
2 cores with other jobs, so compare figures of the same run):

``fused_outer_adagrad(W, accum, A, E, lr, eps)``
    Project Adam's server-side update for a fully connected layer (OSDI 2014, 3.2.4 and
    4.3.2): the worker ships activations ``A`` (k, M) and error terms ``E`` (k, N), k*(M+N)
    numbers; the shard computes ``G = A.T @ E`` one tile of W at a time (sgemm of OpenBLAS
    through ``scipy.linalg.cython_blas``, without the GIL) and applies Adagrad to that tile
    at once, while it is in cache. NumPy's two steps write the M*N gradient and then stream
    it through memory again with every temporary of ``accum += G*G; W -= lr*G/(...)``.
    One run on the shared machine (load ~2.5 on 2 cores), one thread: 1.46x, 1.71x and 2.32x
    faster than NumPy's two steps for (M, N, k) = (784, 1024, 128), (1024, 1024, 128) and
    (1024, 1024, 32); 1.27x, 1.50x, 2.08x faster than NumPy's GEMM followed by the compiled
    Adagrad kernel. That is 0.28, 0.30 and 0.65 G weight updates/s per core; the GEMM inside
    runs at 47%, 52% and 28% of 150 GFLOP/s (the rest is the Adagrad pass and OpenBLAS
    re-packing E for each tile). A second run on a quiet machine separated the tiles:
    512x512 took 2.89, 3.86 and 1.55 ms (1.70x, 1.59x and 2.89x NumPy's two steps: 4.90, 6.16,
    4.48 ms) against 3.29, 4.31 and 1.84 ms for 256x256, so 512x512 is the default. At k=32
    the gain is largest because the update, not the GEMM, dominates.
``gemm_bias_act(X, W, b, act, out)``
    ``act(X @ W + b)`` for the forward pass: one sgemm into ``out``, then bias and
    activation in place over the (cache-resident) result, no temporaries. For ``relu`` and
    ``none`` the bias/activation pass is the compiled one; for ``tanh`` and ``sigmoid`` the
    compiled pass calls scalar libm ``tanhf``/``expf`` (GCC does not vectorize them without
    ``-ffast-math``), which measured 1.5-2.5x slower than NumPy's SIMD ``np.tanh``/``np.exp``,
    so those use sgemm + bias compiled, then NumPy's activation in place. The GEMM dominates
    (bias + activation are ~5% of the time at the training shapes), so against
    ``act(X @ W + b)`` in NumPy the gain is the temporaries: 0.95-1.25x in one run, within
    the machine's noise at 128x1024 @ 1024x1024. Doing the GEMM in row blocks of 32 to apply
    bias+act while a block is hot measured ~2x slower at N=1024 (OpenBLAS re-packs W per
    block) and is not used by default.
``sgemm(A, B, out, trans_a=False)``
    ``op(A) @ B`` through the kernels' sgemm (releases the GIL; see "BLAS" below).
    The two layouts training needs: ``X @ W`` (forward) and ``X.T @ D`` (weight gradient).
``zero_skip_matmul(X, W, out)``, ``zero_skip_update(W, X, D, alpha, W2=None)``
    The first layer's two products for inputs with many zeros (``ext/zero_skip.h``; the
    Hogwild engine uses them): register-blocked micro-kernels that, per block of 4 rows
    (forward) or 4 input columns (update), visit only the inputs nonzero somewhere in the
    block; 4 x 64 with AVX-512F, 4 x 24 with AVX2 + FMA, the best the CPU has
    (``ZERO_SKIP_ISA``, chosen at import; ``isa=`` picks another the CPU runs, for tests
    and benchmarks). On CPUs with neither (``ZERO_SKIP_ISA`` None) the NumPy references
    run. Figures: ``docs/performance.md``; ``bench/bench_gemm.py``.

Not kept: a packed, cache-blocked sgemm in Cython alone (Goto/BLIS structure: packed A and
B panels, KC=256, MC=96, NC=2048, a 4x8 register-blocked micro-kernel with constant trip
counts so GCC -O3 unrolls and vectorizes it). With the default flags (SSE2 only; OpenBLAS
picks AVX-512 at run time) it reached 13-16 GFLOP/s at the four large training shapes and
8.4 at 128x1024 @ 1024x10, against 90-99 and 34 GFLOP/s for NumPy's OpenBLAS in the same
run: 13-25% of OpenBLAS, 6-10% of 150 GFLOP/s. With ``HPCPS_MARCH_NATIVE=1`` it was no
better (6-11 GFLOP/s; before a guard was added, GCC 12 vectorized the k loop as in-order
reductions with gathers, ~2 GFLOP/s), and a 6x16 block was worse still (~1 GFLOP/s,
spills). It lost at every shape, so it was removed, and ``sgemm`` above calls OpenBLAS.

BLAS: the compiled kernels call ``scipy.linalg.cython_blas.sgemm`` (OpenBLAS), or Intel
MKL's sgemm (LP64, sequential) when ``hpcps.kernels.blas`` chooses it (``HPCPS_BLAS``, read
at the first call of a function below; the figures above are OpenBLAS's).

OpenBLAS may start its own threads inside sgemm. Server ranks run with
``OPENBLAS_NUM_THREADS=1`` (``hpcps.train`` sets it); ``threads`` here are OpenMP threads
over tiles, and with both set above 1 the two multiply.

Environment
-----------
HPCPS_ZERO_SKIP_ISA = avx512 | avx2 | none
    The most the zero-skipping kernels may use (default: whatever the CPU has); ``avx2`` on
    an AVX-512 CPU runs the AVX2 kernels, ``none`` the NumPy references here and BLAS in
    the Hogwild engine. Read once, at import; another value raises ConfigError.

Attributes
----------
HAVE_EXTENSION : bool
    True when the compiled kernels are the ones in use.
ACTIVATIONS : tuple of str
    ``("none", "relu", "tanh", "sigmoid")``.
ZERO_SKIP_ISA : str or None
    ``"avx512"`` or ``"avx2"``: the zero-skipping kernels used by default here and by the
    Hogwild engine; None when there are none (no extension, a CPU without AVX2 and FMA, or
    ``HPCPS_ZERO_SKIP_ISA=none``).
ZERO_SKIP_ISAS : tuple of str
    Every instruction set the kernels may use on this CPU, lowest first (``isa=``).
ZERO_SKIP_CPU_ISA : str or None
    The best instruction set this CPU runs them with, whatever ``HPCPS_ZERO_SKIP_ISA`` says.
"""
import operator
import os

import numpy as np

from hpcps.errors import ConfigError

from . import _check_array, _check_no_overlap, _check_scalar, load_extension, reference
from . import blas as _blas

ACTIVATIONS = ("none", "relu", "tanh", "sigmoid")
# Activations whose compiled pass beats NumPy's (see the module docstring).
_COMPILED_ACTS = ("none", "relu")

_gemm, HAVE_EXTENSION = load_extension("_gemm", None, "hpcps.kernels.gemm")

# Instruction sets of the zero-skipping kernels, lowest first (names -> ext/zero_skip.h's
# HP_ISA_* codes, which the compiled engine takes).
ISA_NAMES = ("avx2", "avx512")
ZERO_SKIP_ENV = "HPCPS_ZERO_SKIP_ISA"


def zero_skip_isas(cpu_best, cap=None):
    """The instruction sets the zero-skipping kernels may use, lowest first: every one up
    to ``cpu_best`` (the CPU's best, a name in ``ISA_NAMES`` or None), and up to ``cap``
    (``HPCPS_ZERO_SKIP_ISA``: a name, ``"none"``, or None/empty for no cap).

    Raises
    ------
    ConfigError
        On a ``cap`` that names no instruction set.
    """
    if cpu_best is None:
        return ()
    have = ISA_NAMES[:ISA_NAMES.index(cpu_best) + 1]
    cap = (cap or "").strip().lower()
    if not cap:
        return have
    if cap == "none":
        return ()
    if cap not in ISA_NAMES:
        raise ConfigError(f"{ZERO_SKIP_ENV}={cap!r}: choose one of {ISA_NAMES + ('none',)}")
    return have[:ISA_NAMES.index(cap) + 1]


ZERO_SKIP_CPU_ISA = _gemm.zero_skip_cpu_isa() if _gemm is not None else None
ZERO_SKIP_ISAS = zero_skip_isas(ZERO_SKIP_CPU_ISA, os.environ.get(ZERO_SKIP_ENV))
ZERO_SKIP_ISA = ZERO_SKIP_ISAS[-1] if ZERO_SKIP_ISAS else None
ZERO_SKIP_ISA_CODES = dict(_gemm.ZERO_SKIP_ISAS) if _gemm is not None else {}
ZERO_SKIP_COMPILED = ZERO_SKIP_ISA is not None   # the public functions run compiled kernels

__all__ = [
    "ACTIVATIONS", "HAVE_EXTENSION", "ISA_NAMES", "ZERO_SKIP_COMPILED", "ZERO_SKIP_CPU_ISA",
    "ZERO_SKIP_ISA", "ZERO_SKIP_ISAS", "fused_outer_adagrad", "gemm_bias_act", "sgemm",
    "zero_skip_isas", "zero_skip_matmul", "zero_skip_update", "outer_adagrad_reference",
    "gemm_bias_act_reference", "sgemm_reference", "zero_skip_matmul_reference",
    "zero_skip_update_reference",
]


# --------------------------------------------------------------------------- checks

def _check_matrix(name, a, ndim=2, writable=False):
    _check_array(name, a, writable, ndim)


def _out_matrix(out, shape, inputs):
    """``out`` checked (2-D float32 C-contiguous, writable, ``shape``, separate from every
    input), or a new matrix when None."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    _check_matrix("out", out, writable=True)
    if out.shape != shape:
        raise ValueError(f"out must have shape {shape}, got {out.shape}")
    _check_no_overlap([("out", out)], inputs)
    return out


def _check_positive_int(name, x):
    try:
        x = operator.index(x)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {x!r}") from None
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return x


# --------------------------------------------------------------------------- references

def outer_adagrad_reference(W, accum, A, E, lr, eps):
    """NumPy's two steps: ``G = A.T @ E``, then Adagrad on ``W`` with ``G`` (float32)."""
    G = np.asarray(A.T @ E, dtype=np.float32)
    reference.adagrad_update(W.reshape(-1), G.reshape(-1), accum.reshape(-1), lr, eps)


def _activation_inplace(act, z):
    if act == "relu":
        np.maximum(z, 0.0, out=z)
    elif act == "tanh":
        np.tanh(z, out=z)
    elif act == "sigmoid":  # exp(-z) may overflow to inf for very negative z: the right 0
        np.negative(z, out=z)
        with np.errstate(over="ignore"):
            np.exp(z, out=z)
        z += np.float32(1.0)
        np.reciprocal(z, out=z)


def gemm_bias_act_reference(X, W, b, act, out):
    """``out = act(X @ W + b)`` in NumPy, in place in ``out``; returns ``out``."""
    np.matmul(X, W, out=out)
    out += b
    _activation_inplace(act, out)
    return out


def sgemm_reference(A, B, out, trans_a=False):
    """``out = op(A) @ B`` in NumPy; returns ``out``."""
    return np.matmul(A.T if trans_a else A, B, out=out)


def zero_skip_matmul_reference(X, W, out):
    """``out = X @ W`` in NumPy; returns ``out``."""
    return np.matmul(X, W, out=out)


def zero_skip_update_reference(W, X, D, alpha, W2=None):
    """``W += alpha * X.T @ D`` (and ``W2``) in NumPy."""
    G = np.float32(alpha) * (X.T @ D)
    W += G
    if W2 is not None:
        W2 += G


# --------------------------------------------------------------------------- public API

def fused_outer_adagrad(W, accum, A, E, lr, eps, threads=1, tile_m=512, tile_n=512):
    """Adagrad with the gradient ``A.T @ E``, computed and applied one tile at a time.

    Computes ``G = A.T @ E`` and applies ``accum += G*G; W -= lr*G / (sqrt(accum) + eps)``
    without ever holding all of ``G``: for each ``tile_m x tile_n`` tile of ``W``, the tile
    of ``G`` goes into a per-thread buffer (OpenBLAS sgemm) and is applied at once.

    Parameters
    ----------
    W : numpy.ndarray
        (M, N) float32 C-contiguous weights (inputs x outputs, as in ``x @ W``), updated.
    accum : numpy.ndarray
        (M, N) float32 C-contiguous sum of squared gradients, updated.
    A : numpy.ndarray
        (k, M) float32 C-contiguous activations of the layer's inputs, k examples.
    E : numpy.ndarray
        (k, N) float32 C-contiguous error terms of the layer's outputs (dLoss/dz).
    lr, eps : float
        Learning rate and Adagrad's epsilon; finite, ``eps >= 0``.
    threads : int, optional
        OpenMP threads over tiles (default 1: server ranks usually share cores).
    tile_m, tile_n : int, optional
        Tile of ``W``; the default 512x512 (1 MB of ``G``, in this CPU's L2) was faster than
        256x256 at every measured shape on a quiet machine (see ``bench/bench_gemm.py``).

    Raises
    ------
    ValueError
        If an array is not 2-D float32 C-contiguous, the shapes disagree, a written array is
        read-only or overlaps another operand, ``lr``/``eps`` are not finite, ``eps < 0``,
        or ``threads``/``tile_m``/``tile_n`` are not integers >= 1.
    """
    _check_matrix("W", W, writable=True)
    _check_matrix("accum", accum, writable=True)
    _check_matrix("A", A)
    _check_matrix("E", E)
    M, N = W.shape
    k = A.shape[0]
    if accum.shape != (M, N) or A.shape != (k, M) or E.shape != (k, N):
        raise ValueError(
            f"shape mismatch: W {W.shape} and accum {accum.shape} must be (M, N), A {A.shape} "
            f"(k, M) and E {E.shape} (k, N)"
        )
    _check_no_overlap([("W", W), ("accum", accum)], [("A", A), ("E", E)])
    lr = _check_scalar("lr", lr)
    eps = _check_scalar("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    threads = _check_positive_int("threads", threads)
    tile_m = _check_positive_int("tile_m", tile_m)
    tile_n = _check_positive_int("tile_n", tile_n)
    if _gemm is None:
        outer_adagrad_reference(W, accum, A, E, lr, eps)
    else:
        _blas.ensure()
        _gemm.fused_outer_adagrad(W, accum, A, E, lr, eps, threads, tile_m, tile_n)


def gemm_bias_act(X, W, b, act, out=None):
    """``out = act(X @ W + b)``: one sgemm, then bias and activation in place.

    Parameters
    ----------
    X : numpy.ndarray
        (B, K) float32 C-contiguous inputs.
    W : numpy.ndarray
        (K, N) float32 C-contiguous weights.
    b : numpy.ndarray
        (N,) float32 C-contiguous bias.
    act : str
        One of ``ACTIVATIONS``: ``"none"``, ``"relu"``, ``"tanh"``, ``"sigmoid"``.
    out : numpy.ndarray, optional
        (B, N) float32 C-contiguous output; allocated when None.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Raises
    ------
    ValueError
        On an unknown ``act``, an array that is not float32 C-contiguous of the right
        dimension, disagreeing shapes, or an ``out`` that is read-only or overlaps an input.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    _check_matrix("X", X)
    _check_matrix("W", W)
    _check_matrix("b", b, ndim=1)
    B, K = X.shape
    if W.shape[0] != K or b.shape != (W.shape[1],):
        raise ValueError(f"shape mismatch: X {X.shape} @ W {W.shape} + b {b.shape}")
    out = _out_matrix(out, (B, W.shape[1]), [("X", X), ("W", W), ("b", b)])
    if _gemm is None:
        return gemm_bias_act_reference(X, W, b, act, out)
    _blas.ensure()
    if act in _COMPILED_ACTS:
        _gemm.gemm_bias_act(X, W, b, act, out)
    else:
        _gemm.gemm_bias_act(X, W, b, "none", out)
        _activation_inplace(act, out)
    return out


def sgemm(A, B, out=None, trans_a=False):
    """``out = op(A) @ B`` in float32 through BLAS sgemm (OpenBLAS, or MKL: see
    ``hpcps.kernels.blas``), without the GIL.

    Parameters
    ----------
    A : numpy.ndarray
        float32 C-contiguous, (M, K), or (K, M) with ``trans_a`` (``X.T @ D`` without a copy).
    B : numpy.ndarray
        (K, N) float32 C-contiguous.
    out : numpy.ndarray, optional
        (M, N) float32 C-contiguous; allocated when None.
    trans_a : bool, optional
        Multiply by ``A.T`` instead of ``A``.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Raises
    ------
    ValueError
        On arrays that are not 2-D float32 C-contiguous, disagreeing shapes, or an ``out``
        that is read-only or overlaps an input.
    """
    _check_matrix("A", A)
    _check_matrix("B", B)
    trans_a = bool(trans_a)
    M, K = (A.shape[1], A.shape[0]) if trans_a else A.shape
    if B.shape[0] != K:
        raise ValueError(
            f"shape mismatch: {'A.T' if trans_a else 'A'} is ({M}, {K}), B is {B.shape}"
        )
    N = B.shape[1]
    out = _out_matrix(out, (M, N), [("A", A), ("B", B)])
    if _gemm is None:
        return sgemm_reference(A, B, out, trans_a)
    _blas.ensure()
    _gemm.sgemm_blas(A, B, out, trans_a)
    return out


def _zero_skip_isa(isa):
    """``isa`` checked (None: ``ZERO_SKIP_ISA``); None when the NumPy reference runs."""
    if isa is None:
        return ZERO_SKIP_ISA
    if isa not in ZERO_SKIP_ISAS:
        raise ValueError(f"isa {isa!r} is not available here; choose one of "
                         f"{ZERO_SKIP_ISAS} (this CPU's best: {ZERO_SKIP_CPU_ISA}, "
                         f"{ZERO_SKIP_ENV}={os.environ.get(ZERO_SKIP_ENV)!r})")
    return isa


def zero_skip_matmul(X, W, out=None, isa=None):
    """``out = X @ W``, skipping the inputs that are zero in a whole block of 4 rows of X.

    Parameters
    ----------
    X : numpy.ndarray
        (B, K) float32 C-contiguous, typically mostly zeros (a mini-batch of images).
    W : numpy.ndarray
        (K, N) float32 C-contiguous.
    out : numpy.ndarray, optional
        (B, N) float32 C-contiguous; allocated when None.
    isa : str, optional
        The kernels' instruction set, one of ``ZERO_SKIP_ISAS``; None: ``ZERO_SKIP_ISA``
        (the NumPy reference when that is None).

    Returns
    -------
    numpy.ndarray
        ``out``.

    Raises
    ------
    ValueError
        On arrays that are not 2-D float32 C-contiguous, disagreeing shapes, an ``out``
        that is read-only or overlaps an input, or an ``isa`` not in ``ZERO_SKIP_ISAS``.
    """
    _check_matrix("X", X)
    _check_matrix("W", W)
    B, K = X.shape
    if W.shape[0] != K:
        raise ValueError(f"shape mismatch: X {X.shape} @ W {W.shape}")
    out = _out_matrix(out, (B, W.shape[1]), [("X", X), ("W", W)])
    isa = _zero_skip_isa(isa)
    if isa is None:
        return zero_skip_matmul_reference(X, W, out)
    out[...] = 0.0
    _gemm.zero_skip_matmul(X, W, out, isa)
    return out


def zero_skip_update(W, X, D, alpha, W2=None, isa=None):
    """``W += alpha * X.T @ D`` (and the same into ``W2``), skipping, for each block of 4
    columns of X, the rows where all 4 are zero. The gradient is never formed.

    Parameters
    ----------
    W : numpy.ndarray
        (K, N) float32 C-contiguous, updated in place.
    X : numpy.ndarray
        (B, K) float32 C-contiguous inputs.
    D : numpy.ndarray
        (B, N) float32 C-contiguous error terms.
    alpha : float
        Scale, e.g. ``-lr``.
    W2 : numpy.ndarray, optional
        (K, N) float32, also updated (a replica's running delta).
    isa : str, optional
        As for :func:`zero_skip_matmul`.

    Raises
    ------
    ValueError
        On arrays that are not 2-D float32 C-contiguous, disagreeing shapes, a non-finite
        ``alpha``, a read-only ``W``/``W2`` or one that overlaps another array, or an
        ``isa`` not in ``ZERO_SKIP_ISAS``.
    """
    _check_matrix("W", W, writable=True)
    _check_matrix("X", X)
    _check_matrix("D", D)
    alpha = _check_scalar("alpha", alpha)
    B, K = X.shape
    if D.shape[0] != B or W.shape != (K, D.shape[1]):
        raise ValueError(f"shape mismatch: W {W.shape} += X.T {X.shape[::-1]} @ D {D.shape}")
    outs = [("W", W)]
    if W2 is not None:
        _check_matrix("W2", W2, writable=True)
        if W2.shape != W.shape:
            raise ValueError(f"W2 must have shape {W.shape}, got {W2.shape}")
        outs.append(("W2", W2))
    _check_no_overlap(outs, [("X", X), ("D", D)])
    isa = _zero_skip_isa(isa)
    if isa is None:
        zero_skip_update_reference(W, X, D, alpha, W2)
        return
    _gemm.zero_skip_update(X, D, alpha, W, W2, isa)
