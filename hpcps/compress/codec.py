"""Strom's (2015) compressed updates: residual thresholding, 1-bit words, Golomb-Rice coding.

The method
----------
Each worker keeps a per-weight *residual*. After each mini-batch it adds its gradient into the
residual; every element whose residual is now above ``+tau`` (below ``-tau``) is sent as one
update of ``+tau`` (``-tau``), and ``tau`` is subtracted from (added to) that element's
residual. The quantization error stays in the residual, never dropped, so small but biased
gradient elements are sent too, only later ("delayed updates" of variable length). Receivers
add ``+-tau`` to their own replica for every update of every message ("dead reckoning");
addition commutes, so messages may arrive in any order. No MPI here: the strategy that sends
messages is handed a :class:`Compressor`.

Word format
-----------
One update is one ``uint32``: ``word = (index << 1) | neg``, ``neg = 1`` for ``-tau``, ``0``
for ``+tau``. Sorting words sorts them by index. The index has 31 bits, so a model (or the
slice one compressor covers) must have fewer than ``MAX_WEIGHTS = 2**31`` weights.

Message format
--------------
A 16-byte little-endian header, then the payload::

    offset  type    field
    0       uint32  magic 0x31435048 (the bytes "HPC1")
    4       uint8   version, 1
    5       uint8   coding: 0 = raw words, 1 = Golomb-Rice
    6       uint8   k, the Rice parameter (0..30; 0 for raw)
    7       uint8   reserved, 0
    8       uint32  count, the number of words
    12      uint32  payload_bytes, exactly the bytes after the header

Raw payload: the ``count`` words as little-endian ``uint32``, in the order given.

Golomb-Rice payload: the words sorted, indices strictly increasing. The gaps between indices
(the first gap is the first index, then ``index[j] - index[j-1] - 1 >= 0``) are coded one
entry per word: ``gap >> k`` one-bits, a zero bit, the ``k`` low bits of the gap (most
significant first), then the sign bit. Bits are packed MSB-first: payload bit ``p`` is bit
``7 - p % 8`` of byte ``p // 8``. The last byte is padded with *one*-bits (as JPEG does) so
that neither a larger nor a smaller ``count`` can decode cleanly: an extra entry would need a
zero bit the padding does not have, a missing one leaves a zero bit where padding should be.
``k`` is chosen per message to make the payload as short as possible: the coded length is
convex in ``k``, so a walk from ``floor(log2(mean gap))`` finds the exact minimum in a few
passes. Random gaps at density ``d`` cost about ``log2(1/d) + 2.5`` bits per update; Strom
reports 10-11.

Decoding takes bytes from the network: every header field is checked, the payload is read
with explicit bounds, and any inconsistency raises :class:`CodecError` naming the bit where
decoding stopped. A decoded message has only indices below the receiver's weight count.

Implementations
---------------
The loops are compiled from ``ext/compress.pyx`` into ``hpcps.kernels._compress``; where that
module does not load, the NumPy versions in :class:`NumpyReference` are used (with one
warning at import), and ``HPCPS_NO_EXTENSION=1`` forces them. Both return the same results,
bit for bit, and the same error positions (the tests compare them).
"""
from __future__ import annotations

import math
import operator
import struct

import numpy as np

from hpcps.errors import HpcpsError
from hpcps import kernels
from hpcps.kernels import load_extension

MAX_WEIGHTS = 2**31
MAGIC = 0x31435048
VERSION = 1
CODING_RAW = 0
CODING_GOLOMB = 1
MAX_K = 30
HEADER = struct.Struct("<IBBBBII")
HEADER_BYTES = HEADER.size  # 16

# Status codes of rice_decode (the same in ext/compress.pyx).
OK, TRUNCATED, GAP_TOO_LONG, INDEX_RANGE, TRAILING_BYTES, BAD_PADDING = range(6)

__all__ = [
    "MAX_WEIGHTS", "CodecError", "Compressor", "threshold", "apply", "apply_counts", "encode",
    "decode",
    "gap_entropy_bits", "bits_per_update", "HAVE_EXTENSION",
]


