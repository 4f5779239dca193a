# cython: cdivision=True, boundscheck=False, wraparound=False, initializedcheck=False
"""Kernels for sparse embedding tables, without the GIL: float32 rows, int64 ids.

A replica's step touches a few thousand rows of tables that may hold 10^7-10^10: it finds
the unique ids of its batch (``unique_inverse``), pulls those rows, pools them into the
batch (``gather_pooled``), and after backward sums each row's gradient over the positions
that used it (``segment_sum``); the shard applies the summed gradients to its rows
(``rowwise_adagrad_rows``, ``adagrad_rows``, ``sgd_rows``). The shard's row store (hash
map from id to slot, rows created on first touch) uses ``lookup_insert``,
``rebuild_index`` and ``init_rows``.

Hogwild-safe: every function works on the arrays it is given and on scratch it allocates
itself (``malloc``, thread-safe), keeps no global state and releases the GIL for its whole
loop, so several threads may call them at once. Threads writing the same rows of a table
(``rowwise_adagrad_rows`` etc. on overlapping slots) race as Hogwild's updates do: a float is
written whole, so a row may miss or mix an update but never holds garbage. The store's
``lookup_insert`` changes the hash map and must not run concurrently with another call on
the same map.

Callers should use ``hpcps.kernels.embedding``, which checks dtypes, shapes, id and index
ranges before coming here; this module trusts its input (an index out of range would write
outside the arrays).
"""
from libc.math cimport sqrtf
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy, memset

cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL
cdef uint64_t MIX1 = 0xBF58476D1CE4E5B9ULL
cdef uint64_t MIX2 = 0x94D049BB133111EBULL
cdef int64_t EMPTY = -1     # an empty hash slot; ids are >= 0, -1 is padding
# The shard's map hashes ids salted: placing rows on shards by a hash of the id makes all
# of a shard's ids agree in some bits of that hash, and if the map used the same hash its
# home positions would crowd into a fraction of the map.
cdef uint64_t MAP_SALT = 0x2545F4914F6CDD1DULL


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    """splitmix64: one step of the generator, a bijection on 64 bits with good avalanche."""
    z = z + GOLDEN
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    return z ^ (z >> 31)


cdef int _cmp_int64(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0]
    cdef int64_t y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


def mix64(uint64_t z):
    """splitmix64 of ``z`` (for tests: the reference must hash the same way)."""
    return _mix(z)


# --------------------------------------------------------------------------- unique

cdef Py_ssize_t _unique(const int64_t* ids, Py_ssize_t n, int64_t* uniq, int64_t* inverse,
                        bint sort) noexcept nogil:
    """First-seen (or sorted) unique ids and the inverse; -1 on an allocation failure."""
    cdef Py_ssize_t cap = 16, i, j, m = 0
    cdef uint64_t mask, h
    cdef int64_t x, k
    cdef int64_t* keys
    cdef int64_t* first
    cdef int64_t* rank
    while cap < 2 * n:
        cap <<= 1
    mask = <uint64_t>(cap - 1)
    keys = <int64_t*>malloc(cap * sizeof(int64_t))
    first = <int64_t*>malloc(cap * sizeof(int64_t))
    if keys == NULL or first == NULL:
        free(keys)
        free(first)
        return -1
    memset(keys, 0xFF, cap * sizeof(int64_t))      # every key EMPTY (-1)
    for i in range(n):
        x = ids[i]
        if x < 0:
            inverse[i] = -1
            continue
        h = _mix(<uint64_t>x) & mask
        while True:
            k = keys[h]
            if k == x:
                inverse[i] = first[h]
                break
            if k == EMPTY:
                keys[h] = x
                first[h] = m
                uniq[m] = x
                inverse[i] = m
                m += 1
                break
            h = (h + 1) & mask
    if sort and m > 1:
        rank = <int64_t*>malloc(m * sizeof(int64_t))
        if rank == NULL:
            free(keys)
            free(first)
            return -1
        qsort(uniq, m, sizeof(int64_t), _cmp_int64)
        for j in range(m):      # rank[first-seen index] = sorted index
            x = uniq[j]
            h = _mix(<uint64_t>x) & mask
            while keys[h] != x:
                h = (h + 1) & mask
            rank[first[h]] = j
        for i in range(n):
            if inverse[i] >= 0:
                inverse[i] = rank[inverse[i]]
        free(rank)
    free(keys)
    free(first)
    return m


