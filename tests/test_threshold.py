"""The threshold module without MPI: the adaptive rule, clipping, warm-up, momentum correction,
the residual watch, and replicas that stay bit-identical while each one's tau changes."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpcps.compress import codec as compress
from hpcps.errors import ConfigError
from hpcps.options import parse_tau
from hpcps.strategies.deadreckon.replica import Reckoner
from hpcps.compress.threshold import (
    MAX_STEP,
    UNIT_DIVISOR,
    WARMUP_DENSITY_FACTOR,
    ResidualWatch,
    Threshold,
    Velocity,
    clip_norm,
    warmup_density,
)


def stream(rng, n, steps, scale_at=lambda t: 1e-3, bias=0.3):
    """Synthetic SGD steps: a fixed per-element bias (elements that keep their sign, as real
    gradients have) plus noise, the overall scale changing with ``scale_at(t)``."""
    direction = rng.standard_normal(n).astype(np.float32)
    for t in range(steps):
        noise = rng.standard_normal(n).astype(np.float32)
        yield np.float32(scale_at(t)) * (bias * direction + noise)


def run_stream(thr, grads, n):
    residual = np.zeros(n, dtype=np.float32)
    out = np.empty(n, dtype=np.uint32)
    densities, taus = [], []
    for g in grads:
        words = compress.threshold(residual, g, thr.tau, out=out)
        thr.after_pass(residual, len(words))
        densities.append(len(words) / n)
        taus.append(thr.tau)
    return np.array(densities), np.array(taus), residual


@pytest.mark.parametrize("target", [1e-3, 1e-2])
@pytest.mark.parametrize("tau0", [1e-5, 2e-3, 0.5])
def test_adaptive_tau_reaches_and_holds_the_target_density(target, tau0):
    """From a tau far too small, about right, or far too large, the measured density comes
    to the target within 300 steps and stays near it while the gradients shrink 10x (as
    they do over a training run)."""
    rng = np.random.default_rng(0)
    n, steps = 20_000, 1500
    thr = Threshold(tau0, n, density=target)
    scale = lambda t: 1e-3 * 10 ** (-max(0, t - 300) / 1200)  # noqa: E731
    d, taus, _ = run_stream(thr, stream(rng, n, steps, scale), n)
    for lo in range(300, steps, 200):  # every window of 200 steps after the first 300
        window = d[lo:lo + 200]
        assert abs(window.mean() / target - 1) < 0.15, (lo, window.mean(), target)
    assert d[300:].std() < (0.6 if target < 5e-3 else 0.2) * target  # no wild swings
    assert taus[-1] < taus[400]  # tau followed the shrinking gradients down


def test_a_fixed_tau_does_not_hold_the_density():
    """What the rule fixes: with a fixed tau the density falls as the gradients shrink."""
    rng = np.random.default_rng(0)
    n = 20_000
    thr = Threshold(2e-3, n)
    scale = lambda t: 1e-3 * 10 ** (-t / 600)  # noqa: E731
    d, taus, _ = run_stream(thr, stream(rng, n, 1200, scale), n)
    assert np.all(taus == taus[0])
    assert d[-200:].mean() < 0.3 * d[100:300].mean()


def test_tau_moves_by_at_most_max_step_per_step_and_stays_a_multiple_of_the_unit():
    rng = np.random.default_rng(1)
    n = 10_000
    thr = Threshold(1e-6, n, density=1e-3)  # far too small: every step wants to grow
    _, taus, _ = run_stream(thr, stream(rng, n, 50), n)
    ratios = taus[1:] / taus[:-1]
    assert ratios.max() <= MAX_STEP * (1 + 1e-3) and ratios.min() >= 1 / MAX_STEP - 1e-3
    units = taus / thr.unit
    np.testing.assert_allclose(units, np.round(units), rtol=0, atol=1e-6)


def test_sparsity_warm_up_starts_high_and_falls_geometrically_to_the_target():
    target, steps = 1e-3, 100
    d = [warmup_density(t, target, steps) for t in range(steps + 10)]
    assert d[0] == pytest.approx(WARMUP_DENSITY_FACTOR * target)
    assert all(a > b for a, b in zip(d[:steps], d[1:steps + 1]))
    assert d[steps] == d[-1] == target
    ratios = [b / a for a, b in zip(d[:steps - 1], d[1:steps])]
    assert max(ratios) == pytest.approx(min(ratios))  # geometric
    assert warmup_density(0, 0.5, 10) == 1.0  # capped at every element
    assert warmup_density(5, target, 0) == target


def test_the_adaptive_rule_follows_the_warm_up_schedule():
    rng = np.random.default_rng(2)
    n, target, warm = 20_000, 2e-3, 300
    thr = Threshold(2e-3, n, density=target, warmup_steps=warm)
    d, _, _ = run_stream(thr, stream(rng, n, 800), n)
    early, late = d[50:100].mean(), d[500:].mean()
    assert early > 10 * target and abs(late / target - 1) < 0.2


@pytest.mark.parametrize("clip", [2.0, 4.0])
def test_residual_clipping_bounds_the_residual(clip):
    """A strongly biased stream piles residual up on the biased elements (at most one word
    per element per step leaves); clipping holds every element within clip * tau."""
    rng = np.random.default_rng(3)
    n, tau = 20_000, 1e-3
    grads = list(stream(rng, n, 200, scale_at=lambda t: 3e-3, bias=2.0))
    _, _, free = run_stream(Threshold(tau, n), grads, n)
    assert np.abs(free).max() > 10 * tau  # without clipping: unbounded growth
    thr = Threshold(tau, n, residual_clip=clip)
    residual = np.zeros(n, dtype=np.float32)
    for g in grads:
        words = compress.threshold(residual, g, thr.tau)
        thr.after_pass(residual, len(words))
        assert np.abs(residual).max() <= np.float32(clip * tau)


def test_residual_clipping_follows_an_adaptive_tau():
    rng = np.random.default_rng(4)
    n = 20_000
    thr = Threshold(1e-3, n, density=1e-3, residual_clip=3.0)
    residual = np.zeros(n, dtype=np.float32)
    for g in stream(rng, n, 300, scale_at=lambda t: 3e-3, bias=2.0):
        words = compress.threshold(residual, g, thr.tau)
        tau_used = thr.tau
        thr.after_pass(residual, len(words))
        assert np.abs(residual).max() <= np.float32(3.0 * tau_used)


def test_clip_norm():
    g = np.array([3.0, 4.0], dtype=np.float32)
    assert clip_norm(g, 10.0) == pytest.approx(5.0) and g.tolist() == [3.0, 4.0]
    assert clip_norm(g, 1.0) == pytest.approx(5.0)
    assert np.linalg.norm(g) == pytest.approx(1.0, rel=1e-6)
    g = np.array([3.0, 4.0], dtype=np.float32)
    clip_norm(g, 0.0)  # off
    assert g.tolist() == [3.0, 4.0]


def test_momentum_correction_accumulates_velocity_and_masks_what_was_sent():
    """Dense, with tau tiny (everything sent each step), velocity accumulation plus masking
    sends exactly the gradient; with nothing sent it is the momentum velocity."""
    rng = np.random.default_rng(5)
    n, mu = 1000, 0.9
    vel = Velocity(n, mu)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    ref = np.zeros(n, dtype=np.float32)
    for g in gs:  # nothing sent: plain momentum
        ref = mu * ref + g
        vel.accumulate(g.copy())
    np.testing.assert_allclose(vel.v, ref, rtol=1e-5)
    words = (np.arange(0, n, 2, dtype=np.uint32) << 1)  # even elements sent
    vel.mask(words)
    assert not vel.v[::2].any() and np.array_equal(vel.v[1::2], ref[1::2].astype(np.float32))


def test_residual_watch_fires_once_on_steady_growth_only():
    w = ResidualWatch(window=5, factor=4.0)
    assert all(w.update(x) is None for x in [1.0, 1.2, 1.1, 1.3, 1.2, 1.25] * 5)  # level
    w = ResidualWatch(window=5, factor=4.0)
    fired = [w.update(1.5 ** k) for k in range(12)]
    texts = [f for f in fired if f]
    assert len(texts) == 1 and "keeps growing" in texts[0] and "--residual-clip" in texts[0]
    assert fired.index(texts[0]) == 5  # 1.5**5 = 7.6 > 4 after 5 rises in a row
    assert "a larger --density" in texts[0]
    w = ResidualWatch(window=5, factor=4.0, adaptive=False)  # a fixed --tau: no --density
    (text,) = [f for f in (w.update(1.5 ** k) for k in range(12)) if f]
    assert "a smaller --tau" in text and "a larger --density" not in text
    w = ResidualWatch(window=5, factor=4.0)  # a residual that grows with tau is healthy
    assert all(w.update(1.5 ** k, tau=1.5 ** k) is None for k in range(12))


def test_parse_tau():
    assert parse_tau("auto") == "auto" and parse_tau("AUTO") == "auto"
    assert parse_tau("0.002") == 0.002 and parse_tau(1) == 1.0
    for bad in ("x", "-1", "0", "nan", True, None):
        with pytest.raises(ConfigError):
            parse_tau(bad)


def test_fields_report_tau_density_and_residual_norm():
    thr = Threshold(2e-3, 1000, density=1e-2)
    r = np.full(1000, 1e-3, dtype=np.float32)
    thr.after_pass(r, 10)
    thr.after_pass(r, 30)
    f = thr.fields(r)
    assert f["density"] == pytest.approx(0.02) and f["tau"] == pytest.approx(thr.tau, rel=1e-3)
    assert f["residual_norm"] == pytest.approx(math.sqrt(1000) * 1e-3, rel=1e-3)


def test_replicas_stay_bit_identical_while_each_tau_adapts():
    """Four simulated replicas, each thresholding its own gradients with its own adaptive
    tau (so their taus differ and change every step), deliver their messages to the others
    in different random orders and delays; after draining, every copy is identical."""
    rng = np.random.default_rng(6)
    R, n, steps = 4, 5000, 120
    start = rng.standard_normal(n).astype(np.float32)
    thr = [Threshold(1e-3, n, density=0.01 * (r + 1)) for r in range(R)]
    res = [np.zeros(n, dtype=np.float32) for _ in range(R)]
    reck = [Reckoner(start.copy(), thr[0].unit) for _ in range(R)]
    inbox = [[] for _ in range(R)]
    multiples_seen = set()
    for _ in range(steps):
        for r in range(R):
            g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            m = thr[r].multiple
            words = compress.threshold(res[r], g, thr[r].tau).copy()
            thr[r].after_pass(res[r], len(words))
            multiples_seen.add(m)
            reck[r].apply(words, m)
            for q in range(R):
                if q != r:
                    inbox[q].append((words, m))
            # deliver a random part of each inbox, in random order
            for q in range(R):
                rng.shuffle(inbox[q])
                k = int(rng.integers(0, len(inbox[q]) + 1))
                for w, mm in inbox[q][:k]:
                    reck[q].apply(w, mm)
                del inbox[q][:k]
    assert len(multiples_seen) > 20 and all(t.multiple != UNIT_DIVISOR for t in thr)
    for q in range(R):  # drain
        for w, mm in inbox[q]:
            reck[q].apply(w, mm)
    for q in range(1, R):
        np.testing.assert_array_equal(reck[0].params, reck[q].params)
