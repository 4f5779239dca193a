"""The linear scaling rule for sync and averaging (``hpcps.strategies.lr_rule``): its
arithmetic without MPI, the options refused with the other strategies, and one short run per
strategy whose start line names the scaled rate."""
from __future__ import annotations

import re

import pytest
from mpirun import train

from hpcps import config
from hpcps.errors import ConfigError
from hpcps.strategies.lr_rule import describe_rate, lr_multiplier


@pytest.mark.parametrize("R,T", [(1, 1), (4, 1), (6, 2), (3, 4)])
def test_linear_rule_warms_up_from_one_to_r_times_t(R, T):
    k = R * T
    assert lr_multiplier("linear", R, T, 0, 100) == 1.0
    for step in (1, 25, 50, 99):
        assert lr_multiplier("linear", R, T, step, 100) == pytest.approx(1 + (k - 1) * step / 100)
    assert lr_multiplier("linear", R, T, 50, 100) == pytest.approx((1 + k) / 2)
    for step in (100, 101, 10**6):
        assert lr_multiplier("linear", R, T, step, 100) == k
    assert lr_multiplier("linear", R, T, 0, 0) == k  # no warm-up: the scaled rate at once
    assert lr_multiplier("none", R, T, 0, 100) == lr_multiplier("none", R, T, 500, 100) == 1.0


def test_linear_rule_refuses_nonsense():
    with pytest.raises(ValueError):
        lr_multiplier("sqrt", 2, 1, 0, 10)
    with pytest.raises(ValueError):
        lr_multiplier("linear", 0, 1, 0, 10)


def test_defaults_and_description():
    for strategy in ("sync", "averaging"):
        cfg = config.parse(["--strategy", strategy, "--lr-rule", "linear", "--lr", "0.01",
                            "--threads", "2", "--lr-warmup-steps", "40"])
        assert cfg.lr_rule == "linear" and cfg.lr_warmup_steps == 40
        text = describe_rate(cfg, 6)
        assert text.startswith("lr=0.12 ") and "6 replicas x 2 threads" in text, text
        assert "over 40 steps" in text
        off = config.parse(["--strategy", strategy, "--lr-rule", "none", "--lr", "0.01"])
        assert describe_rate(off, 6) == "lr=0.01"


@pytest.mark.parametrize("strategy", ["downpour", "deadreckon", "sandblaster"])
@pytest.mark.parametrize("flag,value", [("--lr-rule", "linear"), ("--lr-warmup-steps", "10")])
def test_refused_with_other_strategies(strategy, flag, value):
    with pytest.raises(ConfigError, match="applies only to --strategy averaging or hybrid or "
                       "sync"):
        config.parse(["--strategy", strategy, flag, value])


def test_warmup_steps_nonnegative():
    with pytest.raises(ConfigError, match=">= 0"):
        config.parse(["--strategy", "sync", "--lr-warmup-steps", "-1"])


@pytest.mark.parametrize("strategy", ["sync", "averaging"])
def test_start_line_names_the_scaled_rate(strategy, digits_h5, tmp_path):
    run = train(2, "--strategy", strategy, "--data", str(digits_h5), "--run-dir", str(tmp_path),
                "--layers", "64,32,10", "--steps", "60", "--threads", "2", "--lr", "0.01",
                "--lr-rule", "linear", "--lr-warmup-steps", "20", "--eval-every", "0",
                "--checkpoint-every", "0")
    assert run.returncode == 0, run.stderr[-2000:]
    start = next(line for line in run.stdout.splitlines() if "replica(s) x" in line)
    assert re.search(r"lr=0\.04 \(linear rule: 0\.01 x 2 replicas x 2 threads, warm-up from "
                     r"0\.01 over 20 steps\)", start), start