def unique_inverse(const int64_t[::1] ids, int64_t[::1] uniq, int64_t[::1] inverse,
                   bint sort=False):
    """Unique ids of ``ids`` (ids < 0 are padding, left out) into ``uniq``, and for each
    position the index of its id in ``uniq`` (-1 for padding) into ``inverse``.

    Returns the number of unique ids (the first entries of ``uniq``): first-seen order, or
    ascending with ``sort``. ``uniq`` and ``inverse`` must hold ``len(ids)`` entries.
    """
    cdef Py_ssize_t n = ids.shape[0], m
    if uniq.shape[0] < n or inverse.shape[0] < n:
        raise ValueError(f"uniq and inverse must hold {n} entries")
    if n == 0:
        return 0
    with nogil:
        m = _unique(&ids[0], n, &uniq[0], &inverse[0], sort)
    if m < 0:
        raise MemoryError("unique_inverse: no memory for the hash table")
    return m


# --------------------------------------------------------------------------- gather, backward

def gather_pooled(const float[:, ::1] rows, const int64_t[:, ::1] inverse,
                  const int64_t[::1] offsets, bint mean, float[:, :, ::1] out):
    """``out[b, f] = pool(rows[inverse[b, c]] for c in offsets[f]:offsets[f+1], c valid)``.

    ``pool`` is the sum, or with ``mean`` the sum times ``1/count`` of valid positions;
    positions with ``inverse < 0`` (padding) are skipped; no valid position gives zeros.
    Sums run over the positions in order, in float32.
    """
    cdef Py_ssize_t B = inverse.shape[0], F = offsets.shape[0] - 1, d = rows.shape[1]
    cdef Py_ssize_t b, f, c, j, cnt
    cdef int64_t r
    cdef float inv
    cdef float* o
    cdef const float* src
    if out.shape[0] != B or out.shape[1] != F or out.shape[2] != d:
        raise ValueError("out must have shape (batch, fields, dim)")
    if B == 0 or F == 0 or d == 0:
        return
    with nogil:
        for b in range(B):
            for f in range(F):
                o = &out[b, f, 0]
                if offsets[f + 1] - offsets[f] == 1:     # single-valued: a copy
                    r = inverse[b, offsets[f]]
                    if r < 0:
                        memset(o, 0, d * sizeof(float))
                    else:
                        memcpy(o, &rows[r, 0], d * sizeof(float))
                    continue
                for j in range(d):
                    o[j] = 0.0
                cnt = 0
                for c in range(offsets[f], offsets[f + 1]):
                    r = inverse[b, c]
                    if r < 0:
                        continue
                    src = &rows[r, 0]
                    for j in range(d):
                        o[j] = o[j] + src[j]
                    cnt += 1
                if mean and cnt > 1:
                    inv = <float>1.0 / <float>cnt
                    for j in range(d):
                        o[j] = o[j] * inv


