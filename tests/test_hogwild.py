"""Tests for hpcps.engine.hogwild: the nogil engine against hpcps.model.mlp.MLP, Hogwild
convergence, the delta a replica pushes, input checks, and the NumPy fallback (in a subprocess).

BLAS is kept to one thread by conftest.py (OPENBLAS_NUM_THREADS=1 before numpy loads).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hpcps.engine import hogwild
from hpcps.errors import ConfigError
from hpcps.engine.hogwild import HogwildEngine
from hpcps.model.mlp import MLP

REPO = Path(__file__).resolve().parents[1]

needs_extension = pytest.mark.skipif(
    not hogwild.HAVE_EXTENSION,
    reason="hpcps.kernels._hogwild is not built (run `python setup.py build_ext --inplace`)",
)


def _data(n, n_in, n_out, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_in), dtype=np.float32)
    y = rng.integers(0, n_out, n)
    return x, y


@needs_extension
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("sizes,rows", [((13, 17, 5, 7), 9), ((7, 3), 1), ((31, 64, 2), 11)])
def test_gradient_matches_mlp(activation, sizes, rows):
    check_gradient_matches_mlp(activation, sizes, rows)


def check_gradient_matches_mlp(activation, sizes, rows):
    """The engine's loss and gradient equal MLP's on random data (also run per BLAS by
    tests/test_blas.py)."""
    model = MLP(sizes, activation)
    params = model.init_params(3)
    params += np.random.default_rng(1).normal(0, 0.05, params.shape).astype(np.float32)
    x, y = _data(rows, sizes[0], sizes[-1], seed=2)
    want_loss, want = model.loss_and_grad(params, x, y)
    engine = HogwildEngine(sizes, activation, threads=1, batch=rows + 2)
    loss, grad = engine.loss_and_grad(params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5 * scale)


def _sequential_sgd(model, params, x, y, order, lr, batch):
    """Plain SGD with MLP: what one Hogwild thread must compute."""
    loss_sum = 0.0
    for lo in range(0, len(order), batch):
        idx = order[lo:lo + batch]
        loss, g = model.loss_and_grad(params, x[idx], y[idx])
        params -= np.float32(lr) * g
        loss_sum += loss * len(idx)
    return loss_sum


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("steps", [None, 6])
def test_one_thread_is_sequential_sgd(with_delta, steps):
    sizes, batch, lr = (20, 31, 17, 5), 16, 0.05
    model = MLP(sizes, "tanh")
    x, y = _data(200, sizes[0], sizes[-1], seed=4)
    order = np.random.default_rng(5).permutation(200)[:103]   # last batch partial
    if steps is not None:
        order = np.random.default_rng(5).permutation(200)
    want = model.init_params(7)
    got = want.copy()
    used = order if steps is None else order[:steps * batch]
    want_loss = _sequential_sgd(model, want, x, y, used, lr, batch)
    engine = HogwildEngine(sizes, "tanh", threads=1, batch=batch)
    delta = np.zeros_like(got) if with_delta else None
    loss_sum, n = engine.train(got, x, y, order, lr, steps_per_thread=steps, delta=delta)
    assert n == len(used)
    assert loss_sum == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_delta_is_the_sum_of_applied_updates():
    sizes = (10, 12, 4)
    model = MLP(sizes, "relu")
    x, y = _data(96, 10, 4, seed=8)
    start = model.init_params(9)
    params = start.copy()
    delta = np.full_like(params, 0.5)       # accumulates, is not cleared
    engine = HogwildEngine(sizes, "relu", threads=1, batch=8)
    engine.train(params, x, y, np.arange(96), 0.1, delta=delta)
    engine.train(params, x, y, np.arange(95, -1, -1), 0.1, delta=delta)
    np.testing.assert_allclose(delta - 0.5, params - start, atol=2e-6)
    assert np.abs(delta - 0.5).max() > 1e-3


@pytest.mark.parametrize("threads", [2, 3])
def test_lr_zero_visits_every_example_once(threads):
    """With lr = 0 nothing moves, so the split of the order is visible in the loss sum."""
    sizes = (6, 9, 3)
    model = MLP(sizes, "sigmoid")
    params = model.init_params(0)
    before = params.copy()
    x, y = _data(101, 6, 3, seed=1)
    engine = HogwildEngine(sizes, "sigmoid", threads=threads, batch=7)
    loss_sum, n = engine.train(params, x, y, np.arange(101), 0.0)
    assert n == 101
    assert loss_sum == pytest.approx(model.loss(params, x, y) * 101, rel=1e-5)
    loss_sum, n = engine.train(params, x, y, np.arange(101), 0.0, steps_per_thread=2)
    assert n == threads * 2 * 7
    np.testing.assert_array_equal(params, before)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    return x[:1437], y[:1437], x[1437:], y[1437:]


@pytest.mark.parametrize("threads,backend", [(2, "threads"), (4, "threads"), (2, "openmp")])
def test_hogwild_converges_on_digits(digits, threads, backend):
    xtr, ytr, xte, yte = digits
    sizes = (64, 128, 64, 10)
    model = MLP(sizes, "relu")
    params = model.init_params(1)
    engine = HogwildEngine(sizes, "relu", threads=threads, batch=16, backend=backend)
    rng = np.random.default_rng(2)
    delta = np.zeros_like(params)
    start = params.copy()
    for _ in range(12):  # Hogwild on an oversubscribed machine: give it a few epochs more
        loss_sum, n = engine.train(params, xtr, ytr, rng.permutation(len(ytr)), 0.1,
                                   delta=delta)
        assert n == len(ytr) and np.isfinite(loss_sum)
    _, acc = model.evaluate(params, xte, yte)
    assert acc > 0.88, acc  # chance is 0.1
    # lost updates may make delta differ from the net change, but only slightly overall
    # (a single weight can lose a large share under contention, so no per-weight bound)
    moved = params - start
    assert np.linalg.norm(delta - moved) <= 0.1 * np.linalg.norm(moved)


def test_bad_inputs():
    sizes = (5, 4, 3)
    engine = HogwildEngine(sizes, "relu", threads=2, batch=4)
    n = engine.n_params
    p = np.zeros(n, np.float32)
    x, y = _data(10, 5, 3)
    order = np.arange(10)
    for kwargs in [dict(threads=0), dict(batch=0), dict(threads=1.5),
                   dict(activation="gelu"), dict(backend="mpi")]:
        args = dict(sizes=sizes, activation="relu", threads=1, batch=4) | kwargs
        with pytest.raises(ConfigError):
            HogwildEngine(**args)
    with pytest.raises(ConfigError):
        HogwildEngine((5,), "relu")
    bad_calls = [
        dict(params=p.astype(np.float64)),
        dict(params=np.zeros(n + 1, np.float32)),
        dict(params=np.zeros(2 * n, np.float32)[::2]),
        dict(x=x.astype(np.float64)),
        dict(x=np.zeros((10, 6), np.float32)),
        dict(x=np.asfortranarray(x)),
        dict(y=y[:9]),
        dict(y=np.full(10, 3)),
        dict(y=np.full(10, -1)),
        dict(y=y.astype(np.float32)),
        dict(order=np.array([0, 10])),
        dict(order=np.array([-1, 2])),
        dict(order=order.astype(np.float32)),
        dict(lr=float("nan")),
        dict(lr=-0.1),
        dict(lr="fast"),
        dict(steps_per_thread=0),
        dict(steps_per_thread=2),       # 2 threads x 2 steps x 4 > 10 indices
        dict(delta=np.zeros(n, np.float64)),
        dict(delta=p),                  # overlaps params
    ]
    for bad in bad_calls:
        args = dict(params=p, x=x, y=y, order=order, lr=0.1) | bad
        with pytest.raises(ValueError):
            engine.train(**args)
    ro = p.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        engine.train(ro, x, y, order, 0.1)
    with pytest.raises(ValueError):
        engine.loss_and_grad(p, x, y)           # 10 rows > batch 4
    assert engine.train(p, x, y, np.arange(0), 0.1) == (0.0, 0)
    assert not p.any()


def test_numpy_fallback_matches_compiled():
    """HPCPS_NO_EXTENSION=1 gives the reference engine: same numbers, one thread."""
    code = textwrap.dedent("""
        import json, warnings
        import numpy as np
        from hpcps.engine import hogwild
        from hpcps.model.mlp import MLP
        sizes = (8, 11, 4)
        x = np.random.default_rng(0).standard_normal((40, 8), dtype=np.float32)
        y = np.random.default_rng(1).integers(0, 4, 40)
        p = MLP(sizes, "tanh").init_params(0)
        d = np.zeros_like(p)
        e = hogwild.HogwildEngine(sizes, "tanh", threads=1, batch=6)
        loss, n = e.train(p, x, y, np.arange(40)[::-1].copy(), 0.2, delta=d)
        print(json.dumps({"compiled": hogwild.HAVE_EXTENSION, "loss": loss, "n": n,
                          "p": p.tolist(), "d": d.tolist()}))
    """)
    out = {}
    for flag in ("1", "0"):
        env = dict(os.environ, HPCPS_NO_EXTENSION=flag, OPENBLAS_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=60)
        assert res.returncode == 0, res.stderr
        out[flag] = json.loads(res.stdout)
    assert out["1"]["compiled"] is False
    if not out["0"]["compiled"]:
        pytest.skip("extension not built: only the fallback ran")
    assert out["1"]["n"] == out["0"]["n"] == 40
    assert out["1"]["loss"] == pytest.approx(out["0"]["loss"], rel=1e-5)
    np.testing.assert_allclose(out["1"]["p"], out["0"]["p"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["1"]["d"], out["0"]["d"], rtol=1e-4, atol=1e-6)