class CodecError(HpcpsError):
    """A compressed message is truncated, corrupt, or does not fit the receiver's model."""

    exit_code = 6


class NumpyReference:
    """NumPy versions of the compiled kernels: same signatures, same results, same errors.

    They define what ``hpcps.kernels._compress`` must compute and are the fallback where it
    is not built. Callers are the public functions below, which check the arguments first.
    """

    _BLOCK = 1 << 16  # elements per block of threshold: bounded temporaries

    @staticmethod
    def threshold(residual, grad, tau, out):
        """``residual += grad``; write words beyond ``+-tau`` to ``out``; return their count."""
        n = residual.shape[0]
        if grad.shape[0] != n:
            raise ValueError(
                f"length mismatch: residual has {n}, grad has {grad.shape[0]} elements")
        if out.shape[0] < n:
            raise ValueError(f"out holds {out.shape[0]} words, needs {n}")
        tau = np.float32(tau)
        count = 0
        for start in range(0, n, NumpyReference._BLOCK):
            stop = min(start + NumpyReference._BLOCK, n)
            r = residual[start:stop]
            r += grad[start:stop]
            pos = r > tau
            neg = r < -tau
            hit = np.flatnonzero(pos | neg)
            if hit.size:
                words = ((hit + start).astype(np.uint32) << 1) | neg[hit]
                out[count:count + hit.size] = words
                count += hit.size
                r[pos] -= tau
                r[neg] += tau
        return count

    @staticmethod
    def apply(weights, words, step):
        """Add ``+-step`` per word; return -1, or the position of the first bad word."""
        idx = words >> 1
        bad = np.flatnonzero(idx >= weights.shape[0])
        if bad.size:
            return int(bad[0])
        step = np.float32(step)
        deltas = np.where(words & 1, -step, step).astype(np.float32)
        np.add.at(weights, idx, deltas)  # unbuffered: duplicate indices each count, in order
        return -1

    @staticmethod
    def apply_counts(params, base, counts, words, multiple, unit):
        """Dead reckoning's apply (see :func:`apply_counts`); -1, or the first bad word."""
        n = params.shape[0]
        if base.shape[0] != n or counts.shape[0] != n:
            raise ValueError(f"params, base and counts differ in length: {n}, "
                             f"{base.shape[0]}, {counts.shape[0]}")
        idx = (words >> 1).astype(np.intp)
        bad = np.flatnonzero(idx >= n)
        if bad.size:
            return int(bad[0])
        signs = 1 - 2 * (words & 1).astype(np.int64)
        np.add.at(counts, idx, int(multiple) * signs)  # unbuffered: duplicates each count
        params[idx] = base[idx] + float(unit) * counts[idx].astype(np.float64)
        return -1

    @staticmethod
    def _gaps(words):
        idx = (words >> 1).astype(np.int64)
        return np.diff(idx, prepend=-1) - 1

    @staticmethod
    def rice_bits(words, k):
        """Coded length in bits (no padding); -1 if indices are not strictly increasing."""
        gaps = NumpyReference._gaps(words)
        if gaps.size and gaps.min() < 0:
            return -1
        return int((gaps >> k).sum()) + words.shape[0] * (k + 2)

    @staticmethod
    def rice_encode(words, k, out):
        """Write the payload to ``out``; return bytes written, -1 (too small), -2 (order)."""
        m = words.shape[0]
        if m == 0:
            return 0
        gaps = NumpyReference._gaps(words)
        if gaps.min() < 0:
            return -2
        q = gaps >> k
        lengths = q + k + 2
        nbits = int(lengths.sum())
        nbytes = (nbits + 7) // 8
        if nbytes > out.shape[0]:
            return -1
        starts = np.cumsum(lengths) - lengths
        bits = np.zeros(nbytes * 8, dtype=np.uint8)
        total_q = int(q.sum())
        if total_q:
            offsets = np.arange(total_q) - np.repeat(np.cumsum(q) - q, q)
            bits[np.repeat(starts, q) + offsets] = 1
        low = ((gaps & ((1 << k) - 1)) << 1) | (words & 1)  # k low bits, then the sign
        base = starts + q + 1
        for t in range(k + 1):
            bits[base + t] = (low >> (k - t)) & 1
        bits[nbits:] = 1  # padding
        out[:nbytes] = np.packbits(bits)
        return nbytes

    @staticmethod
    def rice_decode(payload, count, k, n_weights, out, info):
        """Decode into ``out``; return a status code, with position details in ``info``."""
        nbytes = payload.shape[0]
        total = 8 * nbytes
        if out.shape[0] < count or count < 0:
            raise ValueError(f"out holds {out.shape[0]} words, needs {count}")
        if nbytes == 0:
            if count == 0:
                return OK
            info[:3] = 0
            return TRUNCATED
        bits = np.unpackbits(np.asarray(payload, dtype=np.uint8))
        zeros = np.flatnonzero(bits == 0)
        # next_zero[p]: the first zero bit at or after p (total when none: past-the-end bits
        # read as zero in the compiled kernel too).
        next_zero = np.append(zeros, total)[np.searchsorted(zeros, np.arange(total + 1))]
        padded = np.concatenate([bits, np.zeros(k + 1, dtype=np.uint8)]).astype(np.int64)
        value = np.zeros(total + 1, dtype=np.int64)  # value[p]: the k+1 bits from p on
        for t in range(k + 1):
            value = (value << 1) | padded[t:t + total + 1]
        next_zero, value = next_zero.tolist(), value.tolist()

        def fail(status, where, j, detail):
            info[0], info[1], info[2] = where, j, detail
            return status

        decoded = []
        pos, prev = 0, -1
        for j in range(count):
            start = pos
            gapmax = n_weights - prev - 2
            if gapmax < 0:
                return fail(INDEX_RANGE, start, j, prev + 1)
            qmax = gapmax >> k
            z = next_zero[pos]
            q = z - pos
            if q > qmax:
                return fail(GAP_TOO_LONG, start, j, qmax)
            if z >= total:
                return fail(TRUNCATED, start, j, total - start)
            pos = z + 1
            if pos + k + 1 > total:
                return fail(TRUNCATED, start, j, total - start)
            v = value[pos]
            pos += k + 1
            idx = prev + 1 + ((q << k) | (v >> 1))
            if idx >= n_weights:
                return fail(INDEX_RANGE, start, j, idx)
            decoded.append((idx << 1) | (v & 1))
            prev = idx
        out[:count] = decoded
        rem = total - pos
        if rem >= 8:
            return fail(TRAILING_BYTES, pos, count, rem)
        if rem and not bits[pos:].all():
            return fail(BAD_PADDING, pos, count, rem)
        return OK


