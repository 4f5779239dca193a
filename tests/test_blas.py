"""Tests for hpcps.kernels.blas: the compiled kernels and the Hogwild engine give the NumPy
references' results with every available sgemm (OpenBLAS, and Intel MKL where it loads),
threads may call MKL concurrently, and bad choices are refused clearly.

Environment-variable cases and PyTorch in the same process run in subprocesses, so this
process's choice is left alone.
"""
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from test_hogwild import check_gradient_matches_mlp

from hpcps.engine import hogwild
from hpcps.errors import ConfigError
from hpcps.engine.hogwild import HogwildEngine
from hpcps.kernels import blas, gemm
from hpcps.model.mlp import MLP

REPO = Path(__file__).resolve().parents[1]
GEMM_RTOL, GEMM_ATOL = 1e-4, 1e-4   # as tests/test_gemm.py
LR, EPS = 0.05, 1e-7

needs_extension = pytest.mark.skipif(
    not (gemm.HAVE_EXTENSION and hogwild.HAVE_EXTENSION),
    reason="the compiled kernels are not built (run `python setup.py build_ext --inplace`)",
)


def _available():
    before = blas.current()
    found = ["openblas"]
    try:
        blas.use("mkl")
        found.append("mkl")
    except ConfigError:
        pass
    finally:
        blas.use(before)
    return found


AVAILABLE = _available()
MKL = pytest.mark.skipif("mkl" not in AVAILABLE, reason=f"MKL not loadable: {blas.mkl_error}")


@pytest.fixture(params=AVAILABLE)
def backend(request):
    """Run the test with each available sgemm, then restore this process's choice."""
    before = blas.current()
    assert blas.use(request.param) == request.param
    assert blas.current() == request.param
    yield request.param
    blas.use(before)


def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _data(n, n_in, n_out, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n_in), dtype=np.float32), rng.integers(0, n_out, n)


def _run(code, env_extra=None, timeout=120):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("HPCPS_BLAS", None)
    env.update(env_extra or {})
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=timeout, check=False)
    assert res.returncode == 0, res.stderr
    return res


# --------------------------------------------------------------------------- kernels

@needs_extension
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (37, 129, 65), (128, 784, 1024),
                                   (1024, 128, 1024), (128, 1024, 10), (3, 0, 4)])
def test_sgemm_matches_numpy(backend, M, K, N, trans_a):
    rng = np.random.default_rng(M + K + N)
    A = _f32(rng, K, M) if trans_a else _f32(rng, M, K)
    B = _f32(rng, K, N)
    out = gemm.sgemm(A, B, trans_a=trans_a)
    ref = gemm.sgemm_reference(A, B, np.empty((M, N), np.float32), trans_a)
    np.testing.assert_allclose(out, ref, rtol=GEMM_RTOL, atol=GEMM_ATOL)


@needs_extension
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,k", [(37, 129, 65), (65, 1030, 7), (784, 1024, 128)])
def test_fused_outer_adagrad_matches_reference(backend, M, N, k, threads):
    rng = np.random.default_rng(M + N + k)
    W, accum = _f32(rng, M, N), rng.uniform(0.1, 2.0, (M, N)).astype(np.float32)
    A, E = _f32(rng, k, M), _f32(rng, k, N, scale=0.1)
    W2, acc2 = W.copy(), accum.copy()
    # threads=2: two OpenMP threads call sgemm at once, on different tiles
    gemm.fused_outer_adagrad(W, accum, A, E, LR, EPS, threads=threads, tile_m=256,
                             tile_n=256)
    gemm.outer_adagrad_reference(W2, acc2, A, E, LR, EPS)
    np.testing.assert_allclose(accum, acc2, rtol=GEMM_RTOL, atol=GEMM_ATOL)
    np.testing.assert_allclose(W, W2, rtol=GEMM_RTOL, atol=GEMM_ATOL)


@needs_extension
@pytest.mark.parametrize("act", gemm.ACTIVATIONS)
def test_gemm_bias_act_matches_reference(backend, act):
    rng = np.random.default_rng(5)
    X, W, b = _f32(rng, 128, 784), _f32(rng, 784, 512, scale=784 ** -0.5), _f32(rng, 512)
    out = gemm.gemm_bias_act(X, W, b, act)
    ref = gemm.gemm_bias_act_reference(X, W, b, act, np.empty((128, 512), np.float32))
    np.testing.assert_allclose(out, ref, rtol=GEMM_RTOL, atol=GEMM_ATOL)


