"""The zero-skipping first layer (ext/zero_skip.h) against BLAS, in every engine mode, and the
threaded gradient sum Sandblaster uses.

Each test runs the same engine call twice, with ``zero_skip=1`` (skip zeros whenever there
is any) and ``zero_skip=0`` (BLAS only), and against ``hpcps.model.mlp.MLP``; shapes are odd on
purpose: inputs not a multiple of the 4-input blocks, outputs not a multiple of the
64-column panels or of 16 lanes, batches not a multiple of the 4-row blocks.
"""
import os

import numpy as np
import pytest

from hpcps.engine import hogwild
from hpcps.errors import ConfigError
from hpcps.engine.hogwild import HogwildEngine
from hpcps.kernels import gemm
from hpcps.model.mlp import MLP

pytestmark = pytest.mark.skipif(
    not hogwild.HAVE_EXTENSION or not HogwildEngine((2, 2), threads=1, batch=1).zero_skipping,
    reason=f"zero skipping needs the compiled engine on a CPU with AVX2 and FMA or AVX-512F "
           f"(this one's best: {gemm.ZERO_SKIP_CPU_ISA}, {gemm.ZERO_SKIP_ENV} = "
           f"{os.environ.get(gemm.ZERO_SKIP_ENV)!r})",
)

SHAPES = [((13, 70, 5, 7), 9), ((7, 3), 1), ((31, 129, 2), 11), ((64, 64, 10), 16),
          ((787, 200, 10), 37)]


