# cython: cdivision=True, boundscheck=False, wraparound=False
"""Strom's compressed updates: threshold + residual, apply, Golomb-Rice coding of index gaps.

The format and the method are described in ``hpcps.compress.codec``, which checks every argument
before coming here and turns the status codes below into exceptions. These functions repeat
only the checks that memory safety needs (buffer lengths), so a caller that skips the Python
layer can get wrong answers but never an access outside an array.

Bits are packed MSB-first: bit ``p`` of a payload is bit ``7 - p % 8`` of byte ``p // 8``.
The reader peeks 64 bits at a time (bytes past the end read as zero, never loaded) and counts
unary runs with ``clz``, so decoding costs a few operations per entry, not per bit.
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    static inline int hpcps_clz64(unsigned long long x) { return x ? __builtin_clzll(x) : 64; }
    #else
    static inline int hpcps_clz64(unsigned long long x) {
        int n = 0;
        if (!x) return 64;
        while (!(x & 0x8000000000000000ULL)) { x <<= 1; n++; }
        return n;
    }
    #endif
    """
    int hpcps_clz64(unsigned long long x) nogil

# Status codes of rice_decode, mirrored in hpcps.compress.codec.
cdef enum:
    OK = 0
    TRUNCATED = 1
    GAP_TOO_LONG = 2
    INDEX_RANGE = 3
    TRAILING_BYTES = 4
    BAD_PADDING = 5

# Elements per block of the threshold loop: the first sweep over a block (add, compare) has
# no data-dependent store, so it vectorizes; only blocks with a hit are swept again, while
# they are still in L1. Measured on 10M weights: 32 was best overall (~1.4 G weights/s at
# density 1e-3, ~0.9 at 1e-2); 16 loses at 1e-3, 64 and 256 lose at 1e-2.
cdef enum:
    BLOCK = 32

MAX_WEIGHTS = 2 ** 31


cdef Py_ssize_t _threshold(float* r, const float* g, Py_ssize_t n, float tau,
                           uint32_t* out) noexcept nogil:
    cdef Py_ssize_t start, stop, i
    cdef Py_ssize_t cnt = 0
    cdef float v
    cdef float ntau = -tau
    cdef int hit
    start = 0
    while start < n:
        stop = start + BLOCK
        if stop > n:
            stop = n
        hit = 0
        for i in range(start, stop):
            v = r[i] + g[i]
            r[i] = v
            hit = hit | (v > tau) | (v < ntau)
        if hit:
            for i in range(start, stop):
                v = r[i]
                if v > tau:
                    out[cnt] = <uint32_t>(i << 1)
                    cnt += 1
                    r[i] = v - tau
                elif v < ntau:
                    out[cnt] = <uint32_t>((i << 1) | 1)
                    cnt += 1
                    r[i] = v + tau
        start = stop
    return cnt


def threshold(float[::1] residual, const float[::1] grad, float tau, uint32_t[::1] out):
    """Add ``grad`` into ``residual`` and emit one word per element beyond ``+-tau``.

    Parameters
    ----------
    residual : float32[::1]
        Per-weight residual, updated in place (``+= grad``, then ``-+= tau`` where emitted).
    grad : float32[::1]
        Gradient of the same length, read only.
    tau : float
        Threshold (> 0, float32).
    out : uint32[::1]
        At least ``len(residual)`` words; the first ``count`` receive the emitted words,
        ``(i << 1) | neg``, in increasing ``i``.

    Returns
    -------
    int
        The number of words written.
    """
    cdef Py_ssize_t n = residual.shape[0]
    cdef Py_ssize_t cnt
    if grad.shape[0] != n:
        raise ValueError(f"length mismatch: residual has {n}, grad has {grad.shape[0]} elements")
    if out.shape[0] < n:
        raise ValueError(f"out holds {out.shape[0]} words, needs {n}")
    if n >= MAX_WEIGHTS:
        raise ValueError(f"model too large: {n} weights, the index field holds < 2**31")
    if n == 0:
        return 0
    with nogil:
        cnt = _threshold(&residual[0], &grad[0], n, tau, &out[0])
    return cnt


cdef Py_ssize_t _first_bad(const uint32_t[::1] words, Py_ssize_t n) noexcept nogil:
    """-1 when every word's index is below ``n``, else the position of the first that is not."""
    cdef Py_ssize_t j, m = words.shape[0]
    cdef uint32_t top = 0
    for j in range(m):  # a max reduction: vectorized, and far cheaper than the scatter
        if words[j] > top:
            top = words[j]
    if m and <Py_ssize_t>(top >> 1) >= n:
        for j in range(m):
            if <Py_ssize_t>(words[j] >> 1) >= n:
                return j
    return -1


