"""Tests for hpcps.compress.codec: compiled kernels against the NumPy reference, the codec, fuzzing.

The compiled module is imported directly so the comparisons run whatever backend
``hpcps.compress.codec`` picked; the public functions are run in this process with the backend in
use, and the whole file once more in a subprocess with ``HPCPS_NO_EXTENSION=1``.
"""
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hpcps.compress import codec as compress
from hpcps.compress.codec import CodecError, reference
from hpcps.errors import HpcpsError

try:
    from hpcps.kernels import _compress as compiled
except ImportError:
    compiled = None

REPO = Path(__file__).resolve().parents[1]
SIZES = [0, 1, 7, 100003]
TAU = 0.5

needs_extension = pytest.mark.skipif(
    compiled is None,
    reason="hpcps.kernels._compress is not built (run `python setup.py build_ext --inplace`)",
)
IMPLEMENTATIONS = [
    pytest.param(reference, id="reference"),
    pytest.param(compiled, id="compiled", marks=needs_extension),
]


def _grad(kind, n, rng):
    if kind == "random":
        return rng.standard_normal(n, dtype=np.float32)
    if kind == "below":
        return rng.uniform(-TAU, TAU, n).astype(np.float32) * np.float32(0.999)
    if kind == "above":
        return (np.float32(TAU) * 1.001 + rng.uniform(0, 3, n).astype(np.float32)) * np.where(
            rng.random(n) < 0.5, 1, -1).astype(np.float32)
    if kind == "boundary":  # exactly +-tau (not emitted) and the next float beyond (emitted)
        t = np.float32(TAU)
        choices = np.array([t, -t, np.nextafter(t, np.float32(9)), np.nextafter(-t, np.float32(-9)),
                            0, -0.0], dtype=np.float32)
        return choices[rng.integers(0, choices.size, n)]
    raise ValueError(kind)


def _threshold_loop(residual, grad, tau):
    """The pseudo code of Strom's section 2.6, one element at a time, in float32."""
    tau = np.float32(tau)
    words = []
    for i in range(residual.size):
        r = np.float32(residual[i] + grad[i])
        if r > tau:
            words.append(i << 1)
            r = np.float32(r - tau)
        elif r < -tau:
            words.append((i << 1) | 1)
            r = np.float32(r + tau)
        residual[i] = r
    return np.array(words, dtype=np.uint32)


def _words(n, density, rng, sort=True):
    """Distinct random indices at ``density``, random signs."""
    m = max(1, int(round(n * density))) if n else 0
    idx = rng.choice(n, size=m, replace=False) if m < n else np.arange(n)
    words = (idx.astype(np.uint32) << 1) | rng.integers(0, 2, idx.size, dtype=np.uint32)
    return np.sort(words) if sort else words


# ----------------------------------------------------------------------------- threshold

@needs_extension
@pytest.mark.parametrize("kind", ["random", "below", "above", "boundary"])
@pytest.mark.parametrize("n", SIZES)
def test_threshold_compiled_matches_reference(n, kind):
    rng = np.random.default_rng(n)
    r1 = (rng.standard_normal(n, dtype=np.float32) * 0.1) if kind == "random" else np.zeros(
        n, dtype=np.float32)
    r2 = r1.copy()
    o1, o2 = np.empty(n, np.uint32), np.empty(n + 5, np.uint32)
    for _ in range(3):  # repeated calls: residuals carry over
        g = _grad(kind, n, rng)
        g_before = g.copy()
        c1 = compiled.threshold(r1, g, TAU, o1)
        c2 = reference.threshold(r2, g, TAU, o2)
        np.testing.assert_array_equal(g, g_before)
        assert c1 == c2
        np.testing.assert_array_equal(o1[:c1], o2[:c2])
        np.testing.assert_array_equal(r1, r2)
        assert not np.isnan(r1).any()
        if kind == "below" and _ == 0:  # nothing reaches tau until residuals add up
            assert c1 == 0
        if kind == "above" and _ == 0:
            assert c1 == n


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["random", "boundary"])
def test_threshold_matches_pseudo_code(impl, kind):
    rng = np.random.default_rng(7)
    r1 = rng.standard_normal(300, dtype=np.float32) * np.float32(0.3)
    r2 = r1.copy()
    for _ in range(3):
        g = _grad(kind, 300, rng)
        out = np.empty(300, np.uint32)
        count = impl.threshold(r1, g, TAU, out)
        np.testing.assert_array_equal(out[:count], _threshold_loop(r2, g, TAU))
        np.testing.assert_array_equal(r1, r2)


