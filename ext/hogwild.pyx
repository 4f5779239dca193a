# cython: cdivision=True, boundscheck=False, wraparound=False, initializedcheck=False
"""Hogwild training of an MLP inside one process: T threads, no GIL, no locks.

Every thread owns a training context (Project Adam, section 3.2.1): the activations of
each layer, two error buffers, a bias-gradient row and a full gradient scratch, allocated
once in ``__init__`` for the largest mini-batch; a training step allocates nothing. Each
thread gathers its own examples, runs forward and backward with ``sgemm`` from
``scipy.linalg.cython_blas`` (callable without the GIL) and writes its update straight
into the shared parameter vector, without a lock (section 3.2.2, and Niu et al.'s
Hogwild!). The races this allows, and why SGD tolerates them, are described in
``hpcps/engine/hogwild.py``.

BLAS is Fortran, column-major: a row-major (m, n) matrix is, to BLAS, its (n, m)
transpose. So a row-major product ``C = A @ B`` is computed as ``C^T = B^T @ A^T``, i.e.
``sgemm(N, N, n, m, k, B, A, C)`` with the operands swapped; every call below is written
with its row-major meaning next to it.

Without ``delta`` the weight-gradient GEMM accumulates straight into the shared weights
(``alpha = -lr``, ``beta = 1``): no gradient buffer and no separate update pass. With
``delta`` the gradient of a layer goes to the thread's scratch and one fused loop adds
``-lr * g`` to both the weights and ``delta``. Either way a layer's error is propagated
to the layer below before that layer's weights are updated, so one thread alone computes
exactly what sequential SGD computes.

Callers should use ``hpcps.engine.hogwild``, which checks shapes, dtypes, index and label
ranges and overlap before coming here; this module trusts its input.
"""
import numpy as np

from cython.parallel cimport prange
from libc.stdint cimport int64_t
from libc.string cimport memcpy
from libc.string cimport memset

from zero_skip cimport (HP_ISA_NONE, hp_plan, hp_zskip_floats, hp_zskip_forward,
                        hp_zskip_ints, hp_zskip_plan, hp_zskip_supported, hp_zskip_update)

include "layers.pxi"

cdef enum:
    MODE_GRAD = 0       # write the gradient to a caller's buffer, do not update
    MODE_FUSED = 1      # params -= lr * grad, inside the GEMM
    MODE_DELTA = 2      # params -= lr * grad and delta -= lr * grad, via scratch
    MODE_SUM = 3        # grad += sum over the examples of their gradients (no update)


