"""Project Adam's activation pushes: the shard's update equals the dense gradient's."""
import numpy as np
import pytest

from hpcps.model import optim
from hpcps.model.convnet import ConvNet
from hpcps.model.mlp import MLP
from hpcps.ps import activations as act


def test_row_aligned_ranges_cover_the_vector_on_row_boundaries():
    model = MLP((30, 20, 5))
    starts = {0}
    pos = 0
    for *_, width in act.units(model):
        pos += width
        starts.add(pos)
    for shards in (1, 2, 3, 7):
        ranges = act.row_aligned_ranges(model, shards)
        assert ranges[0][0] == 0 and ranges[-1][1] == model.n_params
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(lo in starts and hi in starts and hi > lo for lo, hi in ranges)
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 2 * 20  # within a couple of rows of even


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
@pytest.mark.parametrize("k", [4, 64])          # 4: activations for the wide layers; 64: dense
@pytest.mark.parametrize("shards", [1, 3])
def test_activation_push_equals_dense_push(opt_name, k, shards):
    model = MLP((40, 32, 6), "relu")
    rng = np.random.default_rng(0)
    params = model.init_params(1)
    x = rng.standard_normal((k, 40)).astype(np.float32)
    y = rng.integers(0, 6, k)
    _, grad = model.loss_and_grad(params, x, y)
    _, inputs, errors = model.loss_and_parts(params, x, y)
    modes = act.activation_layers(model, k)
    assert any(modes) == (k == 4)
    assert_shards_update_as_dense(model, params, grad, inputs, errors, modes, k, shards,
                                  optim.make(opt_name, 0.05))


def assert_shards_update_as_dense(model, params, grad, inputs, errors, modes, k, shards, opt,
                                  dense=None):
    """Every shard's update from its message (of the size the sender and receiver agree on,
    within the receiver's bound) equals the dense gradient's, parameters and state."""
    dense_params = params.copy()
    dense_state = opt.init_state(model.n_params)
    opt.apply(dense_params, grad, dense_state)
    for lo, hi in act.row_aligned_ranges(model, shards):
        chunk = act.pieces(model, lo, hi)
        msg = act.pack(model, chunk, modes, inputs, errors, dense)
        assert len(msg) == act.message_floats(model, chunk, k)
        assert 4 * len(msg) <= act.max_message_bytes(model, chunk, k)
        mine = params[lo:hi].copy()
        state = opt.init_state(hi - lo)
        act.apply(model, chunk, k, msg, mine, state, opt)
        np.testing.assert_allclose(mine, dense_params[lo:hi], rtol=1e-5, atol=1e-6)
        for key in state:
            np.testing.assert_allclose(state[key], dense_state[key][lo:hi], rtol=1e-5,
                                       atol=1e-7)


def test_fewer_numbers_cross_the_wire():
    model = MLP((784, 512, 512, 10))
    k = 32
    ranges = act.row_aligned_ranges(model, 2)
    sent = sum(act.message_floats(model, act.pieces(model, lo, hi), k) for lo, hi in ranges)
    assert sent < 0.15 * model.n_params  # the wide layers go as k*(M+N), not M*N
    with pytest.raises(ValueError, match="expected"):
        chunk = act.pieces(model, *ranges[0])
        act.apply(model, chunk, k, np.zeros(5, np.float32), np.zeros(ranges[0][1]),
                  {}, optim.make("sgd", 0.1))


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
@pytest.mark.parametrize("k", [2, 64])   # 2: activations for every fc layer; 64: dense
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_conv_models_push_equals_its_dense_push(opt_name, k, shards):
    """Conv layers go dense, fc layers as inputs and errors where that is fewer numbers; a
    conv layer is one unit, never cut between shards. The shard's update equals the dense
    gradient's, and the message fits the bound the shard allocates."""
    model = ConvNet("conv3x3x4p1,pool2,fc24,fc16,fc10", (1, 8, 8))
    rng = np.random.default_rng(2)
    params = model.init_params(1)
    x = rng.standard_normal((k, 64)).astype(np.float32)
    y = rng.integers(0, 10, k)
    grad = np.empty(model.n_params, np.float32)
    _, inputs, errors = act.parts(model, params, x, y, grad)
    np.testing.assert_allclose(grad, model.loss_and_grad(params, x, y)[1], rtol=1e-6)
    assert inputs[0] is None and errors[0] is None  # the conv layer
    modes = act.activation_layers(model, k)
    assert modes == [False] + [k == 2] * 3
    conv_units = {(u[0], u[1]) for u in act.units(model) if u[1] in ("dW", "db")}
    assert conv_units == {(0, "dW"), (0, "db")}
    assert_shards_update_as_dense(model, params, grad, inputs, errors, modes, k, shards,
                                  optim.make(opt_name, 0.05), model.views(grad))


def test_adam_mnist_pushes_fewer_bytes_at_small_batches():
    """Project Adam's network: with 32 examples per push its two fc400 layers go as inputs
    and errors, 5.1x fewer bytes than the dense gradient; at 128 the saving is 1.46x."""
    model = ConvNet("adam-mnist", (1, 28, 28))
    whole = act.pieces(model, 0, model.n_params)
    for k, ratio in ((32, 5.15), (128, 1.46)):
        assert model.n_params / act.message_floats(model, whole, k) == pytest.approx(ratio,
                                                                                   abs=0.01)