def test_threshold_boundaries_are_strict():
    t = np.float32(TAU)
    grad = np.array([t, -t, np.nextafter(t, np.float32(1)), np.nextafter(-t, np.float32(-1)), 0],
                    dtype=np.float32)
    residual = np.zeros(5, dtype=np.float32)
    words = compress.threshold(residual, grad, TAU)
    np.testing.assert_array_equal(words, [2 << 1, (3 << 1) | 1])
    np.testing.assert_array_equal(residual[:2], [t, -t])
    assert abs(residual[2]) < 1e-6 and abs(residual[3]) < 1e-6


def test_threshold_emits_once_per_call_and_drains():
    residual = np.zeros(2, dtype=np.float32)
    grad = np.array([2.6, -1.1], dtype=np.float32)
    zero = np.zeros(2, dtype=np.float32)
    sent = [compress.threshold(residual, grad, 1.0).tolist()]
    for _ in range(3):
        sent.append(compress.threshold(residual, zero, 1.0).tolist())
    assert sent == [[0, 3], [0], [], []]
    np.testing.assert_allclose(residual, [0.6, -0.1], rtol=1e-6)


def test_residual_is_conserved_and_messages_rebuild_the_sum():
    # Nothing is dropped: sum(grads) == residual + tau * (sent +1s - sent -1s), per element,
    # and applying every decoded message to zeros rebuilds the sent part (dead reckoning).
    rng = np.random.default_rng(11)
    n, tau = 5000, 0.05
    comp = compress.Compressor(n, tau)
    total = np.zeros(n)
    signs = np.zeros(n)
    replica = np.zeros(n, dtype=np.float32)
    for step in range(60):
        g = (rng.standard_normal(n) * 0.02 + 0.001 * (step % 3)).astype(np.float32)
        total += g
        msg, words = comp.compress(g)
        idx, neg = words >> 1, (words & 1).astype(bool)
        np.add.at(signs, idx, np.where(neg, -1.0, 1.0))
        compress.apply(replica, compress.decode(msg.tobytes(), n), tau)
    assert signs.any()
    np.testing.assert_allclose(comp.residual + comp.tau * signs, total, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(replica, comp.tau * signs, rtol=1e-5, atol=1e-6)
    assert np.abs(comp.residual).max() <= comp.tau + np.abs(total).max()


def _bad_threshold_inputs():
    r = np.zeros(8, dtype=np.float32)
    g = np.zeros(8, dtype=np.float32)
    ro = np.zeros(8, dtype=np.float32)
    ro.flags.writeable = False
    return {
        "float64 grad": ((r, g.astype(np.float64), TAU, None), "float32"),
        "strided": ((np.zeros(16, np.float32)[::2], g, TAU, None), "C-contiguous"),
        "length": ((r, g[:7], TAU, None), "length mismatch"),
        "2-D": ((np.zeros((2, 4), np.float32), g, TAU, None), "1-D"),
        "list": ((list(r), g, TAU, None), "numpy.ndarray"),
        "read-only": ((ro, g, TAU, None), "read-only"),
        "alias": ((r, r, TAU, None), "overlap"),
        "tau 0": ((r, g, 0.0, None), "tau"),
        "tau < 0": ((r, g, -1.0, None), "tau"),
        "tau nan": ((r, g, float("nan"), None), "tau"),
        "tau inf": ((r, g, float("inf"), None), "tau"),
        "tau float32 0": ((r, g, 1e-50, None), "tau"),
        "tau float32 inf": ((r, g, 1e39, None), "tau"),
        "tau str": ((r, g, "big", None), "tau"),
        "out short": ((r, g, TAU, np.empty(7, np.uint32)), "out holds"),
        "out int32": ((r, g, TAU, np.empty(8, np.int32)), "uint32"),
    }


@pytest.mark.parametrize("case", list(_bad_threshold_inputs()))
def test_threshold_refuses_bad_input(case):
    args, message = _bad_threshold_inputs()[case]
    with pytest.raises(ValueError, match=message):
        compress.threshold(*args)


def test_models_of_2_31_weights_are_refused():
    assert compress.check_n_weights(compress.MAX_WEIGHTS - 1) == 2**31 - 1
    for n in (2**31, 2**40):
        with pytest.raises(ValueError, match="too large.*31-bit"):
            compress.check_n_weights(n)
        with pytest.raises(ValueError, match="too large"):
            compress.Compressor(n, TAU)  # refused before allocating 8 GB
        with pytest.raises(ValueError, match="too large"):
            compress.decode(compress.encode(np.zeros(0, np.uint32)), n)
    with pytest.raises(ValueError, match=">= 0"):
        compress.check_n_weights(-1)


@needs_extension
def test_compiled_checks_lengths_itself():
    r, g = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="length mismatch"):
        compiled.threshold(r, g[:7], TAU, np.empty(8, np.uint32))
    with pytest.raises(ValueError, match="out holds"):
        compiled.threshold(r, g, TAU, np.empty(7, np.uint32))
    with pytest.raises(ValueError, match="out holds"):
        compiled.rice_decode(np.zeros(4, np.uint8), 5, 0, 100, np.empty(4, np.uint32),
                             np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="k must be"):
        compiled.rice_bits(np.zeros(1, np.uint32), 31)
    assert compiled.rice_encode(np.array([2, 4], np.uint32), 0, np.empty(0, np.uint8)) == -1
    assert compiled.rice_encode(np.array([2, 40], np.uint32), 0, np.empty(2, np.uint8)) == -1
    assert compiled.rice_encode(np.array([4, 2], np.uint32), 0, np.empty(9, np.uint8)) == -2


