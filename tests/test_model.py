import numpy as np
import pytest

from hpcps.errors import ConfigError
from hpcps.model import MLP


def _batch(model, n=5, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, model.sizes[0])).astype(dtype)
    y = rng.integers(0, model.sizes[-1], n)
    return x, y


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("sizes", [(4, 3), (6, 5, 3), (5, 7, 4, 3)])
def test_gradient_matches_finite_differences(activation, sizes):
    model = MLP(sizes, activation)
    flat = model.init_params(3).astype(np.float64)
    flat += 0.05 * np.random.default_rng(0).standard_normal(flat.shape)  # non-zero biases
    x, y = _batch(model)
    _, grad = model.loss_and_grad(flat, x, y, grad=np.empty_like(flat))
    eps = 1e-6
    num = np.empty_like(flat)
    for i in range(model.n_params):
        e = np.zeros_like(flat)
        e[i] = eps
        num[i] = (model.loss(flat + e, x, y) - model.loss(flat - e, x, y)) / (2 * eps)
    np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-7)


def test_float32_path_stays_float32_and_agrees_with_float64():
    model = MLP((10, 8, 3), "relu")
    flat = model.init_params(0)
    x, y = _batch(model, 16, dtype=np.float32)
    loss32, g32 = model.loss_and_grad(flat, x, y)
    assert g32.dtype == np.float32
    loss64, g64 = model.loss_and_grad(flat.astype(np.float64), x.astype(np.float64), y,
                                      grad=np.empty(model.n_params))
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-6)
    assert abs(loss32 - loss64) < 1e-5


def test_views_flatten_round_trip_and_layout():
    model = MLP((3, 4, 2))
    flat = np.arange(model.n_params, dtype=np.float32)
    v = model.views(flat)
    assert list(v) == ["layer0/W", "layer0/b", "layer1/W", "layer1/b"]
    assert v["layer0/W"].shape == (3, 4) and v["layer1/b"].shape == (2,)
    assert model.n_params == 3 * 4 + 4 + 4 * 2 + 2
    v["layer0/b"][0] = -1  # views, not copies
    assert flat[12] == -1
    np.testing.assert_array_equal(model.flatten({k: a.copy() for k, a in v.items()}), flat)


def test_evaluate_counts_correct_predictions():
    model = MLP((2, 2), "relu")
    flat = model.flatten({"layer0/W": np.eye(2, dtype=np.float32),
                          "layer0/b": np.zeros(2, np.float32)})
    x = np.array([[1, 0], [0, 1], [1, 0]], np.float32)
    loss, acc = model.evaluate(flat, x, np.array([0, 1, 1]))
    assert acc == pytest.approx(2 / 3) and loss > 0


def test_sigmoid_stays_finite_for_large_inputs():
    model = MLP((2, 3, 2), "sigmoid")
    flat = model.init_params(0) * 1e4
    x = np.full((4, 2), 1e3, np.float32)
    loss, grad = model.loss_and_grad(flat, x, np.array([0, 1, 0, 1]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


@pytest.mark.parametrize("sizes,act", [((5,), "relu"), ((3, 0, 2), "relu"), ((3, 2), "gelu")])
def test_bad_model_refused(sizes, act):
    with pytest.raises(ConfigError):
        MLP(sizes, act)