@needs_extension
def test_two_threads_call_sgemm_at_once(backend):
    """Two Python threads in sgemm together (it runs without the GIL), 40 products each,
    every one checked: a BLAS that shared buffers between threads would corrupt some."""
    rng = np.random.default_rng(11)
    problems = []
    for t in range(2):
        A, B = _f32(rng, 128, 512), _f32(rng, 512, 256 + 64 * t)
        problems.append((A, B, A @ B))
    bad = []
    start = threading.Barrier(2)

    def work(t):
        A, B, want = problems[t]
        out = np.empty_like(want)
        start.wait()
        for _ in range(40):
            out[...] = np.nan
            gemm.sgemm(A, B, out)
            if not np.allclose(out, want, rtol=GEMM_RTOL, atol=GEMM_ATOL):
                bad.append(t)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not bad


# --------------------------------------------------------------------------- engine

@needs_extension
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("sizes,rows", [((13, 17, 5, 7), 9), ((784, 256, 128, 10), 64)])
def test_engine_gradient_matches_mlp(backend, activation, sizes, rows):
    check_gradient_matches_mlp(activation, sizes, rows)


@needs_extension
@pytest.mark.parametrize("with_delta", [False, True])
def test_one_thread_train_is_sequential_sgd(backend, with_delta):
    sizes, batch, lr = (20, 31, 17, 5), 16, 0.05
    model = MLP(sizes, "tanh")
    x, y = _data(200, sizes[0], sizes[-1], seed=4)
    order = np.random.default_rng(5).permutation(200)[:103]   # last batch partial
    want = model.init_params(7)
    got = want.copy()
    want_loss = 0.0
    for lo in range(0, len(order), batch):
        idx = order[lo:lo + batch]
        loss, g = model.loss_and_grad(want, x[idx], y[idx])
        want -= np.float32(lr) * g
        want_loss += loss * len(idx)
    engine = HogwildEngine(sizes, "tanh", threads=1, batch=batch)
    delta = np.zeros_like(got) if with_delta else None
    loss_sum, n = engine.train(got, x, y, order, lr, delta=delta)
    assert n == len(order)
    assert loss_sum == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@needs_extension
@pytest.mark.parametrize("backend_threads", ["threads", "openmp"])
def test_two_engine_threads_at_once(backend, backend_threads):
    """T = 2 engine threads call sgemm concurrently: with lr = 0 each example's loss must
    come out exactly as NumPy computes it, and the threaded gradient sum must match; then
    Hogwild training with both threads updating must still reduce the loss."""
    sizes = (784, 256, 256, 10)
    model = MLP(sizes, "relu")
    params = model.init_params(0)
    x, _ = _data(1024, sizes[0], sizes[-1], seed=6)
    x *= np.float32(0.3)
    y = np.argmax(x[:, :10], axis=1)          # learnable labels
    engine = HogwildEngine(sizes, "relu", threads=2, batch=64, backend=backend_threads)
    before = params.copy()
    loss_sum, n = engine.train(params, x, y, np.arange(1024), 0.0)
    assert n == 1024
    np.testing.assert_array_equal(params, before)
    assert loss_sum == pytest.approx(model.loss(params, x, y) * 1024, rel=1e-5)
    loss_sum, grad, n = engine.gradient_sum(params, x, y, np.arange(1024))
    want_loss, want = model.loss_and_grad(params, x, y)
    assert loss_sum == pytest.approx(want_loss * 1024, rel=1e-5)
    np.testing.assert_allclose(grad / 1024, want, rtol=1e-3, atol=1e-5 * np.abs(want).max())
    start_loss = model.loss(params, x, y)
    rng = np.random.default_rng(7)
    for _ in range(6):
        engine.train(params, x, y, rng.permutation(1024), 0.2)
    assert np.all(np.isfinite(params))
    assert model.loss(params, x, y) < 0.4 * start_loss   # ~0.1 measured, both backends


# --------------------------------------------------------------------------- choosing