def segment_sum(const float[:, :, ::1] grad_out, const int64_t[:, ::1] inverse,
                const int64_t[::1] offsets, bint mean, float[:, ::1] grad_rows):
    """The backward of ``gather_pooled``: ``grad_rows`` (zeroed first) gets, for every valid
    position ``(b, c)`` of field ``f``, ``grad_out[b, f] * scale`` added to row
    ``inverse[b, c]``; ``scale`` is 1, or ``1/count`` with ``mean``. Positions are visited
    in order, so a row's sum runs in position order, in float32.
    """
    cdef Py_ssize_t B = inverse.shape[0], F = offsets.shape[0] - 1, d = grad_rows.shape[1]
    cdef Py_ssize_t n = grad_rows.shape[0], b, f, c, j, cnt
    cdef int64_t r
    cdef float scale
    cdef const float* g
    cdef float* dst
    if grad_out.shape[0] != B or grad_out.shape[1] != F or grad_out.shape[2] != d:
        raise ValueError("grad_out must have shape (batch, fields, dim)")
    if n == 0 or d == 0:
        return
    with nogil:
        memset(&grad_rows[0, 0], 0, n * d * sizeof(float))
        for b in range(B):
            for f in range(F):
                scale = 1.0
                if mean:
                    cnt = 0
                    for c in range(offsets[f], offsets[f + 1]):
                        if inverse[b, c] >= 0:
                            cnt += 1
                    if cnt > 1:
                        scale = <float>1.0 / <float>cnt
                g = &grad_out[b, f, 0]
                for c in range(offsets[f], offsets[f + 1]):
                    r = inverse[b, c]
                    if r < 0:
                        continue
                    dst = &grad_rows[r, 0]
                    for j in range(d):
                        dst[j] = dst[j] + g[j] * scale


# --------------------------------------------------------------------------- shard updates

def rowwise_adagrad_rows(float[:, ::1] table, float[::1] accum, const int64_t[::1] slots,
                    const float[:, ::1] grads, float lr, float eps):
    """For each k, row ``s = slots[k]``: ``accum[s] += mean(grads[k]**2)``, then
    ``table[s] -= lr / sqrt(accum[s] + eps) * grads[k]``. One accumulator per row."""
    cdef Py_ssize_t n = slots.shape[0], d = table.shape[1], k, j
    cdef int64_t s
    cdef float ss, a, step, gj
    cdef float* w
    cdef const float* g
    if grads.shape[0] != n or grads.shape[1] != d:
        raise ValueError("grads must have shape (len(slots), dim)")
    if n == 0 or d == 0:
        return
    with nogil:
        for k in range(n):
            s = slots[k]
            g = &grads[k, 0]
            w = &table[s, 0]
            ss = 0.0
            for j in range(d):
                gj = g[j]
                ss = ss + gj * gj
            a = accum[s] + ss / <float>d
            accum[s] = a
            step = lr / sqrtf(a + eps)
            for j in range(d):
                w[j] = w[j] - step * g[j]


def adagrad_rows(float[:, ::1] table, float[:, ::1] accum, const int64_t[::1] slots,
            const float[:, ::1] grads, float lr, float eps):
    """Per-element Adagrad on the rows ``slots``, as ``hpcps.kernels.adagrad_update`` does on
    a dense vector: ``accum += g*g; w -= lr*g / (sqrt(accum) + eps)``."""
    cdef Py_ssize_t n = slots.shape[0], d = table.shape[1], k, j
    cdef int64_t s
    cdef float a, gj
    cdef float* w
    cdef float* acc
    cdef const float* g
    if grads.shape[0] != n or grads.shape[1] != d:
        raise ValueError("grads must have shape (len(slots), dim)")
    if n == 0 or d == 0:
        return
    with nogil:
        for k in range(n):
            s = slots[k]
            g = &grads[k, 0]
            w = &table[s, 0]
            acc = &accum[s, 0]
            for j in range(d):
                gj = g[j]
                a = acc[j] + gj * gj
                acc[j] = a
                w[j] = w[j] - lr * gj / (sqrtf(a) + eps)


def sgd_rows(float[:, ::1] table, const int64_t[::1] slots, const float[:, ::1] grads, float lr):
    """``table[slots[k]] -= lr * grads[k]`` for each k."""
    cdef Py_ssize_t n = slots.shape[0], d = table.shape[1], k, j
    cdef float* w
    cdef const float* g
    if grads.shape[0] != n or grads.shape[1] != d:
        raise ValueError("grads must have shape (len(slots), dim)")
    if n == 0 or d == 0:
        return
    with nogil:
        for k in range(n):
            g = &grads[k, 0]
            w = &table[slots[k], 0]
            for j in range(d):
                w[j] = w[j] - lr * g[j]


