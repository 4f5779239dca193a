# The nogil pieces both Hogwild engines use (``include``d by ext/hogwild.pyx, the MLP's, and
# ext/convnet.pyx, the conv network's): buffer alignment, the sgemm call, the activations and
# their derivatives, and the softmax cross-entropy. Each module compiles its own copy, so
# everything here is ``inline`` and as fast as written in place.
import threading

from libc.math cimport expf, logf, tanhf
from libc.stdint cimport int64_t

include "sgemm_ptr.pxi"

cdef enum:
    ALIGN = 16          # floats: every buffer starts on a 64-byte boundary

cdef enum:
    ACT_RELU = 0
    ACT_TANH = 1
    ACT_SIGMOID = 2

ACTIVATIONS = {"relu": ACT_RELU, "tanh": ACT_TANH, "sigmoid": ACT_SIGMOID}


cdef inline Py_ssize_t _aligned(Py_ssize_t n) noexcept nogil:
    return (n + ALIGN - 1) // ALIGN * ALIGN


cdef inline void _gemm(char ta, char tb, int m, int n, int k, float alpha,
                       const float *a, int lda, const float *b, int ldb,
                       float beta, float *c, int ldc) noexcept nogil:
    # cython_blas takes non-const pointers; sgemm does not write a or b.
    _f_sgemm(&ta, &tb, &m, &n, &k, &alpha, <float *> a, &lda, <float *> b, &ldb,
             &beta, c, &ldc)


cdef inline void _activate(int act, float *z, Py_ssize_t n) noexcept nogil:
    """z = act(z) in place. Branch-free forms: the compiler turns them into vector max/blend
    (a branch on the sign of each activation mispredicts half the time and cost ~15% of an
    MLP step)."""
    cdef Py_ssize_t i
    if act == ACT_RELU:
        for i in range(n):
            z[i] = z[i] if z[i] > 0.0 else 0.0
    elif act == ACT_TANH:
        for i in range(n):
            z[i] = tanhf(z[i])
    else:
        for i in range(n):
            z[i] = 1.0 / (1.0 + expf(-z[i]))


cdef inline void _act_grad(int act, const float *a, float *d, Py_ssize_t n) noexcept nogil:
    """d *= act'(z), from the activation's output a = act(z)."""
    cdef Py_ssize_t i
    if act == ACT_RELU:
        for i in range(n):
            d[i] = d[i] if a[i] > 0.0 else 0.0
    elif act == ACT_TANH:
        for i in range(n):
            d[i] = d[i] * (1.0 - a[i] * a[i])
    else:
        for i in range(n):
            d[i] = d[i] * (a[i] * (1.0 - a[i]))


def _on_threads(thread_main, int threads):
    """Run ``thread_main(t)`` (an engine's, which enters its nogil loop) for t in
    1..threads-1 on Python threads and t = 0 on this one; return when all have ended."""
    workers = [threading.Thread(target=thread_main, args=(t,)) for t in range(1, threads)]
    for w in workers:
        w.start()
    thread_main(0)
    for w in workers:
        w.join()


cdef inline Py_ssize_t _share(int t, int threads, Py_ssize_t steps, Py_ssize_t batch,
                              Py_ssize_t n_order, Py_ssize_t *hi) noexcept nogil:
    """Thread t's part [lo, hi) of an order of n_order examples (lo returned): ``steps``
    mini-batches of ``batch`` each from t * steps * batch when steps > 0, else the order split
    evenly by hpcps.blocks.block_range's rule (the first parts one longer)."""
    cdef Py_ssize_t lo, per, extra
    if steps > 0:
        lo = t * steps * batch
        hi[0] = lo + steps * batch
        return lo
    per = n_order // threads
    extra = n_order % threads
    lo = t * per + (t if t < extra else extra)
    hi[0] = lo + per + (1 if t < extra else 0)
    return lo


cdef inline double _softmax_xent(float *z, const int64_t *lab, int nb, int n_out,
                                 float inv_nb) noexcept nogil:
    """The summed cross-entropy of the nb rows of logits z (n_out each) against labels lab;
    z becomes the output error (softmax - 1_y) * inv_nb."""
    cdef int r, j, cls
    cdef float m, s, v
    cdef float *d
    cdef double loss = 0.0
    for r in range(nb):
        d = z + <Py_ssize_t> r * n_out
        m = d[0]
        for j in range(1, n_out):
            if d[j] > m:
                m = d[j]
        cls = <int> lab[r]
        loss += m - d[cls]      # + log(sum exp(d - m)), added below
        s = 0.0
        for j in range(n_out):
            v = expf(d[j] - m)
            d[j] = v
            s = s + v
        loss += logf(s)
        v = inv_nb / s
        for j in range(n_out):
            d[j] = d[j] * v
        d[cls] = d[cls] - inv_nb
    return loss