@needs_extension
@MKL
def test_use_switches_the_pointer_both_ways():
    from hpcps.kernels import _gemm, _hogwild
    before = blas.current()
    try:
        blas.use("openblas")
        scipy_sgemm = _gemm._get_sgemm()
        assert _hogwild._get_sgemm() == scipy_sgemm
        assert blas.use("mkl") == "mkl" and blas.current() == "mkl"
        assert _gemm._get_sgemm() == _hogwild._get_sgemm() != scipy_sgemm
        info = blas.info()
        assert info["blas"] == "mkl" and "Math Kernel Library" in info["mkl_version"]
        assert info["reason"] == "use('mkl'): asked for" and info["timing"] is None
        auto = blas.use("auto")                    # timed: the pointer is the faster one's
        assert (_gemm._get_sgemm() == scipy_sgemm) == (auto == "openblas")
        assert _hogwild._get_sgemm() == _gemm._get_sgemm()
        assert blas.use("openblas") == "openblas" and blas.current() == "openblas"
        assert _gemm._get_sgemm() == _hogwild._get_sgemm() == scipy_sgemm
        assert blas.use(" MKL ") == "mkl"          # case and spaces, as in the env var
    finally:
        blas.use(before)


@MKL
def test_mkl_is_lp64_and_sequential():
    """The layers asked for are the ones in effect (a second call reports them), and the
    loaded sgemm passes the LP64 check."""
    blas.use(blas.current())            # loaded already (AVAILABLE), nothing changes
    lib = blas._mkl["lib"]
    assert lib.MKL_Set_Interface_Layer(0) == 0           # LP64
    assert lib.MKL_Set_Threading_Layer(1) == 1           # SEQUENTIAL
    assert lib.MKL_Get_Max_Threads() == 1
    assert blas._check_sgemm(blas._mkl["sgemm"])


def test_bad_names_are_refused():
    before = blas.current()
    for bad in ("", "intel", "openblas64", None, 3, "mkl,openblas"):
        with pytest.raises(ConfigError, match="choose one of"):
            blas.use(bad)
    assert blas.current() == before


def test_mkl_wheel_installed_means_mkl_loads():
    """Where the ``mkl`` wheel is installed (``.[test]`` installs it on Linux x86_64), MKL
    must load: a loader that quietly fell back to OpenBLAS would hide here otherwise."""
    try:
        importlib.metadata.version("mkl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the mkl wheel is not installed")
    assert "mkl" in AVAILABLE, blas.mkl_error


def test_mkl_is_looked_for_under_sys_prefix_then_on_the_loaders_path_without_a_subprocess(
        monkeypatch):
    """The wheel's files come first, then the sonames for the dynamic loader's own search
    (LD_LIBRARY_PATH, as ``module load`` sets it); nothing starts a process (the system
    search of ``ctypes.util.find_library`` ran ldconfig, gcc and ld in every rank). Where
    MKL is absent, each candidate's line says why it was not used."""
    import ctypes.util
    import subprocess
    started = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: started.append(name))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    cands = list(blas._mkl_candidates())
    lib = os.path.join(sys.prefix, "lib")
    assert cands[:3] == [os.path.join(lib, f"libmkl_rt.so{v}") for v in (".3", ".2", "")]
    assert cands[3:] == ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"]
    # where nothing loads: one line per candidate
    monkeypatch.setattr(blas, "_mkl", None)
    monkeypatch.setattr(blas, "mkl_error", None)
    monkeypatch.setattr(blas, "_mkl_candidates",
                        lambda: ["/no/such/dir/libmkl_rt.so.3", "libhpcps-no-such-mkl.so.3"])
    with pytest.raises(ConfigError) as err:
        blas._load_mkl()
    assert "/no/such/dir/libmkl_rt.so.3: no such file" in str(err.value)
    assert "libhpcps-no-such-mkl.so.3: not on the loader's path (LD_LIBRARY_PATH" \
        in str(err.value)
    assert started == []


