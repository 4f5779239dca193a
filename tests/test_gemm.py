"""Tests for hpcps.kernels.gemm: compiled GEMM kernels against their NumPy references.

The public functions are called with the extension in use (skipped where it is not built);
the fallback path (``HPCPS_NO_EXTENSION=1``) runs in a subprocess so this process's imports
are left alone.
"""
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hpcps.errors import ConfigError
from hpcps.kernels import gemm

REPO = Path(__file__).resolve().parents[1]
GEMM_RTOL, GEMM_ATOL = 1e-4, 1e-4  # float32 GEMMs: summation order differs between kernels
LR, EPS = 0.05, 1e-7

needs_extension = pytest.mark.skipif(
    not gemm.HAVE_EXTENSION,
    reason="hpcps.kernels._gemm is not built (run `python setup.py build_ext --inplace`)",
)

# (M, N, k) of W (M, N) and A (k, M), E (k, N): edge sizes, odd sizes, sizes that are not
# multiples of the tiles, and the training shapes (784-1024-1024-10, batch 128).
UPDATE_SHAPES = [(1, 1, 1), (1, 5, 3), (37, 129, 65), (65, 1030, 7), (130, 260, 1),
                 (784, 1024, 128), (1024, 10, 128)]
GEMM_SHAPES = [(1, 1, 1), (37, 129, 65), (129, 65, 37), (3, 1, 17), (128, 784, 1024),
               (128, 1024, 10)]  # (B, K, N)


def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _update_problem(M, N, k, seed, integer=False):
    rng = np.random.default_rng(seed)
    W = _f32(rng, M, N)
    accum = rng.uniform(0.1, 2.0, (M, N)).astype(np.float32)
    if integer:  # small integers: A.T @ E is exact in float32 whatever the summation order
        A = rng.integers(-3, 4, (k, M)).astype(np.float32)
        E = rng.integers(-3, 4, (k, N)).astype(np.float32)
    else:
        A, E = _f32(rng, k, M), _f32(rng, k, N, scale=0.1)
    return W, accum, A, E


@needs_extension
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,k", UPDATE_SHAPES)
def test_fused_outer_adagrad_matches_reference(M, N, k, threads):
    W, accum, A, E = _update_problem(M, N, k, seed=M + N + k)
    W2, acc2 = W.copy(), accum.copy()
    A0, E0 = A.copy(), E.copy()
    gemm.fused_outer_adagrad(W, accum, A, E, LR, EPS, threads=threads)
    gemm.outer_adagrad_reference(W2, acc2, A, E, LR, EPS)
    np.testing.assert_array_equal(A, A0)  # inputs are read only
    np.testing.assert_array_equal(E, E0)
    np.testing.assert_allclose(accum, acc2, rtol=GEMM_RTOL, atol=GEMM_ATOL)
    np.testing.assert_allclose(W, W2, rtol=GEMM_RTOL, atol=GEMM_ATOL)


