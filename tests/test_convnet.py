"""Conv models: the spec, the layers against finite differences and PyTorch, the dataset's image
shape, checkpoints and inspect, the Hogwild engine (compiled, against the NumPy reference), and
a run with resume (docs/conv.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import train

from hpcps import config

from hpcps.io import checkpoint, data

from hpcps.model import convnet
from hpcps.engine import conv_hogwild
from hpcps.engine.conv_hogwild import ConvHogwild, engine_for
from hpcps.model.convnet import ConvNet, col2im, im2col, maxpool, maxpool_back
from hpcps.errors import CheckpointError, ConfigError, DataError
from hpcps.tools.inspect import describe, summarize
from hpcps.model.spec import PRESETS, is_conv_spec, parse_spec

SMALL = "conv3x3x4s2p1,pool2s1,conv2x2x3,fc5,fc3"   # stride, padding, overlapping pool, C_in 2
DIGITS_CONV = "conv3x3x8p1,pool2,fc32,fc10"


def numeric_grad(loss, p, which, eps=1e-6):
    """Central differences of ``loss(params)`` at ``p`` for the entries ``which``."""
    g = np.empty(len(which))
    for n, i in enumerate(which):
        q = p.copy()
        q[i] += eps
        hi = loss(q)
        q[i] -= 2 * eps
        g[n] = (hi - loss(q)) / (2 * eps)
    return g


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
def test_gradient_matches_finite_differences_in_float64(activation):
    model = ConvNet(SMALL, (2, 9, 8), activation)
    rng = np.random.default_rng(1)
    p = model.init_params(3).astype(np.float64) + rng.normal(size=model.n_params) * 0.05
    x, y = rng.random((5, 2 * 9 * 8)), rng.integers(0, 3, 5)
    loss, g = model.loss_and_grad(p, x, y)
    assert g.dtype == np.float64 and np.isclose(loss, model.loss(p, x, y))
    # every bias and a sample of every weight array (the whole vector takes seconds)
    which = np.concatenate([np.arange(off, off + int(np.prod(shape)))[:12]
                            for _, shape, off in model.layout])
    num = numeric_grad(lambda q: model.loss(q, x, y), p, which)
    assert np.abs(num - g[which]).max() <= 1e-6 * max(1.0, np.abs(g).max())


def direct_conv(x, W, b, stride, pad):
    """Cross-correlation by loops, NCHW: the definition the im2col code must match."""
    B, C, H, Wd = x.shape
    O, _, kh, kw = W.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (H + 2 * pad - kh) // stride + 1, (Wd + 2 * pad - kw) // stride + 1
    out = np.empty((B, O, ho, wo))
    for i in range(ho):
        for j in range(wo):
            win = xp[:, :, i * stride:i * stride + kh, j * stride:j * stride + kw]
            out[:, :, i, j] = np.einsum("bchw,ochw->bo", win, W) + b
    return out


@pytest.mark.parametrize("stride,pad", [(1, 0), (2, 1), (3, 2)])
def test_im2col_conv_and_col2im_match_loops(stride, pad):
    rng = np.random.default_rng(2)
    x = rng.random((2, 3, 7, 6))
    W, b = rng.normal(size=(4, 3, 3, 2)), rng.normal(size=4)
    ref = direct_conv(x, W, b, stride, pad)
    ho, wo = ref.shape[2:]
    a = x.transpose(0, 2, 3, 1)
    cols = im2col(a, 3, 2, stride, pad, ho, wo)
    out = (cols @ W.transpose(2, 3, 1, 0).reshape(-1, 4) + b).reshape(2, ho, wo, 4)
    assert np.allclose(out.transpose(0, 3, 1, 2), ref)
    # col2im is im2col's transpose: <im2col(a), d> == <a, col2im(d)>
    d = rng.normal(size=cols.shape)
    back = col2im(d, a.shape, 3, 2, stride, pad, ho, wo)
    assert np.isclose(np.sum(cols * d), np.sum(a * back))


def test_maxpool_routes_the_gradient_to_the_first_maximum():
    a = np.zeros((1, 4, 4, 1))
    a[0, 1, 1, 0] = 5.0                              # one clear maximum in window (0, 0)
    out = maxpool(a, 2, 2, 2, 2)
    assert out[0, 0, 0, 0] == 5.0 and out.sum() == 5.0
    dx = maxpool_back(np.ones((1, 2, 2, 1)), a, out, 2, 2)
    assert dx.sum() == 4 and dx[0, 1, 1, 0] == 1   # all-zero windows: their first position
    assert dx[0, 0, 2, 0] == dx[0, 2, 0, 0] == dx[0, 2, 2, 0] == 1
    # overlapping windows (pool3s1) add up where they share a maximum
    b = np.zeros((1, 4, 4, 1))
    b[0, 2, 2, 0] = 1.0
    db = maxpool_back(np.ones((1, 2, 2, 1)), b, maxpool(b, 3, 1, 2, 2), 3, 1)
    assert db[0, 2, 2, 0] == 4 and db.sum() == 4


TORCH_REFERENCE = Path(__file__).with_name("data") / "adam_mnist_torch.npz"


def test_adam_mnist_matches_pytorch():
    """Loss and gradient against PyTorch's, stored once by tests/data/make_torch_reference.py
    (the test extra has no torch: the check runs everywhere, against the stored file)."""
    sys.path.insert(0, str(TORCH_REFERENCE.parent))
    try:
        from make_torch_reference import SMALL, STRIDE, inputs
    finally:
        sys.path.remove(str(TORCH_REFERENCE.parent))
    ref = np.load(TORCH_REFERENCE)
    model, p, x, y = inputs()
    assert model.n_params == 298090
    loss, g = model.loss_and_grad(p, x, y)
    assert np.isclose(loss, float(ref["loss"]), rtol=1e-5), (loss, float(ref["loss"]))
    views = model.views(g)
    assert {f"grad/{k}" for k in views} == {k for k in ref.files if k.startswith("grad/")}
    for k, v in views.items():
        flat = v.ravel()
        want = ref[f"grad/{k}"]
        got = flat if flat.size <= SMALL else flat[::STRIDE]
        assert got.shape == want.shape, k
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=k)


def test_spec_grammar_presets_and_refusals():
    assert [s.kind for s in parse_spec("adam-mnist")] == \
        ["conv", "pool", "conv", "pool", "fc", "fc", "fc"]
    s = parse_spec("conv3x5x16s2p1,maxpool3s2,flatten,fc10")
    assert (s[0].kh, s[0].kw, s[0].out, s[0].stride, s[0].pad) == (3, 5, 16, 2, 1)
    assert (s[1].kh, s[1].stride) == (3, 2) and s[2].kind == "flatten"
    assert is_conv_spec("adam-mnist") and not is_conv_spec("fc10")
    assert PRESETS["adam-mnist"].startswith("conv5x5x10")
    for bad, words in [("conv5x5,fc10", "cannot read layer 'conv5x5'"),
                       ("conv3x3x4,pool2", "must end with an fc"),
                       ("fc20,conv3x3x4,fc10", "come first"),
                       ("conv3x3x0,fc10", ">= 1"), ("", "empty")]:
        with pytest.raises(ConfigError, match=words):
            parse_spec(bad)
    with pytest.raises(ConfigError, match="needs an input of at least 5x5 but gets 20x4x4"):
        ConvNet("conv5x5x20,pool2,conv5x5x20,fc10", (1, 12, 12))
    m = ConvNet("adam-mnist", (1, 28, 28))
    assert m.sizes == [784, 5760, 1280, 400, 400, 10]
    assert [op.out_shape for op in m.ops][:4] == [(10, 24, 24), (10, 12, 12), (20, 8, 8),
                                                   (20, 4, 4)]


def test_config_takes_model_and_refuses_what_it_cannot_run():
    cfg = config.parse(["--model", "adam-mnist"])
    assert cfg.model == "adam-mnist" and cfg.to_dict()["model"] == "adam-mnist"
    with pytest.raises(ConfigError, match="not both"):
        config.parse(["--model", "adam-mnist", "--layers", "784,10"])
    assert config.parse(["--model", "adam-mnist", "--strategy", "sync", "--partitions",
                         "2"]).partitions == 2  # model parallelism by output maps
    assert config.parse(["--model", "adam-mnist", "--push", "activations"]).push == \
        "activations"  # fc layers as inputs and errors, conv layers dense
    with pytest.raises(ConfigError, match="cannot read layer"):
        config.parse(["--model", "conv5,fc10"])


def test_a_preset_brings_its_recipe_and_options_given_win():
    """--model adam-mnist under downpour (the default strategy) brings the options it reached
    99.3% with (docs/conv.md); options given win, an item the options given refuse is left
    out (--weight-decay and the cosine schedule beside --push activations), --steps keeps
    the recipe's --epochs out, and another strategy keeps its own defaults."""
    cfg = config.parse(["--model", "adam-mnist"])
    assert (cfg.optimizer, cfg.lr, cfg.batch_size, cfg.weight_decay, cfg.dropout,
            cfg.lr_schedule, cfg.augment, cfg.epochs, cfg.momentum) == \
        ("momentum", 0.01, 64, 1e-3, 0.3, "cosine", "shift:1", 50.0, 0.9)
    assert config.recipe_note(cfg) == (
        "--model adam-mnist's recipe (docs/conv.md): --optimizer momentum --lr 0.01 "
        "--batch-size 64 --weight-decay 0.001 --dropout 0.3 --lr-schedule cosine "
        "--augment shift:1 --epochs 50")
    # --augment none keeps the images as they are
    cfg = config.parse(["--model", "adam-mnist", "--augment", "none"])
    assert cfg.augment == "none" and config.recipe_note(cfg).endswith(
        "in effect instead: --augment none")
    cfg = config.parse(["--model", "adam-mnist", "--lr", "0.02", "--optimizer", "adagrad",
                        "--steps", "100"])
    assert (cfg.optimizer, cfg.lr, cfg.epochs, cfg.steps, cfg.dropout) == \
        ("adagrad", 0.02, None, 100, 0.3)
    assert config.recipe_note(cfg).endswith("in effect instead: --optimizer adagrad --lr 0.02")
    cfg = config.parse(["--model", "adam-mnist", "--push", "activations"])
    assert (cfg.weight_decay, cfg.lr_schedule, cfg.dropout, cfg.optimizer) == \
        (None, None, 0.3, "momentum"), cfg
    cfg = config.parse(["--model", "adam-mnist", "--strategy", "sync"])
    assert cfg.dropout is None and config.recipe_note(cfg) is None
    assert config.recipe_note(config.parse(["--model", DIGITS_CONV])) is None