cdef class HogwildEngine:
    """Per-thread contexts and the nogil training loop for one MLP shape.

    Parameters
    ----------
    sizes : sequence of int
        Layer widths, input first, as for ``hpcps.model.mlp.MLP``.
    activation : str
        ``relu``, ``tanh`` or ``sigmoid`` (hidden layers; the output is softmax).
    threads : int
        Number of training threads T; one context each.
    batch : int
        Largest mini-batch a context holds.
    sparse_below : float
        Skip zeros in the first layer of a mini-batch when that does at most this fraction
        of the dense work (0: never).
    isa : str, optional
        Instruction set of the zero-skipping kernels, ``"avx512"`` or ``"avx2"``; None
        (default) takes ``hpcps.kernels.gemm.ZERO_SKIP_ISA``, the best this CPU runs. With
        none available every layer uses BLAS.
    """

    cdef readonly int n_layers, threads, batch, n_params, act
    cdef int[::1] sz                 # layer widths
    cdef Py_ssize_t[::1] w_off       # offset of layer l's W in the flat vector
    cdef Py_ssize_t[::1] b_off       # offset of layer l's b
    cdef Py_ssize_t[::1] a_off       # offset of activation l in a context
    cdef Py_ssize_t d0_off, d1_off, gb_off, g_off
    cdef float[:, ::1] work          # (threads, context size): one row per thread
    cdef int64_t[:, ::1] labels      # (threads, batch)
    cdef double[::1] loss            # per-thread loss sum of the current call
    cdef int64_t[::1] seen           # per-thread example count of the current call
    # zero-skipping first layer (ext/zero_skip.h): per-thread scratch for its plan
    cdef readonly double sparse_below   # use it when the work left <= this (0: never)
    cdef int zs_isa                  # HP_ISA_* of the zero-skipping kernels (NONE: BLAS)
    cdef int[:, ::1] sp_int
    cdef float[:, ::1] sp_val
    cdef int64_t[::1] sparse_steps   # per thread: steps that took the zero-skipping path
    cdef int run_mode                # mode of the current train()/gradient_sum() call
    # operands of the current train() call, read by every thread
    cdef float *p_params
    cdef float *p_delta
    cdef const float *p_x
    cdef const int64_t *p_y
    cdef const int64_t *p_order
    cdef Py_ssize_t n_order, steps
    cdef float lr

    def __init__(self, sizes, str activation, int threads, int batch,
                 double sparse_below=0.0, isa=None):
        cdef Py_ssize_t l, off, widest
        sizes = [int(s) for s in sizes]
        self.n_layers = len(sizes) - 1
        self.threads = threads
        self.batch = batch
        self.act = ACTIVATIONS[activation]
        self.sz = np.asarray(sizes, dtype=np.intc)
        self.w_off = np.zeros(self.n_layers, dtype=np.intp)
        self.b_off = np.zeros(self.n_layers, dtype=np.intp)
        off = 0
        for l in range(self.n_layers):
            self.w_off[l] = off
            off += sizes[l] * sizes[l + 1]
            self.b_off[l] = off
            off += sizes[l + 1]
        self.n_params = off
        # context layout: acts[0..L] (B x width), d0, d1 (B x widest), gb (widest), g
        self.a_off = np.zeros(self.n_layers + 1, dtype=np.intp)
        off = 0
        for l in range(self.n_layers + 1):
            self.a_off[l] = off
            off += _aligned(batch * sizes[l])
        widest = max(sizes)
        self.d0_off = off
        off += _aligned(batch * widest)
        self.d1_off = off
        off += _aligned(batch * widest)
        self.gb_off = off
        off += _aligned(widest)
        self.g_off = off
        off += _aligned(self.n_params)
        # One allocation for all threads; rows are padded so no two threads' contexts
        # share a cache line (false sharing would cost more than the padding).
        self.work = np.zeros((threads, off), dtype=np.float32)
        self.labels = np.zeros((threads, batch), dtype=np.int64)
        self.loss = np.zeros(threads, dtype=np.float64)
        self.seen = np.zeros(threads, dtype=np.int64)
        self.sparse_below = sparse_below
        self.sparse_steps = np.zeros(threads, dtype=np.int64)
        from hpcps.kernels import gemm as kernels_gemm   # the ISA names and the choice
        if isa is None:
            isa = kernels_gemm.ZERO_SKIP_ISA
        if isa is None:
            self.zs_isa = HP_ISA_NONE
        else:
            if isa not in kernels_gemm.ZERO_SKIP_ISA_CODES:
                raise ValueError(f"unknown instruction set {isa!r}")
            self.zs_isa = kernels_gemm.ZERO_SKIP_ISA_CODES[isa]
            if not hp_zskip_supported(self.zs_isa):
                raise ValueError(f"this CPU cannot run the {isa} zero-skipping kernels")
        if self.zs_isa == HP_ISA_NONE:   # no kernels for this CPU: BLAS for every layer
            self.sparse_below = 0.0
        if self.sparse_below > 0.0:
            self.sp_int = np.zeros((threads, hp_zskip_ints(batch, sizes[0])), dtype=np.intc)
            self.sp_val = np.zeros((threads, hp_zskip_floats(batch, sizes[0])),
                                   dtype=np.float32)

    # -- one mini-batch, one thread ------------------------------------------------------
    cdef void _step(self, int t, float *params, const float *x, const int64_t *y,
                    const int64_t *rows, int nb, float lr, float *grad, float *delta,
                    int mode) noexcept nogil:
        """Forward and backward over ``nb`` examples (rows of x/y, or x/y themselves when
        ``rows`` is NULL) in thread t's context, then the update ``mode`` asks for."""
        cdef float *ctx = &self.work[t, 0]
        cdef int64_t *lab = &self.labels[t, 0]
        cdef int L = self.n_layers
        cdef int l, r, j, n_in, n_out
        cdef Py_ssize_t i, n, k
        cdef float *a
        cdef float *z
        cdef float *d
        cdef float *dp
        cdef float *W
        cdef float *b
        cdef float *gW
        cdef float *gb = ctx + self.gb_off
        cdef float *dl
        cdef float u, inv_nb = 1.0 / nb
        cdef double loss = 0.0
        cdef hp_plan plan
        cdef bint sparse = False, skip

        if mode == MODE_SUM:
            inv_nb = 1.0    # sums over the examples, not means

        # gather the examples into the context (they become acts[0])
        n_in = self.sz[0]
        a = ctx + self.a_off[0]
        for r in range(nb):
            k = rows[r] if rows != NULL else r
            memcpy(a + <Py_ssize_t> r * n_in, x + k * n_in, n_in * sizeof(float))
            lab[r] = y[k]
        if self.sparse_below > 0.0:
            # list the zeros of the batch; skip them in the first layer if that saves enough
            sparse = hp_zskip_plan(&plan, self.zs_isa, nb, n_in, a, &self.sp_int[t, 0],
                                   &self.sp_val[t, 0]) <= self.sparse_below
            if sparse:
                self.sparse_steps[t] += 1

        # forward: z = act(a @ W + b)
        for l in range(L):
            n_in = self.sz[l]
            n_out = self.sz[l + 1]
            a = ctx + self.a_off[l]
            z = ctx + self.a_off[l + 1]
            W = params + self.w_off[l]
            b = params + self.b_off[l]
            for r in range(nb):
                memcpy(z + <Py_ssize_t> r * n_out, b, n_out * sizeof(float))
            if l == 0 and sparse:
                hp_zskip_forward(&plan, n_out, W, z)
            else:
                _gemm(b'N', b'N', n_out, nb, n_in, 1.0, W, n_out, a, n_in, 1.0, z, n_out)
            if l < L - 1:
                _activate(self.act, z, <Py_ssize_t> nb * n_out)

        # softmax cross-entropy; the logits buffer becomes the output error (p - 1_y) / nb
        n_out = self.sz[L]
        z = ctx + self.a_off[L]
        loss = _softmax_xent(z, lab, nb, n_out, inv_nb)

        # backward
        d = z
        for l in range(L - 1, -1, -1):
            n_in = self.sz[l]
            n_out = self.sz[l + 1]
            a = ctx + self.a_off[l]
            W = params + self.w_off[l]
            b = params + self.b_off[l]
            if l > 0:
                # error of the layer below, with the weights this step's forward used:
                # dp = (d @ W^T) * act'(a)
                dp = ctx + (self.d0_off if (L - 1 - l) % 2 == 0 else self.d1_off)
                _gemm(b'T', b'N', n_in, nb, n_out, 1.0, W, n_out, d, n_out, 0.0, dp, n_in)
                _act_grad(self.act, a, dp, <Py_ssize_t> nb * n_in)
            # bias gradient: column sums of d
            for j in range(n_out):
                gb[j] = 0.0
            for r in range(nb):
                dl = d + <Py_ssize_t> r * n_out
                for j in range(n_out):
                    gb[j] = gb[j] + dl[j]
            # weight gradient a^T @ d, (n_in, n_out), and the update; in the first layer
            # of a sparse batch the zero-skipping kernel replaces the GEMM
            n = <Py_ssize_t> n_in * n_out
            skip = l == 0 and sparse
            if mode == MODE_FUSED:
                if skip:
                    hp_zskip_update(&plan, n_out, d, -lr, W, NULL)
                else:
                    _gemm(b'N', b'T', n_out, n_in, nb, -lr, d, n_out, a, n_in, 1.0, W, n_out)
                for j in range(n_out):
                    b[j] = b[j] - lr * gb[j]
            elif mode == MODE_GRAD or mode == MODE_SUM:
                gW = grad + self.w_off[l]
                if skip:
                    if mode == MODE_GRAD:
                        memset(gW, 0, n * sizeof(float))
                    hp_zskip_update(&plan, n_out, d, 1.0, gW, NULL)
                else:
                    _gemm(b'N', b'T', n_out, n_in, nb, 1.0, d, n_out, a, n_in,
                          0.0 if mode == MODE_GRAD else 1.0, gW, n_out)
                dl = grad + self.b_off[l]
                if mode == MODE_GRAD:
                    memcpy(dl, gb, n_out * sizeof(float))
                else:
                    for j in range(n_out):
                        dl[j] = dl[j] + gb[j]
            else:
                dl = delta + self.w_off[l]
                if skip:
                    hp_zskip_update(&plan, n_out, d, -lr, W, dl)
                else:
                    gW = ctx + self.g_off
                    _gemm(b'N', b'T', n_out, n_in, nb, 1.0, d, n_out, a, n_in, 0.0, gW,
                          n_out)
                    for i in range(n):
                        u = -lr * gW[i]
                        W[i] = W[i] + u
                        dl[i] = dl[i] + u
                dl = delta + self.b_off[l]
                for j in range(n_out):
                    u = -lr * gb[j]
                    b[j] = b[j] + u
                    dl[j] = dl[j] + u
            if l > 0:
                d = dp
        self.loss[t] += loss

    # -- one thread's share of a train() call --------------------------------------------
    cdef void _run(self, int t) noexcept nogil:
        """Thread t's part of the order: [lo, hi), in mini-batches of ``batch``."""
        cdef Py_ssize_t lo, hi, pos
        cdef int nb
        cdef int mode = self.run_mode
        cdef float *grad = NULL
        if mode == MODE_SUM:   # each thread sums into its own scratch, added up after
            grad = &self.work[t, 0] + self.g_off
            memset(grad, 0, self.n_params * sizeof(float))
        lo = _share(t, self.threads, self.steps, self.batch, self.n_order, &hi)
        self.loss[t] = 0.0
        self.seen[t] = hi - lo
        pos = lo
        while pos < hi:
            nb = <int> (self.batch if hi - pos > self.batch else hi - pos)
            self._step(t, self.p_params, self.p_x, self.p_y, self.p_order + pos, nb,
                       self.lr, grad, self.p_delta, mode)
            pos += nb

    def _thread_main(self, int t):
        with nogil:
            self._run(t)

    def train(self, float[::1] params, const float[:, ::1] x, const int64_t[::1] y,
              const int64_t[::1] order, float lr, Py_ssize_t steps_per_thread,
              float[::1] delta, str backend):
        """Run the T threads once over ``order``; return (loss_sum, examples).

        ``steps_per_thread > 0``: thread t takes ``steps_per_thread`` mini-batches from
        ``order[t*S*B : (t+1)*S*B]``; ``0``: the order is split evenly into T parts, each
        walked in mini-batches (the last one may be smaller). ``delta`` may be None.
        ``backend`` is ``threads`` (Python threads, each entering nogil code) or
        ``openmp`` (one ``prange`` over the threads).
        """
        self.p_params = &params[0]
        self.p_delta = &delta[0] if delta is not None else NULL
        self.p_x = &x[0, 0]
        self.p_y = &y[0]
        self.p_order = &order[0] if order.shape[0] > 0 else NULL
        self.n_order = order.shape[0]
        self.steps = steps_per_thread
        self.lr = lr
        self.run_mode = MODE_DELTA if delta is not None else MODE_FUSED
        if order.shape[0] == 0:
            return 0.0, 0
        self._launch(backend)
        self.p_params = NULL
        self.p_delta = NULL
        return float(np.sum(self.loss)), int(np.sum(self.seen))

    def gradient_sum(self, const float[::1] params, const float[:, ::1] x,
                     const int64_t[::1] y, const int64_t[::1] order, float[::1] grad,
                     str backend):
        """Sum over the examples ``order`` of their loss and gradient, with T threads.

        The order is split evenly into T parts; thread t walks its part in mini-batches
        of ``batch`` and sums their gradients into its own scratch; the T sums are then
        added into ``grad`` (overwritten) in thread order. Nothing is updated, so the
        result does not depend on timing: the same T and batch give the same bits.
        Returns (loss_sum, examples).
        """
        cdef int t, T = self.threads
        cdef Py_ssize_t n = self.n_params
        self.p_params = <float *> &params[0]
        self.p_delta = NULL
        self.p_x = &x[0, 0]
        self.p_y = &y[0]
        self.p_order = &order[0] if order.shape[0] > 0 else NULL
        self.n_order = order.shape[0]
        self.steps = 0
        self.lr = 0.0
        self.run_mode = MODE_SUM
        grad[:] = 0.0
        if order.shape[0] == 0:
            return 0.0, 0
        self._launch(backend)
        self.p_params = NULL
        acc = np.asarray(grad)
        for t in range(T):
            if self.seen[t] > 0:
                acc += np.asarray(self.work[t, self.g_off:self.g_off + n])
        return float(np.sum(self.loss)), int(np.sum(self.seen))

    def _launch(self, str backend):
        cdef int t, T = self.threads
        if T == 1:
            with nogil:
                self._run(0)
        elif backend == "openmp":
            for t in prange(T, nogil=True, num_threads=T, schedule="static", chunksize=1):
                self._run(t)
        else:
            _on_threads(self._thread_main, T)

    def sparse_step_count(self):
        """Steps, over all threads and calls so far, whose first layer used the nonzeros."""
        return int(np.sum(self.sparse_steps))

    @property
    def zero_skip_isa(self):
        """``"avx512"`` or ``"avx2"``: the zero-skipping kernels' instruction set; None
        when the first layer always uses BLAS."""
        if self.sparse_below <= 0.0:
            return None
        from hpcps.kernels import gemm as kernels_gemm
        return {c: n for n, c in kernels_gemm.ZERO_SKIP_ISA_CODES.items()}[self.zs_isa]

    def loss_and_grad(self, const float[::1] params, const float[:, ::1] x,
                      const int64_t[::1] y, float[::1] grad):
        """Mean loss over all rows of x (at most ``batch``) and its gradient, in context 0."""
        cdef int nb = x.shape[0]
        self.loss[0] = 0.0
        with nogil:
            self._step(0, <float *> &params[0], &x[0, 0], &y[0], NULL, nb, 0.0,
                       &grad[0], NULL, MODE_GRAD)
        return self.loss[0] / nb
