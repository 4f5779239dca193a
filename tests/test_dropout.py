"""Dropout (``--dropout p``): the masks, the gradient through them, the compiled engine and the
partitions against the NumPy model, the option's refusals, and runs (docs/conv.md)."""
from __future__ import annotations

import numpy as np
import pytest
from mpirun import train
from test_convnet import numeric_grad

from hpcps import config

from hpcps.engine import conv_hogwild

from hpcps.io import checkpoint

from hpcps.model import convnet
from hpcps.engine.conv_hogwild import ConvHogwild
from hpcps.model.convnet import ConvNet, dropout_key, dropout_scale, thread_key
from hpcps.errors import ConfigError

SMALL = "conv3x3x4,pool2,fc20,fc16,fc5"
DIGITS_CONV = "conv3x3x8p1,pool2,fc32,fc10"


def test_masks_drop_the_rate_asked_and_depend_on_every_coordinate():
    p = 0.3
    m = dropout_scale(p, 11, 5, 1, 256, 400)
    assert m.shape == (256, 400) and m.dtype == np.float32
    assert set(np.unique(m)) == {0.0, np.float32(1 / (1 - p))}
    assert abs((m == 0).mean() - p) < 0.01
    assert abs(m.mean() - 1.0) < 0.015          # inverted dropout keeps the expectation
    assert (dropout_scale(0.0, 11, 5, 1, 8, 10) == 1).all()
    # a slice of the units is the same slice of the whole layer's masks (model parallelism)
    np.testing.assert_array_equal(dropout_scale(p, 11, 5, 1, 256, 400, 150, 260), m[:, 150:260])
    # another key, draw or layer: other masks, as unlike each other as two random ones
    for other in (dropout_scale(p, 12, 5, 1, 256, 400), dropout_scale(p, 11, 6, 1, 256, 400),
                  dropout_scale(p, 11, 5, 2, 256, 400)):
        agree = ((other == 0) == (m == 0)).mean()
        assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01
    # units of one example are not correlated with the next example's
    d = (m == 0).astype(float)
    assert abs(np.corrcoef(d[:-1].ravel(), d[1:].ravel())[0, 1]) < 0.02
    # streams: per replica, thread and run segment
    keys = {dropout_key(0, r, s, t) for r in range(3) for s in (0, 100) for t in range(2)}
    assert len(keys) == 12 and thread_key(7, 0) == 7 and thread_key(7, 1) != 7


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
def test_gradient_through_the_masks_matches_finite_differences(activation):
    model = ConvNet(SMALL, (1, 8, 8), activation, dropout=0.4)
    rng = np.random.default_rng(0)
    p = model.init_params(1).astype(np.float64) + rng.normal(size=model.n_params) * 0.05
    x, y = rng.random((6, 64)), rng.integers(0, 5, 6)
    loss, g = model.loss_and_grad(p, x, y, draw=3)
    which = np.concatenate([np.arange(off, off + int(np.prod(shape)))[:10]
                            for _, shape, off in model.layout])
    num = numeric_grad(lambda q: model.loss_and_grad(q, x, y, draw=3)[0], p, which)
    assert np.abs(num - g[which]).max() <= 1e-6 * max(1.0, np.abs(g).max())
    # the masks matter in training and nowhere else
    plain = ConvNet(SMALL, (1, 8, 8), activation)
    assert not np.isclose(loss, plain.loss_and_grad(p, x, y)[0])
    assert model.loss(p, x, y) == plain.loss(p, x, y)
    assert model.evaluate(p, x, y) == plain.evaluate(p, x, y)


def test_each_training_call_takes_the_next_draw():
    model = ConvNet(SMALL, (1, 8, 8), "relu", dropout=0.5)
    model.seed_dropout(99, first_draw=10)
    rng = np.random.default_rng(1)
    p = model.init_params(2)
    x, y = rng.random((4, 64), dtype=np.float32), rng.integers(0, 5, 4)
    for draw in (10, 11, 12):
        assert model.loss_and_grad(p, x, y)[0] == model.loss_and_grad(p, x, y, draw=draw)[0]


@pytest.mark.skipif(not conv_hogwild.HAVE_EXTENSION, reason="the compiled engine is not built")
@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("spec,shape", [("adam-mnist", (1, 28, 28)), (SMALL, (1, 8, 8)),
                                        ("fc12,fc9,fc3", (2, 3, 3))])
def test_compiled_engine_drops_the_units_the_numpy_model_drops(spec, shape, activation):
    model = ConvNet(spec, shape, activation, dropout=0.35)
    model.seed_dropout(dropout_key(5, 1), first_draw=40)
    rng = np.random.default_rng(3)
    p = model.init_params(1) + rng.normal(size=model.n_params).astype(np.float32) * 0.01
    x = rng.random((13, model.n_features), dtype=np.float32)
    y = rng.integers(0, model.n_classes, 13)
    eng = ConvHogwild(model, 1, 16)
    for draw in (40, 41):   # the engine keeps its own count of draws, from the model's first
        loss, g = model.loss_and_grad(p, x, y, draw=draw)
        loss_c, g_c = eng.loss_and_grad(p, x, y)
        assert loss_c == pytest.approx(loss, rel=1e-5)
        assert np.abs(g_c - g).max() <= 1e-5 * np.abs(g).max()
    # evaluation has no dropout
    assert eng.evaluate(p, x, y) == pytest.approx(ConvNet(spec, shape, activation).evaluate(
        p, x, y), rel=1e-5)