def test_environment_variable(tmp_path):
    """HPCPS_BLAS, read at the first engine, with MKL made unfindable (an empty directory):
    ``mkl`` is a clear ConfigError, ``auto`` falls back to OpenBLAS, typos are refused."""
    code = f"""
        import json, sys
        import numpy as np
        from hpcps.errors import ConfigError
        from hpcps.kernels import blas, gemm
        from hpcps.engine.hogwild import HogwildEngine
        blas._mkl_candidates = lambda: [{str(tmp_path / "libmkl_rt.so.3")!r}]
        try:
            HogwildEngine((4, 3), "relu")
            out = {{"ok": blas.current(), "reason": blas.info()["reason"]}}
        except ConfigError as exc:
            out = {{"error": str(exc)}}
        A = np.ones((2, 3), np.float32)
        try:     # the kernels ask again: the same answer
            gemm.sgemm(A, A.T.copy())
            out["again"] = blas.current()
        except ConfigError as exc:
            out["again"] = "error"
        print(json.dumps(out))
    """
    got = {}
    for value in ("mkl", "auto", "openblas", "OpenBLAS", "mlk"):
        got[value] = json.loads(_run(code, {"HPCPS_BLAS": value}).stdout)
    if gemm.HAVE_EXTENSION:
        err = got["mkl"]["error"]
        assert "HPCPS_BLAS=mkl" in err and "libmkl_rt not found" in err
        assert str(tmp_path) in err and "pip install mkl" in err
        assert got["mkl"]["again"] == "error"
        assert got["mlk"]["error"].startswith("HPCPS_BLAS='mlk'")
    reason = got["auto"].pop("reason")
    assert got["auto"] == {"ok": "openblas", "again": "openblas"}
    if gemm.HAVE_EXTENSION:
        assert reason.startswith("HPCPS_BLAS=auto: MKL cannot be used (libmkl_rt not found")
    assert got["openblas"].pop("reason") == "HPCPS_BLAS=openblas: asked for"
    assert got["OpenBLAS"].pop("reason") == "HPCPS_BLAS=OpenBLAS: asked for"
    assert got["openblas"] == got["OpenBLAS"] == {"ok": "openblas", "again": "openblas"}


@needs_extension
@MKL
def test_default_is_used_when_unset():
    code = """
        import json
        from hpcps.kernels import blas, gemm
        import numpy as np
        gemm.sgemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
        print(json.dumps(blas.info()))
    """
    info = json.loads(_run(code).stdout)
    assert blas.DEFAULT == "auto"
    assert info["reason"].startswith("HPCPS_BLAS unset: auto: timed both at the sgemm shapes "
                                     "of an MLP 784-512-512-10 at batch 128 (8 products)")
    _check_auto_choice(info)


def _check_auto_choice(info):
    """auto kept the library its own timing found faster, and says so."""
    speed = info["timing"]["mkl_speed_over_openblas"]  # rounded to 3 places: a tie may go
    assert info["blas"] == ("mkl" if speed > 1.0 else "openblas") or speed == 1.0  # either way
    assert f"MKL ran {speed:.2f}x OpenBLAS's speed" in info["reason"]
    assert blas.MIN_ROUNDS <= info["timing"]["rounds"] <= blas.MAX_ROUNDS


@needs_extension
@MKL
def test_auto_times_the_engines_shapes():
    """The first Hogwild engine hands auto its model's sgemm calls (without the first
    layer's when it skips zeros); the choice is made once and the summary fields say which
    library and why."""
    code = """
        import json
        from hpcps.engine.hogwild import HogwildEngine
        from hpcps.kernels import blas
        engine = HogwildEngine((30, 700, 10), batch=16)
        first = blas.info()
        HogwildEngine((5, 5), batch=2)              # already chosen: not timed again
        assert blas.info() == first
        print(json.dumps({"info": first, "summary": blas.summary(),
                          "skips": engine.zero_skip_isa is not None}))
    """
    got = json.loads(_run(code, {"HPCPS_BLAS": "auto"}).stdout)
    info = got["info"]
    layer2 = "16x10 @ 10x700^T, 16x700 @ 700x10 + C, 700x16^T @ 16x10 + C"
    layer1 = "16x30 @ 30x700 + C, 30x16^T @ 16x700 + C, "
    assert info["timing"]["shapes"] == ("" if got["skips"] else layer1) + layer2
    n = 3 if got["skips"] else 5
    assert info["reason"].startswith(f"HPCPS_BLAS=auto: timed both at the sgemm shapes of "
                                     f"this model ({n} products)")
    _check_auto_choice(info)
    assert got["summary"] == {"blas": info["blas"], "blas_reason": info["reason"]}