reference = NumpyReference

_impl, HAVE_EXTENSION = load_extension("_compress", reference, "hpcps.compress.codec")


# ----------------------------------------------------------------------------- checks

def check_n_weights(n, name="model"):
    """Return ``n`` as an int if a word can address ``n`` weights, else raise ValueError.

    Separate from the functions that allocate, so the limit can be tested without 8 GB.
    """
    try:
        n = operator.index(n)
    except TypeError:
        raise ValueError(f"{name} size must be an integer, got {n!r}") from None
    if n < 0:
        raise ValueError(f"{name} size must be >= 0, got {n}")
    if n >= MAX_WEIGHTS:
        raise ValueError(
            f"{name} too large: {n} weights, but a word's 31-bit index field addresses fewer "
            f"than 2**31 = {MAX_WEIGHTS}; use one compressor per slice (layer or shard)"
        )
    return n


def max_message_bytes(n):
    """Upper bound on the size of any valid message for ``n`` weights.

    A message holds at most one word per weight. With the optimal Rice parameter an entry
    never costs more than with k = 30: a unary quotient of at most one 1 (gaps are below
    2**31) and its 0, 30 remainder bits and the sign, 33 bits; a raw word costs 32. Receivers
    size their buffers with this and refuse anything larger before reading it.
    """
    return HEADER_BYTES + (33 * int(n) + 7) // 8 + 1


def _check_tau(tau):
    try:
        t = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a real number, got {tau!r}") from None
    with np.errstate(over="ignore"):
        t32 = np.float32(t)
    if not (math.isfinite(t) and np.isfinite(t32)) or not t32 > 0:
        raise ValueError(f"tau must be > 0 and finite in float32, got {tau!r}")
    return float(t32)


