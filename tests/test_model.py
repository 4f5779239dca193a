import numpy as np
import pytest

from hpcps.errors import ConfigError
from hpcps.model.mlp import MLP


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


# -- model parallelism: P partitions computed in lockstep threads (no MPI) ---------------------
import threading  # noqa: E402

from hpcps.model.mlp import PartitionedMLP, SingleExchange, partition_widths  # noqa: E402


class ThreadExchange:
    """The replica exchange for P threads of one process: what MPI does between ranks."""

    def __init__(self, parts):
        self.parts = parts
        self.slots = [None] * parts
        self.barrier = threading.Barrier(parts, timeout=30)

    def for_part(self, p):
        outer = self

        class One:
            @staticmethod
            def gather(local_t, widths):
                outer.slots[p] = local_t
                outer.barrier.wait()
                whole = np.concatenate(outer.slots, axis=0)
                outer.barrier.wait()
                return whole

            @staticmethod
            def scatter_sum(partial_t, widths):
                outer.slots[p] = partial_t
                outer.barrier.wait()
                total = np.sum(outer.slots, axis=0)
                outer.barrier.wait()
                lo = sum(widths[:p])
                return total[lo:lo + widths[p]]
        return One


def run_partitioned(sizes, activation, parts, fn, make=None):
    """``fn(model)`` on each of ``parts`` partitions, run as threads of this process joined
    by a :class:`ThreadExchange`; the model is ``make(p, exchange)`` (default: partition p
    of the MLP of ``sizes``)."""
    ex = ThreadExchange(parts)
    results = [None] * parts
    errors = []
    if make is None:
        def make(p, exchange):
            return PartitionedMLP(sizes, activation, parts, p, exchange)

    def work(p):
        try:
            model = make(p, ex.for_part(p))
            results[p] = fn(model)
        except Exception as e:  # surfaced below with the partition
            errors.append((p, e))
            ex.barrier.abort()

    threads = [threading.Thread(target=work, args=(p,)) for p in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
def test_partitioned_forward_and_gradient_equal_the_whole_model(parts, activation):
    sizes = (12, 9, 7, 5)  # 9 and 7 do not split evenly over 2, 3 or 4
    whole = MLP(sizes, activation)
    params = whole.init_params(5)
    x, y = _batch(whole, 8, dtype=np.float32)
    loss, grad = whole.loss_and_grad(params, x, y)
    logits = whole.forward(params, x)[-1]

    def job(model):
        local = model.init_params(5)
        out = model.forward(local, x)[0][-1]
        l, g = model.loss_and_grad(local, x, y)
        return local, out, l, g

    results = run_partitioned(sizes, activation, parts, job)
    model = PartitionedMLP(sizes, activation, parts, 0)
    np.testing.assert_array_equal(model.full_from_parts([r[0] for r in results]), params)
    for local, out, l, g in results:
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-6)
        assert l == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(model.full_from_parts([r[3] for r in results]), grad,
                               rtol=1e-5, atol=1e-6)


def test_partition_widths_split_evenly_and_refuse_narrow_layers():
    assert partition_widths(10, 4, 0) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert partition_widths(4, 4, 2) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match="layer 2 has 3 neurons, fewer than --partitions 4"):
        partition_widths(3, 4, 2)


def test_local_and_full_round_trip():
    model = PartitionedMLP((6, 5, 3), "relu", 3, 1)
    whole = MLP((6, 5, 3))
    flat = np.arange(whole.n_params, dtype=np.float32)
    locals_ = [model.local_from_full(whole.views(flat), q) for q in range(3)]
    assert [len(v) for v in locals_] == model.part_sizes
    assert sum(model.part_sizes) == whole.n_params
    np.testing.assert_array_equal(model.full_from_parts(locals_), flat)


def test_single_partition_is_the_plain_model():
    whole = MLP((10, 6, 4), "tanh")
    single = PartitionedMLP((10, 6, 4), "tanh", 1, 0, SingleExchange)
    x, y = _batch(whole, 5, dtype=np.float32)
    p = whole.init_params(1)
    np.testing.assert_array_equal(single.init_params(1), p)
    np.testing.assert_array_equal(single.loss_and_grad(p, x, y)[1], whole.loss_and_grad(p, x, y)[1])