def test_mlp_shapes():
    """The engine's calls per step: forward into the bias, error (not in layer 1), update
    into the weights; the first layer's left out when the zero-skipping kernels do it."""
    F, T = False, True
    assert blas.mlp_shapes((784, 512, 512, 10), 128) == (
        (128, 784, 512, F, F, 1.0), (784, 128, 512, T, F, 1.0),
        (128, 512, 512, F, T, 0.0), (128, 512, 512, F, F, 1.0), (512, 128, 512, T, F, 1.0),
        (128, 10, 512, F, T, 0.0), (128, 512, 10, F, F, 1.0), (512, 128, 10, T, F, 1.0))
    assert blas.mlp_shapes((784, 512, 10), 64, first_layer=False) == (
        (64, 10, 512, F, T, 0.0), (64, 512, 10, F, F, 1.0), (512, 64, 10, T, F, 1.0))
    # repeated layers listed once, and sizes clipped so timing a huge model stays short
    assert blas.mlp_shapes((8, 8, 8), 4) == (
        (4, 8, 8, F, F, 1.0), (8, 4, 8, T, F, 1.0), (4, 8, 8, F, T, 0.0))
    big = blas.MAX_DIM
    assert blas.mlp_shapes((100_000, 10), 32) == ((32, big, 10, F, F, 1.0),
                                                  (big, 32, 10, T, F, 1.0))


@pytest.mark.parametrize("mkl_rounds,want", [
    ([[1.0, 2.0], [0.9, 2.2], [1.1, 1.8]], "mkl"),       # faster at best (a Xeon)
    ([[1.2, 2.4], [1.1, 2.5], [1.3, 2.3]], "openblas"),  # slower (an AMD EPYC)
    ([[0.95, 2.0]] + [[9.0, 9.0]] * 4, "mkl"),           # disturbed rounds do not count
    ([[1.0, 2.0]] * 3, "openblas"),                      # a tie keeps the one that needs no
])                                                       # loading
def test_decide_takes_each_products_fastest_round(mkl_rounds, want):
    openblas = [[1.0, 2.0], [1.4, 2.1], [1.2, 3.0], [5.0, 5.0], [1.1, 2.0]][:len(mkl_rounds)]
    rounds = [{"openblas": o, "mkl": m} for o, m in zip(openblas, mkl_rounds)]
    name, speed = blas.decide(rounds)
    best_mkl = sum(min(col) for col in zip(*mkl_rounds))
    assert name == want and speed == pytest.approx(3.0 / best_mkl)


def test_decide_without_calls_is_a_tie():
    assert blas.decide([{"openblas": [], "mkl": []}] * 3) == ("openblas", 1.0)


@needs_extension
@MKL
def test_auto_with_a_one_layer_model():
    """One layer whose products the zero-skipping kernels do: auto times them anyway (BLAS
    does them for dense batches), never an empty set."""
    code = """
        import json
        from hpcps.engine.hogwild import HogwildEngine
        from hpcps.kernels import blas
        HogwildEngine((2, 2), batch=1)
        print(json.dumps(blas.info()))
    """
    info = json.loads(_run(code, {"HPCPS_BLAS": "auto"}).stdout)
    assert info["timing"]["shapes"] == "1x2 @ 2x2 + C, 2x1^T @ 1x2 + C"
    _check_auto_choice(info)


@needs_extension
def test_time_sgemm_rounds():
    """Every round times every library on every shape; at least MIN_ROUNDS, at most
    max_rounds, within the budget once MIN_ROUNDS are done."""
    shapes = blas.mlp_shapes((20, 30, 5), 8)
    got = blas.time_sgemm({"openblas": 0, "again": 0}, shapes, max_rounds=4, budget_s=0.0)
    assert len(got["rounds"]) == blas.MIN_ROUNDS
    assert all(set(r) == {"openblas", "again"} for r in got["rounds"])
    assert all(len(t) == len(shapes) and min(t) > 0 for r in got["rounds"] for t in r.values())
    got = blas.time_sgemm({"openblas": 0}, shapes, min_rounds=1, max_rounds=4, budget_s=60)
    assert len(got["rounds"]) == 4


# --------------------------------------------------------------------------- PyTorch