def _check_array(name, a, dtype, writable=False):
    kernels._check_array(name, a, writable, ndim=1, dtype=dtype)


def _check_words(words):
    _check_array("words", words, np.uint32)
    return words


def _no_overlap(*named):
    for i, (name, a) in enumerate(named):
        for other, b in named[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError(f"{name} and {other} overlap in memory; pass separate arrays")


# ----------------------------------------------------------------------------- kernels

def threshold(residual, grad, tau, out=None):
    """Add ``grad`` into ``residual`` and emit one word per element beyond ``+-tau``.

    For each ``i`` in increasing order, after ``r = residual[i] + grad[i]``: if ``r > tau``
    emit ``i << 1`` and keep ``r - tau``; elif ``r < -tau`` emit ``(i << 1) | 1`` and keep
    ``r + tau``; else keep ``r``. At most one word per element per call, so a residual far
    beyond ``tau`` drains over several calls. All arithmetic is float32; one pass over memory.

    Parameters
    ----------
    residual : numpy.ndarray
        1-D float32 C-contiguous, updated in place. Fewer than ``MAX_WEIGHTS`` elements.
    grad : numpy.ndarray
        1-D float32 C-contiguous of the same length, read only.
    tau : float
        Threshold, > 0 and finite (rounded to float32).
    out : numpy.ndarray, optional
        1-D uint32 C-contiguous buffer of at least ``len(residual)`` words; allocated when
        None. Preallocate it (as :class:`Compressor` does) to keep allocation off the hot path.

    Returns
    -------
    numpy.ndarray
        uint32 view of ``out`` holding the emitted words, in increasing index order.

    Raises
    ------
    ValueError
        Bad dtype, shape, contiguity, lengths, overlapping arrays, bad ``tau``, or a model of
        ``MAX_WEIGHTS`` weights or more.
    """
    _check_array("residual", residual, np.float32, writable=True)
    _check_array("grad", grad, np.float32)
    n = check_n_weights(residual.shape[0])
    if grad.shape[0] != n:
        raise ValueError(f"length mismatch: residual has {n}, grad has {grad.shape[0]} elements")
    tau = _check_tau(tau)
    if out is None:
        out = np.empty(n, dtype=np.uint32)
    else:
        _check_array("out", out, np.uint32, writable=True)
        if out.shape[0] < n:
            raise ValueError(f"out holds {out.shape[0]} words, needs at least {n}")
    _no_overlap(("residual", residual), ("grad", grad), ("out", out))
    count = _impl.threshold(residual, grad, tau, out)
    return out[:count]


def apply_counts(params, base, counts, words, multiple, unit):
    """Dead reckoning's apply (:class:`hpcps.strategies.deadreckon.Reckoner`): per word,
    ``counts[i] += multiple`` (sign bit 0) or ``-= multiple`` (sign bit 1), ``i = word >> 1``,
    then ``params[i] = float32(base[i] + unit * counts[i])``, computed in float64. Integer
    counts add up the same in any order, so replicas that apply the same messages in
    different orders hold bit-identical weights. Duplicate indices each count. Every index is
    checked before anything changes.

    Parameters
    ----------
    params, base : numpy.ndarray
        1-D float32 C-contiguous of one length; ``params`` updated in place.
    counts : numpy.ndarray
        1-D int64 C-contiguous of that length, updated in place.
    words : numpy.ndarray
        1-D uint32 C-contiguous words ``(index << 1) | neg``.
    multiple : int
        Units each word moves its weight by (>= 1).
    unit : float
        Weight units per count (finite, > 0).

    Raises
    ------
    CodecError
        If a word's index is ``>= len(params)``.
    ValueError
        Bad arrays or scalars.
    """
    _check_array("params", params, np.float32, writable=True)
    _check_array("base", base, np.float32)
    _check_array("counts", counts, np.int64, writable=True)
    _check_words(words)
    _no_overlap(("params", params), ("base", base), ("counts", counts), ("words", words))
    multiple = operator.index(multiple)
    unit = float(unit)
    if multiple < 1 or not (math.isfinite(unit) and unit > 0):
        raise ValueError(f"multiple must be >= 1 and unit finite and > 0, got {multiple}, "
                         f"{unit}")
    bad = _impl.apply_counts(params, base, counts, words, multiple, unit)
    if bad >= 0:
        raise CodecError(f"word {bad} of the message addresses weight {int(words[bad]) >> 1}, "
                         f"but the model has {params.shape[0]}")


def apply(weights, words, tau, scale=1.0):
    """Add ``+tau * scale`` (sign bit 0) or ``-tau * scale`` (sign bit 1) per word.

    The step ``tau * scale`` is rounded to float32 once, then added in float32. Duplicate
    indices are each applied. Every index is checked before any weight changes, so a message
    that does not fit the model leaves ``weights`` untouched (replicas must apply the same
    messages whole, or drift apart).

    Parameters
    ----------
    weights : numpy.ndarray
        1-D float32 C-contiguous, updated in place.
    words : numpy.ndarray
        1-D uint32 C-contiguous words ``(index << 1) | neg``, any order.
    tau : float
        The sender's threshold, > 0 and finite.
    scale : float, optional
        Finite multiplier (e.g. a learning-rate factor); default 1.

    Raises
    ------
    CodecError
        If a word's index is ``>= len(weights)``; names the word and the index.
    ValueError
        Bad arrays or scalars.
    """
    _check_array("weights", weights, np.float32, writable=True)
    n = check_n_weights(weights.shape[0])
    _check_words(words)
    _no_overlap(("weights", weights), ("words", words))
    tau = _check_tau(tau)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a real number, got {scale!r}") from None
    step = np.float32(tau) * np.float32(scale)
    if not (math.isfinite(scale) and np.isfinite(step)):
        raise ValueError(f"tau * scale must be finite in float32, got {tau} * {scale}")
    bad = _impl.apply(weights, words, float(step))
    if bad >= 0:
        word = int(words[bad])
        raise CodecError(
            f"update {bad} (word 0x{word:08x}) has index {word >> 1}, but the model has {n} "
            "weights; nothing applied"
        )


# ----------------------------------------------------------------------------- codec

def _best_k(words):
    """The Rice parameter with the shortest payload and its length in bits (ties: lower k).

    Returns ``(k, bits)``, or ``(k, -1)`` when the indices are not strictly increasing. The
    length is ``count*(k+2) + sum(gap >> k)``; its increments ``count - sum(ceil((gap>>k)/2))``
    never decrease with ``k``, so it is convex and walking downhill from a good guess ends at
    the global minimum.
    """
    m = words.shape[0]
    if m == 0:
        return 0, 0
    mean_gap = max(int(words[-1] >> 1) - (m - 1), 0) / m
    k = min(max(int(math.floor(math.log2(mean_gap))) if mean_gap >= 1 else 0, 0), MAX_K)
    best = _impl.rice_bits(words, k)
    if best < 0:
        return k, -1
    for step in (-1, 1):
        moved = False
        while 0 <= k + step <= MAX_K:
            bits = _impl.rice_bits(words, k + step)
            if bits > best or (bits == best and step > 0):  # on a plateau, go to its low end
                break
            k, best, moved = k + step, bits, True
        if moved:
            break
    return k, best


def encode(words, golomb=True):
    """Pack words into a self-describing message (format in the module docstring).

    Parameters
    ----------
    words : numpy.ndarray
        1-D uint32 words ``(index << 1) | neg``. For Golomb-Rice they are sorted first
        (threshold's output already is); raw keeps their order and duplicates.
    golomb : bool, optional
        Golomb-Rice code the index gaps (default) or send the raw words.

    Returns
    -------
    numpy.ndarray
        uint8 message: 16-byte header, then the payload.

    Raises
    ------
    ValueError
        Bad array; for Golomb-Rice, two words with the same index (the receiver could not
        tell them from corruption; threshold never emits them); a payload of 4 GiB or more.
    """
    _check_words(words)
    m = words.shape[0]
    if m >= MAX_WEIGHTS:
        raise ValueError(f"too many words: {m} (at most {MAX_WEIGHTS - 1})")
    if not golomb:
        nbytes = 4 * m
        if nbytes > 0xFFFFFFFF:
            raise ValueError(f"raw message too large: {nbytes} payload bytes")
        msg = np.empty(HEADER_BYTES + nbytes, dtype=np.uint8)
        HEADER.pack_into(msg.data, 0, MAGIC, VERSION, CODING_RAW, 0, 0, m, nbytes)
        msg[HEADER_BYTES:] = words.astype("<u4", copy=False).view(np.uint8)
        return msg
    k, nbits = _best_k(words)
    if nbits < 0:
        words = np.sort(words)
        k, nbits = _best_k(words)
        if nbits < 0:
            idx = words >> 1
            j = int(np.flatnonzero(idx[1:] == idx[:-1])[0])
            raise ValueError(
                f"index {int(idx[j])} appears twice; a Golomb-Rice message holds each index "
                "at most once (use golomb=False to send duplicates)"
            )
    nbytes = (nbits + 7) // 8
    if nbytes > 0xFFFFFFFF:
        raise ValueError(f"message too large: {nbytes} payload bytes")
    msg = np.empty(HEADER_BYTES + nbytes, dtype=np.uint8)
    HEADER.pack_into(msg.data, 0, MAGIC, VERSION, CODING_GOLOMB, k, 0, m, nbytes)
    written = _impl.rice_encode(words, k, msg[HEADER_BYTES:])
    if written != nbytes:  # a bug, not bad input: the length was computed above
        raise RuntimeError(f"rice_encode wrote {written} bytes, expected {nbytes}")
    return msg


def _as_bytes(buf):
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise ValueError(f"message must be a 1-D uint8 array, got {buf.dtype} {buf.shape}")
        return np.ascontiguousarray(buf)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, dtype=np.uint8)
    raise ValueError(f"message must be bytes, bytearray or a uint8 array, got {type(buf).__name__}")


