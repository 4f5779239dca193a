# cython: cdivision=True, boundscheck=False, wraparound=False, initializedcheck=False
"""float32 matrix-multiply kernels for the layers and the parameter-server shards, without the GIL.

Three things live here (see ``hpcps.kernels.gemm`` for the measured figures and which of
them the public API uses):

``fused_outer_adagrad``
    Project Adam's server-side update for a fully connected layer: the worker sends the
    activations ``A`` (k, M) and the error terms ``E`` (k, N); the shard forms
    ``G = A^T E`` tile by tile into a small per-thread buffer (through OpenBLAS's sgemm
    from ``scipy.linalg.cython_blas``, callable without the GIL) and applies Adagrad to
    that tile of ``W``/``accum`` at once, while the tile is still in L1/L2. The M*N
    gradient is never written to memory, which is what the two-step version pays for.
``gemm_bias_act``
    ``out = act(X @ W + b)``: sgemm into ``out`` in row blocks, then bias and activation
    over each block while it is still in cache.
``sgemm_blas``
    ``op(A) @ B`` through the same sgemm, for the forward and weight-gradient layouts.
``zero_skip_matmul``, ``zero_skip_update``
    The Hogwild engine's first-layer products from ``ext/zero_skip.h`` (AVX-512F or AVX2 +
    FMA, as the caller asks and the CPU allows), which skip inputs that are zero in a whole
    4-row (4-column) block, exposed for tests and ``bench/bench_gemm.py``.

A packed, cache-blocked sgemm in Cython alone was measured here and removed: it reached
12-18% of OpenBLAS at every training shape (figures in ``hpcps.kernels.gemm``).

OpenBLAS may start its own threads inside sgemm; the callers (server ranks) run with
``OPENBLAS_NUM_THREADS=1`` (``hpcps.train`` sets it), and ``threads`` here are OpenMP
threads over tiles. Input is checked by ``hpcps.kernels.gemm``; these functions repeat
only the shape checks that memory safety needs.
"""
import numpy as np

from cython.parallel cimport prange, parallel
from libc.math cimport sqrtf, tanhf, expf
from libc.stdlib cimport malloc, free
from libc.string cimport memset

include "sgemm_ptr.pxi"


cdef enum:
    ACT_NONE = 0
    ACT_RELU = 1
    ACT_TANH = 2
    ACT_SIGMOID = 3

_ACTS = {"none": ACT_NONE, "relu": ACT_RELU, "tanh": ACT_TANH, "sigmoid": ACT_SIGMOID}


cdef inline void _sgemm_rm(bint trans_a, bint trans_b, int m, int n, int k, float alpha,
                           const float* a, int lda, const float* b, int ldb, float beta,
                           float* c, int ldc) noexcept nogil:
    """Row-major ``C(m,n) = alpha * op(A)(m,k) @ op(B)(k,n) + beta * C`` through Fortran sgemm.

    A row-major matrix is its transpose in column-major order, so row-major
    ``C = op(A) op(B)`` is column-major ``C^T = op(B)^T op(A)^T``: swap the operands and
    the sizes, keep the transpose flags.
    """
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    _f_sgemm(&tb, &ta, &n, &m, &k, &alpha, <float*>b, &ldb, <float*>a, &lda, &beta, c, &ldc)


# ---------------------------------------------------------------------------------------
# fused outer product + Adagrad
# ---------------------------------------------------------------------------------------

cdef void _outer_adagrad_tile(float* W, float* accum, const float* A, const float* E,
                              int M, int N, int k, int i0, int j0, int mb, int nb,
                              float lr, float eps, float* buf) noexcept nogil:
    cdef int i, j
    cdef float g, acc
    cdef float* wrow
    cdef float* arow
    cdef float* grow
    if k > 0:
        # buf(mb, nb) = A[:, i0:i0+mb]^T @ E[:, j0:j0+nb]
        _sgemm_rm(True, False, mb, nb, k, 1.0, A + i0, M, E + j0, N, 0.0, buf, nb)
    else:
        memset(buf, 0, mb * nb * sizeof(float))
    for i in range(mb):
        wrow = W + <Py_ssize_t>(i0 + i) * N + j0
        arow = accum + <Py_ssize_t>(i0 + i) * N + j0
        grow = buf + i * nb
        for j in range(nb):
            g = grow[j]
            acc = arow[j] + g * g
            arow[j] = acc
            wrow[j] = wrow[j] - lr * g / (sqrtf(acc) + eps)


