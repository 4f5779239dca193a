"""bfloat16 on the wire (``--wire-dtype bf16``): float32 values sent as their top 16 bits.

bfloat16 keeps float32's sign and 8-bit exponent and 7 of its 23 mantissa bits, so any float32
fits its range and loses only precision: 8 significant bits, a relative error of at most
2**-8 (0.4%) after rounding to the nearest value (ties to even). Messages carry half the
bytes; every sum, update and master copy of the weights stays float32, and a NaN stays a
NaN (an infinity stays infinite, and a value above bfloat16's largest finite one rounds to
infinity, as IEEE rounding does).

:func:`encode`, :func:`decode` and :func:`accumulate` run compiled (``ext/compress.pyx``) with
:class:`NumpyBf16` as their reference and fallback; :class:`Wire` names a message format for
the layers that send (:mod:`hpcps.mpi`). No MPI here.
"""
from __future__ import annotations

import numpy as np

from hpcps.kernels import load_extension

WIRE_DTYPES = ("fp32", "bf16")  # the values of --wire-dtype


class NumpyBf16:
    """The conversions in NumPy: the reference the compiled ones are tested against."""

    @staticmethod
    def bf16_encode(x: np.ndarray, out: np.ndarray) -> None:
        u = x.view(np.uint32)
        rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[:len(x)] = np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)

    @staticmethod
    def bf16_decode(b: np.ndarray, out: np.ndarray) -> None:
        out[:len(b)].view(np.uint32)[:] = b.astype(np.uint32) << 16

    @staticmethod
    def bf16_accumulate(b: np.ndarray, acc: np.ndarray) -> None:
        acc[:len(b)] += (b.astype(np.uint32) << 16).view(np.float32)

    @staticmethod
    def bf16_sum(words: np.ndarray, parts: int, out: np.ndarray) -> None:
        m = len(out)
        acc = np.zeros(m, np.float32)
        for p in range(parts):
            acc += (words[p * m:(p + 1) * m].astype(np.uint32) << 16).view(np.float32)
        NumpyBf16.bf16_encode(acc, out)


_impl, HAVE_EXTENSION = load_extension("_compress", NumpyBf16, "hpcps.compress.bf16")


def _check(name: str, a, dtype, writable: bool) -> None:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != dtype \
            or not a.flags.c_contiguous:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{name} must be a 1-D C-contiguous {np.dtype(dtype).name} array, "
                         f"got {got}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is written but is read-only")


def _check_pair(src: tuple[str, np.ndarray, type], dst: tuple[str, np.ndarray, type]) -> None:
    _check(*src, writable=False)
    _check(*dst, writable=True)
    if len(src[1]) != len(dst[1]):
        raise ValueError(f"{src[0]} has {len(src[1])} values but {dst[0]} has {len(dst[1])}")
    if np.may_share_memory(src[1], dst[1]):
        raise ValueError(f"{src[0]} and {dst[0]} overlap in memory; pass separate arrays")


def encode(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to bfloat16, nearest with ties to even, into ``out`` (uint16,
    the same length); returns ``out``."""
    _check_pair(("x", x, np.float32), ("out", out, np.uint16))
    _impl.bf16_encode(x, out)
    return out


def decode(b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bits ``b`` (uint16) into ``out`` (exact); returns
    ``out``."""
    _check_pair(("b", b, np.uint16), ("out", out, np.float32))
    _impl.bf16_decode(b, out)
    return out


def accumulate(b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc += decode(b)``, summed in float32; returns ``acc``."""
    _check_pair(("b", b, np.uint16), ("acc", acc, np.float32))
    _impl.bf16_accumulate(b, acc)
    return acc


def sum_blocks(words: np.ndarray, parts: int, out: np.ndarray) -> np.ndarray:
    """The sum of the ``parts`` consecutive blocks of bfloat16 ``words`` (uint16, each block
    ``len(out)`` values), added in float32 in block order and rounded to bfloat16 into
    ``out`` (uint16); returns ``out``. A reduce-scatter's block in one pass."""
    _check("words", words, np.uint16, writable=False)
    _check("out", out, np.uint16, writable=True)
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts must be a positive integer, got {parts!r}")
    if len(words) != parts * len(out):
        raise ValueError(f"words has {len(words)} values, not parts x len(out) = "
                         f"{parts} x {len(out)}")
    if np.may_share_memory(words, out):
        raise ValueError("words and out overlap in memory; pass separate arrays")
    _impl.bf16_sum(words, int(parts), out)
    return out


def round_trip(x: np.ndarray) -> np.ndarray:
    """``x`` as the receiver of its bfloat16 message sees it (a new float32 array)."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    return decode(encode(x, np.empty(len(x), np.uint16)), np.empty(len(x), np.float32))


class Wire:
    """How float32 payloads travel: ``fp32`` as they are, or ``bf16`` (2 bytes a value).

    ``itemsize`` is the bytes per value on the wire; :meth:`to_bytes` and :meth:`from_bytes`
    move between float32 values and a message body.
    """

    def __init__(self, name: str = "fp32"):
        if name not in WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {name!r}")
        self.name = name
        self.bf16 = name == "bf16"
        self.itemsize = 2 if self.bf16 else 4
        self.dtype = np.dtype(np.uint16 if self.bf16 else np.float32)

    @staticmethod
    def named(name: str | None) -> "Wire":
        """The wire of ``--wire-dtype`` ``name`` (None, the option not taken: float32)."""
        return BF16 if name == "bf16" else FP32 if name in (None, "fp32") else Wire(name)

    def __repr__(self) -> str:
        return f"Wire({self.name!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Wire) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def to_bytes(self, x: np.ndarray) -> np.ndarray:
        """The message body (uint8) of float32 values ``x``: a view on the float32 wire."""
        x = np.ascontiguousarray(x, dtype=np.float32).ravel()
        if not self.bf16:
            return x.view(np.uint8)
        return encode(x, np.empty(len(x), np.uint16)).view(np.uint8)

    def from_bytes(self, body: np.ndarray) -> np.ndarray:
        """The float32 values of a message body made by :meth:`to_bytes`."""
        if not self.bf16:
            return body.view(np.float32)
        words = body.view(np.uint16)
        return decode(words, np.empty(len(words), np.float32))


FP32 = Wire("fp32")
BF16 = Wire("bf16")