_TORCH_CODE = """
    import os, sys, warnings
    import numpy as np
    warnings.simplefilter("error")           # the late-torch warning must not fire here
    {first}
    from hpcps.engine.hogwild import HogwildEngine
    from hpcps.kernels import blas
    from hpcps.model.mlp import MLP
    sizes = (64, 48, 10)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64), dtype=np.float32)
    y = rng.integers(0, 10, 256)
    model = MLP(sizes, "relu")
    want = model.init_params(1)
    got = want.copy()
    engine = HogwildEngine(sizes, "relu", threads=1, batch=32)   # loads MKL
    assert blas.current() == "mkl", blas.info()
    engine.train(got, x, y, np.arange(256), 0.05)
    for lo in range(0, 256, 32):
        _, g = model.loss_and_grad(want, x[lo:lo + 32], y[lo:lo + 32])
        want -= np.float32(0.05) * g
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    {then}
    import torch
    torch.set_num_threads(2)
    a, b = torch.randn(200, 300, dtype=torch.float32), torch.randn(300, 100)
    net = torch.nn.Linear(300, 100)
    net(a).sum().backward()
    err = (a @ b).double() - a.double() @ b.double()
    assert float(err.abs().max()) < 1e-3
    assert torch.get_num_threads() == 2
    print("ok")
"""


def _torch_available():
    try:
        importlib.metadata.version("torch")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@needs_extension
@MKL
@pytest.mark.skipif(not _torch_available(), reason="torch is not installed")
def test_with_torch_imported_first(tmp_path):
    """bench_hogwild's order: torch, then our engine with MKL. Both compute right, and
    torch's statically linked MKL binds none of its symbols to our libmkl (checked with
    the dynamic loader's own log)."""
    code = _TORCH_CODE.format(first="import torch", then="")
    log = tmp_path / "ld"
    _run(code, {"HPCPS_BLAS": "mkl", "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)},
         timeout=300)
    bindings = torch_to_mkl = 0
    for f in tmp_path.glob("ld.*"):
        with open(f, errors="replace") as fh:
            for line in fh:
                if "binding file" in line:
                    bindings += 1
                    if "libtorch" in line.split(" to ")[0] and "libmkl" in line.split(" to ")[1]:
                        torch_to_mkl += 1
    if bindings == 0:
        pytest.skip("the dynamic loader wrote no LD_DEBUG log here")
    assert torch_to_mkl == 0


@needs_extension
@MKL
@pytest.mark.skipif(not _torch_available(), reason="torch is not installed")
def test_torch_imported_after_mkl_is_warned():
    code = _TORCH_CODE.format(first="", then="warnings.simplefilter('default')")
    res = _run(code, {"HPCPS_BLAS": "mkl"}, timeout=300)
    assert res.stdout.strip() == "ok"
    assert "torch is imported after hpcps loaded Intel MKL" in res.stderr


@needs_extension
def test_kernels_load_without_all_of_scipy_linalg():
    """Every rank imports the compiled kernels at start; their sgemm comes from
    scipy.linalg.cython_blas, loaded alone (scipy.linalg's package is not imported), and a
    later ``import scipy.linalg`` still works and shares that module."""
    code = textwrap.dedent("""
        import sys
        import hpcps.train
        from hpcps.kernels import gemm
        assert gemm.HAVE_EXTENSION
        assert "scipy.linalg.cython_blas" in sys.modules
        assert "scipy.linalg" not in sys.modules, "scipy.linalg was imported"
        import numpy as np
        import scipy.linalg
        from scipy.linalg import cython_blas
        assert cython_blas is sys.modules["scipy.linalg.cython_blas"]
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert np.allclose(scipy.linalg.blas.sgemm(1.0, a, a.T), a @ a.T)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HPCPS_NO_EXTENSION": ""})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_one_thread_limits_every_blas_inside_the_block_and_restores_it():
    """The engines' sgemm calls run with every BLAS at one thread; the caller's setting
    comes back after, also when the block raises."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def counts():
        return [d["num_threads"] for d in threadpoolctl.threadpool_info()
                if d["user_api"] == "blas"]
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        one = blas.OneThread()
        if not one.libraries:
            pytest.skip("no BLAS library that threadpoolctl can see")
        before = counts()
        with one():
            assert set(counts()) == {1}
        assert counts() == before
        with pytest.raises(RuntimeError):
            with one():
                raise RuntimeError("inside")
        assert counts() == before