def apply(float[::1] weights, const uint32_t[::1] words, float step):
    """Add ``+step`` (sign bit 0) or ``-step`` (sign bit 1) to ``weights[word >> 1]``.

    All indices are checked before any weight is touched, so a bad message changes nothing.

    Returns
    -------
    int
        -1 when applied; otherwise the position in ``words`` of the first word whose index
        is ``>= len(weights)`` (nothing applied).
    """
    cdef Py_ssize_t m = words.shape[0]
    cdef Py_ssize_t j, bad
    cdef float delta[2]
    delta[0] = step
    delta[1] = -step
    with nogil:
        bad = _first_bad(words, weights.shape[0])
    if bad >= 0:
        return bad
    with nogil:
        for j in range(m):
            weights[words[j] >> 1] += delta[words[j] & 1]
    return -1


def apply_counts(float[::1] params, const float[::1] base, int64_t[::1] counts,
                 const uint32_t[::1] words, int64_t multiple, double unit):
    """Dead reckoning's apply: per word, ``counts[i] += multiple`` (sign bit 0) or
    ``-= multiple`` (sign bit 1), ``i = word >> 1``, then ``params[i] = float(base[i] + unit *
    counts[i])`` computed in double. Duplicate indices each count.

    All indices are checked before anything is touched, so a bad message changes nothing.

    Returns
    -------
    int
        -1 when applied; otherwise the position in ``words`` of the first word whose index
        is ``>= len(params)`` (nothing applied).
    """
    cdef Py_ssize_t n = params.shape[0]
    cdef Py_ssize_t m = words.shape[0]
    cdef Py_ssize_t j, i, bad
    cdef int64_t c
    cdef int64_t delta[2]
    if base.shape[0] != n or counts.shape[0] != n:
        raise ValueError(f"params, base and counts differ in length: {n}, {base.shape[0]}, "
                         f"{counts.shape[0]}")
    delta[0] = multiple
    delta[1] = -multiple
    with nogil:
        bad = _first_bad(words, n)
    if bad >= 0:
        return bad
    with nogil:
        for j in range(m):
            i = words[j] >> 1
            c = counts[i] + delta[words[j] & 1]
            counts[i] = c
            params[i] = <float>(<double>base[i] + unit * <double>c)
    return -1


def rice_bits(const uint32_t[::1] words, int k):
    """Payload length in bits of ``words`` Rice-coded with parameter ``k``, without padding.

    Returns -1 when the indices are not strictly increasing (unsorted or duplicated).
    """
    cdef Py_ssize_t m = words.shape[0]
    cdef Py_ssize_t j
    cdef int64_t prev = -1
    cdef int64_t idx
    cdef int64_t total = 0
    cdef int bad = 0
    if k < 0 or k > 30:
        raise ValueError(f"k must be in 0..30, got {k}")
    with nogil:
        for j in range(m):
            idx = words[j] >> 1
            bad = bad | (idx <= prev)
            total += (idx - prev - 1) >> k
            prev = idx
    if bad:
        return -1
    return total + <int64_t>m * (k + 2)


cdef inline Py_ssize_t _put(uint8_t* out, Py_ssize_t nout, Py_ssize_t o, uint64_t* acc,
                            int* nacc, uint64_t value, int nbits) noexcept nogil:
    # Append the low ``nbits`` (<= 32) of value; flush whole bytes. Returns the new byte
    # position, or -1 when ``out`` is full.
    acc[0] = (acc[0] << nbits) | value
    nacc[0] += nbits
    while nacc[0] >= 8:
        if o >= nout:
            return -1
        nacc[0] -= 8
        out[o] = <uint8_t>(acc[0] >> nacc[0])
        o += 1
    acc[0] &= ((<uint64_t>1) << nacc[0]) - 1
    return o


