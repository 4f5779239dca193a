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


# --------------------------------------------------------------------------- embedding tables
#
# References of ``ext/embedding.pyx`` (``hpcps.kernels.embedding`` checks the input of both).
# Each takes the same arguments as its compiled twin and sums in the same order, so results
# agree bit for bit unless the build contracts ``a + b*c`` into an FMA.

_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MAP_SALT = 0x2545F4914F6CDD1D   # the shard map's salt (see ext/embedding.pyx)


def mix64(z):
    """splitmix64 of a Python int in [0, 2**64) (the compiled kernels' hash)."""
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _mix_array(z):
    """splitmix64 of a uint64 array (NumPy's uint64 array arithmetic wraps, as C's does)."""
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def _home(ids, mask):
    """Each id's first probe position in a shard's map of ``mask + 1`` entries."""
    salted = ids.view(np.uint64) ^ np.uint64(_MAP_SALT)
    return (_mix_array(salted) & np.uint64(mask)).astype(np.int64)


def unique_inverse(ids, uniq, inverse, sort=False):
    """Unique ids (ids < 0 are padding, left out) into ``uniq[:m]``, first-seen order or
    ascending with ``sort``; ``inverse[i]`` the index of ``ids[i]`` in it (-1 for padding).
    Returns m."""
    n = ids.shape[0]
    if uniq.shape[0] < n or inverse.shape[0] < n:
        raise ValueError(f"uniq and inverse must hold {n} entries")
    valid = ids >= 0
    u, first, inv = np.unique(ids[valid], return_index=True, return_inverse=True)
    m = u.shape[0]
    if sort:
        uniq[:m] = u
        inverse[:n][valid] = inv.reshape(-1)
    else:
        order = np.argsort(first, kind="stable")    # sorted index, by first occurrence
        rank = np.empty(m, dtype=np.int64)
        rank[order] = np.arange(m)
        uniq[:m] = u[order]
        inverse[:n][valid] = rank[inv.reshape(-1)]
    inverse[:n][~valid] = -1
    return m


def _field_counts(valid, offsets):
    """(B, F) number of valid positions of each example's field."""
    return np.add.reduceat(valid.astype(np.int64), offsets[:-1], axis=1)


def _mean_scale(valid, offsets):
    """(B, F) float32 ``1/count`` where a field has more than one valid position, else 1."""
    counts = _field_counts(valid, offsets).astype(np.float32)
    scale = np.ones_like(counts)
    many = counts > 1
    scale[many] = np.float32(1.0) / counts[many]
    return scale


def gather_pooled(rows, inverse, offsets, mean, out):
    """``out[b, f]``: the sum (or with ``mean`` the sum times 1/count) of
    ``rows[inverse[b, c]]`` over the valid positions c of field f (``offsets[f]`` to
    ``offsets[f + 1]``, each field at least one wide); zeros where none is valid."""
    B, F, d = out.shape
    if B == 0 or F == 0 or d == 0:
        return
    valid = inverse >= 0
    if rows.shape[0] == 0:      # nothing to gather: every position is padding
        out[...] = 0.0
        return
    vals = rows.take(np.where(valid, inverse, 0), axis=0)     # (B, P, d)
    vals[~valid] = 0.0
    # the k-th position of every field at once, k = 0, 1, ...: each sum runs in position
    # order from zero, as the compiled loop's does (np.add.reduceat's order differs)
    out[...] = 0.0
    widths = np.diff(offsets)
    for k in range(int(widths.max())):
        wide = widths > k
        out[:, wide] += vals[:, offsets[:-1][wide] + k]
    if mean:
        out *= _mean_scale(valid, offsets)[:, :, None]


def segment_sum(grad_out, inverse, offsets, mean, grad_rows):
    """The backward of :func:`gather_pooled`: ``grad_rows`` (zeroed first) gets
    ``grad_out[b, f] * scale`` added to row ``inverse[b, c]`` for every valid position c of
    field f, in position order (``scale`` 1, or 1/count with ``mean``)."""
    grad_rows[...] = 0.0
    if grad_rows.size == 0 or inverse.size == 0:
        return
    valid = inverse >= 0
    field = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))   # column -> field
    scale = _mean_scale(valid, offsets) if mean else np.ones(grad_out.shape[:2], np.float32)
    contrib = grad_out[:, field, :] * scale[:, field, None]
    rows, contrib = inverse[valid], contrib[valid]
    for j in range(grad_rows.shape[1]):     # 1-D np.add.at has a fast path; 2-D is ~3x slower
        np.add.at(grad_rows[:, j], rows, contrib[:, j])


def rowwise_adagrad_rows(table, accum, slots, grads, lr, eps):
    """One accumulator per row: ``accum[s] += mean(g**2)``, ``table[s] -= lr /
    sqrt(accum[s] + eps) * g`` for each slot s (distinct) and its gradient row g."""
    if slots.shape[0] == 0 or table.shape[1] == 0:
        return
    lr, eps = np.float32(lr), np.float32(eps)
    ss = np.zeros(slots.shape[0], dtype=np.float32)
    for j in range(grads.shape[1]):     # in element order, as the compiled loop sums
        ss += grads[:, j] * grads[:, j]
    a = accum[slots] + ss / np.float32(grads.shape[1])
    accum[slots] = a
    step = lr / np.sqrt(a + eps)
    table[slots] = table[slots] - step[:, None] * grads