def test_config_file_takes_model(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('model = "conv3x3x8p1,pool2,fc32,fc10"\nstrategy = "sync"\n')
    assert config.parse(["--config", str(f)]).model == "conv3x3x8p1,pool2,fc32,fc10"


def flat_copy(src, dst):
    with h5py.File(src) as f, h5py.File(dst, "w") as g:
        for k in f.attrs:
            if k != "image_shape":
                g.attrs[k] = f.attrs[k]
        for split in ("train", "test"):
            for a in ("x", "y"):
                g[f"{split}/{a}"] = f[f"{split}/{a}"][()]
    return dst


def test_image_shape_in_the_dataset(digits_h5, tmp_path):
    info = data.open_dataset(digits_h5)
    assert info.image_shape == (1, 8, 8) and info.to_dict()["image_shape"] == [1, 8, 8]
    flat = data.open_dataset(flat_copy(digits_h5, tmp_path / "flat.h5"))
    assert flat.image_shape is None and "image_shape" not in flat.to_dict()
    cfg = config.parse(["--model", DIGITS_CONV, "--strategy", "sync"])
    with pytest.raises(ConfigError, match="declares no image shape"):
        convnet.build(cfg, flat)
    # an fc-only spec needs no image shape
    fc_only = convnet.build(config.parse(["--model", "fc32,fc10"]), flat)
    assert fc_only.n_params == 64 * 32 + 32 + 330
    with pytest.raises(ConfigError, match="has 10 classes"):
        convnet.build(config.parse(["--model", "conv3x3x8,fc7"]), info)
    bad = flat_copy(digits_h5, tmp_path / "bad.h5")
    with h5py.File(bad, "a") as f:
        f.attrs["image_shape"] = np.array([1, 8, 9])
    with pytest.raises(DataError, match="holds 72 values but each row of x has 64"):
        data.open_dataset(bad)


def conv_checkpoint(digits_h5, seed=0):
    cfg = config.parse(["--model", DIGITS_CONV, "--strategy", "sync"])
    info = data.open_dataset(digits_h5)
    model = convnet.build(cfg, info)
    p = model.init_params(seed)
    return model, checkpoint.Checkpoint(
        params={k: v.copy() for k, v in model.views(p).items()}, optimizer="adagrad",
        opt_state={f"accum/{k}": np.ones_like(v) for k, v in model.views(p).items()}, step=7,
        config=cfg.to_dict(), dataset=info.to_dict())


def test_checkpoint_holds_kernels_out_in_kh_kw_and_inspect_shows_the_model(digits_h5,
                                                                          tmp_path):
    model, ckpt = conv_checkpoint(digits_h5)
    path = checkpoint.save(tmp_path / "c.h5", ckpt)
    back = checkpoint.load(path)
    assert back.params["layer0/W"].shape == (8, 1, 3, 3)
    assert all(np.array_equal(back.params[k], v) for k, v in ckpt.params.items())
    with h5py.File(path) as f:   # self-describing for h5py alone
        assert f["params"].attrs["model_spec"].decode() == DIGITS_CONV
        assert "(out_maps, in_maps, kh, kw)" in f["params/layer0/W"].attrs["description"].decode()
    assert checkpoint.check_compatible(back, model.sizes, "adagrad", ckpt.dataset) == []
    s = summarize(path)
    assert s["model"]["spec"] == DIGITS_CONV and s["layer_sizes"] == [64, 512, 32, 10]
    text = describe(path)
    assert "conv3x3x8p1    -> 8x8x8 relu  layer0/W (8, 1, 3, 3)" in text
    wrong = dict(ckpt.params, **{"layer0/W": np.zeros((1, 8, 3, 3), np.float32)})
    with pytest.raises(CheckpointError, match=r"needs \(8, 1, 3, 3\)"):
        checkpoint.save(tmp_path / "w.h5", checkpoint.Checkpoint(
            params=wrong, optimizer="sgd", opt_state={}, step=0, config=ckpt.config,
            dataset=ckpt.dataset))


ENGINES = [pytest.param(True, id="compiled", marks=pytest.mark.skipif(
    not conv_hogwild.HAVE_EXTENSION, reason="the compiled conv engine is not built")),
    pytest.param(False, id="numpy")]


@pytest.mark.skipif(not conv_hogwild.HAVE_EXTENSION, reason="the compiled engine is not built")
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("spec,shape", [
    ("adam-mnist", (1, 28, 28)),
    (SMALL, (2, 9, 7)),                              # stride, padding, overlapping pool
    ("pool2,conv3x3x5p2,flatten,fc3", (3, 8, 8)),    # nothing to learn below the conv
    ("conv3x3x4,conv2x2x6s2,fc3", (3, 7, 7)),        # conv on conv, C_in 3 (NHWC gather)
    ("fc6,fc3", (1, 4, 4)),                          # fc on the maps, first
])
def test_compiled_engine_matches_the_numpy_model(spec, shape, activation):
    model = ConvNet(spec, shape, activation)
    rng = np.random.default_rng(2)
    p = model.init_params(1) + rng.normal(size=model.n_params).astype(np.float32) * 0.01
    x = rng.random((13, model.n_features), dtype=np.float32)
    y = rng.integers(0, model.n_classes, 13)
    loss, g = model.loss_and_grad(p, x, y)
    eng = ConvHogwild(model, 1, 16)
    assert eng.compiled
    loss_c, g_c = eng.loss_and_grad(p, x, y)
    assert loss_c == pytest.approx(loss, rel=1e-5)
    assert np.abs(g_c - g).max() <= 1e-5 * np.abs(g).max()
    # evaluation: forward passes only, in mini-batches (37 rows, batches of 16)
    xe = rng.random((37, model.n_features), dtype=np.float32)
    ye = rng.integers(0, model.n_classes, 37)
    want = model.evaluate(p, xe, ye)
    got = eng.evaluate(p, xe, ye)
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == want[1]
    assert conv_hogwild.evaluate(model, p, xe, ye) == pytest.approx(want, rel=1e-5)


def test_compiled_engine_describes_the_model_as_ops():
    table = conv_hogwild.op_table(ConvNet("adam-mnist", (1, 28, 28)))
    col = {c: i for i, c in enumerate(conv_hogwild.COLUMNS)}
    kinds = list(table[:, col["kind"]])
    C, P, F, L = (conv_hogwild.K_CONV, conv_hogwild.K_POOL, conv_hogwild.K_FLAT,
                  conv_hogwild.K_FC)
    assert kinds == [C, P, C, P, F, L, L, L]   # the flatten before the first fc is explicit
    assert list(table[:, col["dx"]]) == [0, 1, 1, 1, 1, 1, 1, 1]
    assert list(table[:, col["act"]]) == [1, 0, 1, 0, 0, 1, 1, 0]
    assert list(table[4, [col["c"], col["h"], col["w"], col["oc"]]]) == [20, 4, 4, 320]


@pytest.mark.parametrize("compiled", ENGINES)
def test_hogwild_engine_trains_and_sums_gradients(digits_h5, compiled):
    x, y = data.load_split(digits_h5, "train")
    model = ConvNet(DIGITS_CONV, (1, 8, 8))
    assert isinstance(engine_for(model, "relu", 2, 16), ConvHogwild)
    p = model.init_params(0)
    rows = np.arange(100)
    # gradient_sum: the sum of per-batch gradients, the same for any thread count
    ref = np.zeros_like(p)
    for lo in range(0, 100, 16):
        idx = rows[lo:lo + 16]
        ref += model.loss_and_grad(p, x[idx], y[idx])[1] * len(idx)
    for T in (1, 3):
        loss_sum, g, n = ConvHogwild(model, T, 16, compiled).gradient_sum(p, x, y, rows)
        assert n == 100 and np.allclose(g, ref, atol=1e-4)
    # T = 1 is plain SGD, step for step
    q, seq = p.copy(), p.copy()
    delta = np.zeros_like(p)
    ConvHogwild(model, 1, 16, compiled).train(q, x, y, rows[:64], 0.1, steps_per_thread=4,
                                              delta=delta)
    for lo in range(0, 64, 16):
        seq -= np.float32(0.1) * model.loss_and_grad(seq, x[lo:lo + 16], y[lo:lo + 16])[1]
    assert np.allclose(q, seq, atol=1e-5) and np.allclose(delta, q - p, atol=1e-5)
    # T = 2, lock-free: learns
    order = np.random.default_rng(0).permutation(len(y))
    eng = ConvHogwild(model, 2, 16, compiled)
    before = model.evaluate(p, x, y)[0]
    for _ in range(3):
        eng.train(p, x, y, order, 0.05)
    assert model.evaluate(p, x, y)[0] < 0.5 * before
    with pytest.raises(ValueError, match="need"):
        eng.train(p, x, y, order[:10], 0.05, steps_per_thread=1)
    # indices and labels out of range are refused before any thread starts
    with pytest.raises(IndexError, match="outside"):
        eng.train(p, x, y, np.array([0, len(y)]), 0.05)
    bad = y.copy()
    bad[order[0]] = 10
    with pytest.raises((ValueError, IndexError)):
        eng.train(p, x, bad, order[:32], 0.05)


def test_conv_run_resumes_and_refuses_another_model(digits_h5, tmp_path):
    common = ["--strategy", "sync", "--model", DIGITS_CONV, "--data", str(digits_h5),
              "--batch-size", "16", "--eval-every", "0", "--checkpoint-every", "0",
              "--timeout", "60", "--run-dir", str(tmp_path)]
    first = train(2, *common, "--steps", "100", timeout=120)
    assert first.returncode == 0, first.output[-3000:]
    ckpt = tmp_path / "checkpoint.h5"
    again = train(2, *common, "--steps", "150", "--resume", str(ckpt), timeout=120)
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed from" in again.stdout and checkpoint.load(ckpt).step == 150
    other = train(2, *common[:2], "--model", "conv3x3x4,pool2,fc10", *common[4:],
                  "--steps", "200", "--resume", str(ckpt), timeout=60)
    assert other.returncode == 4 and "holds model " + DIGITS_CONV in other.stderr, other.stderr


# -- model parallelism ---------------------------------------------------------------------------
def run_conv_partitions(spec, shape, activation, parts, fn):
    """``fn(model)`` on each of ``parts`` partitions of a conv model, as threads of this
    process joined by the thread exchange of ``test_model`` (what MPI does between ranks)."""
    from test_model import run_partitioned
    return run_partitioned(None, None, parts, fn, make=lambda p, ex: convnet.PartitionedConvNet(
        spec, shape, activation, parts, p, ex))


PARTITIONED = [
    ("conv3x3x4s2p1,pool2s1,conv2x2x5,fc5,fc4", (2, 9, 8)),  # stride, padding, overlapping pool
    ("conv3x3x5p1,pool2,conv3x3x7,pool2s1,flatten,fc6,fc4", (3, 10, 10)),  # explicit flatten
    ("fc9,fc5", (1, 4, 4)),                                # no conv: an MLP on images
    ("conv3x3x6,conv2x2x5,fc4", (1, 7, 7)),              # conv after conv, no pool
]


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("spec,shape", PARTITIONED, ids=["small", "flatten", "fc-only",
                                                         "conv-conv"])
def test_partitioned_conv_forward_and_gradient_equal_the_whole_model(spec, shape, parts):
    """In float64: every partition computes the whole model's logits and loss, and exactly
    its own slice of the whole model's gradient (kernels cut by output maps, fc layers by
    units); gathering the slices gives the whole gradient back."""
    whole = ConvNet(spec, shape, "tanh")
    rng = np.random.default_rng(2)
    p = whole.init_params(4).astype(np.float64) + rng.normal(size=whole.n_params) * 0.05
    x, y = rng.random((6, int(np.prod(shape)))), rng.integers(0, whole.n_classes, 6)
    loss, g = whole.loss_and_grad(p, x, y)
    logits = whole.forward(p, x)[-1]

    def job(model):
        local = model.local_from_full(whole.views(p))
        assert local.dtype == np.float64
        out = model.forward(local, x)[-1]
        l2, g2 = model.loss_and_grad(local, x, y)
        return out, l2, g2, model

    results = run_conv_partitions(spec, shape, "tanh", parts, job)
    for q, (out, l2, g2, model) in enumerate(results):
        np.testing.assert_allclose(out, logits, rtol=1e-12, atol=1e-12)
        assert np.isclose(l2, loss, rtol=1e-12)
        np.testing.assert_allclose(g2, model.local_from_full(whole.views(g), q), rtol=1e-10,
                                   atol=1e-12)
    model = results[0][3]
    np.testing.assert_allclose(model.full_from_parts([r[2] for r in results]), g, rtol=1e-10,
                               atol=1e-12)
    assert sum(model.part_sizes) == whole.n_params


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_partitioned_conv_exchange_bytes_follow_the_formula(parts):
    """The bytes each partition hands the exchange equal ``exchange_bytes``: the pooled maps
    at the input of each layer that mixes maps, the fc units, the logits."""
    spec, shape = "conv5x5x10,pool2,conv5x5x20,pool2,fc40,fc10", (1, 28, 28)
    B = 4

    class Counting:
        def __init__(self, inner):
            self.inner, self.sent = inner, 0

        def gather(self, local_t, widths):
            self.sent += local_t.nbytes * (parts - 1)
            return self.inner.gather(local_t, widths)

        def scatter_sum(self, partial_t, widths):
            out = self.inner.scatter_sum(partial_t, widths)
            self.sent += partial_t.nbytes - out.nbytes
            return out

    from test_model import run_partitioned
    rng = np.random.default_rng(0)
    x, y = rng.random((B, 784)).astype(np.float32), rng.integers(0, 10, B)

    def job(m):
        m.loss_and_grad(m.init_params(0), x, y)
        return m.exchange.sent, m.exchange_bytes(B)

    got = run_partitioned(None, None, parts, job, make=lambda q, ex: convnet.PartitionedConvNet(
        spec, shape, "relu", parts, q, Counting(ex)))
    for sent, formula in got:
        assert sent == formula > 0
    # the pooled maps, not the conv outputs, cross: 10x12x12 and 20x4x4 values per example
    m = convnet.PartitionedConvNet(spec, shape, "relu", parts, 0)
    assert [sum(w) for w in m.widths] == [10 * 12 * 12, 20 * 4 * 4, 40, 10]


COMPILED_PARTITIONED = PARTITIONED + [("adam-mnist", (1, 28, 28))]
needs_engine = pytest.mark.skipif(not conv_hogwild.HAVE_EXTENSION,
                                  reason="the compiled conv engine is not built")


def run_compiled_partitions(spec, shape, activation, parts, fn, dropout=0.0, batch=4):
    """``fn(compiled, numpy)`` on each of ``parts`` partitions: the compiled partition and
    the NumPy one it wraps (same exchange, same dropout stream), as threads of this process."""
    from test_model import run_partitioned
    return run_partitioned(None, None, parts, lambda m: fn(conv_hogwild.CompiledPartition(
        m, batch), m), make=lambda p, ex: convnet.PartitionedConvNet(
        spec, shape, activation, parts, p, ex, dropout))


@needs_engine
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("spec,shape", COMPILED_PARTITIONED,
                         ids=["small", "flatten", "fc-only", "conv-conv", "adam-mnist"])
def test_compiled_partition_equals_the_whole_model_and_the_numpy_partition(spec, shape,
                                                                           activation, parts):
    """float32: the compiled partition's loss is the whole model's and its gradient the
    whole model's slice (to 1e-5), and so are the NumPy partition's; its logits too, also
    over more rows than the engine's batch (forward passes in chunks)."""
    whole = ConvNet(spec, shape, activation)
    rng = np.random.default_rng(2)
    p = (whole.init_params(4) + rng.normal(size=whole.n_params) * 0.05).astype(np.float32)
    x = rng.random((6, int(np.prod(shape)))).astype(np.float32)
    y = rng.integers(0, whole.n_classes, 6)
    loss, g = whole.loss_and_grad(p, x, y)
    xe = rng.random((11, x.shape[1])).astype(np.float32)
    logits = whole.forward(p, xe)[-1]

    def job(compiled, model):
        local = model.local_from_full(whole.views(p))
        grad = np.full(model.n_params, np.nan, dtype=np.float32)  # every entry overwritten
        out = compiled.forward(local, xe)[-1]                      # 11 rows, batch 4
        l1, g1 = compiled.loss_and_grad(local, x, y, grad)         # 6 rows: the engine grows
        l2, g2 = model.loss_and_grad(local, x, y)
        return out, l1, g1, l2, g2

    results = run_compiled_partitions(spec, shape, activation, parts, job)
    model = convnet.PartitionedConvNet(spec, shape, activation, parts, 0)
    for q, (out, l1, g1, l2, g2) in enumerate(results):
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-5)
        assert l1 == pytest.approx(loss, abs=1e-5) and l1 == pytest.approx(l2, abs=1e-5)
        want = model.local_from_full(whole.views(g), q)
        np.testing.assert_allclose(g1, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.full_from_parts([r[2] for r in results]), g, rtol=1e-5,
                               atol=1e-5)


