"""Tests for hpcps.kernels: compiled kernels against the NumPy reference, and input checks.

The compiled module is imported directly (not through ``hpcps.kernels``) so the
comparison runs even when ``HPCPS_NO_EXTENSION=1`` is set; the fallback path itself is
tested in subprocesses, so this process's imports are left alone.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import hpcps.kernels as kernels
from hpcps.kernels import reference

try:
    from hpcps.kernels import _adagrad as compiled
except ImportError:
    compiled = None

REPO = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-6, 1e-7  # float32: a few ulp, in case the build contracts a*b+c into FMA
SIZES = [0, 1, 7, 1000, 100003]

needs_extension = pytest.mark.skipif(
    compiled is None,
    reason="hpcps.kernels._adagrad is not built (run `python setup.py build_ext --inplace`)",
)


def _problem(n, seed):
    """Parameters, gradient and a positive accumulator like a shard holds mid-training."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    accum = rng.uniform(0.0, 2.0, n).astype(np.float32)
    return w, g, accum


def _adagrad_both(impl, w, g, accum, lr, eps, threads=1):
    """Run ``impl`` and the reference on copies of the same input; return both results."""
    w1, a1, w2, a2 = w.copy(), accum.copy(), w.copy(), accum.copy()
    g_before = g.copy()
    impl.adagrad_update(w1, g, a1, lr, eps, threads)
    reference.adagrad_update(w2, g, a2, lr, eps)
    np.testing.assert_array_equal(g, g_before)  # the gradient is read only
    return (w1, a1), (w2, a2)


IMPLEMENTATIONS = [
    pytest.param(reference, id="reference"),
    pytest.param(compiled, id="compiled", marks=needs_extension),
    pytest.param(kernels, id="public"),
]


@needs_extension
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_adagrad_compiled_matches_reference(n, threads):
    w, g, accum = _problem(n, seed=n)
    (w1, a1), (w2, a2) = _adagrad_both(compiled, w, g, accum, lr=0.05, eps=1e-8, threads=threads)
    np.testing.assert_allclose(a1, a2, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w1, w2, rtol=RTOL, atol=ATOL)


@needs_extension
@pytest.mark.parametrize("n", SIZES)
def test_adagrad_compiled_repeated_steps_match_reference(n):
    # Several steps let rounding differences, if any, accumulate through accum.
    w, _, accum = _problem(n, seed=1)
    w1, a1, w2, a2 = w.copy(), accum.copy(), w.copy(), accum.copy()
    rng = np.random.default_rng(2)
    for step in range(5):
        g = rng.standard_normal(n, dtype=np.float32)
        compiled.adagrad_update(w1, g, a1, 0.1, 1e-7, 1 + step % 2)
        reference.adagrad_update(w2, g, a2, 0.1, 1e-7)
    np.testing.assert_allclose(a1, a2, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w1, w2, rtol=RTOL, atol=ATOL)


@needs_extension
@pytest.mark.parametrize("n", SIZES)
def test_sgd_compiled_matches_reference(n):
    w, g, _ = _problem(n, seed=n + 1)
    w1, w2 = w.copy(), w.copy()
    compiled.sgd_update(w1, g, 0.01)
    reference.sgd_update(w2, g, 0.01)
    np.testing.assert_allclose(w1, w2, rtol=RTOL, atol=ATOL)


