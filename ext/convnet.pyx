# cython: cdivision=True, boundscheck=False, wraparound=False, initializedcheck=False
"""Hogwild training of a convolutional network inside one process: T threads, no GIL.

The compiled counterpart of ``hpcps.model.convnet.ConvNet`` (the NumPy reference, which the tests
compare it with): the same layers (convolution with any kernel, stride and padding, max-pooling,
flatten, fully connected, softmax cross-entropy), the same parameter layout (conv kernels
``(out, in, kh, kw)``, fc weights ``(fan_in, fan_out)``) and the same arithmetic on NHWC
activations, with the mini-batch loop, the layers and the update in nogil code. As in
``ext/hogwild.pyx`` every thread owns a context allocated once (activations, pooling argmax,
error buffers, im2col scratch and a gradient), gathers its own examples and adds its update
into the shared parameter vector without a lock.

A convolution is im2col and one ``sgemm``, done a few examples at a time: each chunk's window
matrix (``CHUNK_FLOATS`` floats at most, so it stays in the core's L2 cache) is built, multiplied
and, in the backward pass, built again rather than kept: the two copies cost less than a
whole-batch window matrix that streams through memory. Window columns are ordered
(in map, kernel row, kernel column), the order of the stored kernel's last three axes, so the
kernel matrix is the parameter vector itself, used transposed, with no copy.

BLAS is column-major: a row-major product ``C = A @ B`` is ``sgemm(N, N, n, m, k, B, A, C)``
with the operands swapped; each call below has its row-major meaning beside it.

Dropout (op column ``O_DROP``, a hidden fc layer's 24-bit threshold) follows
``hpcps.model.convnet.dropout_scale`` exactly: each thread has a key and a draw counter, a unit's
fate is SplitMix64's output function of (key, draw, layer, example row, unit), and the dropped
and scaled outputs go to a buffer of their own (``O_DOUT``) that the next layer reads, so the
backward pass still has the activations themselves.

A step computes the mini-batch's whole gradient at the weights it read, then adds ``-lr * g``
to the parameters (and to ``delta``): the update rule of ``hpcps.engine.conv_hogwild``'s NumPy path,
so one thread alone computes what sequential SGD computes.

Callers use ``hpcps.engine.conv_hogwild``, which checks shapes, dtypes and labels; this module trusts
its input.
"""
import numpy as np

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset

include "layers.pxi"

cdef enum:
    CHUNK_FLOATS = 65536        # largest im2col chunk (256 KiB), but at least one example

cdef enum:
    K_CONV = 0
    K_POOL = 1
    K_FLAT = 2
    K_FC = 3
    K_EXCH = 4      # a partition's exchange point: its output is the whole input of the next
                    # layer, written by the caller between part_forward calls

cdef enum:
    MODE_GRAD = 0       # the mean gradient into the caller's buffer, no update
    MODE_STEP = 1       # params -= lr * mean gradient (and delta -= the same)
    MODE_SUM = 2        # the thread's sum += sum over the examples of their gradients

# columns of the op table
cdef enum:
    O_KIND = 0
    O_C = 1             # input maps (fc: input units)
    O_H = 2
    O_W = 3
    O_OC = 4            # output maps (fc: units)
    O_OH = 5
    O_OW = 6
    O_KH = 7
    O_KW = 8
    O_S = 9             # stride
    O_P = 10            # padding
    O_WOFF = 11         # offset of W in the parameter vector (-1: none)
    O_BOFF = 12
    O_ACT = 13          # 1: the activation follows this op
    O_DX = 14           # 1: the error at this op's input is needed
    O_OUT = 15          # offset of the op's output in a context
    O_ARG = 16          # pool: offset of its argmax in the int context
    O_CHUNK = 17        # conv: examples per im2col chunk
    O_WT = 18           # conv: offset of its kernel snapshot (OC x KH*KW*C) in a context
    O_DROP = 19         # fc: dropout threshold of its outputs (24 bits; 0: none)
    O_LAYER = 20        # fc: its parameter layer's index (the dropout masks' layer)
    O_DOUT = 21         # fc with dropout: offset of its dropped outputs in a context
    O_ULO = 22          # fc: index of its first unit in the whole layer (a partition's slice)
    O_UALL = 23         # fc: units of the whole layer (the dropout masks' row length)
    N_COLS = 24

cdef enum:
    DROP_SHIFT = 40     # 64 - hpcps.model.convnet.DROP_BITS


cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    """SplitMix64's output function (hpcps.model.convnet._mix)."""
    z = (z ^ (z >> 30)) * <uint64_t> 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t> 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef void _drop(float *z, float *out, int nb, int n, int width, int lo, uint64_t key,
                int64_t draw, int64_t layer, uint64_t thresh, float scale) noexcept nogil:
    """out = z * mask (nb x n), or z *= mask in place when out is z: the masks of
    hpcps.model.convnet.dropout_scale(p, key, draw, layer, nb, width, lo, lo + n) (units
    lo .. lo+n-1 of a layer of ``width``: a partition's slice, or the whole layer)."""
    cdef uint64_t golden = <uint64_t> 0x9E3779B97F4A7C15ULL
    cdef uint64_t base = _mix64(key + golden * (<uint64_t> draw * 256 + <uint64_t> layer + 1))
    cdef Py_ssize_t r, j, i
    for r in range(nb):
        for j in range(n):
            i = <Py_ssize_t> r * n + j
            if (_mix64(base + golden * <uint64_t> (<Py_ssize_t> r * width + lo + j + 1))
                    >> DROP_SHIFT) >= thresh:
                out[i] = z[i] * scale
            else:
                out[i] = 0.0

cdef void _im2col(const float *a, int nb, int C, int H, int W, int OH, int OW, int KH,
                  int KW, int S, int P, float *cols) noexcept nogil:
    """cols[(r*OH + oh)*OW + ow, (i*KW + j)*C + c] = a[r, oh*S + i - P, ow*S + j - P, c]
    (zero outside the image); a is NHWC, so a window row's KW*C values are contiguous."""
    cdef int r, oh, ow, i, h, w0, lo, hi
    cdef Py_ssize_t K = <Py_ssize_t> KH * KW * C, rowlen = <Py_ssize_t> KW * C
    cdef float *dst
    for r in range(nb):
        for oh in range(OH):
            for ow in range(OW):
                dst = cols + ((<Py_ssize_t> r * OH + oh) * OW + ow) * K
                w0 = ow * S - P
                lo = -w0 if w0 < 0 else 0                 # first j inside the image
                hi = W - w0 if W - w0 < KW else KW        # one past the last
                for i in range(KH):
                    h = oh * S + i - P
                    if h < 0 or h >= H or lo >= hi:
                        memset(dst, 0, rowlen * sizeof(float))
                    else:
                        if lo > 0:
                            memset(dst, 0, <Py_ssize_t> lo * C * sizeof(float))
                        memcpy(dst + <Py_ssize_t> lo * C,
                               a + ((<Py_ssize_t> r * H + h) * W + w0 + lo) * C,
                               <Py_ssize_t> (hi - lo) * C * sizeof(float))
                        if hi < KW:
                            memset(dst + <Py_ssize_t> hi * C, 0,
                                   <Py_ssize_t> (KW - hi) * C * sizeof(float))
                    dst += rowlen


cdef void _col2im(const float *cols, int nb, int C, int H, int W, int OH, int OW, int KH,
                  int KW, int S, int P, float *dx) noexcept nogil:
    """dx[r, h, w, c] += every window value that came from there (dx NHWC, not cleared)."""
    cdef int r, oh, ow, i, h, w0, lo, hi
    cdef Py_ssize_t K = <Py_ssize_t> KH * KW * C, rowlen = <Py_ssize_t> KW * C, q, n
    cdef const float *src
    cdef float *dst
    for r in range(nb):
        for oh in range(OH):
            for ow in range(OW):
                src = cols + ((<Py_ssize_t> r * OH + oh) * OW + ow) * K
                w0 = ow * S - P
                lo = -w0 if w0 < 0 else 0
                hi = W - w0 if W - w0 < KW else KW
                for i in range(KH):
                    h = oh * S + i - P
                    if h >= 0 and h < H and lo < hi:
                        dst = dx + ((<Py_ssize_t> r * H + h) * W + w0 + lo) * C
                        n = <Py_ssize_t> (hi - lo) * C
                        for q in range(n):
                            dst[q] += src[<Py_ssize_t> lo * C + q]
                    src += rowlen


cdef void _kernel_to_windows(const float *Wp, int OC, int C, int KK, float *Wt) noexcept nogil:
    """Wt[o, k*C + c] = W[o, c, k] (k = i*KW + j): the stored (out, in, kh, kw) kernels in the
    windows' column order."""
    cdef int o, c, k
    for o in range(OC):
        for c in range(C):
            for k in range(KK):
                Wt[(<Py_ssize_t> o * KK + k) * C + c] = Wp[(<Py_ssize_t> o * C + c) * KK + k]


cdef void _windows_to_kernel(const float *Gt, int OC, int C, int KK, float *G) noexcept nogil:
    """The inverse of _kernel_to_windows (a kernel gradient back to (out, in, kh, kw))."""
    cdef int o, c, k
    for o in range(OC):
        for c in range(C):
            for k in range(KK):
                G[(<Py_ssize_t> o * C + c) * KK + k] = Gt[(<Py_ssize_t> o * KK + k) * C + c]