@needs_engine
@pytest.mark.parametrize("parts", [2, 3])
def test_compiled_partition_drops_the_units_the_numpy_partition_drops(parts):
    """With dropout, the compiled partition's masks for its slice of each hidden fc layer
    are the NumPy partition's (the whole model's, cut): the same loss and gradient for the
    same draw, and both take the stream's next draw when none is given."""
    spec, shape = "conv3x3x6p1,pool2,fc12,fc9,fc4", (1, 6, 6)
    whole = ConvNet(spec, shape, "relu", dropout=0.4)
    rng = np.random.default_rng(5)
    p = whole.init_params(1)
    x = rng.random((7, 36)).astype(np.float32)
    y = rng.integers(0, 4, 7)
    want_loss, want = whole.loss_and_grad(p, x, y, draw=3)

    def job(compiled, model):
        local = model.local_from_full(whole.views(p))
        l1, g1 = compiled.loss_and_grad(local, x, y, draw=3)
        l2, g2 = model.loss_and_grad(local, x, y, draw=3)
        return l1, g1.copy(), l2, g2

    results = run_compiled_partitions(spec, shape, "relu", parts, job, dropout=0.4, batch=8)
    model = convnet.PartitionedConvNet(spec, shape, "relu", parts, 0)
    for q, (l1, g1, l2, g2) in enumerate(results):
        assert l1 == pytest.approx(want_loss, abs=1e-5) and l1 == pytest.approx(l2, abs=1e-5)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g1, model.local_from_full(whole.views(want), q), rtol=1e-5,
                                   atol=1e-5)