def _sparse_data(n, n_in, n_out, density, seed=0):
    """Inputs with about ``density`` nonzeros, clustered like image strokes, plus one
    all-zero row and one all-zero column so whole blocks are skipped."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_in), dtype=np.float32)
    x[rng.random((n, n_in)) >= density] = 0.0
    x[:, n_in // 2] = 0.0
    if n > 1:
        x[n // 2] = 0.0
    y = rng.integers(0, n_out, n)
    return x, y


def _engines(sizes, threads=1, batch=16, activation="relu"):
    return (HogwildEngine(sizes, activation, threads=threads, batch=batch, zero_skip=1.0,
                          first_layer=gemm.ZERO_SKIP_ISA),
            HogwildEngine(sizes, activation, threads=threads, batch=batch, zero_skip=0.0))


def test_engine_uses_the_chosen_kernels():
    """Before its first call the engine skips zeros with the kernels hpcps.kernels.gemm
    chose for this CPU (AVX2 on an AVX2-only CPU; tests/test_gemm.py checks that choice
    against the CPU's flags), with none when zero_skip is 0 or BLAS is asked for, and with
    the instruction set asked for."""
    assert HogwildEngine((5, 3), batch=2).zero_skip_isa == gemm.ZERO_SKIP_ISA
    assert HogwildEngine((5, 3), batch=2, zero_skip=0.0).zero_skip_isa is None
    assert HogwildEngine((5, 3), batch=2, first_layer="blas").zero_skip_isa is None
    for isa in gemm.ZERO_SKIP_ISAS:
        assert HogwildEngine((5, 3), batch=2, first_layer=isa).zero_skip_isa == isa
    with pytest.raises(ConfigError, match="first_layer 'sse2'"):
        HogwildEngine((5, 3), batch=2, first_layer="sse2")


class _Timed:
    """A stand-in engine whose call takes ``seconds``."""

    def __init__(self, seconds):
        self.seconds = seconds

    def run(self):
        import time
        time.sleep(self.seconds)


@pytest.mark.parametrize("blas_s,want", [(0.002, "blas"), (0.0095, "avx2")])
def test_the_first_layer_is_the_fastest_way_unless_within_the_margin(blas_s, want):
    """time_ways keeps the usual way unless another is CHOICE_MARGIN faster at its best
    round, and says what it timed."""
    speeds = {"avx2": 0.010, "blas": blas_s}
    got = hogwild.time_ways(lambda w: _Timed(speeds[w]), ["avx2", "blas"], "avx2",
                            lambda e: e.run(), budget_s=0.0, rounds=(3, 3))
    assert got["way"] == want, got
    assert set(got["seconds"]) == {"avx2", "blas"}
    assert got["seconds"]["avx2"] >= 0.010 and "best of 3 rounds" in got["why"]
    assert ("blas not 10% faster, so avx2 is kept" in got["why"]) == (want == "avx2"), got


def test_the_engine_times_its_ways_at_the_first_call_and_keeps_them(monkeypatch):
    """With more than one way (an instruction set and BLAS), the first call decides: the
    choice names a way this CPU has, the times of every way, and holds for the next engine
    of that shape (no second timing); the results are those of that way. Asked for a way,
    or with HPCPS_ZERO_SKIP_ISA set, nothing is timed."""
    sizes = (784, 48, 10)
    x, y = _sparse_data(64, 784, 10, 0.2, seed=2)
    p = MLP(sizes, "relu").init_params(1)
    hogwild._CHOSEN.clear()
    first = HogwildEngine(sizes, threads=1, batch=16)
    assert first.first_layer is None  # not decided before a call
    loss, g = first.loss_and_grad(p, x[:16], y[:16])
    choice = first.first_layer
    assert choice["way"] in (*gemm.ZERO_SKIP_ISAS, "blas"), choice
    assert set(choice["seconds"]) == {*gemm.ZERO_SKIP_ISAS, "blas"} and "timed" in choice["why"]
    assert hogwild.chosen() == choice
    assert first.zero_skip_isa == (None if choice["way"] == "blas" else choice["way"])
    pinned = HogwildEngine(sizes, threads=1, batch=16, first_layer=choice["way"])
    loss_p, g_p = pinned.loss_and_grad(p, x[:16], y[:16])
    assert loss == loss_p and np.array_equal(g, g_p)  # the way chosen computed it
    calls = []
    monkeypatch.setattr(hogwild, "time_ways", lambda *a, **k: calls.append(1))
    again = HogwildEngine(sizes, threads=1, batch=16)
    again.loss_and_grad(p, x[:16], y[:16])
    assert again.first_layer == choice and calls == []
    trained = HogwildEngine(sizes, threads=2, batch=16)
    with pytest.raises(TypeError):  # a new shape and call: it would time (the stub fails)
        trained.train(p.copy(), x, y, np.arange(64), 0.01)
    assert calls == [1]
    hogwild._CHOSEN.clear()
    calls.clear()
    asked = HogwildEngine(sizes, threads=2, batch=16, first_layer="blas")
    asked.train(p.copy(), x, y, np.arange(64), 0.01)
    assert asked.first_layer == {"way": "blas", "why": "asked for", "seconds": {}}
    monkeypatch.setenv(gemm.ZERO_SKIP_ENV, gemm.ZERO_SKIP_ISA)
    capped = HogwildEngine(sizes, threads=2, batch=16)
    capped.train(p.copy(), x, y, np.arange(64), 0.01)
    assert capped.first_layer["way"] == gemm.ZERO_SKIP_ISA and calls == []
    assert gemm.ZERO_SKIP_ENV in capped.first_layer["why"]
    hogwild._CHOSEN.clear()


@pytest.mark.parametrize("sizes,rows", SHAPES)
@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 1.0])
def test_gradient_matches_blas_and_mlp(sizes, rows, density):
    model = MLP(sizes, "relu")
    params = model.init_params(3)
    x, y = _sparse_data(rows, sizes[0], sizes[-1], density, seed=rows)
    skip, dense = _engines(sizes, batch=rows)
    loss_s, g_s = skip.loss_and_grad(params, x, y)
    loss_d, g_d = dense.loss_and_grad(params, x, y)
    loss_m, g_m = model.loss_and_grad(params, x, y)
    assert skip.zero_skip_steps == 1 and dense.zero_skip_steps == 0
    assert loss_s == pytest.approx(loss_d, rel=1e-6)
    assert loss_s == pytest.approx(loss_m, rel=1e-5)
    scale = max(float(np.abs(g_m).max()), 1e-12)
    np.testing.assert_allclose(g_s, g_d, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(g_s, g_m, rtol=1e-4, atol=1e-5 * scale)
    # the first layer's gradient is exactly zero where the input column is all zero
    W0 = model.views(g_s)[model.layout[0][0]]
    assert not W0[sizes[0] // 2].any()


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("sizes", [(31, 129, 2), (787, 200, 10)])
def test_one_thread_training_matches_blas(sizes, with_delta):
    """One thread is sequential SGD, so zero skipping must give the BLAS run's weights."""
    x, y = _sparse_data(300, sizes[0], sizes[-1], 0.2, seed=4)
    start = MLP(sizes, "relu").init_params(5)
    out = {}
    for name, engine in zip(("skip", "dense"), _engines(sizes, batch=13)):
        p = start.copy()
        d = np.zeros_like(p) if with_delta else None
        loss, n = engine.train(p, x, y, np.arange(300), 0.05, delta=d)
        out[name] = (p, d, loss, n, engine.zero_skip_steps)
    p_s, d_s, loss_s, n_s, steps_s = out["skip"]
    p_d, d_d, loss_d, n_d, steps_d = out["dense"]
    assert n_s == n_d == 300 and steps_s == 24 and steps_d == 0   # ceil(300 / 13)
    assert loss_s == pytest.approx(loss_d, rel=1e-5)
    assert np.abs(p_s - start).max() > 1e-3                       # it trained
    np.testing.assert_allclose(p_s, p_d, rtol=1e-4, atol=1e-6)
    if with_delta:
        np.testing.assert_allclose(d_s, p_s - start, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(d_s, d_d, rtol=1e-4, atol=1e-6)


def test_threshold_decides_per_batch():
    """zero_skip is the largest fraction of dense work for which zeros are skipped."""
    sizes = (64, 32, 10)
    dense_x, y = _sparse_data(8, 64, 10, 1.0, seed=1)
    dense_x[:, 0] = 1.0                               # no zero column: nothing to skip
    sparse_x = np.zeros_like(dense_x)
    sparse_x[:, :8] = 1.0                             # 8 of 64 columns: 1/8 of the work
    p = MLP(sizes, "relu").init_params(0)
    engine = HogwildEngine(sizes, threads=1, batch=8, zero_skip=0.5,
                           first_layer=gemm.ZERO_SKIP_ISA)
    engine.loss_and_grad(p, sparse_x, y)
    assert engine.zero_skip_steps == 1
    engine.loss_and_grad(p, np.ascontiguousarray(dense_x), y)
    assert engine.zero_skip_steps == 1                # the dense batch used BLAS
    with pytest.raises(ConfigError):
        HogwildEngine(sizes, zero_skip=1.5)
    with pytest.raises(ConfigError):
        HogwildEngine(sizes, zero_skip="lots")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("zero_skip", [0.0, 1.0])
def test_gradient_sum_is_the_sum_of_example_gradients(threads, zero_skip):
    sizes = (29, 40, 6)
    model = MLP(sizes, "tanh")
    params = model.init_params(2)
    x, y = _sparse_data(200, 29, 6, 0.3, seed=7)
    rows = np.random.default_rng(0).permutation(200)[:157]
    engine = HogwildEngine(sizes, "tanh", threads=threads, batch=10, zero_skip=zero_skip)
    loss_sum, grad, n = engine.gradient_sum(params, x, y, rows)
    want_loss, want = model.loss_and_grad(params, x[rows], y[rows])
    assert n == 157
    assert loss_sum == pytest.approx(want_loss * 157, rel=1e-5)
    np.testing.assert_allclose(grad, want * 157, rtol=1e-4,
                               atol=1e-5 * float(np.abs(want * 157).max()))
    # deterministic: nothing is updated, threads sum into their own buffers
    again = engine.gradient_sum(params, x, y, rows)[1]
    np.testing.assert_array_equal(again, grad)
    # empty rows: zero gradient, nothing seen
    loss0, g0, n0 = engine.gradient_sum(params, x, y, rows[:0], grad)
    assert (loss0, n0) == (0.0, 0) and not g0.any()


def test_gradient_sum_checks_inputs():
    sizes = (5, 4, 3)
    engine = HogwildEngine(sizes, threads=2, batch=4)
    p = MLP(sizes, "relu").init_params(0)
    x, y = _sparse_data(10, 5, 3, 0.5)
    with pytest.raises(ValueError, match="outside"):
        engine.gradient_sum(p, x, y, np.array([0, 10]))
    with pytest.raises(ValueError, match="rows"):
        engine.gradient_sum(p, x, y, np.array([0.5]))
    with pytest.raises(ValueError, match="overlap"):
        engine.gradient_sum(p, x, y, np.arange(3), grad=p)