def rice_encode(const uint32_t[::1] words, int k, uint8_t[::1] out):
    """Rice-code the index gaps of strictly increasing ``words`` into ``out``.

    Per word: ``gap >> k`` one-bits, a zero bit, the ``k`` low bits of the gap, the sign bit.
    The last byte is padded with one-bits (so an extra entry can never be read from it).

    Returns
    -------
    int
        Bytes written; -1 when ``out`` is too small, -2 when the indices are not strictly
        increasing.
    """
    cdef Py_ssize_t m = words.shape[0]
    cdef Py_ssize_t nout = out.shape[0]
    cdef Py_ssize_t j
    cdef Py_ssize_t o = 0
    cdef uint64_t acc = 0
    cdef int nacc = 0
    cdef int64_t prev = -1
    cdef int64_t idx, gap, q
    cdef uint64_t lowmask = ((<uint64_t>1) << k) - 1
    if k < 0 or k > 30:
        raise ValueError(f"k must be in 0..30, got {k}")
    if nout == 0:
        return 0 if m == 0 else -1
    with nogil:
        for j in range(m):
            idx = words[j] >> 1
            if idx <= prev:
                o = -2
                break
            gap = idx - prev - 1
            prev = idx
            q = gap >> k
            while q >= 32 and o >= 0:
                o = _put(&out[0], nout, o, &acc, &nacc, 0xFFFFFFFF, 32)
                q -= 32
            if o < 0:
                break
            # q ones and the terminating zero, then k low bits and the sign: <= 32 + 31 bits.
            o = _put(&out[0], nout, o, &acc, &nacc, (((<uint64_t>1) << q) - 1) << 1, <int>q + 1)
            if o < 0:
                break
            o = _put(&out[0], nout, o, &acc, &nacc,
                     ((<uint64_t>gap & lowmask) << 1) | (words[j] & 1), k + 1)
            if o < 0:
                break
        if o >= 0 and nacc > 0:
            o = _put(&out[0], nout, o, &acc, &nacc, ((<uint64_t>1) << (8 - nacc)) - 1,
                     8 - nacc)
    return o


cdef inline uint64_t _peek(const uint8_t* buf, Py_ssize_t nbytes, int64_t pos) noexcept nogil:
    # 64 bits from bit ``pos`` on, MSB-aligned; at least the top 57 are payload bits (or
    # zeros past the end, which are never loaded).
    cdef Py_ssize_t b = <Py_ssize_t>(pos >> 3)
    cdef uint64_t x = 0
    cdef int t
    if b + 8 <= nbytes:
        for t in range(8):
            x = (x << 8) | buf[b + t]
    else:
        for t in range(8):
            x = x << 8
            if b + t < nbytes:
                x = x | buf[b + t]
    return x << (pos & 7)


def rice_decode(const uint8_t[::1] payload, Py_ssize_t count, int k, Py_ssize_t n_weights,
                uint32_t[::1] out, int64_t[::1] info):
    """Decode ``count`` Rice-coded entries of ``payload`` into ``out``; never read past it.

    Parameters
    ----------
    payload : uint8[::1]
        The bytes after the header, as received.
    count, k, n_weights : int
        From the header (``k`` in 0..30) and the receiver's model size (< 2**31).
    out : uint32[::1]
        At least ``count`` words.
    info : int64[::1]
        Three slots, filled on error: bit position (start of the failing entry, or of the
        unused bits), entry number, and the offending value (index or bits left).

    Returns
    -------
    int
        0 (OK), 1 (truncated), 2 (gap runs past the last weight), 3 (index out of range),
        4 (whole unused bytes at the end), 5 (padding bits not all ones).
    """
    cdef Py_ssize_t nbytes = payload.shape[0]
    cdef int64_t total = <int64_t>nbytes * 8
    cdef int64_t pos = 0
    cdef int64_t start = 0
    cdef int64_t prev = -1
    cdef int64_t gapmax, qmax, q, idx, rem
    cdef Py_ssize_t j = 0
    cdef uint64_t x, v
    cdef int run
    cdef int status = OK
    cdef const uint8_t* buf
    if info.shape[0] < 3:
        raise ValueError("info needs 3 slots")
    if out.shape[0] < count or count < 0:
        raise ValueError(f"out holds {out.shape[0]} words, needs {count}")
    if k < 0 or k > 30:
        raise ValueError(f"k must be in 0..30, got {k}")
    if n_weights < 0 or n_weights >= MAX_WEIGHTS:
        raise ValueError(f"n_weights must be in 0..2**31-1, got {n_weights}")
    if nbytes == 0:
        if count == 0:
            return OK
        info[0] = 0
        info[1] = 0
        info[2] = 0
        return TRUNCATED
    buf = &payload[0]
    with nogil:
        while j < count:
            start = pos
            gapmax = n_weights - prev - 2
            if gapmax < 0:
                status = INDEX_RANGE
                idx = prev + 1
                break
            qmax = gapmax >> k
            q = 0
            while True:
                x = _peek(buf, nbytes, pos)
                run = hpcps_clz64(~x)
                if run >= 57:
                    q += 57
                    pos += 57
                    if q > qmax:
                        break
                else:
                    q += run
                    pos += run
                    break
            if q > qmax:
                status = GAP_TOO_LONG
                idx = qmax
                break
            if pos >= total:  # the terminating zero lies past the end
                status = TRUNCATED
                idx = total - start
                break
            pos += 1
            if pos + k + 1 > total:
                status = TRUNCATED
                idx = total - start
                break
            v = _peek(buf, nbytes, pos) >> (63 - k)
            pos += k + 1
            idx = prev + 1 + ((q << k) | <int64_t>(v >> 1))
            if idx >= n_weights:
                status = INDEX_RANGE
                break
            out[j] = <uint32_t>((idx << 1) | <int64_t>(v & 1))
            prev = idx
            j += 1
        if status == OK:
            rem = total - pos
            start = pos
            idx = rem
            if rem >= 8:
                status = TRAILING_BYTES
            elif rem > 0 and (_peek(buf, nbytes, pos) >> (64 - rem)) != \
                    (((<uint64_t>1) << rem) - 1):
                status = BAD_PADDING
    if status != OK:
        info[0] = start
        info[1] = j
        info[2] = idx
    return status