@needs_extension
@pytest.mark.parametrize("tile", [(1, 1), (7, 13), (64, 256), (1000, 3000)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_outer_adagrad_exact_given_exact_gradient(tile, threads):
    """With an exactly representable G, the Adagrad math agrees with the reference to 1 ulp."""
    W, accum, A, E = _update_problem(37, 129, 5, seed=3, integer=True)
    W2, acc2 = W.copy(), accum.copy()
    gemm.fused_outer_adagrad(W, accum, A, E, LR, EPS, threads, tile[0], tile[1])
    gemm.outer_adagrad_reference(W2, acc2, A, E, LR, EPS)
    np.testing.assert_array_equal(accum, acc2)
    np.testing.assert_array_max_ulp(W, W2, maxulp=1)


@needs_extension
def test_fused_outer_adagrad_k0_leaves_weights():
    W, accum, _, _ = _update_problem(5, 7, 1, seed=0)
    W0, acc0 = W.copy(), accum.copy()
    gemm.fused_outer_adagrad(W, accum, np.empty((0, 5), np.float32),
                             np.empty((0, 7), np.float32), LR, EPS)
    np.testing.assert_array_equal(W, W0)
    np.testing.assert_array_equal(accum, acc0)


@needs_extension
@pytest.mark.parametrize("act", gemm.ACTIVATIONS)
@pytest.mark.parametrize("B,K,N", GEMM_SHAPES)
def test_gemm_bias_act_matches_reference(B, K, N, act):
    rng = np.random.default_rng(B * K + N)
    X, W, b = _f32(rng, B, K), _f32(rng, K, N, scale=K ** -0.5), _f32(rng, N)
    out = gemm.gemm_bias_act(X, W, b, act)
    ref = gemm.gemm_bias_act_reference(X, W, b, act, np.empty((B, N), np.float32))
    np.testing.assert_allclose(out, ref, rtol=GEMM_RTOL, atol=GEMM_ATOL)
    out2 = np.full((B, N), np.nan, np.float32)
    assert gemm.gemm_bias_act(X, W, b, act, out2) is out2
    np.testing.assert_array_equal(out2, out)


@needs_extension
@pytest.mark.parametrize("act", gemm.ACTIVATIONS)
@pytest.mark.parametrize("block_rows", [0, 1, 32, 1000])
def test_compiled_bias_act_pass_every_activation(act, block_rows):
    """The compiled pass for every activation (the API uses it for relu/none only)."""
    from hpcps.kernels import _gemm
    rng = np.random.default_rng(7)
    X, W, b = _f32(rng, 37, 65, scale=3.0), _f32(rng, 65, 129), _f32(rng, 129)
    out = np.empty((37, 129), np.float32)
    _gemm.gemm_bias_act(X, W, b, act, out, block_rows)
    ref = gemm.gemm_bias_act_reference(X, W, b, act, np.empty_like(out))
    np.testing.assert_allclose(out, ref, rtol=GEMM_RTOL, atol=GEMM_ATOL)


@needs_extension
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (37, 129, 65), (128, 784, 1024),
                                   (784, 128, 1024), (3, 0, 4)])
def test_sgemm_matches_numpy(M, K, N, trans_a):
    rng = np.random.default_rng(M + K + N)
    A = _f32(rng, K, M) if trans_a else _f32(rng, M, K)
    B = _f32(rng, K, N)
    out = gemm.sgemm(A, B, trans_a=trans_a)
    ref = gemm.sgemm_reference(A, B, np.empty((M, N), np.float32), trans_a)
    np.testing.assert_allclose(out, ref, rtol=GEMM_RTOL, atol=GEMM_ATOL)


def _ok_update():
    return _update_problem(4, 6, 3, seed=1)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.__setitem__(0, a[0].astype(np.float64)), "float32"),
    (lambda a: a.__setitem__(0, np.asfortranarray(np.ones((4, 6), np.float32))),
     "C-contiguous"),
    (lambda a: a.__setitem__(1, a[1][:3]), "shape mismatch"),
    (lambda a: a.__setitem__(2, a[2][:, :3].copy()), "shape mismatch"),
    (lambda a: a.__setitem__(3, a[3].ravel()), "2-D"),
    (lambda a: a.__setitem__(1, a[0]), "overlap"),
    (lambda a: a[0].setflags(write=False), "read-only"),
    (lambda a: a.__setitem__(2, [[1.0]]), "numpy.ndarray"),
])
def test_fused_outer_adagrad_refuses_bad_arrays(mutate, match):
    args = list(_ok_update())
    mutate(args)
    with pytest.raises(ValueError, match=match):
        gemm.fused_outer_adagrad(*args, LR, EPS)


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": float("nan")}, "lr"), ({"eps": -1.0}, "eps"), ({"eps": "x"}, "eps"),
    ({"threads": 0}, "threads"), ({"threads": 1.5}, "threads"), ({"tile_m": 0}, "tile_m"),
])
def test_fused_outer_adagrad_refuses_bad_scalars(kwargs, match):
    W, accum, A, E = _ok_update()
    params = {"lr": LR, "eps": EPS, **kwargs}
    with pytest.raises(ValueError, match=match):
        gemm.fused_outer_adagrad(W, accum, A, E, **params)