def _parse_header(data):
    """Check the header of ``data`` (uint8 array) against its length; return its fields."""
    size = data.shape[0]
    if size < HEADER_BYTES:
        raise CodecError(
            f"compressed message truncated: {size} bytes, the header alone needs {HEADER_BYTES}"
        )
    magic, version, coding, k, reserved, count, payload_bytes = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CodecError(f"not an hpcps compressed message: magic 0x{magic:08x}, "
                         f"expected 0x{MAGIC:08x}")
    if version != VERSION:
        raise CodecError(f"compressed message has version {version}; this hpcps reads {VERSION}")
    if coding not in (CODING_RAW, CODING_GOLOMB):
        raise CodecError(f"compressed message corrupt: unknown coding {coding}")
    if k > MAX_K or (coding == CODING_RAW and k != 0):
        raise CodecError(f"compressed message corrupt: Rice parameter k = {k}")
    if reserved != 0:
        raise CodecError(f"compressed message corrupt: reserved header byte is {reserved}")
    if payload_bytes != size - HEADER_BYTES:
        what = "truncated" if payload_bytes > size - HEADER_BYTES else "corrupt"
        raise CodecError(
            f"compressed message {what}: header announces {payload_bytes} payload bytes, "
            f"{size - HEADER_BYTES} arrived"
        )
    return coding, k, count, payload_bytes


