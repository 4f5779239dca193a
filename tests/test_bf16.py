"""bfloat16 on the wire (hpcps.compress.bf16, ``--wire-dtype bf16``): the conversions, compiled
and NumPy, against an independent definition of rounding to nearest even; the message
buffers that carry them."""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.compress import bf16
from hpcps.compress.bf16 import BF16, FP32, NumpyBf16, Wire
from hpcps.mpi.protocol import HEADER_BYTES, Message

try:
    from hpcps.kernels import _compress as compiled
except ImportError:
    compiled = None

IMPLEMENTATIONS = [
    pytest.param(NumpyBf16, id="reference"),
    pytest.param(compiled, id="compiled", marks=pytest.mark.skipif(
        compiled is None, reason="hpcps.kernels._compress is not built")),
]


def nearest_bf16(x: np.ndarray) -> np.ndarray:
    """Round each float32 to bfloat16 the slow way: of the two bf16 values around it (the
    float32 with its low 16 bits cut, and the next one up in magnitude) take the nearer in
    float64, the one with an even last bit on a tie. Returns the bf16 bits."""
    u = x.view(np.uint32).astype(np.uint64)
    low = (u >> 16).astype(np.uint64)
    high = low + 1
    as_f = lambda b: ((b & 0xFFFF).astype(np.uint32) << 16).view(np.float32).astype(  # noqa
        np.float64)
    xv = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        d_low = np.abs(xv - as_f(low))
        d_high = np.abs(as_f(high) - xv)
    pick_high = (d_high < d_low) | ((d_high == d_low) & (low % 2 == 1))
    out = np.where(pick_high, high, low).astype(np.uint16)
    # past the largest finite bf16: the value rounds to infinity when it is at least half an
    # ulp above it (d_high is inf there, so the comparison above never picks it)
    big = np.abs(xv) >= float(np.float32(3.3961776e38))  # bf16 max + half an ulp
    sign = (u >> 31).astype(np.uint16) << 15
    out = np.where(big & np.isfinite(xv), sign | 0x7F80, out)
    out = np.where(np.isinf(xv), sign | 0x7F80, out)
    out = np.where(np.isnan(xv), (low | 0x40).astype(np.uint16), out)
    return out.astype(np.uint16)


def samples(n: int = 20000, seed: int = 0) -> np.ndarray:
    """Random float32s over the whole range, ties and near-ties, and the special values."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 2000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    near = ties + rng.choice(np.array([0xFFFFFFFF, 1], np.uint32), 2000)  # -1 and +1 ulp
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45,
                        3.3895314e38, 3.40282e38, -3.40282e38, 1.00390625, 1.01171875],
                       np.float32)
    out = np.concatenate([bits.view(np.float32), ties.view(np.float32),
                          near.view(np.float32), special])
    return np.ascontiguousarray(out, np.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_encode_rounds_to_nearest_even_everywhere(impl):
    x = samples()
    got = np.empty(len(x), np.uint16)
    with np.errstate(all="ignore"):
        impl.bf16_encode(x, got)
    want = nearest_bf16(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # a NaN stays a NaN of the same sign (quiet), whatever its payload
    back = (got[nan].astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(back).all()
    assert ((got[nan] >> 15) == (x[nan].view(np.uint32) >> 31)).all()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_decode_is_exact_and_accumulate_adds_in_float32(impl):
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2 ** 16, 5000, dtype=np.uint64).astype(np.uint16)
    b = b[~np.isnan((b.astype(np.uint32) << 16).view(np.float32))]
    out = np.empty(len(b), np.float32)
    impl.bf16_decode(b, out)
    np.testing.assert_array_equal(out.view(np.uint32), b.astype(np.uint32) << 16)
    acc = rng.standard_normal(len(b)).astype(np.float32)
    want = acc + out
    impl.bf16_accumulate(b, acc)
    np.testing.assert_array_equal(acc, want)


def test_public_functions_check_their_arguments():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="uint16"):
        bf16.encode(x, np.empty(4, np.float32))
    with pytest.raises(ValueError, match="4 values but out has 3"):
        bf16.encode(x, np.empty(3, np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        bf16.encode(np.ones(8, np.float32)[::2], np.empty(4, np.uint16))
    raw = np.zeros(16, np.uint8)
    words = raw[:8].view(np.uint16)
    with pytest.raises(ValueError, match="overlap"):
        bf16.decode(words, raw.view(np.float32))
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        bf16.decode(words, ro)
    with pytest.raises(ValueError, match="fp32, bf16"):
        Wire("fp16")


def test_relative_error_is_at_most_half_an_ulp():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(100000) * 10.0 ** rng.uniform(-30, 30, 100000)).astype(np.float32)
    y = bf16.round_trip(x)
    rel = np.abs(y.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert rel.max() <= 2.0 ** -8  # 8 significant bits: half an ulp is 2**-8 of 2**e


@pytest.mark.parametrize("wire", [FP32, BF16], ids=["fp32", "bf16"])
def test_a_message_carries_its_values_in_the_wires_format(wire):
    values = np.random.default_rng(3).standard_normal(1001).astype(np.float32)
    out = Message(len(values), wire)
    assert out.buf.nbytes == HEADER_BYTES + wire.itemsize * len(values)
    out.payload[:] = values
    out.header[2] = 7.5
    out.pack()
    into = out.fresh()
    assert into.wire == wire and len(into) == len(values)
    into.buf[:] = out.buf  # what MPI does
    into.unpack()
    assert into.header[2] == 7.5
    np.testing.assert_array_equal(into.payload, values if wire is FP32 else
                                  bf16.round_trip(values))
    body = wire.to_bytes(values)
    assert body.dtype == np.uint8 and body.nbytes == wire.itemsize * len(values)
    np.testing.assert_array_equal(wire.from_bytes(body), into.payload)


def test_wire_names():
    assert Wire.named(None) is FP32 and Wire.named("fp32") is FP32 and Wire.named("bf16") is BF16
    assert BF16.dtype == np.uint16 and FP32.dtype == np.float32


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_sum_of_blocks_adds_in_float32_in_block_order_then_rounds(impl, parts):
    rng = np.random.default_rng(parts)
    m = 1001
    values = rng.standard_normal(parts * m).astype(np.float32) * 100
    words = np.empty(parts * m, np.uint16)
    NumpyBf16.bf16_encode(values, words)
    acc = np.zeros(m, np.float32)
    for p in range(parts):  # float32 additions, block 0 first: the order the kernel keeps
        acc = acc + (words[p * m:(p + 1) * m].astype(np.uint32) << 16).view(np.float32)
    want = nearest_bf16(acc)
    got = np.empty(m, np.uint16)
    impl.bf16_sum(words, parts, got)
    np.testing.assert_array_equal(got, want)


def test_sum_blocks_checks_its_arguments():
    words = np.zeros(6, np.uint16)
    with pytest.raises(ValueError, match="parts x len"):
        bf16.sum_blocks(words, 4, np.empty(2, np.uint16))
    with pytest.raises(ValueError, match="positive integer"):
        bf16.sum_blocks(words, 0, np.empty(2, np.uint16))
    with pytest.raises(ValueError, match="overlap"):
        bf16.sum_blocks(words, 3, words[:2])
