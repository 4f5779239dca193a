import numpy as np
import pytest

from hpcps.model import optim
from hpcps.errors import ConfigError


def test_sgd_step():
    opt = optim.make("sgd", 0.5)
    w = np.ones(4, np.float32)
    opt.apply(w, np.array([1, 2, 0, -2], np.float32), opt.init_state(4))
    np.testing.assert_allclose(w, [0.5, 0.0, 1.0, 2.0])


def test_adagrad_is_lr_over_root_sum_of_squares():
    opt = optim.make("adagrad", 0.1, eps=0.0)
    w = np.zeros(3, np.float32)
    st = opt.init_state(3)
    grads = [np.array([1.0, -2.0, 0.5], np.float32), np.array([3.0, 1.0, 0.5], np.float32)]
    ref = np.zeros(3)
    acc = np.zeros(3)
    for g in grads:
        opt.apply(w, g, st)
        acc += g.astype(np.float64) ** 2
        ref -= 0.1 * g / np.sqrt(acc)
    np.testing.assert_allclose(w, ref, rtol=1e-6)
    np.testing.assert_allclose(st["accum"], acc, rtol=1e-6)


def test_adagrad_on_slices_equals_whole_vector():
    """What the shards do (each its own slice and state) equals one optimizer on everything."""
    rng = np.random.default_rng(0)
    n = 1001
    opt = optim.make("adagrad", 0.05)
    w_full, st_full = rng.standard_normal(n).astype(np.float32), opt.init_state(n)
    w_parts = w_full.copy()
    cuts = [(0, 334), (334, 668), (668, n)]
    st_parts = [opt.init_state(hi - lo) for lo, hi in cuts]
    for _ in range(5):
        g = rng.standard_normal(n).astype(np.float32)
        opt.apply(w_full, g, st_full)
        for (lo, hi), st in zip(cuts, st_parts):
            part = w_parts[lo:hi]
            opt.apply(part, np.ascontiguousarray(g[lo:hi]), st)
    np.testing.assert_array_equal(w_full, w_parts)


def test_unknown_optimizer():
    with pytest.raises(ConfigError, match="unknown optimizer"):
        optim.make("adam", 0.1)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_against_float64_reference(nesterov):
    rng = np.random.default_rng(1)
    n, lr, mu = 257, 0.05, 0.9
    opt = optim.make("momentum", lr, momentum=mu, nesterov=nesterov)
    w = rng.standard_normal(n).astype(np.float32)
    ref, v = w.astype(np.float64), np.zeros(n)
    st = opt.init_state(n)
    for _ in range(6):
        g = rng.standard_normal(n).astype(np.float32)
        opt.apply(w, g, st)
        v = mu * v + g
        ref -= lr * (g + mu * v) if nesterov else lr * v
    np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st["velocity"], v, rtol=1e-5, atol=1e-6)


def test_momentum_zero_is_sgd_and_slices_equal_whole():
    rng = np.random.default_rng(2)
    g = rng.standard_normal(100).astype(np.float32)
    w0 = rng.standard_normal(100).astype(np.float32)
    a, b = w0.copy(), w0.copy()
    m = optim.make("momentum", 0.1, momentum=0.0)
    m.apply(a, g, m.init_state(100))
    optim.make("sgd", 0.1).apply(b, g, {})
    np.testing.assert_allclose(a, b, rtol=1e-6)
    whole, parts = w0.copy(), w0.copy()
    opt = optim.make("momentum", 0.1, momentum=0.5, nesterov=True)
    st_whole, st_parts = opt.init_state(100), [opt.init_state(40), opt.init_state(60)]
    for _ in range(3):
        opt.apply(whole, g, st_whole)
        opt.apply(parts[:40], np.ascontiguousarray(g[:40]), st_parts[0])
        opt.apply(parts[40:], np.ascontiguousarray(g[40:]), st_parts[1])
    np.testing.assert_array_equal(whole, parts)


def test_momentum_range_is_checked():
    with pytest.raises(ConfigError, match="momentum"):
        optim.make("momentum", 0.1, momentum=1.0)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_lr_scale_is_a_rate_for_this_gradient(name):
    """``apply(..., lr_scale=c)``: SGD and momentum move as if the gradient were c * g (the
    velocity keeps c * g); Adagrad steps at lr * c while its sum of squares takes g itself."""
    rng = np.random.default_rng(7)
    g1, g2 = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    opt = optim.make(name, 0.1)
    w_a = w_b = None
    for scaled in (True, False):
        w = np.linspace(-1, 1, 40).astype(np.float32)
        st = opt.init_state(40)
        if scaled:
            opt.apply(w, g1, st, lr_scale=0.25)
        elif name == "adagrad":  # reference by hand
            acc = g1.astype(np.float64) ** 2
            w = (w - 0.1 * 0.25 * g1 / (np.sqrt(acc) + 1e-8)).astype(np.float32)
            st["accum"][:] = acc
        else:
            opt.apply(w, np.float32(0.25) * g1, st)
        opt.apply(w, g2, st)  # a later, unscaled gradient sees the state the first left
        if scaled:
            w_a = w
        else:
            w_b = w
    np.testing.assert_allclose(w_a, w_b, rtol=1e-5, atol=1e-6)