@pytest.mark.skipif(not conv_hogwild.HAVE_EXTENSION, reason="the compiled engine is not built")
def test_hogwild_threads_each_draw_their_own_masks():
    """Thread t of the compiled engine uses stream thread_key(key, t): with the parameters
    frozen (lr 0), the T threads' summed gradients equal the NumPy model's on each thread's
    rows with that thread's stream."""
    model = ConvNet(SMALL, (1, 8, 8), "relu", dropout=0.5)
    model.seed_dropout(1234, 0)
    rng = np.random.default_rng(4)
    p = model.init_params(1)
    x = rng.random((32, 64), dtype=np.float32)
    y = rng.integers(0, 5, 32)
    eng = ConvHogwild(model, 2, 16)
    got = np.empty_like(p)
    eng.gradient_sum(p, x, y, np.arange(32), got)
    want = np.zeros(model.n_params, dtype=np.float64)
    for t in range(2):
        m = ConvNet(SMALL, (1, 8, 8), "relu", dropout=0.5)
        m.seed_dropout(thread_key(1234, t), 0)
        want += 16 * m.loss_and_grad(p, x[16 * t:16 * (t + 1)], y[16 * t:16 * (t + 1)],
                                     draw=0)[1]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_partitions_drop_the_units_the_whole_model_drops(parts):
    """Each partition draws the masks of its own units only; together they are the whole
    model's (float64: logits, loss and every gradient slice to 1e-10)."""
    from test_convnet import run_conv_partitions
    spec, shape = "conv3x3x5p1,pool2,fc9,fc7,fc4", (2, 6, 6)
    whole = ConvNet(spec, shape, "tanh", dropout=0.4)
    whole.seed_dropout(77, 0)
    rng = np.random.default_rng(5)
    p = whole.init_params(4).astype(np.float64) + rng.normal(size=whole.n_params) * 0.05
    x, y = rng.random((6, 72)), rng.integers(0, 4, 6)
    loss, g = whole.loss_and_grad(p, x, y, draw=9)

    def job(model):
        model.full.dropout = model.dropout = 0.4
        model.seed_dropout(77, 9)
        local = model.local_from_full(whole.views(p))
        return model.loss_and_grad(local, x, y), model

    results = run_conv_partitions(spec, shape, "tanh", parts, job)
    for q, ((l2, g2), model) in enumerate(results):
        assert np.isclose(l2, loss, rtol=1e-12)
        np.testing.assert_allclose(g2, model.local_from_full(whole.views(g), q), rtol=1e-10,
                                   atol=1e-12)


def test_the_option_is_refused_where_it_cannot_apply():
    base = ["--data", "d.h5"]
    with pytest.raises(ConfigError, match="an MLP with dropout is --model fc32,fc10"):
        config.parse(["--layers", "64,32,10", "--dropout", "0.5", *base])
    with pytest.raises(ConfigError, match="below 1"):
        config.parse(["--model", "adam-mnist", "--dropout", "1", *base])
    with pytest.raises(ConfigError, match="must be >= 0"):
        config.parse(["--model", "adam-mnist", "--dropout", "-0.2", *base])
    with pytest.raises(ConfigError, match="not sandblaster"):
        config.parse(["--strategy", "sandblaster", "--model", "adam-mnist", "--dropout", "0.5",
                      *base])
    for strategy in ("sync", "downpour", "deadreckon", "averaging"):
        assert config.parse(["--strategy", strategy, "--model", "adam-mnist", "--dropout",
                             "0.5", *base]).dropout == 0.5


def test_partitioned_run_drops_what_the_whole_run_drops(digits_h5, tmp_path):
    """A sync replica with dropout on 1 rank and split over 2 ranks (P = 2), same seed: the
    same weights after 120 steps (the partitions draw the whole model's masks); the run
    learns, and the summary names the rate."""
    run = ["--strategy", "sync", "--model", DIGITS_CONV, "--dropout", "0.3", "--steps", "120",
           "--batch-size", "16", "--lr", "0.05", "--optimizer", "sgd", "--eval-every", "0",
           "--timeout", "60", "--data", str(digits_h5)]
    ckpts = []
    for n in (1, 2):
        r = train(n, *run, "--partitions", str(n), "--run-dir", str(tmp_path / f"p{n}"),
                  timeout=120)
        assert r.returncode == 0, r.output[-3000:]
        assert "dropout 0.3" in r.output
        ckpts.append(checkpoint.load(tmp_path / f"p{n}" / "checkpoint.h5"))
    for name, v in ckpts[0].params.items():
        np.testing.assert_allclose(ckpts[1].params[name], v, rtol=0, atol=2e-4, err_msg=name)
    # without dropout the same run ends elsewhere: the masks were applied
    r = train(1, *[a for a in run if a not in ("--dropout", "0.3")], "--run-dir",
              str(tmp_path / "plain"), timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    plain = checkpoint.load(tmp_path / "plain" / "checkpoint.h5").params["layer1/W"]
    assert np.abs(plain - ckpts[0].params["layer1/W"]).max() > 1e-3
    acc = float(r.output.split("final test accuracy: ")[1].split("%")[0])
    assert acc >= 80, r.output[-2000:]
    assert convnet.dropout_key(0, 0) != convnet.dropout_key(0, 1)