# ------------------------------------------------------------------ bfloat16 on the wire
# bfloat16 is the top half of a float32: the same sign and 8-bit exponent, 7 stored mantissa
# bits. Encoding rounds to the nearest bf16, ties to even, by adding 0x7FFF plus the lowest
# kept bit before the shift; a NaN stays a (quiet) NaN of the same sign, since rounding its
# payload could carry into the exponent and make it an infinity. Checked arguments come from
# hpcps.compress.bf16; the loops have no branches but the NaN select, so GCC vectorizes them.

cdef inline uint16_t _to_bf16(uint32_t u) noexcept nogil:
    # both results, then a select: no branch, so the loops that call it vectorize
    cdef uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16
    cdef uint32_t quiet = (u >> 16) | 0x0040u
    return <uint16_t>(quiet if (u & 0x7FFFFFFFu) > 0x7F800000u else rounded)


def bf16_encode(const float[::1] x, uint16_t[::1] out):
    """out[i] = x[i] rounded to bfloat16 (nearest, ties to even), as its 16 bits."""
    cdef Py_ssize_t i, n = x.shape[0]
    if out.shape[0] < n:
        raise ValueError("out is shorter than x")
    if n == 0:
        return
    cdef const uint32_t* u = <const uint32_t*>&x[0]
    cdef uint16_t* o = &out[0]
    with nogil:
        for i in range(n):
            o[i] = _to_bf16(u[i])


def bf16_decode(const uint16_t[::1] b, float[::1] out):
    """out[i] = the float32 value of bfloat16 bits b[i] (exact)."""
    cdef Py_ssize_t i, n = b.shape[0]
    if out.shape[0] < n:
        raise ValueError("out is shorter than b")
    if n == 0:
        return
    cdef const uint16_t* s = &b[0]
    cdef uint32_t* o = <uint32_t*>&out[0]
    with nogil:
        for i in range(n):
            o[i] = (<uint32_t>s[i]) << 16


def bf16_accumulate(const uint16_t[::1] b, float[::1] acc):
    """acc[i] += the float32 value of bfloat16 bits b[i] (the sum in float32)."""
    cdef Py_ssize_t i, n = b.shape[0]
    if acc.shape[0] < n:
        raise ValueError("acc is shorter than b")
    if n == 0:
        return
    cdef const uint16_t* s = &b[0]
    cdef float* a = &acc[0]
    cdef uint32_t bits
    cdef float v
    with nogil:
        for i in range(n):
            bits = (<uint32_t>s[i]) << 16
            v = (<float*>&bits)[0]
            a[i] += v


def bf16_sum(const uint16_t[::1] words, Py_ssize_t parts, uint16_t[::1] out):
    """out[i] = the sum, in float32 and in order p = 0, 1, ..., of the bfloat16 values
    words[p * m + i] over the ``parts`` blocks of m = len(out) values, rounded to bfloat16:
    a reduce-scatter's own block, summed and ready for the allgather in one pass (in tiles
    that stay in L1, each block added across a tile at a time so that the adds vectorize)."""
    cdef Py_ssize_t i, j, p, lo, hi, m = out.shape[0]
    if parts < 1 or words.shape[0] < parts * m:
        raise ValueError("words holds fewer than parts x len(out) values")
    if m == 0:
        return
    cdef const uint16_t* s = &words[0]
    cdef uint16_t* o = &out[0]
    cdef float acc[1024]
    cdef uint32_t bits
    with nogil:
        lo = 0
        while lo < m:
            hi = lo + 1024 if lo + 1024 < m else m
            for j in range(hi - lo):
                acc[j] = 0.0
            for p in range(parts):
                for j in range(hi - lo):
                    bits = (<uint32_t>s[p * m + lo + j]) << 16
                    acc[j] = acc[j] + (<float*>&bits)[0]
            for j in range(hi - lo):
                o[lo + j] = _to_bf16((<uint32_t*>&acc[j])[0])
            lo = hi