# ----------------------------------------------------------------------------- apply

@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_apply_matches_reference_with_duplicates(impl):
    rng = np.random.default_rng(3)
    n = 1000
    w = rng.standard_normal(n, dtype=np.float32)
    words = rng.integers(0, 2 * n, 5000, dtype=np.uint32)  # many duplicates, any order
    w1, w2 = w.copy(), w.copy()
    assert impl.apply(w1, words, np.float32(0.37)) == -1
    expected = w.astype(np.float32).copy()
    for word in words.tolist():  # sequential float32 additions, as both kernels do
        expected[word >> 1] += np.float32(-0.37) if word & 1 else np.float32(0.37)
    np.testing.assert_array_equal(w1, expected)
    reference.apply(w2, words, np.float32(0.37))
    np.testing.assert_array_equal(w1, w2)


def test_apply_duplicates_each_count_and_scale():
    w = np.zeros(3, dtype=np.float32)
    compress.apply(w, np.array([2, 2, 2, 3, 5], dtype=np.uint32), 0.5, scale=2.0)
    np.testing.assert_array_equal(w, [0.0, 2.0, -1.0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_apply_reports_first_bad_index_and_changes_nothing(impl):
    w = np.zeros(10, dtype=np.float32)
    words = np.array([0, 3, 19, 21, 40, 2], dtype=np.uint32)
    assert impl.apply(w, words, 1.0) == 3
    np.testing.assert_array_equal(w, 0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_apply_counts_matches_a_word_by_word_loop(impl):
    """Dead reckoning's apply: integer counts, each duplicate counted, then the weight from
    the count in float64 rounded once to float32, bit for bit."""
    rng = np.random.default_rng(5)
    n = 1000
    base = rng.standard_normal(n, dtype=np.float32)
    counts = rng.integers(-50, 50, n).astype(np.int64)
    params = base.copy()
    words = rng.integers(0, 2 * n, 5000, dtype=np.uint32)  # duplicates, any order
    unit = 1.3e-4
    want_counts = counts.copy()
    for word in words.tolist():
        want_counts[word >> 1] += -3 if word & 1 else 3
    touched = np.unique(words >> 1)
    want = base.copy()
    want[touched] = (base[touched].astype(np.float64)
                     + unit * want_counts[touched].astype(np.float64)).astype(np.float32)
    assert impl.apply_counts(params, base, counts, words, 3, unit) == -1
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(params, want)
    # the first bad word is reported and nothing changes
    before = (params.copy(), counts.copy())
    assert impl.apply_counts(params, base, counts, np.array([2, 2 * n + 1, 7], np.uint32),
                             1, unit) == 1
    np.testing.assert_array_equal(params, before[0])
    np.testing.assert_array_equal(counts, before[1])


def test_apply_counts_refuses_what_does_not_fit():
    params, base, counts = np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.int64)
    with pytest.raises(CodecError, match="addresses weight 4, but the model has 4"):
        compress.apply_counts(params, base, counts, np.array([8], np.uint32), 1, 0.1)
    with pytest.raises(ValueError, match="int64"):
        compress.apply_counts(params, base, counts.astype(np.int32), np.zeros(1, np.uint32),
                              1, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        compress.apply_counts(params, base, counts, np.zeros(1, np.uint32), 0, 0.1)
    with pytest.raises(ValueError, match="differ in length"):
        compress.apply_counts(params, base[:3], counts, np.zeros(1, np.uint32), 1, 0.1)


def test_apply_bad_index_raises_codec_error():
    w = np.ones(10, dtype=np.float32)
    with pytest.raises(CodecError, match="index 10, but the model has 10 weights"):
        compress.apply(w, np.array([4, 21], dtype=np.uint32), TAU)
    np.testing.assert_array_equal(w, 1)
    assert CodecError.exit_code == 6 and issubclass(CodecError, HpcpsError)
    with pytest.raises(ValueError, match="scale"):
        compress.apply(w, np.zeros(1, np.uint32), TAU, scale=float("nan"))
    with pytest.raises(ValueError, match="uint32"):
        compress.apply(w, np.zeros(1, np.int64), TAU)


# ----------------------------------------------------------------------------- codec

DENSITIES = [1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0]


@pytest.mark.parametrize("golomb", [True, False])
@pytest.mark.parametrize("n", [1, 7, 1000, 300007])
@pytest.mark.parametrize("density", DENSITIES)
def test_round_trip(density, n, golomb):
    rng = np.random.default_rng(int(density * 1e6) + n)
    words = _words(n, density, rng)
    msg = compress.encode(words, golomb=golomb)
    assert msg.dtype == np.uint8
    for buf in (msg, msg.tobytes(), bytearray(msg)):
        np.testing.assert_array_equal(compress.decode(buf, n), words)
    if golomb and words.size:
        # k is the exact optimum over 0..30 and the payload as long as it says.
        costs = [reference.rice_bits(words, k) for k in range(31)]
        assert msg[6] == int(np.argmin(costs))
        assert msg.size - 16 == (min(costs) + 7) // 8
        assert 8 * (msg.size - 16) < 32 * words.size + 8  # payload: below raw, plus padding


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("k", [0, 1, 5, 17, 30])
def test_kernels_round_trip_every_k(impl, k):
    rng = np.random.default_rng(k)
    n = 50000
    words = _words(n, 0.01, rng)
    words[-1] = ((n - 1) << 1) | 1  # the last index
    words[0] = 0  # a first gap of 0
    nbits = impl.rice_bits(words, k)
    assert nbits == reference.rice_bits(words, k)
    buf = np.empty((nbits + 7) // 8, np.uint8)
    assert impl.rice_encode(words, k, buf) == buf.size
    ref = np.empty_like(buf)
    reference.rice_encode(words, k, ref)
    np.testing.assert_array_equal(buf, ref)
    out, info = np.empty(words.size, np.uint32), np.zeros(3, np.int64)
    assert impl.rice_decode(buf, words.size, k, n, out, info) == compress.OK
    np.testing.assert_array_equal(out, words)


def test_golomb_sorts_and_raw_keeps_order():
    words = np.array([9, 2, 7, 100], dtype=np.uint32)
    np.testing.assert_array_equal(compress.decode(compress.encode(words), 60), np.sort(words))
    dup = np.array([9, 9, 8, 2], dtype=np.uint32)
    np.testing.assert_array_equal(compress.decode(compress.encode(dup, golomb=False), 5), dup)
    for bad in (np.array([4, 4], np.uint32), np.array([4, 5], np.uint32)):
        with pytest.raises(ValueError, match="index 2 appears twice"):
            compress.encode(bad)


@pytest.mark.parametrize("golomb", [True, False])
def test_empty_message(golomb):
    msg = compress.encode(np.zeros(0, np.uint32), golomb=golomb)
    assert msg.size == 16
    assert compress.decode(msg, 0).size == 0
    assert np.isnan(compress.bits_per_update(msg))
    assert np.isnan(compress.gap_entropy_bits(np.zeros(0, np.uint32)))


def test_header_layout_is_documented_one():
    msg = compress.encode(np.array([6, 11], np.uint32))
    magic, version, coding, k, reserved, count, payload = struct.unpack_from("<IBBBBII", msg)
    assert msg[:4].tobytes() == b"HPC1"
    assert (magic, version, coding, reserved, count, payload) == (0x31435048, 1, 1, 0, 2,
                                                                  msg.size - 16)
    # Gaps 3 and 1 with k = 1: '1' '0' '1' '0' then '0' '1' '1', padded with a '1'.
    assert k == 1 and msg[16:].tolist() == [0b10100111]


def test_bits_per_update_near_entropy():
    # Golomb-Rice is within a few hundredths of a bit of the entropy of geometric gaps. The
    # plug-in entropy needs many samples per distinct gap, hence the high densities here.
    rng = np.random.default_rng(5)
    n = 2_000_000
    for density in (1e-2, 0.1):
        words = _words(n, density, rng)
        bits = compress.bits_per_update(compress.encode(words))
        entropy = compress.gap_entropy_bits(words)
        assert entropy < bits < entropy + 0.1
        assert compress.bits_per_update(compress.encode(words, golomb=False)) > 32
    flat = np.arange(2, 4000, 4, dtype=np.uint32)  # indices 1, 3, 5...: every gap 1, 0 + 1 bits
    assert compress.gap_entropy_bits(flat) == 1.0


def test_compressor():
    comp = compress.Compressor(1000, 0.25, golomb=False)
    g = np.linspace(-1, 1, 1000, dtype=np.float32)
    msg, words = comp.compress(g)
    np.testing.assert_array_equal(compress.decode(msg, 1000), words)
    assert msg[5] == 0 and comp.tau == np.float32(0.25)
    assert np.abs(comp.residual).max() <= 1.0


# ----------------------------------------------------------------------------- corruption

def _valid_messages():
    rng = np.random.default_rng(1)
    n = 1000
    msgs = [compress.encode(_words(n, d, rng), golomb=g)
            for d in (0.003, 0.05, 0.5) for g in (True, False)]
    msgs.append(compress.encode(np.array([0, 3, 5], np.uint32)))  # k = 0, 6 bits of padding
    return n, msgs


def _decode_or_error(buf, n):
    try:
        words = compress.decode(buf, n)
    except CodecError as exc:
        assert "compressed message" in str(exc) or "hpcps" in str(exc)
        return None
    assert words.dtype == np.uint32
    assert ((words >> 1) < n).all()
    return words


def test_fuzz_random_bytes():
    rng = np.random.default_rng(2)
    for trial in range(2500):
        size = int(rng.integers(0, 80))
        buf = rng.integers(0, 256, size, dtype=np.uint8)
        if trial % 2:  # make most of them get past the header checks
            payload = size - 16 if size >= 16 else 0
            coding = int(rng.integers(0, 2))
            k = int(rng.integers(0, 31)) if coding else 0
            count = int(rng.integers(0, 3 * payload + 2))
            if size >= 16:
                struct.pack_into("<IBBBBII", buf, 0, 0x31435048, 1, coding, k, 0, count, payload)
        _decode_or_error(buf.tobytes(), int(rng.integers(1, 5000)))


@pytest.mark.parametrize("impl", [pytest.param(compiled, id="compiled", marks=needs_extension)])
def test_fuzz_decoder_kernels_agree(impl):
    # Random payloads fed straight to both decoders: same status, same position, same words.
    rng = np.random.default_rng(4)
    outcomes = set()
    for trial in range(3000):
        payload = rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8)
        if trial % 3 == 0:
            payload |= 0xF0  # long unary runs
        k = int(rng.integers(0, 31)) if trial % 4 else int(rng.integers(0, 3))
        count = int(rng.integers(0, 8 * payload.size // (k + 2) + 2))
        n = int(rng.integers(1, 1 << int(rng.integers(1, 31))))
        results = []
        for backend in (impl, reference):
            out = np.zeros(count + 1, np.uint32)
            info = np.zeros(3, np.int64)
            status = backend.rice_decode(payload, count, k, n, out, info)
            results.append((status, info.tolist(), out[:count].tolist() if status == 0 else None))
        assert results[0] == results[1], (payload.tolist(), count, k, n)
        if results[0][0] == 0:
            assert all((w >> 1) < n for w in results[0][2])
        outcomes.add(results[0][0])
    assert outcomes == set(range(6))  # every error path was reached


def test_every_truncation_raises():
    n, msgs = _valid_messages()
    for msg in msgs:
        for size in range(msg.size):
            with pytest.raises(CodecError):
                compress.decode(msg[:size].tobytes(), n)
            if size > 16:
                # Even with the header's length fixed up, a shorter payload cannot decode.
                cut = msg[:size].copy()
                struct.pack_into("<I", cut, 12, size - 16)
                with pytest.raises(CodecError):
                    compress.decode(cut, n)
        with pytest.raises(CodecError, match="corrupt"):
            compress.decode(np.append(msg, np.uint8(0)), n)


def test_single_bit_flips():
    n, msgs = _valid_messages()
    for msg in msgs:
        original = compress.decode(msg, n)
        for bit in range(8 * msg.size):
            bad = msg.copy()
            bad[bit // 8] ^= np.uint8(1 << (bit % 8))
            if 8 <= bit // 8 < 16:  # count and payload_bytes: must be caught
                with pytest.raises(CodecError):
                    compress.decode(bad, n)
            else:
                words = _decode_or_error(bad, n)
                if bit // 8 < 8:
                    assert words is None or bit // 8 == 6  # magic/version/coding/reserved
                if words is not None and bit // 8 >= 16:
                    assert not np.array_equal(words, original)  # codes are unique


def test_multiple_bit_flips():
    n, msgs = _valid_messages()
    rng = np.random.default_rng(9)
    for msg in msgs:
        for _ in range(300):
            bad = msg.copy()
            bits = rng.integers(16 * 8, 8 * msg.size, int(rng.integers(2, 9)))
            np.bitwise_xor.at(bad, bits // 8, (1 << (bits % 8)).astype(np.uint8))
            _decode_or_error(bad, n)


def test_decode_refuses_wrong_types():
    with pytest.raises(ValueError, match="uint8"):
        compress.decode(np.zeros(16, np.int8), 10)
    with pytest.raises(ValueError, match="bytes"):
        compress.decode("HPC1", 10)


def test_decode_index_beyond_receiver_model():
    words = np.array([0, 19], np.uint32)
    for golomb in (True, False):
        msg = compress.encode(words, golomb=golomb)
        with pytest.raises(CodecError, match="model has 9 weights|model's 9 weights"):
            compress.decode(msg, 9)
        np.testing.assert_array_equal(compress.decode(msg, 10), words)


# ----------------------------------------------------------------------------- backends

def _run_python(args, env_extra, timeout=120):
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_backend_follows_environment():
    forced = os.environ.get("HPCPS_NO_EXTENSION") == "1"
    assert compress.HAVE_EXTENSION is (compiled is not None and not forced)


@pytest.mark.skipif(os.environ.get("HPCPS_NO_EXTENSION") == "1", reason="already the reference")
def test_suite_passes_on_the_reference_backend():
    _run_python(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", __file__],
                {"HPCPS_NO_EXTENSION": "1"})


def test_missing_extension_warns_and_falls_back():
    code = """
        import json, sys, warnings
        import numpy as np

        class HideExtension:
            def find_spec(self, name, path=None, target=None):
                if name == "hpcps.kernels._compress":
                    raise ImportError("hidden by the test")
                return None

        sys.meta_path.insert(0, HideExtension())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hpcps.compress.codec as c
        words = c.threshold(np.zeros(4, np.float32), np.array([1, -1, 0, 2], np.float32), 0.5)
        back = c.decode(c.encode(words), 4)
        print(json.dumps({"have": c.HAVE_EXTENSION, "words": back.tolist(),
                          "warnings": [str(w.message) for w in caught
                                       if "hpcps.compress.codec" in str(w.message)]}))
    """
    proc = _run_python(["-c", textwrap.dedent(code)], {"HPCPS_NO_EXTENSION": "0"})
    result = json.loads(proc.stdout)
    assert result["have"] is False
    assert result["words"] == [0, 3, 6]
    assert len(result["warnings"]) == 1 and "build_ext --inplace" in result["warnings"][0]