_STATUS_TEXT = {
    TRUNCATED: "truncated: entry {j} of {count} needs more than the {detail} bits left",
    GAP_TOO_LONG: "entry {j} of {count} points past the model's {n} weights "
                  "(unary quotient above {detail})",
    INDEX_RANGE: "entry {j} of {count} has index {detail}, the model has {n} weights",
    TRAILING_BYTES: "{detail} bits left over after all {count} entries",
    BAD_PADDING: "padding bits are not all ones",
}


def decode(buf, n_weights):
    """Decode a message received from the network into its words.

    Parameters
    ----------
    buf : bytes, bytearray, memoryview or numpy.ndarray
        The message as received (uint8 if an array).
    n_weights : int
        The receiver's weight count; every decoded index must be below it.

    Returns
    -------
    numpy.ndarray
        The uint32 words exactly as encoded (sorted by index for Golomb-Rice).

    Raises
    ------
    CodecError
        Truncated or corrupt message (the text says which check failed and at which bit), or
        an index ``>= n_weights``. Nothing is read or written outside the buffers.
    ValueError
        ``buf`` of the wrong type, or a bad ``n_weights``.
    """
    n_weights = check_n_weights(n_weights)
    data = _as_bytes(buf)
    coding, k, count, payload_bytes = _parse_header(data)
    payload = data[HEADER_BYTES:]
    if coding == CODING_RAW:
        if payload_bytes != 4 * count:
            raise CodecError(f"compressed message corrupt: {count} raw words need {4 * count} "
                             f"payload bytes, header announces {payload_bytes}")
        words = payload.view("<u4").astype(np.uint32)
        bad = np.flatnonzero((words >> 1) >= n_weights)
        if bad.size:
            j = int(bad[0])
            raise CodecError(f"compressed message corrupt: word {j} of {count} has index "
                             f"{int(words[j]) >> 1}, the model has {n_weights} weights")
        return words
    payload_bits = 8 * payload_bytes
    if count > n_weights or count * (k + 2) > payload_bits:
        raise CodecError(
            f"compressed message corrupt: count {count} does not fit {payload_bits} payload "
            f"bits at k = {k} (or a model of {n_weights} weights)"
        )
    out = np.empty(count, dtype=np.uint32)
    info = np.zeros(3, dtype=np.int64)
    status = _impl.rice_decode(payload, count, k, n_weights, out, info)
    if status != OK:
        where, j, detail = (int(x) for x in info)
        text = _STATUS_TEXT[status].format(j=j, count=count, detail=detail, n=n_weights)
        raise CodecError(f"compressed message corrupt: {text}, at bit {where} of {payload_bits}")
    return out