def swap_outer(const float[:, :, ::1] a, float[:, :, ::1] out):
    """out[k, j, i] = a[i, j, k]: the first and last axes swapped, without the GIL (a
    partition's maps between the engine's NHWC and the exchange's (maps, positions, batch))."""
    cdef Py_ssize_t I = a.shape[0], J = a.shape[1], K = a.shape[2], i, j, k
    if out.shape[0] != K or out.shape[1] != J or out.shape[2] != I:
        raise ValueError(f"out has shape {tuple(out.shape)[:3]}, not {(K, J, I)}")
    if I == 0 or J == 0 or K == 0:
        return
    cdef const float *src = &a[0, 0, 0]
    cdef float *dst = &out[0, 0, 0]
    with nogil:
        for j in range(J):
            for i in range(I):
                for k in range(K):
                    dst[(k * J + j) * I + i] = src[(i * J + j) * K + k]


cdef class ConvEngine:
    """T threads training one convolutional network's flat float32 parameters.

    ``ops`` is the op table (int64, one row per layer, columns ``O_*``) that
    ``hpcps.engine.conv_hogwild`` builds from a ``ConvNet``; ``n_params`` the vector's length;
    ``batch`` the largest mini-batch; ``act`` the hidden activation; ``dropout`` the rate of
    the fc layers whose ``O_DROP`` is set (thread t's masks: ``keys[t]``, ``draws[t]``).
    """

    cdef readonly int threads, batch, n_ops, n_params, n_in, n_classes
    cdef readonly int in_c, in_h, in_w
    cdef int act
    cdef int64_t[:, ::1] ops
    cdef const int64_t *ops_p        # the op table's rows, N_COLS each
    cdef float[:, ::1] work          # (threads, context): activations, errors, cols, gradient
    cdef int32_t[:, ::1] iwork       # (threads, int context): pooling argmax
    cdef int64_t[:, ::1] labels
    cdef double[::1] loss
    cdef int64_t[::1] seen
    cdef readonly uint64_t[::1] keys     # each thread's dropout stream ...
    cdef readonly int64_t[::1] draws     # ... and its next draw
    cdef int64_t[::1] cur                # the draw of the thread's step under way
    cdef float drop_scale
    cdef readonly Py_ssize_t d0_off
    cdef Py_ssize_t in_off, d1_off, cols_off, dcols_off, gt_off, g_off, sum_off

    cdef float *p_params
    cdef float *p_delta
    cdef const float *p_x
    cdef const int64_t *p_y
    cdef const int64_t *p_order
    cdef Py_ssize_t n_order, steps
    cdef float lr
    cdef int run_mode

    def __init__(self, ops, int n_params, input_shape, int threads, int batch,
                 str activation, double dropout=0.0):
        cdef Py_ssize_t off, ioff, widest, cols
        cdef int i
        self.ops = np.ascontiguousarray(ops, dtype=np.int64).copy()
        self.n_ops = self.ops.shape[0]
        if self.ops.shape[1] != N_COLS:
            raise ValueError(f"the op table has {self.ops.shape[1]} columns, not {N_COLS}")
        self.n_params = n_params
        self.threads = threads
        self.batch = batch
        self.act = ACTIVATIONS[activation]
        self.in_c, self.in_h, self.in_w = [int(v) for v in input_shape]
        self.n_in = self.in_c * self.in_h * self.in_w
        self.n_classes = int(self.ops[self.n_ops - 1, O_OC])
        off, ioff = 0, 0
        self.in_off = off
        off += _aligned(<Py_ssize_t> batch * self.n_in)
        widest = self.n_in
        cols = 0
        wt = []
        for i in range(self.n_ops):
            if self.ops[i, O_UALL] == 0:   # a whole layer: its units are all of them
                self.ops[i, O_UALL] = self.ops[i, O_OC]
            n_out = self.ops[i, O_OC] * self.ops[i, O_OH] * self.ops[i, O_OW]
            widest = max(widest, n_out)
            self.ops[i, O_OUT] = off
            off += _aligned(batch * n_out)
            if self.ops[i, O_DROP]:
                self.ops[i, O_DOUT] = off
                off += _aligned(batch * n_out)
            if self.ops[i, O_KIND] == K_POOL:
                self.ops[i, O_ARG] = ioff
                ioff += _aligned(batch * n_out)
            if self.ops[i, O_KIND] == K_CONV:
                per = self.ops[i, O_OH] * self.ops[i, O_OW] * self.ops[i, O_C] \
                    * self.ops[i, O_KH] * self.ops[i, O_KW]
                chunk = max(1, min(batch, CHUNK_FLOATS // max(1, per)))
                self.ops[i, O_CHUNK] = chunk
                cols = max(cols, chunk * per)
                wt.append(i)
        self.ops_p = &self.ops[0, 0]
        self.d0_off = off
        off += _aligned(batch * widest)
        self.d1_off = off
        off += _aligned(batch * widest)
        self.cols_off = off
        off += _aligned(cols)
        self.dcols_off = off
        off += _aligned(cols)
        for i in wt:   # each conv layer's kernel snapshot, in window order
            self.ops[i, O_WT] = off
            off += _aligned(self.ops[i, O_OC] * self.ops[i, O_C] * self.ops[i, O_KH]
                            * self.ops[i, O_KW])
        self.gt_off = off   # a kernel gradient in window order, before it is put back
        off += _aligned(max([self.ops[i, O_OC] * self.ops[i, O_C] * self.ops[i, O_KH]
                             * self.ops[i, O_KW] for i in wt] or [0]))
        self.g_off = off
        off += _aligned(n_params)
        self.sum_off = off
        off += _aligned(n_params)
        # one allocation for all threads; rows padded so no two contexts share a cache line
        self.work = np.zeros((threads, off), dtype=np.float32)
        self.iwork = np.zeros((threads, max(ioff, 1)), dtype=np.int32)
        self.labels = np.zeros((threads, batch), dtype=np.int64)
        self.loss = np.zeros(threads, dtype=np.float64)
        self.seen = np.zeros(threads, dtype=np.int64)
        self.keys = np.zeros(threads, dtype=np.uint64)
        self.draws = np.zeros(threads, dtype=np.int64)
        self.cur = np.zeros(threads, dtype=np.int64)
        self.drop_scale = <float> (1.0 / (1.0 - dropout))

    def seed_dropout(self, int t, uint64_t key, int64_t first_draw):
        """Thread t's dropout stream: ``key``, its next step taking draw ``first_draw``."""
        self.keys[t] = key
        self.draws[t] = first_draw

    # -- one mini-batch, one thread ------------------------------------------------------
    cdef float *_forward(self, int t, const float *params, const float *x,
                         const int64_t *y, const int64_t *rows, int nb,
                         bint train) noexcept nogil:
        """Gather ``nb`` examples (rows of x/y, or x/y themselves when ``rows`` is NULL) into
        thread t's context and run the forward pass (with dropout when ``train``, the masks
        of draw cur[t]); returns the logits (nb x classes)."""
        self._load(t, x, y, rows, nb)
        return self._forward_ops(t, params, 0, self.n_ops, nb, train)

    cdef void _load(self, int t, const float *x, const int64_t *y, const int64_t *rows,
                    int nb) noexcept nogil:
        """Examples (rows of x, or x itself when ``rows`` is NULL), C x H x W each, into
        thread t's input in NHWC, and their labels (unless ``y`` is NULL)."""
        cdef float *ctx = &self.work[t, 0]
        cdef int64_t *lab = &self.labels[t, 0]
        cdef int r, c, C, H, W
        cdef Py_ssize_t k, j, n_in = self.n_in
        cdef float *a = ctx + self.in_off
        C, H, W = self.in_c, self.in_h, self.in_w
        for r in range(nb):
            k = rows[r] if rows != NULL else r
            if y != NULL:
                lab[r] = y[k]
            if C == 1:
                memcpy(a + <Py_ssize_t> r * n_in, x + k * n_in, n_in * sizeof(float))
            else:
                for c in range(C):
                    for j in range(H * W):
                        a[<Py_ssize_t> r * n_in + j * C + c] = x[k * n_in + c * H * W + j]

    cdef float *_forward_ops(self, int t, const float *params, int lo, int hi, int nb,
                             bint train) noexcept nogil:
        """The forward pass of ops lo .. hi-1 in thread t's context, from the loaded input
        (lo = 0) or op lo-1's output; returns op hi-1's output (its dropped copy when
        ``train`` drops it). A K_EXCH op computes nothing: its output is the caller's."""
        cdef float *ctx = &self.work[t, 0]
        cdef int32_t *ictx = &self.iwork[t, 0]
        cdef int i, r, c, oh, ow, p, q, C, H, W, OC, OH, OW, KH, KW, S, P, kind
        cdef int chunk, r0, nr, M, K
        cdef Py_ssize_t k, n_out, j, n_in = self.n_in, base, best_at, at
        cdef float *a
        cdef float *z
        cdef const float *Wp
        cdef const float *bp
        cdef float *cols = ctx + self.cols_off
        cdef int32_t *arg
        cdef float m, v
        cdef const int64_t *o
        cdef const int64_t *prev

        if lo == 0:
            a = ctx + self.in_off
        else:
            prev = self.ops_p + (lo - 1) * N_COLS
            a = ctx + (prev[O_DOUT] if train and prev[O_DROP] else prev[O_OUT])
        for i in range(lo, hi):
            o = self.ops_p + i * N_COLS
            kind = <int> o[O_KIND]
            C, H, W = <int> o[O_C], <int> o[O_H], <int> o[O_W]
            OC, OH, OW = <int> o[O_OC], <int> o[O_OH], <int> o[O_OW]
            z = ctx + o[O_OUT]
            n_out = <Py_ssize_t> OC * OH * OW
            if kind == K_EXCH:
                pass
            elif kind == K_CONV:
                KH, KW, S, P = <int> o[O_KH], <int> o[O_KW], <int> o[O_S], \
                    <int> o[O_P]
                K = C * KH * KW
                # this step's kernels, in window order; the backward pass uses them too
                _kernel_to_windows(params + o[O_WOFF], OC, C, KH * KW, ctx + o[O_WT])
                Wp = ctx + o[O_WT]
                bp = params + o[O_BOFF]
                for j in range(<Py_ssize_t> nb * OH * OW):
                    memcpy(z + j * OC, bp, OC * sizeof(float))
                chunk = <int> o[O_CHUNK]
                r0 = 0
                while r0 < nb:
                    nr = min(chunk, nb - r0)
                    M = nr * OH * OW
                    _im2col(a + <Py_ssize_t> r0 * H * W * C, nr, C, H, W, OH, OW, KH, KW, S, P,
                            cols)
                    # z[chunk] (M x OC) += cols (M x K) @ Wt^T, Wt (OC x K)
                    _gemm(b'T', b'N', OC, M, K, 1.0, Wp, K, cols, K, 1.0,
                          z + <Py_ssize_t> r0 * OH * OW * OC, OC)
                    r0 += nr
                _activate(self.act, z, nb * n_out)
            elif kind == K_POOL:
                KH, KW, S = <int> o[O_KH], <int> o[O_KW], <int> o[O_S]
                arg = ictx + o[O_ARG]
                for r in range(nb):
                    for oh in range(OH):
                        for ow in range(OW):
                            # maps innermost (NHWC), so the compiler vectorizes over them;
                            # the first maximum in row-major window order wins ties
                            j = ((<Py_ssize_t> r * OH + oh) * OW + ow) * C
                            base = ((<Py_ssize_t> oh * S) * W + ow * S) * C
                            at = <Py_ssize_t> r * H * W * C
                            for c in range(C):
                                z[j + c] = a[at + base + c]
                                arg[j + c] = <int32_t> (base + c)
                            for p in range(KH):
                                for q in range(KW):
                                    if p == 0 and q == 0:
                                        continue
                                    best_at = base + (<Py_ssize_t> p * W + q) * C
                                    for c in range(C):   # branch-free: blends
                                        v = a[at + best_at + c]
                                        m = z[j + c]
                                        arg[j + c] = <int32_t> (best_at + c) if v > m \
                                            else arg[j + c]
                                        z[j + c] = v if v > m else m
            elif kind == K_FLAT:
                # NHWC -> rows of C*H*W in (map, row, column) order, as PyTorch's flatten
                for r in range(nb):
                    base = <Py_ssize_t> r * n_out
                    for j in range(H * W):
                        for c in range(C):
                            z[base + c * H * W + j] = a[base + j * C + c]
            else:  # fully connected: z = act(a @ W + b), W (C x OC)
                Wp = params + o[O_WOFF]
                bp = params + o[O_BOFF]
                for r in range(nb):
                    memcpy(z + <Py_ssize_t> r * OC, bp, OC * sizeof(float))
                _gemm(b'N', b'N', OC, nb, C, 1.0, Wp, OC, a, C, 1.0, z, OC)
                if o[O_ACT]:
                    _activate(self.act, z, nb * n_out)
                if train and o[O_DROP]:   # the next layer reads the dropped copy
                    _drop(z, ctx + o[O_DOUT], nb, OC, <int> o[O_UALL], <int> o[O_ULO],
                          self.keys[t], self.cur[t], o[O_LAYER], <uint64_t> o[O_DROP],
                          self.drop_scale)
                    z = ctx + o[O_DOUT]
            a = z

        return a

    cdef void _step(self, int t, float *params, const float *x, const int64_t *y,
                    const int64_t *rows, int nb, float *g) noexcept nogil:
        """Forward and backward over ``nb`` examples (rows of x/y, or x/y themselves when
        ``rows`` is NULL) in thread t's context: the mean loss's gradient (the sum's in
        MODE_SUM) into g, the loss sum into loss[t]."""
        cdef int64_t *lab = &self.labels[t, 0]
        cdef float *a
        cdef float inv_nb = 1.0 / nb
        cdef double loss = 0.0

        if self.run_mode == MODE_SUM:
            inv_nb = 1.0
        self.cur[t] = self.draws[t]
        self.draws[t] += 1
        a = self._forward(t, params, x, y, rows, nb, True)

        # softmax cross-entropy; the logits become the output error (p - 1_y) / nb
        loss = _softmax_xent(a, lab, nb, self.n_classes, inv_nb)
        self.loss[t] += loss
        self._backward_ops(t, params, 0, self.n_ops, a, nb, g)

    cdef float *_backward_ops(self, int t, float *params, int lo, int hi, float *d, int nb,
                              float *g) noexcept nogil:
        """The backward pass of ops hi-1 down to lo in thread t's context, ``d`` the error at
        op hi-1's output (overwritten): each op's parameters' gradient into g; returns the
        error at the output of the K_EXCH op where it stops (or the last error computed)."""
        cdef float *ctx = &self.work[t, 0]
        cdef int32_t *ictx = &self.iwork[t, 0]
        cdef int i, r, c, C, H, W, OC, OH, OW, KH, KW, S, P, kind
        cdef int chunk, r0, nr, M, K
        cdef Py_ssize_t n, n_out, j, base
        cdef float *a
        cdef float *z
        cdef float *dp
        cdef float *Wp
        cdef float *gW
        cdef float *gb
        cdef float *cols = ctx + self.cols_off
        cdef float *dcols = ctx + self.dcols_off
        cdef int32_t *arg
        cdef const int64_t *o
        cdef const int64_t *prev

        # d is the error at op i's output; dp receives the error at its input
        for i in range(hi - 1, lo - 1, -1):
            o = self.ops_p + i * N_COLS
            kind = <int> o[O_KIND]
            if kind == K_EXCH or ((kind == K_FLAT or kind == K_POOL) and not o[O_DX]):
                break   # the caller takes the error from here, or nothing below needs one
            C, H, W = <int> o[O_C], <int> o[O_H], <int> o[O_W]
            OC, OH, OW = <int> o[O_OC], <int> o[O_OH], <int> o[O_OW]
            z = ctx + o[O_OUT]
            if i > 0:   # this op's input: the previous op's output, or its dropped copy
                prev = self.ops_p + (i - 1) * N_COLS
                a = ctx + (prev[O_DOUT] if prev[O_DROP] else prev[O_OUT])
            else:
                a = ctx + self.in_off
            n_out = <Py_ssize_t> OC * OH * OW
            n = <Py_ssize_t> C * H * W
            dp = ctx + (self.d0_off if d != ctx + self.d0_off else self.d1_off)
            if kind == K_FC:
                if o[O_DROP]:   # the error at the dropped copy, through the mask
                    _drop(d, d, nb, OC, <int> o[O_UALL], <int> o[O_ULO], self.keys[t],
                          self.cur[t], o[O_LAYER], <uint64_t> o[O_DROP], self.drop_scale)
                if o[O_ACT]:
                    _act_grad(self.act, z, d, nb * n_out)
                Wp = params + o[O_WOFF]
                gW = g + o[O_WOFF]
                gb = g + o[O_BOFF]
                # gW (C x OC) = a^T @ d
                _gemm(b'N', b'T', OC, C, nb, 1.0, d, OC, a, C, 0.0, gW, OC)
                memset(gb, 0, OC * sizeof(float))
                for r in range(nb):
                    for j in range(OC):
                        gb[j] += d[<Py_ssize_t> r * OC + j]
                if o[O_DX]:
                    # dp (nb x C) = d @ W^T
                    _gemm(b'T', b'N', C, nb, OC, 1.0, Wp, OC, d, OC, 0.0, dp, C)
            elif kind == K_FLAT:
                for r in range(nb):
                    base = <Py_ssize_t> r * n_out
                    for j in range(H * W):
                        for c in range(C):
                            dp[base + j * C + c] = d[base + c * H * W + j]
            elif kind == K_POOL:
                arg = ictx + o[O_ARG]
                memset(dp, 0, <Py_ssize_t> nb * n * sizeof(float))
                for r in range(nb):
                    for j in range(n_out):
                        dp[<Py_ssize_t> r * n + arg[<Py_ssize_t> r * n_out + j]] += \
                            d[<Py_ssize_t> r * n_out + j]
            else:  # conv
                KH, KW, S, P = <int> o[O_KH], <int> o[O_KW], <int> o[O_S], \
                    <int> o[O_P]
                K = C * KH * KW
                _act_grad(self.act, z, d, nb * n_out)
                Wp = ctx + o[O_WT]          # the kernels the forward pass used
                gW = ctx + self.gt_off      # their gradient in window order
                gb = g + o[O_BOFF]
                memset(gb, 0, OC * sizeof(float))
                for j in range(<Py_ssize_t> nb * OH * OW):
                    for c in range(OC):
                        gb[c] += d[j * OC + c]
                if o[O_DX]:
                    memset(dp, 0, <Py_ssize_t> nb * n * sizeof(float))
                chunk = <int> o[O_CHUNK]
                r0 = 0
                while r0 < nb:
                    nr = min(chunk, nb - r0)
                    M = nr * OH * OW
                    _im2col(a + <Py_ssize_t> r0 * n, nr, C, H, W, OH, OW, KH, KW, S, P, cols)
                    # gW (OC x K) (+)= d[chunk]^T (OC x M) @ cols (M x K)
                    _gemm(b'N', b'T', K, OC, M, 1.0, cols, K,
                          d + <Py_ssize_t> r0 * OH * OW * OC, OC, 0.0 if r0 == 0 else 1.0,
                          gW, K)
                    if o[O_DX]:
                        # dcols (M x K) = d[chunk] (M x OC) @ W (OC x K), then back onto dp
                        _gemm(b'N', b'N', K, M, OC, 1.0, Wp, K,
                              d + <Py_ssize_t> r0 * OH * OW * OC, OC, 0.0, dcols, K)
                        _col2im(dcols, nr, C, H, W, OH, OW, KH, KW, S, P,
                                dp + <Py_ssize_t> r0 * n)
                    r0 += nr
                _windows_to_kernel(gW, OC, C, KH * KW, g + o[O_WOFF])
            d = dp
        return d

    # -- one thread's share of a call ----------------------------------------------------
    cdef void _run(self, int t) noexcept nogil:
        cdef Py_ssize_t lo, hi, pos, i
        cdef int nb
        cdef float *g = &self.work[t, 0] + self.g_off
        cdef float *acc = &self.work[t, 0] + self.sum_off
        cdef float *params = self.p_params
        cdef float *delta = self.p_delta
        cdef float u, lr = self.lr
        cdef Py_ssize_t n = self.n_params
        if self.run_mode == MODE_SUM:
            memset(acc, 0, n * sizeof(float))
        lo = _share(t, self.threads, self.steps, self.batch, self.n_order, &hi)
        self.loss[t] = 0.0
        self.seen[t] = hi - lo
        pos = lo
        while pos < hi:
            nb = <int> (self.batch if hi - pos > self.batch else hi - pos)
            self._step(t, params, self.p_x, self.p_y, self.p_order + pos, nb, g)
            if self.run_mode == MODE_SUM:
                for i in range(n):
                    acc[i] = acc[i] + g[i]
            elif delta != NULL:
                for i in range(n):
                    u = -lr * g[i]
                    params[i] = params[i] + u
                    delta[i] = delta[i] + u
            else:
                for i in range(n):
                    params[i] = params[i] - lr * g[i]
            pos += nb

    def _thread_main(self, int t):
        with nogil:
            self._run(t)

    def _launch(self):
        cdef int T = self.threads
        if T == 1:
            with nogil:
                self._run(0)
            return
        _on_threads(self._thread_main, T)

    def _bind(self, const float[:, ::1] x, const int64_t[::1] y, const int64_t[::1] order):
        self.p_x = &x[0, 0]
        self.p_y = &y[0]
        self.p_order = &order[0] if order.shape[0] > 0 else NULL
        self.n_order = order.shape[0]

    # -- a partition of a model-parallel replica: the layers between two exchanges ------
    def table(self):
        """The op table with the engine's columns filled (each op's output offset, ...)."""
        return np.array(self.ops)

    def region(self, int t, Py_ssize_t off, Py_ssize_t n):
        """Floats off .. off+n-1 of thread t's context, as a NumPy view (no copy)."""
        return np.asarray(self.work[t, off:off + n])

    def part_forward(self, int t, const float[::1] params, x, int lo, int hi, int nb,
                     uint64_t key, int64_t draw, bint train):
        """The forward pass of ops lo .. hi-1 over ``nb`` examples in thread t's context:
        from the rows of ``x`` (float32, C x H x W each) when lo = 0, else from op lo-1's
        output (a K_EXCH op's, which the caller filled with the whole input). With
        ``train``, dropout draws the masks of (``key``, ``draw``)."""
        cdef const float[:, ::1] xv
        cdef const float *p = &params[0]
        if lo == 0:
            xv = x
            with nogil:
                self._load(t, &xv[0, 0], NULL, NULL, nb)
        self.keys[t] = key
        self.cur[t] = draw
        with nogil:
            self._forward_ops(t, p, lo, hi, nb, train)

    def part_backward(self, int t, const float[::1] params, int lo, int hi, int nb,
                      float[::1] grad):
        """The backward pass of ops hi-1 down to lo in thread t's context, after
        :meth:`part_forward` of the same ops (with ``train``), from the error at op hi-1's
        output, which the caller wrote at ``d0_off``: the gradient of their parameters into
        ``grad`` (at their offsets). Returns the offset in the context of the error at the
        output of op lo when it is a K_EXCH op (the whole input's error)."""
        cdef float *ctx = &self.work[t, 0]
        cdef float *d
        with nogil:
            d = self._backward_ops(t, <float *> &params[0], lo, hi, ctx + self.d0_off, nb,
                                   &grad[0])
        return d - ctx

    def train(self, float[::1] params, const float[:, ::1] x, const int64_t[::1] y,
              const int64_t[::1] order, float lr, Py_ssize_t steps_per_thread, delta):
        """Run the T threads once over ``order``; return (loss_sum, examples).

        ``steps_per_thread > 0``: thread t takes ``steps_per_thread`` mini-batches from
        ``order[t*S*B : (t+1)*S*B]``; ``0``: the order is split evenly into T parts, each
        walked in mini-batches (the last one may be smaller). ``delta`` may be None.
        """
        cdef float[::1] dv
        if order.shape[0] == 0:
            return 0.0, 0
        self._bind(x, y, order)
        self.p_params = &params[0]
        self.p_delta = NULL
        if delta is not None:
            dv = delta
            self.p_delta = &dv[0]
        self.steps = steps_per_thread
        self.lr = lr
        self.run_mode = MODE_STEP
        self._launch()
        self.p_params = NULL
        self.p_delta = NULL
        return float(np.sum(self.loss)), int(np.sum(self.seen))

    def gradient_sum(self, const float[::1] params, const float[:, ::1] x,
                     const int64_t[::1] y, const int64_t[::1] order, float[::1] grad):
        """Sum over the examples ``order`` of their loss and gradient, T threads each
        summing an even share in mini-batches; the T sums are added into ``grad``
        (overwritten) in thread order, so the same T and batch give the same bits.
        Returns (loss_sum, examples)."""
        cdef int t
        cdef Py_ssize_t n = self.n_params
        grad[:] = 0.0
        if order.shape[0] == 0:
            return 0.0, 0
        self._bind(x, y, order)
        self.p_params = <float *> &params[0]
        self.p_delta = NULL
        self.steps = 0
        self.lr = 0.0
        self.run_mode = MODE_SUM
        self._launch()
        self.p_params = NULL
        out = np.asarray(grad)
        for t in range(self.threads):
            if self.seen[t] > 0:
                out += np.asarray(self.work[t, self.sum_off:self.sum_off + n])
        return float(np.sum(self.loss)), int(np.sum(self.seen))

    def evaluate(self, const float[::1] params, const float[:, ::1] x, const int64_t[::1] y):
        """(loss sum, correct predictions) over all rows of x, forward passes only, in
        mini-batches of ``batch`` in context 0."""
        cdef Py_ssize_t lo = 0, N = x.shape[0], correct = 0
        cdef int nb, r, j, best, n_out = self.n_classes
        cdef float *z
        cdef double loss = 0.0
        if N == 0:
            return 0.0, 0
        with nogil:
            while lo < N:
                nb = <int> (self.batch if N - lo > self.batch else N - lo)
                z = self._forward(0, &params[0], &x[lo, 0], &y[lo], NULL, nb, False)
                for r in range(nb):   # the first largest logit, as numpy.argmax
                    best = 0
                    for j in range(1, n_out):
                        if z[r * n_out + j] > z[r * n_out + best]:
                            best = j
                    correct += best == y[lo + r]
                loss += _softmax_xent(z, &self.labels[0, 0], nb, n_out, 1.0)
                lo += nb
        return loss, correct

    def loss_and_grad(self, const float[::1] params, const float[:, ::1] x,
                      const int64_t[::1] y, float[::1] grad):
        """Mean loss over all rows of x (at most ``batch``) and its gradient into ``grad``,
        in context 0."""
        cdef int nb = x.shape[0]
        self.loss[0] = 0.0
        self.run_mode = MODE_GRAD
        with nogil:
            self._step(0, <float *> &params[0], &x[0, 0], &y[0], NULL, nb, &grad[0])
        return self.loss[0] / nb