@needs_engine
def test_swap_outer_is_numpys_transpose_of_the_outer_axes():
    """The kernel between the engine's NHWC blocks and the exchange's (maps, positions,
    batch): ``a.transpose(2, 1, 0)``, its reference; a wrong output shape is refused."""
    a = np.random.default_rng(0).random((3, 5, 7), dtype=np.float32)
    out = np.empty((7, 5, 3), dtype=np.float32)
    conv_hogwild._compiled.swap_outer(a, out)
    np.testing.assert_array_equal(out, a.transpose(2, 1, 0))
    with pytest.raises(ValueError, match="not"):
        conv_hogwild._compiled.swap_outer(a, np.empty((5, 7, 3), dtype=np.float32))


@needs_engine
def test_partition_op_table_puts_an_exchange_before_every_layer_that_mixes_maps():
    """adam-mnist over 3 partitions: five segments (one per layer with parameters), each
    after the first opening with the exchange of the whole input (pooled maps in NHWC
    before conv2, the flattened 20x4x4 maps before fc400, then units); each partition's
    conv and fc rows hold its own maps and units over every input."""
    m = convnet.PartitionedConvNet("adam-mnist", (1, 28, 28), "relu", 3, 1)
    table, segments = conv_hogwild.partition_op_table(m)
    col = {c: table[:, i] for i, c in enumerate(conv_hogwild.COLUMNS)}
    assert len(segments) == 5 and segments[0][0] == 0 and segments[-1][1] == len(table)
    starts = [lo for lo, _ in segments[1:]]
    assert list(col["kind"][starts]) == [conv_hogwild.K_EXCH] * 4
    assert [(col["c"][i], col["h"][i]) for i in starts] == [(10, 12), (320, 1), (400, 1),
                                                            (400, 1)]
    held = [m.cols[l][1] for l in range(5)]   # (first, one past the last) of partition 1
    convs = np.flatnonzero(col["kind"] == conv_hogwild.K_CONV)
    assert list(col["c"][convs]) == [1, 10]
    assert list(col["oc"][convs]) == [hi - lo for lo, hi in held[:2]]
    fcs = np.flatnonzero(col["kind"] == conv_hogwild.K_FC)
    assert list(col["oc"][fcs]) == [hi - lo for lo, hi in held[2:]]
    assert list(col["ulo"][fcs]) == [lo for lo, _ in held[2:]]
    assert list(col["uall"][fcs]) == [400, 400, 10]
    assert conv_hogwild.compiled_partition(m) is not m
    mlp = convnet.build_partition(config.parse(["--layers", "8,6,4"]), None, 2, 0)
    assert conv_hogwild.compiled_partition(mlp) is mlp   # an MLP's partition stays NumPy


