# cython: cdivision=True, boundscheck=False, wraparound=False
"""Adagrad and SGD updates for a parameter-server shard, in place, without the GIL.

A shard applies one update per gradient push, over every parameter it holds; the loop is
memory bound (three streams read, two written), so each kernel makes one pass over memory
and keeps everything in float32. ``cdivision=True`` matters beyond speed of the division
itself: without it Cython guards every ``/`` with a zero check and GCC cannot vectorize the
loop (measured 10x slower).

Servers run oversubscribed (several ranks per core), so the default is one thread; with
``threads > 1`` the loop is split statically over OpenMP threads.

Callers should use ``hpcps.kernels``, which checks dtype, shape, contiguity and overlap
before coming here; these functions only repeat the length check that memory safety needs.
"""
from cython.parallel cimport prange
from libc.math cimport sqrtf


cdef void _adagrad(float[::1] w, const float[::1] g, float[::1] accum,
                   float lr, float eps, int threads) noexcept nogil:
    cdef Py_ssize_t i
    cdef Py_ssize_t n = w.shape[0]
    cdef float gi, ai
    # Two loops rather than prange(num_threads=1): an OpenMP region costs a few
    # microseconds per call even with one thread, and small shards are updated often.
    if threads > 1:
        for i in prange(n, num_threads=threads, schedule='static'):
            gi = g[i]
            ai = accum[i] + gi * gi
            accum[i] = ai
            w[i] = w[i] - lr * gi / (sqrtf(ai) + eps)
    else:
        for i in range(n):
            gi = g[i]
            ai = accum[i] + gi * gi
            accum[i] = ai
            w[i] = w[i] - lr * gi / (sqrtf(ai) + eps)


cdef void _sgd(float[::1] w, const float[::1] g, float lr) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(w.shape[0]):
        w[i] = w[i] - lr * g[i]


def adagrad_update(float[::1] w, const float[::1] g, float[::1] accum,
                   float lr, float eps, int threads=1):
    """Apply one Adagrad step in place: ``accum += g*g; w -= lr*g / (sqrt(accum) + eps)``.

    This is DistBelief's Adagrad: each parameter's step is ``lr`` divided by the root of
    the sum of its squared gradients so far; ``eps`` only keeps ``0/0`` out when a
    parameter has never seen a nonzero gradient.

    Parameters
    ----------
    w : float32[::1]
        Parameters, updated in place.
    g : float32[::1]
        Gradient, read only.
    accum : float32[::1]
        Sum of squared gradients, updated in place.
    lr : float
        Learning rate (converted to float32).
    eps : float
        Added to the root of the accumulator (converted to float32).
    threads : int, optional
        OpenMP threads; 1 (default) runs a plain loop.

    Raises
    ------
    ValueError
        If the lengths differ or ``threads < 1``.
    """
    if g.shape[0] != w.shape[0] or accum.shape[0] != w.shape[0]:
        raise ValueError(
            f"length mismatch: w has {w.shape[0]}, g has {g.shape[0]}, "
            f"accum has {accum.shape[0]} elements"
        )
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with nogil:
        _adagrad(w, g, accum, lr, eps, threads)


def sgd_update(float[::1] w, const float[::1] g, float lr):
    """Apply one plain SGD step in place: ``w -= lr * g``.

    Parameters
    ----------
    w : float32[::1]
        Parameters, updated in place.
    g : float32[::1]
        Gradient, read only.
    lr : float
        Learning rate (converted to float32).

    Raises
    ------
    ValueError
        If the lengths differ.
    """
    if g.shape[0] != w.shape[0]:
        raise ValueError(
            f"length mismatch: w has {w.shape[0]}, g has {g.shape[0]} elements"
        )
    with nogil:
        _sgd(w, g, lr)
