"""Pure-NumPy reference for each compiled kernel in ``ext/``.

These define what the compiled kernels must compute (tests compare the two) and are the
fallback where the extension is not built. They round the way the C loops do: every
operation in float32, in the same order (``lr * g`` first, then divided by
``sqrt(accum) + eps``), so on a build without FMA contraction the results agree bit for bit.

The arrays are processed in blocks so the temporaries stay in cache and cost
``2 * _BLOCK`` floats, not two more copies of a shard that may hold 100M parameters.
Input checking (dtype, shape, contiguity, overlap) is done by ``hpcps.kernels``; only the
length check is repeated here, because a length-1 array would otherwise broadcast silently.
"""
import numpy as np

_BLOCK = 1 << 16


def adagrad_update(w, g, accum, lr, eps, threads=1):
    """Apply one Adagrad step in place: ``accum += g*g; w -= lr*g / (sqrt(accum) + eps)``.

    Parameters
    ----------
    w : numpy.ndarray
        1-D float32 parameters, updated in place.
    g : numpy.ndarray
        1-D float32 gradient, read only.
    accum : numpy.ndarray
        1-D float32 sum of squared gradients, updated in place.
    lr : float
        Learning rate (rounded to float32, like the compiled kernel).
    eps : float
        Added to the root of the accumulator so a parameter with no gradient yet gets
        ``0 / eps`` instead of ``0 / 0``.
    threads : int, optional
        Accepted for the compiled kernel's signature and ignored: NumPy runs one thread.

    Raises
    ------
    ValueError
        If the lengths differ.
    """
    n = w.shape[0]
    if g.shape[0] != n or accum.shape[0] != n:
        raise ValueError(
            f"length mismatch: w has {n}, g has {g.shape[0]}, accum has {accum.shape[0]} elements"
        )
    lr = np.float32(lr)
    eps = np.float32(eps)
    size = min(n, _BLOCK)
    num = np.empty(size, dtype=np.float32)
    den = np.empty(size, dtype=np.float32)
    for start in range(0, n, _BLOCK):
        stop = min(start + _BLOCK, n)
        k = stop - start
        gb, ab, nb, db = g[start:stop], accum[start:stop], num[:k], den[:k]
        np.multiply(gb, gb, out=nb)
        ab += nb
        np.sqrt(ab, out=db)
        db += eps
        np.multiply(gb, lr, out=nb)
        nb /= db
        w[start:stop] -= nb


def sgd_update(w, g, lr):
    """Apply one plain SGD step in place: ``w -= lr * g``.

    Parameters
    ----------
    w : numpy.ndarray
        1-D float32 parameters, updated in place.
    g : numpy.ndarray
        1-D float32 gradient, read only.
    lr : float
        Learning rate (rounded to float32, like the compiled kernel).

    Raises
    ------
    ValueError
        If the lengths differ.
    """
    n = w.shape[0]
    if g.shape[0] != n:
        raise ValueError(f"length mismatch: w has {n}, g has {g.shape[0]} elements")
    lr = np.float32(lr)
    tmp = np.empty(min(n, _BLOCK), dtype=np.float32)
    for start in range(0, n, _BLOCK):
        stop = min(start + _BLOCK, n)
        tb = tmp[: stop - start]
        np.multiply(g[start:stop], lr, out=tb)
        w[start:stop] -= tb