def test_reference_matches_float64_formula():
    # The reference must itself be right, not merely agree with the compiled kernel.
    w, g, accum = _problem(1000, seed=3)
    lr, eps = 0.05, 1e-8
    a64 = accum.astype(np.float64) + g.astype(np.float64) ** 2
    w64 = w - lr * g.astype(np.float64) / (np.sqrt(a64) + eps)
    reference.adagrad_update(w, g, accum, lr, eps)
    np.testing.assert_allclose(accum, a64, rtol=1e-6)
    np.testing.assert_allclose(w, w64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_first_step_moves_each_parameter_by_lr(impl):
    # From a zero accumulator, sqrt(g*g) = |g|, so every parameter moves by lr against
    # the sign of its gradient whatever the gradient's scale: Adagrad's point.
    w = np.zeros(5, dtype=np.float32)
    g = np.array([1e-3, -2.0, 300.0, -4e-5, 7.0], dtype=np.float32)
    accum = np.zeros(5, dtype=np.float32)
    impl.adagrad_update(w, g, accum, 0.1, 1e-12)
    np.testing.assert_allclose(w, -0.1 * np.sign(g), rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_zero_gradient_on_zero_accumulator_gives_no_nan(impl):
    w = np.linspace(-1, 1, 17, dtype=np.float32)
    g = np.zeros(17, dtype=np.float32)
    accum = np.zeros(17, dtype=np.float32)
    w_before = w.copy()
    impl.adagrad_update(w, g, accum, 0.1, 1e-8)
    assert not np.isnan(w).any()
    np.testing.assert_array_equal(w, w_before)
    np.testing.assert_array_equal(accum, 0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_huge_values_stay_finite_and_match(impl):
    # g*g overflows float32 to inf (NumPy warns, C does not); then lr*g/inf = 0 and the
    # parameter stays put.
    f32max = np.finfo(np.float32).max
    g = np.array([1e19, -1e19, 1e20, -3e38, f32max, 1.0], dtype=np.float32)
    w = np.ones(g.size, dtype=np.float32)
    accum = np.zeros(g.size, dtype=np.float32)
    (w1, a1), (w2, a2) = _adagrad_both(impl, w, g, accum, lr=0.1, eps=1e-8)
    assert np.isfinite(w1).all()
    np.testing.assert_array_equal(np.isinf(a1), np.isinf(a2))
    np.testing.assert_allclose(w1, w2, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(w1[3:5], 1.0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_negative_lr_ascends(impl):
    w, g, accum = _problem(100, seed=4)
    (w1, a1), (w2, a2) = _adagrad_both(impl, w, g, accum, lr=-0.1, eps=1e-8)
    np.testing.assert_allclose(w1, w2, rtol=RTOL, atol=ATOL)
    assert (np.sign(w1 - w) == np.sign(g)).all()


def _good(n=8):
    return [np.zeros(n, dtype=np.float32) for _ in range(3)]


def _bad_inputs():
    w, g, a = _good()
    ro = np.zeros(8, dtype=np.float32)
    ro.flags.writeable = False
    big = np.zeros(16, dtype=np.float32)
    return {
        "float64 gradient": ((w, g.astype(np.float64), a), "float32"),
        "float64 weights": ((w.astype(np.float64), g, a), "float32"),
        "strided slice": ((np.zeros(16, dtype=np.float32)[::2], g, a), "C-contiguous"),
        "length mismatch": ((w, g[:7], a), "length mismatch"),
        "2-D": ((np.zeros((2, 4), dtype=np.float32), g, a), "1-D"),
        "list": ((list(w), g, a), "numpy.ndarray"),
        "read-only accum": ((w, g, ro), "read-only"),
        "w aliases g": ((w, w, a), "overlap"),
        "accum overlaps w": ((big[:8], g, big[4:12]), "overlap"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_adagrad_refuses_bad_arrays(case):
    (w, g, a), message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        kernels.adagrad_update(w, g, a, 0.1, 1e-8)


@pytest.mark.parametrize(
    "lr, eps, threads, message",
    [
        (float("nan"), 1e-8, 1, "lr must be finite"),
        (0.1, float("inf"), 1, "eps must be finite"),
        (0.1, -1e-8, 1, "eps must be >= 0"),
        ("fast", 1e-8, 1, "lr must be a real number"),
        (0.1, 1e-8, 0, "threads must be >= 1"),
        (0.1, 1e-8, 1.5, "threads must be an integer"),
    ],
)
def test_adagrad_refuses_bad_scalars(lr, eps, threads, message):
    w, g, a = _good()
    with pytest.raises(ValueError, match=message):
        kernels.adagrad_update(w, g, a, lr, eps, threads)


@pytest.mark.parametrize("case", ["float64 gradient", "strided slice", "length mismatch", "2-D",
                                  "w aliases g"])
def test_sgd_refuses_bad_arrays(case):
    (w, g, _), message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        kernels.sgd_update(w, g, 0.1)


@needs_extension
def test_compiled_checks_lengths_itself():
    # The compiled functions are reachable without the Python checks; a length mismatch
    # must still be refused there rather than read past the end of an array.
    w, g, a = _good()
    with pytest.raises(ValueError, match="length mismatch"):
        compiled.adagrad_update(w, g[:7], a, 0.1, 1e-8)
    with pytest.raises(ValueError, match="length mismatch"):
        compiled.adagrad_update(w, g, a[:7], 0.1, 1e-8)
    with pytest.raises(ValueError, match="length mismatch"):
        compiled.sgd_update(w, g[:7], 0.1)
    with pytest.raises(ValueError, match="threads"):
        compiled.adagrad_update(w, g, a, 0.1, 1e-8, 0)


def _run_python(code, env_extra):
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_fallback_forced_by_env_matches_reference(tmp_path):
    out = tmp_path / "result.npz"
    _run_python(
        f"""
        import warnings
        warnings.simplefilter("error")  # a forced fallback is asked for: no warning
        import numpy as np
        import hpcps.kernels as k
        assert k.HAVE_EXTENSION is False
        rng = np.random.default_rng(5)
        w = rng.standard_normal(1000, dtype=np.float32)
        g = rng.standard_normal(1000, dtype=np.float32)
        a = np.ones(1000, dtype=np.float32)
        k.adagrad_update(w, g, a, 0.05, 1e-8, threads=2)
        k.sgd_update(w, g, 0.01)
        np.savez({str(out)!r}, w=w, a=a)
        """,
        {"HPCPS_NO_EXTENSION": "1"},
    )
    rng = np.random.default_rng(5)
    w = rng.standard_normal(1000, dtype=np.float32)
    g = rng.standard_normal(1000, dtype=np.float32)
    a = np.ones(1000, dtype=np.float32)
    reference.adagrad_update(w, g, a, 0.05, 1e-8)
    reference.sgd_update(w, g, 0.01)
    got = np.load(out)
    np.testing.assert_array_equal(got["w"], w)
    np.testing.assert_array_equal(got["a"], a)


def test_missing_extension_warns_once_and_falls_back():
    # Hide the compiled module with an import hook, as on a machine where it was never built.
    proc = _run_python(
        """
        import json, sys, warnings
        import numpy as np

        class HideExtension:
            def find_spec(self, name, path=None, target=None):
                if name == "hpcps.kernels._adagrad":
                    raise ImportError("hidden by the test")
                return None

        sys.meta_path.insert(0, HideExtension())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import hpcps.kernels as k
        w = np.ones(3, dtype=np.float32)
        k.sgd_update(w, np.ones(3, dtype=np.float32), 0.5)
        print(json.dumps({"have": k.HAVE_EXTENSION, "w": w.tolist(),
                          "warnings": [str(c.message) for c in caught]}))
        """,
        {"HPCPS_NO_EXTENSION": "0"},
    )
    result = json.loads(proc.stdout)
    assert result["have"] is False
    assert result["w"] == [0.5, 0.5, 0.5]
    assert len(result["warnings"]) == 1
    assert "slower" in result["warnings"][0]
    assert "build_ext --inplace" in result["warnings"][0]