def fused_outer_adagrad(float[:, ::1] W, float[:, ::1] accum, const float[:, ::1] A,
                        const float[:, ::1] E, float lr, float eps, int threads=1,
                        int tile_m=512, int tile_n=512):
    """``G = A.T @ E`` tile by tile, each tile applied at once: ``accum += G*G;
    W -= lr*G / (sqrt(accum) + eps)``. See ``hpcps.kernels.gemm.fused_outer_adagrad``.
    """
    cdef int M = W.shape[0], N = W.shape[1], k = A.shape[0]
    if (accum.shape[0] != M or accum.shape[1] != N or A.shape[1] != M
            or E.shape[0] != k or E.shape[1] != N):
        raise ValueError("shape mismatch")
    if threads < 1 or tile_m < 1 or tile_n < 1:
        raise ValueError("threads, tile_m and tile_n must be >= 1")
    if M == 0 or N == 0:
        return
    tile_m = min(tile_m, M)
    tile_n = min(tile_n, N)
    cdef int tm = (M + tile_m - 1) // tile_m
    cdef int tn = (N + tile_n - 1) // tile_n
    cdef int ntiles = tm * tn
    cdef int t, i0, j0, mb, nb
    cdef int failed[1]
    failed[0] = 0
    cdef float* buf
    cdef float* pW = &W[0, 0]
    cdef float* pacc = &accum[0, 0]
    cdef const float* pA = &A[0, 0] if k > 0 else NULL
    cdef const float* pE = &E[0, 0] if k > 0 else NULL
    cdef size_t bufsize = <size_t>tile_m * tile_n * sizeof(float)
    if threads == 1 or ntiles == 1:
        buf = <float*>malloc(bufsize)
        if buf == NULL:
            raise MemoryError()
        with nogil:
            for t in range(ntiles):
                i0 = (t // tn) * tile_m
                j0 = (t % tn) * tile_n
                mb = min(tile_m, M - i0)
                nb = min(tile_n, N - j0)
                _outer_adagrad_tile(pW, pacc, pA, pE, M, N, k, i0, j0, mb, nb, lr, eps, buf)
        free(buf)
    else:
        with nogil, parallel(num_threads=threads):
            buf = <float*>malloc(bufsize)
            if buf == NULL:
                failed[0] = 1
            else:
                # Tiles are disjoint, so threads never write the same element.
                for t in prange(ntiles, schedule='dynamic'):
                    i0 = (t // tn) * tile_m
                    j0 = (t % tn) * tile_n
                    mb = min(tile_m, M - i0)
                    nb = min(tile_n, N - j0)
                    _outer_adagrad_tile(pW, pacc, pA, pE, M, N, k, i0, j0, mb, nb,
                                        lr, eps, buf)
                free(buf)
        if failed[0]:
            raise MemoryError()


# ---------------------------------------------------------------------------------------
# GEMM + bias + activation
# ---------------------------------------------------------------------------------------

cdef void _bias_act_rows(float* out, const float* b, int rows, int N, int act) noexcept nogil:
    cdef int i, j
    cdef float* row
    cdef float z
    for i in range(rows):
        row = out + <Py_ssize_t>i * N
        if act == ACT_RELU:
            for j in range(N):
                z = row[j] + b[j]
                row[j] = z if z > 0.0 else 0.0
        elif act == ACT_TANH:
            for j in range(N):
                row[j] = tanhf(row[j] + b[j])
        elif act == ACT_SIGMOID:
            for j in range(N):
                row[j] = 1.0 / (1.0 + expf(-(row[j] + b[j])))
        else:
            for j in range(N):
                row[j] = row[j] + b[j]


def gemm_bias_act(const float[:, ::1] X, const float[:, ::1] W, const float[::1] b,
                  str act, float[:, ::1] out, int block_rows=0):
    """``out = act(X @ W + b)``, fused: sgemm in row blocks, bias and activation per block.

    ``block_rows <= 0`` does the whole product in one sgemm call, then one pass.
    See ``hpcps.kernels.gemm.gemm_bias_act``.
    """
    cdef int B = X.shape[0], K = X.shape[1], N = W.shape[1]
    if W.shape[0] != K or b.shape[0] != N or out.shape[0] != B or out.shape[1] != N:
        raise ValueError("shape mismatch")
    if act not in _ACTS:
        raise ValueError(f"unknown activation {act!r}")
    cdef int code = _ACTS[act]
    if B == 0 or N == 0:
        return
    cdef int r0, rb
    cdef int step = B if block_rows <= 0 else min(block_rows, B)
    cdef const float* pX = &X[0, 0] if K > 0 else NULL
    cdef const float* pW = &W[0, 0] if K > 0 else NULL
    cdef float* pout = &out[0, 0]
    with nogil:
        r0 = 0
        while r0 < B:
            rb = min(step, B - r0)
            if K > 0:
                _sgemm_rm(False, False, rb, N, K, 1.0, pX + <Py_ssize_t>r0 * K, K, pW, N,
                          0.0, pout + <Py_ssize_t>r0 * N, N)
            else:
                memset(pout + <Py_ssize_t>r0 * N, 0, <size_t>rb * N * sizeof(float))
            _bias_act_rows(pout + <Py_ssize_t>r0 * N, &b[0], rb, N, code)
            r0 += rb


def sgemm_blas(const float[:, ::1] A, const float[:, ::1] B, float[:, ::1] out,
               bint trans_a=False, bint trans_b=False, float alpha=1.0, float beta=0.0):
    """``out = alpha * op(A) @ op(B) + beta * out`` through the kernels' sgemm, without the GIL.

    ``op(A)`` is ``A`` (M, K) or, with ``trans_a``, ``A.T`` for ``A`` stored (K, M); ``op(B)``
    is ``B`` (K, N) or, with ``trans_b``, ``B.T`` for ``B`` stored (N, K).
    """
    cdef int M = A.shape[1] if trans_a else A.shape[0]
    cdef int K = A.shape[0] if trans_a else A.shape[1]
    cdef int N = B.shape[0] if trans_b else B.shape[1]
    if (B.shape[1] if trans_b else B.shape[0]) != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("shape mismatch")
    if M == 0 or N == 0:
        return
    if K == 0:   # an empty sum: out = beta * out (0, not NaN * 0, when beta is 0)
        if beta == 0.0:
            out[:, :] = 0
        else:
            np.asarray(out)[...] *= beta
        return
    cdef int lda = A.shape[1], ldb = B.shape[1]
    with nogil:
        _sgemm_rm(trans_a, trans_b, M, N, K, alpha, &A[0, 0], lda, &B[0, 0], ldb, beta,
                  &out[0, 0], N)


# -- zero skipping (ext/zero_skip.h; the Hogwild engine's first layer) ---------------------
from zero_skip cimport (HP_ISA_AVX2, HP_ISA_AVX512, hp_plan, hp_zskip_cpu_isa,
                        hp_zskip_floats, hp_zskip_forward, hp_zskip_ints, hp_zskip_plan,
                        hp_zskip_supported, hp_zskip_update)

# the kernels' instruction sets by name, in increasing order
ZERO_SKIP_ISAS = {"avx2": HP_ISA_AVX2, "avx512": HP_ISA_AVX512}


def zero_skip_cpu_isa():
    """The best instruction set this CPU runs the zero-skipping kernels with: ``"avx512"``
    (AVX-512F), ``"avx2"`` (AVX2 and FMA) or None."""
    cdef int isa = hp_zskip_cpu_isa()
    for name, code in ZERO_SKIP_ISAS.items():
        if code == isa:
            return name
    return None


cdef int _isa_code(str isa) except -1:
    code = ZERO_SKIP_ISAS.get(isa)
    if code is None:
        raise ValueError(f"unknown instruction set {isa!r}; one of {tuple(ZERO_SKIP_ISAS)}")
    if not hp_zskip_supported(code):
        raise RuntimeError(f"this CPU cannot run the {isa} zero-skipping kernels "
                           f"(best: {zero_skip_cpu_isa()})")
    return code


def zero_skip_matmul(const float[:, ::1] X, const float[:, ::1] W, float[:, ::1] Z,
                     str isa):
    """``Z += X @ W`` visiting only the inputs nonzero in each block of 4 rows of X, with
    the ``isa`` kernels. Returns the fraction of the dense product's work done."""
    cdef int nb = X.shape[0], n_in = X.shape[1], n = W.shape[1]
    cdef hp_plan plan
    cdef double frac
    if W.shape[0] != n_in or Z.shape[0] != nb or Z.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef int code = _isa_code(isa)
    if nb == 0 or n_in == 0 or n == 0:
        return 0.0
    cdef int[::1] iscr = np.zeros(hp_zskip_ints(nb, n_in), dtype=np.intc)
    cdef float[::1] fscr = np.zeros(hp_zskip_floats(nb, n_in), dtype=np.float32)
    with nogil:
        frac = hp_zskip_plan(&plan, code, nb, n_in, &X[0, 0], &iscr[0], &fscr[0])
        hp_zskip_forward(&plan, n, &W[0, 0], &Z[0, 0])
    return frac


def zero_skip_update(const float[:, ::1] X, const float[:, ::1] D, float alpha,
                     float[:, ::1] W, W2, str isa):
    """``W += alpha * X.T @ D`` (and ``W2`` too, when not None) visiting only the rows
    nonzero in each block of 4 columns of X, with the ``isa`` kernels."""
    cdef int nb = X.shape[0], n_in = X.shape[1], n = D.shape[1]
    cdef hp_plan plan
    cdef float[:, ::1] w2
    cdef float *p2 = NULL
    if D.shape[0] != nb or W.shape[0] != n_in or W.shape[1] != n:
        raise ValueError("shape mismatch")
    if W2 is not None:
        w2 = W2
        if w2.shape[0] != n_in or w2.shape[1] != n:
            raise ValueError("shape mismatch")
    cdef int code = _isa_code(isa)
    if nb == 0 or n_in == 0 or n == 0:
        return
    if W2 is not None:
        p2 = &w2[0, 0]
    cdef int[::1] iscr = np.zeros(hp_zskip_ints(nb, n_in), dtype=np.intc)
    cdef float[::1] fscr = np.zeros(hp_zskip_floats(nb, n_in), dtype=np.float32)
    with nogil:
        hp_zskip_plan(&plan, code, nb, n_in, &X[0, 0], &iscr[0], &fscr[0])
        hp_zskip_update(&plan, n, &D[0, 0], alpha, &W[0, 0], p2)