def test_gemm_bias_act_refuses_bad_input():
    rng = np.random.default_rng(0)
    X, W, b = _f32(rng, 4, 5), _f32(rng, 5, 6), _f32(rng, 6)
    with pytest.raises(ValueError, match="act"):
        gemm.gemm_bias_act(X, W, b, "gelu")
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm.gemm_bias_act(X, W[:4].copy(), b, "relu")
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm.gemm_bias_act(X, W, b[:5].copy(), "relu")
    with pytest.raises(ValueError, match="out must have shape"):
        gemm.gemm_bias_act(X, W, b, "relu", np.empty((4, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        gemm.gemm_bias_act(X.astype(np.float64), W, b, "relu")
    with pytest.raises(ValueError, match="C-contiguous"):
        gemm.gemm_bias_act(X, np.asfortranarray(W), b, "relu")
    buf = np.empty(4 * 6 + 6, np.float32)
    out, bb = buf[:24].reshape(4, 6), buf[18:24]
    with pytest.raises(ValueError, match="overlap"):
        gemm.gemm_bias_act(X, W, bb, "relu", out)


def test_sgemm_refuses_bad_input():
    rng = np.random.default_rng(0)
    A, B = _f32(rng, 4, 5), _f32(rng, 5, 6)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm.sgemm(A, B, trans_a=True)
    with pytest.raises(ValueError, match="out must have shape"):
        gemm.sgemm(A, B, np.empty((6, 4), np.float32))
    ro = np.empty((4, 6), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        gemm.sgemm(A, B, ro)


def test_fallback_without_extension_agrees():
    """HPCPS_NO_EXTENSION=1: the references run, and give the compiled results."""
    # the same calls run in a subprocess without the extension and here with it
    calls = textwrap.dedent("""
        rng = np.random.default_rng(0)
        W = rng.standard_normal((37, 129)).astype(np.float32)
        acc = np.ones_like(W)
        A = rng.standard_normal((5, 37)).astype(np.float32)
        E = rng.standard_normal((5, 129)).astype(np.float32)
        gemm.fused_outer_adagrad(W, acc, A, E, 0.05, 1e-7)
        X = rng.standard_normal((3, 37)).astype(np.float32)
        out = gemm.gemm_bias_act(X, W, np.ones(129, np.float32), "tanh")
        s = gemm.sgemm(A, E, trans_a=True)
        got = np.concatenate([W.ravel(), acc.ravel(), out.ravel(), s.ravel()])
    """)
    code = ("import sys\nimport numpy as np\nfrom hpcps.kernels import gemm\n"
            "assert not gemm.HAVE_EXTENSION\n" + calls
            + "sys.stdout.buffer.write(got.astype(np.float32).tobytes())\n")
    env = {**os.environ, "HPCPS_NO_EXTENSION": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=60, check=True)
    got = np.frombuffer(proc.stdout, dtype=np.float32)
    if not gemm.HAVE_EXTENSION:
        return
    here = {"np": np, "gemm": gemm}
    exec(calls, here)
    want = here["got"]
    np.testing.assert_allclose(got, want, rtol=GEMM_RTOL, atol=GEMM_ATOL)


# -- zero skipping (ext/zero_skip.h) -------------------------------------------------------
# odd on purpose: rows/inputs not multiples of the 4-blocks, outputs not of 64, 24, 16 or 8
ZS_SHAPES = [(1, 1, 1), (3, 5, 10), (13, 70, 65), (37, 129, 200), (128, 784, 1024),
             (130, 787, 1000)]


def _cpu_flags():
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


CPU_FLAGS = _cpu_flags()


def _isa(isa):
    """``isa`` as a test parameter, skipped (saying why) where this CPU cannot run it: every
    test below runs with the kernels this CPU has and reports the others as skipped."""
    reason = (f"this CPU cannot run the {isa} kernels (its best: {gemm.ZERO_SKIP_CPU_ISA}; "
              f"{gemm.ZERO_SKIP_ENV}={os.environ.get(gemm.ZERO_SKIP_ENV)!r})")
    return pytest.param(isa, marks=pytest.mark.skipif(isa not in gemm.ZERO_SKIP_ISAS,
                                                      reason=reason))


ISAS = [_isa(isa) for isa in gemm.ISA_NAMES]


@pytest.mark.skipif(not gemm.HAVE_EXTENSION or platform.machine() != "x86_64"
                    or CPU_FLAGS is None,
                    reason="needs the extension on x86-64 Linux (/proc/cpuinfo)")
def test_zero_skip_isa_is_the_cpus_best():
    """The run-time choice follows the CPU's flags as the kernel reports them: AVX-512F,
    else AVX2 with FMA, else none (then the NumPy references run)."""
    if "avx512f" in CPU_FLAGS:
        want = "avx512"
    elif {"avx2", "fma"} <= CPU_FLAGS:
        want = "avx2"
    else:
        want = None
    assert gemm.ZERO_SKIP_CPU_ISA == want
    if not os.environ.get(gemm.ZERO_SKIP_ENV):
        assert gemm.ZERO_SKIP_ISA == want
        assert gemm.ZERO_SKIP_COMPILED == (want is not None)


@pytest.mark.parametrize("cpu,cap,want", [
    (None, None, ()), (None, "avx512", ()),                      # no AVX2: references only
    ("avx2", None, ("avx2",)), ("avx2", "", ("avx2",)), ("avx2", "avx512", ("avx2",)),
    ("avx2", "none", ()), ("avx512", None, ("avx2", "avx512")),
    ("avx512", "avx2", ("avx2",)), ("avx512", " AVX512 ", ("avx2", "avx512")),
    ("avx512", "none", ()),
])
def test_zero_skip_isas_rule(cpu, cap, want):
    """Every CPU kind: what the kernels may use, given the CPU's best and the cap."""
    assert gemm.zero_skip_isas(cpu, cap) == want


def test_zero_skip_isas_refuses_unknown_cap():
    with pytest.raises(ConfigError, match="HPCPS_ZERO_SKIP_ISA"):
        gemm.zero_skip_isas("avx2", "sse4")


def _zs_inputs(B, K, density, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((B, K), dtype=np.float32)
    X[rng.random((B, K)) >= density] = 0.0
    return X


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("density", [0.0, 0.19, 1.0])
@pytest.mark.parametrize("B,K,N", ZS_SHAPES)
def test_zero_skip_matmul_matches_numpy(B, K, N, density, isa):
    X = _zs_inputs(B, K, density, seed=B)
    W = np.random.default_rng(1).standard_normal((K, N), dtype=np.float32)
    out = np.full((B, N), np.nan, dtype=np.float32)   # must be overwritten, not added to
    gemm.zero_skip_matmul(X, W, out, isa=isa)
    want = X.astype(np.float64) @ W
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * (np.abs(want).max() + 1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("with_w2", [False, True])
@pytest.mark.parametrize("density", [0.0, 0.19, 1.0])
@pytest.mark.parametrize("B,K,N", ZS_SHAPES)
def test_zero_skip_update_matches_numpy(B, K, N, density, with_w2, isa):
    rng = np.random.default_rng(2)
    X = _zs_inputs(B, K, density, seed=K)
    D = rng.standard_normal((B, N), dtype=np.float32)
    W = rng.standard_normal((K, N), dtype=np.float32)
    W2 = rng.standard_normal((K, N), dtype=np.float32) if with_w2 else None
    want = W.astype(np.float64) - 0.3 * (X.astype(np.float64).T @ D)
    want2 = W2.astype(np.float64) - 0.3 * (X.astype(np.float64).T @ D) if with_w2 else None
    gemm.zero_skip_update(W, X, D, -0.3, W2, isa=isa)
    tol = 1e-4 * (np.abs(want).max() + 1)
    np.testing.assert_allclose(W, want, rtol=1e-4, atol=tol)
    if with_w2:
        np.testing.assert_allclose(W2, want2, rtol=1e-4, atol=tol)


@pytest.mark.parametrize("isa", ISAS)
def test_zero_skip_on_mnist_like_strokes_matches_reference(isa):
    """Image-like inputs (blobs of nonzeros, NaN-free) at the first layer's shapes: the
    kernels against the NumPy references, both products."""
    rng = np.random.default_rng(5)
    X = np.zeros((128, 28, 28), np.float32)
    for img in X:
        r, c = rng.integers(4, 20, 2)
        img[r:r + 8, c:c + 5] = rng.random((8, 5), dtype=np.float32)
    X = X.reshape(128, 784)
    W = rng.standard_normal((784, 512), dtype=np.float32)
    D = rng.standard_normal((128, 512), dtype=np.float32)
    got = gemm.zero_skip_matmul(X, W, isa=isa)
    want = gemm.zero_skip_matmul_reference(X, W, np.empty_like(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    W_ref = W.copy()
    gemm.zero_skip_update(W, X, D, -0.1, isa=isa)
    gemm.zero_skip_update_reference(W_ref, X, D, -0.1)
    np.testing.assert_allclose(W, W_ref, rtol=1e-5, atol=1e-5)


def test_zero_skip_default_path_matches_reference():
    """Without ``isa`` the best kernels this machine has run, or the references where it has
    none: the same products either way."""
    X = _zs_inputs(37, 129, 0.19, seed=4)
    W = np.random.default_rng(3).standard_normal((129, 200), dtype=np.float32)
    got = gemm.zero_skip_matmul(X, W)
    want = gemm.zero_skip_matmul_reference(X, W, np.empty_like(got))
    if gemm.ZERO_SKIP_ISA is None:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_zero_skip_refuses_unavailable_isa():
    X = np.zeros((4, 6), np.float32)
    W = np.zeros((6, 3), np.float32)
    D = np.zeros((4, 3), np.float32)
    missing = [isa for isa in gemm.ISA_NAMES if isa not in gemm.ZERO_SKIP_ISAS]
    for isa in missing + ["sse2"]:
        with pytest.raises(ValueError, match="not available"):
            gemm.zero_skip_matmul(X, W, isa=isa)
        with pytest.raises(ValueError, match="not available"):
            gemm.zero_skip_update(W, X, D, 1.0, isa=isa)


@pytest.mark.parametrize("cap", ["none", "avx2", "avx512"])
def test_zero_skip_cap_from_environment(cap):
    """HPCPS_ZERO_SKIP_ISA caps the kernels (a machine without AVX2, or with AVX2 only, as
    seen from this one); the Hogwild engine follows; results still match the reference."""
    code = textwrap.dedent("""
        import numpy as np
        from hpcps.engine.hogwild import HogwildEngine
        from hpcps.kernels import gemm
        rng = np.random.default_rng(0)
        X = rng.standard_normal((9, 40), dtype=np.float32)
        X[rng.random((9, 40)) > 0.2] = 0.0
        W = rng.standard_normal((40, 30), dtype=np.float32)
        got = gemm.zero_skip_matmul(X, W)
        want = X.astype(np.float64) @ W
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4), np.abs(got - want).max()
        print(gemm.ZERO_SKIP_ISA, HogwildEngine((40, 30, 3), batch=9).zero_skip_isa)
    """)
    env = {**os.environ, gemm.ZERO_SKIP_ENV: cap, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    want = gemm.zero_skip_isas(gemm.ZERO_SKIP_CPU_ISA, cap)
    want = str(want[-1]) if want else "None"
    assert proc.stdout.split() == [want, want]


def test_zero_skip_cap_refuses_unknown_value():
    env = {**os.environ, gemm.ZERO_SKIP_ENV: "avx9000", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", "import hpcps.kernels.gemm"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "HPCPS_ZERO_SKIP_ISA='avx9000'" in proc.stderr


def test_zero_skip_refuses_bad_input():
    X = np.zeros((4, 6), np.float32)
    W = np.zeros((6, 3), np.float32)
    D = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm.zero_skip_matmul(X, W.T.copy())
    with pytest.raises(ValueError, match="out must have shape"):
        gemm.zero_skip_matmul(X, W, np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        gemm.zero_skip_update(W, X, D, 1.0, W2=W)
    with pytest.raises(ValueError, match="finite"):
        gemm.zero_skip_update(W, X, D, float("nan"))
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm.zero_skip_update(W, X, D[:3], 1.0)
    with pytest.raises(ValueError):
        gemm.zero_skip_update(W, X.astype(np.float64), D, 1.0)


@needs_extension
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_sgemm_blas_every_layout(trans_a, trans_b, beta):
    """The raw kernel behind ``sgemm`` and BLAS timing: ``alpha op(A) op(B) + beta C``."""
    from hpcps.kernels import _gemm
    rng = np.random.default_rng(7)
    M, K, N = 13, 37, 21
    A = _f32(rng, *((K, M) if trans_a else (M, K)))
    B = _f32(rng, *((N, K) if trans_b else (K, N)))
    C = np.full((M, N), np.nan, np.float32) if beta == 0.0 else _f32(rng, M, N)
    want = -0.5 * ((A.T if trans_a else A) @ (B.T if trans_b else B)).astype(np.float64)
    if beta:
        want += beta * C
    _gemm.sgemm_blas(A, B, C, trans_a, trans_b, -0.5, beta)
    np.testing.assert_allclose(C, want, rtol=GEMM_RTOL, atol=GEMM_ATOL)