# ----------------------------------------------------------------------------- figures

def gap_entropy_bits(words):
    """Empirical entropy of the index gaps, in bits per update, plus 1 bit for the sign.

    ``H = -sum(p * log2(p))`` over the histogram of the gaps as Golomb-Rice codes them (the
    first index, then ``index[j] - index[j-1] - 1``): the bound an ideal coder of independent
    gaps would reach, to set beside :func:`bits_per_update`. NaN for no words. This is the
    plug-in estimate: with fewer words than distinct gap values (sparse messages) it falls
    below the true entropy, by up to a bit or more.
    """
    _check_words(words)
    if words.shape[0] == 0:
        return float("nan")
    gaps = NumpyReference._gaps(np.sort(words))
    if gaps.min() < 0:
        raise ValueError("words hold a duplicate index")
    _, counts = np.unique(gaps, return_counts=True)
    p = counts / words.shape[0]
    return float(-(p * np.log2(p)).sum() + 1.0)


def bits_per_update(msg):
    """Message bits per update, header included: ``8 * len(msg) / count``; NaN if empty."""
    data = _as_bytes(msg)
    count = _parse_header(data)[2]
    return 8.0 * data.shape[0] / count if count else float("nan")


class Compressor:
    """One worker's residual and output buffer: ``compress(grad)`` thresholds then encodes.

    Parameters
    ----------
    n : int
        Weights covered (fewer than ``MAX_WEIGHTS``).
    tau : float
        Threshold, > 0.
    golomb : bool, optional
        Golomb-Rice (default) or raw messages.

    Attributes
    ----------
    residual : numpy.ndarray
        float32, starts at zero; what has been added but not yet sent.
    tau : float
        The threshold, as float32 rounds it.
    """

    def __init__(self, n, tau, golomb=True):
        n = check_n_weights(n)
        self.tau = _check_tau(tau)
        self.golomb = bool(golomb)
        self.residual = np.zeros(n, dtype=np.float32)
        self._out = np.empty(n, dtype=np.uint32)

    def compress(self, grad):
        """Add ``grad`` to the residual; return ``(message, words)``.

        ``words`` is a view of a buffer the next call overwrites; copy it to keep it.
        """
        words = threshold(self.residual, grad, self.tau, out=self._out)
        return encode(words, self.golomb), words