# -- weight decay (--weight-decay, added to every gradient in strategies/gradients.py) ---------
def _weight_norm(path) -> float:
    from hpcps.io import checkpoint
    ck = checkpoint.load(path)
    return float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for k, v in ck.params.items()
                             if k.endswith("/W"))))


@pytest.mark.parametrize("strategy,extra", [
    ("sync", []), ("averaging", []), ("deadreckon", ["--lr", "0.05"]),
    ("downpour", ["--threads", "2"])])
def test_weight_decay_shrinks_the_weights_in_every_loop_strategy(digits_h5, tmp_path, strategy,
                                                                  extra):
    """The same run (seed, steps) with and without --weight-decay: the decayed one ends with
    clearly smaller weights, and still learns."""
    from mpirun import train
    norms = {}
    for wd in ("0", "0.05"):
        run_dir = tmp_path / wd
        out = train(2, "--strategy", strategy, "--layers", "64,32,10", "--data", str(digits_h5),
                    "--steps", "400", "--batch-size", "16", "--eval-every", "0",
                    "--checkpoint-every", "0", "--timeout", "60", "--run-dir", str(run_dir),
                    "--weight-decay", wd, *extra, timeout=120)
        assert out.returncode == 0, out.output[-2000:]
        assert "final test accuracy" in out.output
        norms[wd] = _weight_norm(run_dir / "checkpoint.h5")
    assert norms["0.05"] < 0.8 * norms["0"], norms


# -- the learning-rate schedule (--lr-schedule) ------------------------------------------------
def test_cosine_schedule_falls_from_one_to_zero():
    f = [optim.lr_factor("cosine", s, 100) for s in (0, 25, 50, 75, 100, 130)]
    np.testing.assert_allclose(f, [1.0, 0.5 + 0.5 * np.cos(np.pi / 4), 0.5,
                                   0.5 - 0.5 * np.cos(np.pi / 4), 0.0, 0.0], atol=1e-12)
    assert optim.lr_factor("constant", 99, 100) == optim.lr_factor(None, 5, 100) == 1.0
    with pytest.raises(ConfigError, match="schedule"):
        optim.lr_factor("linear", 1, 10)
    # a shard's apply follows its step counter
    step = [0]
    apply = optim.scheduled(optim.SGD(1.0).apply, "cosine", lambda: step[0], 10)
    w = np.zeros(1, np.float32)
    apply(w, np.ones(1, np.float32), {})
    step[0] = 5
    apply(w, np.ones(1, np.float32), {}, lr_scale=0.5)
    np.testing.assert_allclose(w, [-1.0 - 0.25])
    sgd = optim.SGD(1.0)
    assert optim.scheduled(sgd.apply, "constant", None, 10) == sgd.apply


def test_momentum_schedule_scales_the_step_not_the_velocity():
    opt = optim.make("momentum", 0.1, momentum=0.5)
    w, st = np.zeros(1, np.float32), opt.init_state(1)
    opt.apply(w, np.ones(1, np.float32), st)                  # v = 1, w = -0.1
    opt.apply(w, np.ones(1, np.float32), st, step_scale=0.0)  # v = 1.5, no step
    np.testing.assert_allclose([w[0], st["velocity"][0]], [-0.1, 1.5], rtol=1e-6)
    opt.apply(w, np.zeros(1, np.float32), st, step_scale=0.5)  # v = 0.75, w -= 0.05 * 0.75
    np.testing.assert_allclose(w, [-0.1 - 0.0375], rtol=1e-6)


@pytest.mark.parametrize("strategy,extra", [
    ("sync", []), ("averaging", []), ("deadreckon", ["--lr", "0.05"]), ("downpour", []),
    ("downpour", ["--optimizer", "momentum"])])
def test_cosine_schedule_ends_with_small_steps_and_follows_the_resumed_step(
        digits_h5, tmp_path, strategy, extra):
    """From the same checkpoint at step 360 of 400, the last 40 steps move the weights far
    less under --lr-schedule cosine (its rate there is 0 to 0.1 of --lr) than at a constant
    rate: the schedule follows the global step of the resumed run."""
    from mpirun import train
    common = ["--strategy", strategy, "--layers", "64,32,10", "--data", str(digits_h5),
              "--batch-size", "16", "--eval-every", "0", "--checkpoint-every", "0",
              "--timeout", "60", *extra]
    start = tmp_path / "start"
    out = train(2, *common, "--steps", "360", "--run-dir", str(start), timeout=120)
    assert out.returncode == 0, out.output[-2000:]
    w0 = _weights(start / "checkpoint.h5")
    moved = {}
    for schedule in ("constant", "cosine"):
        run_dir = tmp_path / schedule
        run_dir.mkdir()
        ck = run_dir / "checkpoint.h5"
        ck.write_bytes((start / "checkpoint.h5").read_bytes())
        out = train(2, *common, "--steps", "400", "--resume", str(ck), "--lr-schedule",
                    schedule, timeout=120)
        assert out.returncode == 0, out.output[-2000:]
        moved[schedule] = float(np.linalg.norm(_weights(ck) - w0))
    # (deadreckon may move nothing: its small steps stay in the residual, below tau)
    assert moved["constant"] > 0 and moved["cosine"] < 0.25 * moved["constant"], moved


def _weights(path) -> np.ndarray:
    from hpcps.io import checkpoint
    ck = checkpoint.load(path)
    return np.concatenate([v.ravel().astype(np.float64) for k, v in sorted(ck.params.items())])