# --------------------------------------------------------------------------- row store

def lookup_insert(int64_t[::1] keys, int64_t[::1] vals, const int64_t[::1] ids,
                  int64_t[::1] slots, int64_t[::1] ids_by_slot, int64_t n_rows, bint insert):
    """Look ``ids`` (>= 0) up in the linear-probing map ``keys -> vals`` (capacity a power of
    two, EMPTY = -1, the home of id x at ``mix(x ^ MAP_SALT)``); write each one's slot to
    ``slots``. A missing id gets -1, or with ``insert`` the next slot ``n_rows`` (then
    ``ids_by_slot[slot] = id``). Returns the new ``n_rows``. The caller keeps the map at
    most half full and ``ids_by_slot`` large enough for every id to be new."""
    cdef Py_ssize_t n = ids.shape[0], i
    cdef uint64_t mask = <uint64_t>(keys.shape[0] - 1), h
    cdef int64_t x, k
    if vals.shape[0] != keys.shape[0] or slots.shape[0] != n:
        raise ValueError("keys/vals or ids/slots lengths differ")
    if insert and ids_by_slot.shape[0] < n_rows + n:
        raise ValueError("ids_by_slot too short for the ids to insert")
    if keys.shape[0] < 2 * (n_rows + (n if insert else 0)):
        raise ValueError("hash map too full")
    with nogil:
        for i in range(n):
            x = ids[i]
            h = _mix(<uint64_t>x ^ MAP_SALT) & mask
            while True:
                k = keys[h]
                if k == x:
                    slots[i] = vals[h]
                    break
                if k == EMPTY:
                    if insert:
                        keys[h] = x
                        vals[h] = n_rows
                        ids_by_slot[n_rows] = x
                        slots[i] = n_rows
                        n_rows += 1
                    else:
                        slots[i] = -1
                    break
                h = (h + 1) & mask
    return n_rows


def rebuild_index(int64_t[::1] keys, int64_t[::1] vals, const int64_t[::1] ids_by_slot,
                  int64_t n_rows):
    """Fill an all-EMPTY map ``keys -> vals`` with ``ids_by_slot[s] -> s`` for s < n_rows
    (after the map grows)."""
    cdef uint64_t mask = <uint64_t>(keys.shape[0] - 1), h
    cdef int64_t s, x
    if keys.shape[0] < 2 * n_rows or vals.shape[0] != keys.shape[0]:
        raise ValueError("hash map too small")
    with nogil:
        for s in range(n_rows):
            x = ids_by_slot[s]
            h = _mix(<uint64_t>x ^ MAP_SALT) & mask
            while keys[h] != EMPTY:
                h = (h + 1) & mask
            keys[h] = x
            vals[h] = s


def init_rows(float[:, ::1] rows, const int64_t[::1] ids_by_slot, int64_t start,
              int64_t stop, uint64_t table, uint64_t seed, float scale):
    """Rows ``start:stop`` get their initial values, uniform in ``[-scale, scale)``, from
    (table, id, seed) alone: element j of id x is drawn from
    ``mix(mix(mix(mix(seed) ^ table) ^ x) + j)``, its top 24 bits as a float in [0, 1)."""
    cdef Py_ssize_t d = rows.shape[1], j
    cdef int64_t s
    cdef uint64_t base = _mix(_mix(seed) ^ table), key
    cdef float u
    if start < 0 or stop > rows.shape[0] or stop > ids_by_slot.shape[0] or start > stop:
        raise ValueError("start:stop out of range")
    with nogil:
        for s in range(start, stop):
            key = _mix(base ^ <uint64_t>ids_by_slot[s])
            for j in range(d):
                u = <float>(_mix(key + <uint64_t>j) >> 40) * <float>(1.0 / 16777216.0)
                rows[s, j] = (u * <float>2.0 - <float>1.0) * scale