def adagrad_rows(table, accum, slots, grads, lr, eps):
    """Per-element Adagrad on the rows ``slots`` (distinct): ``accum += g*g;
    w -= lr*g / (sqrt(accum) + eps)``, as :func:`adagrad_update` on a dense vector."""
    if slots.shape[0] == 0:
        return
    lr, eps = np.float32(lr), np.float32(eps)
    a = accum[slots] + grads * grads
    accum[slots] = a
    table[slots] = table[slots] - lr * grads / (np.sqrt(a) + eps)


def sgd_rows(table, slots, grads, lr):
    """``table[slots[k]] -= lr * grads[k]`` (slots distinct)."""
    if slots.shape[0] == 0:
        return
    table[slots] = table[slots] - np.float32(lr) * grads


def _probe(keys, vals, ids, mask):
    """The value of each id in the linear-probing map, -1 where it is missing."""
    found = np.full(ids.shape[0], -1, dtype=np.int64)
    pos = _home(ids, mask)
    pending = np.arange(ids.shape[0])
    while pending.size:
        p = pos[pending]
        k = keys[p]
        hit = k == ids[pending]
        found[pending[hit]] = vals[p[hit]]
        pending = pending[~(hit | (k == -1))]
        pos[pending] = (pos[pending] + 1) & mask
    return found


def _place(keys, vals, ids, values, mask):
    """Insert distinct ``ids`` (none in the map yet) with ``values``, each at the first empty
    entry of its probe sequence (of entries that collide, the first id wins, the rest probe
    on)."""
    pos = _home(ids, mask)
    pending = np.arange(ids.shape[0])
    while pending.size:
        p = pos[pending]
        free = keys[p] == -1
        _, first = np.unique(p[free], return_index=True)
        winners = pending[free][first]
        keys[pos[winners]] = ids[winners]
        vals[pos[winners]] = values[winners]
        placed = np.zeros(ids.shape[0], dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        pos[pending] = (pos[pending] + 1) & mask


def lookup_insert(keys, vals, ids, slots, ids_by_slot, n_rows, insert):
    """Slots of ``ids`` in the map ``keys -> vals`` into ``slots`` (-1 when missing); with
    ``insert``, missing ids get the next slots in first-seen order. Returns the new
    ``n_rows``. Same contract as the compiled kernel (map at most half full afterwards)."""
    n = ids.shape[0]
    if vals.shape[0] != keys.shape[0] or slots.shape[0] != n:
        raise ValueError("keys/vals or ids/slots lengths differ")
    if insert and ids_by_slot.shape[0] < n_rows + n:
        raise ValueError("ids_by_slot too short for the ids to insert")
    if keys.shape[0] < 2 * (n_rows + (n if insert else 0)):
        raise ValueError("hash map too full")
    mask = keys.shape[0] - 1
    slots[:] = _probe(keys, vals, ids, mask)
    if insert and n:
        missing = slots < 0
        if missing.any():
            new = ids[missing]
            u, first, inv = np.unique(new, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")
            rank = np.empty(u.shape[0], dtype=np.int64)
            rank[order] = np.arange(u.shape[0])
            m = u.shape[0]
            ids_by_slot[n_rows:n_rows + m] = u[order]
            _place(keys, vals, u[order], np.arange(n_rows, n_rows + m, dtype=np.int64), mask)
            slots[missing] = n_rows + rank[inv.reshape(-1)]
            n_rows += m
    return n_rows


def rebuild_index(keys, vals, ids_by_slot, n_rows):
    """Fill an all-empty map with ``ids_by_slot[s] -> s`` for s < n_rows."""
    if keys.shape[0] < 2 * n_rows or vals.shape[0] != keys.shape[0]:
        raise ValueError("hash map too small")
    _place(keys, vals, ids_by_slot[:n_rows], np.arange(n_rows, dtype=np.int64),
           keys.shape[0] - 1)


def init_rows(rows, ids_by_slot, start, stop, table, seed, scale):
    """Rows ``start:stop`` uniform in [-scale, scale) from (table, id, seed) alone: element
    j of id x from ``mix(mix(mix(mix(seed) ^ table) ^ x) + j)``, top 24 bits in [0, 1)."""
    if start < 0 or stop > rows.shape[0] or stop > ids_by_slot.shape[0] or start > stop:
        raise ValueError("start:stop out of range")
    if stop == start or rows.shape[1] == 0:
        return
    base = np.uint64(mix64(mix64(seed) ^ table))
    key = _mix_array(base ^ ids_by_slot[start:stop].view(np.uint64))
    z = _mix_array(key[:, None] + np.arange(rows.shape[1], dtype=np.uint64)[None, :])
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    rows[start:stop] = (u * np.float32(2.0) - np.float32(1.0)) * np.float32(scale)