@needs_engine
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_partitions_train_digits_over_two_ranks(digits_h5, tmp_path, threads):
    """sync with --partitions 2 (and --threads 2: thread t of each rank meets thread t of
    the other over its own communicator) trains the digits conv model on the compiled
    partitions to the accuracy the whole model reaches."""
    r = train(2, "--strategy", "sync", "--model", DIGITS_CONV, "--partitions", "2",
              "--threads", str(threads), "--steps", "200", "--batch-size", "16", "--lr", "0.05",
              "--optimizer", "sgd", "--eval-every", "0", "--timeout", "60", "--data",
              str(digits_h5), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    acc = [float(line.split("final test accuracy: ")[1].split("%")[0]) for line in
           r.output.splitlines() if "final test accuracy" in line]
    assert acc and acc[0] >= 80, r.output[-2000:]


def test_partitioned_conv_refuses_a_layer_narrower_than_P():
    with pytest.raises(ConfigError, match="layer fc3 has 3 units, fewer than --partitions 4"):
        convnet.PartitionedConvNet("conv3x3x4,fc3", (1, 5, 5), "relu", 4, 0)


def test_partitioned_conv_runs_train_the_same_model_and_resume_across_P(digits_h5, tmp_path):
    """One sync replica of the digits conv model on 1 rank and split over 2 ranks (P = 2),
    same seed and steps: the checkpoints hold the same kernels and weights (to float32
    summation order), whole layers in (out, in, kh, kw); the P = 2 checkpoint then resumes
    with P = 3 (a slice of every layer's maps on each of 3 ranks) and keeps learning."""
    run = ["--strategy", "sync", "--model", DIGITS_CONV, "--steps", "120", "--batch-size",
           "16", "--lr", "0.05", "--optimizer", "sgd", "--eval-every", "0", "--timeout", "60",
           "--data", str(digits_h5)]
    ckpts = []
    for n in (1, 2):
        r = train(n, *run, "--partitions", str(n), "--run-dir", str(tmp_path / f"p{n}"),
                  timeout=120)
        assert r.returncode == 0, r.output[-3000:]
        ckpts.append(checkpoint.load(tmp_path / f"p{n}" / "checkpoint.h5"))
    one, two = ckpts
    assert one.step == two.step == 120
    assert two.params["layer0/W"].shape == (8, 1, 3, 3)
    for name, v in one.params.items():
        np.testing.assert_allclose(two.params[name], v, rtol=0, atol=2e-4, err_msg=name)
    r = train(3, *run[:-6], "--steps", "240", "--eval-every", "0", "--timeout", "60",
              "--partitions", "3", "--resume", str(tmp_path / "p2" / "checkpoint.h5"),
              "--data", str(digits_h5), "--run-dir", str(tmp_path / "p3"), timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    assert "resumed from" in r.output and checkpoint.load(tmp_path / "p3" / "checkpoint.h5").step \
        == 240
    acc = [float(line.split("final test accuracy: ")[1].split("%")[0]) for line in
           r.output.splitlines() if "final test accuracy" in line]
    assert acc and acc[0] >= 80, r.output[-2000:]
