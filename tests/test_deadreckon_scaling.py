"""deadreckon at many replicas: the learning-rate rule and the warm start.

The rule is a pure function, tested without MPI; the warm start end to end on digits (every
partition of every replica released, replicas bit-identical after it), and the defaults
learning at 8 replicas, oversubscribed on 2 cores, where deadreckon used to end at chance.
"""
from __future__ import annotations


import numpy as np
import pytest
from test_train import QUICK, assert_learned, records, train

from hpcps import config
from hpcps.options import WARMUP_STEPS
from hpcps.strategies import deadreckon, downpour
from hpcps.strategies.deadreckon import replica_lr
from hpcps.strategies.deadreckon.replica import Reckoner
from hpcps.compress.threshold import UNIT_DIVISOR


# -- the learning-rate rule, no MPI ------------------------------------------------------------
@pytest.mark.parametrize("rule,replicas,expected", [
    ("sum", 16, 0.1), ("mean", 16, 0.1 / 16), ("sqrt", 16, 0.1 / 4),
    ("mean", 1, 0.1), ("sqrt", 1, 0.1), ("sqrt", 9, 0.1 / 3), ("mean", 8, 0.0125)])
def test_replica_lr(rule, replicas, expected):
    assert replica_lr(0.1, replicas, rule) == pytest.approx(expected, rel=1e-12)


def test_replica_lr_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="lr scaling"):
        replica_lr(0.1, 4, "cube")
    with pytest.raises(ValueError, match="replicas"):
        replica_lr(0.1, 0, "sqrt")


def test_a_round_of_mean_steps_is_one_step_of_the_mean_gradient():
    """What ``mean`` means: R replicas each stepping lr / R on their own gradient move the
    weights, once every replica applied all R steps, by one step of lr on the mean gradient."""
    rng = np.random.default_rng(0)
    R, lr = 12, 0.1
    grads = rng.standard_normal((R, 50))
    summed = sum(-replica_lr(lr, R, "mean") * g for g in grads)
    np.testing.assert_allclose(summed, -lr * grads.mean(axis=0), rtol=1e-12)


def test_defaults_and_the_shared_option():
    d = config.parse(["--strategy", "deadreckon"])
    assert d.lr_scaling == deadreckon.STRATEGY.defaults["lr_scaling"]
    assert d.warmup_steps == deadreckon.STRATEGY.defaults["warmup_steps"] > 0
    assert config.parse(["--strategy", "deadreckon", "--warmup-steps", "0"]).warmup_steps == 0
    assert config.parse([]).warmup_steps == 200  # downpour's, unchanged
    # one Option object in both declarations; its help names each strategy's own default
    assert WARMUP_STEPS in deadreckon.STRATEGY.options
    assert WARMUP_STEPS in downpour.STRATEGY.options
    assert f"downpour {config.parse([]).warmup_steps}" in WARMUP_STEPS.help
    assert f"deadreckon {d.warmup_steps}" in WARMUP_STEPS.help
    text = config.build_parser().format_help()
    assert "--lr-scaling" in text and "--warmup-steps" in text


def test_restarted_reckoners_agree_whatever_the_order():
    """After the warm start every replica takes the broadcast weights as w0 with zero counts;
    from there, the same messages in any order give the same weights, bit for bit, even for
    a replica whose counts and base were elsewhere before the restart."""
    rng = np.random.default_rng(1)
    n, tau = 3000, 2e-3
    warm = rng.standard_normal(n).astype(np.float32)
    msgs = []
    for _ in range(40):
        idx = np.sort(rng.choice(n, size=300, replace=False)).astype(np.uint32)
        msgs.append((idx << 1) | rng.integers(0, 2, 300).astype(np.uint32))
    finals = []
    for order in (range(40), reversed(range(40)), rng.permutation(40)):
        r = Reckoner(rng.standard_normal(n).astype(np.float32), tau / UNIT_DIVISOR)
        r.apply(msgs[0], UNIT_DIVISOR)     # what it held before the warm start does not matter
        r.params[:] = warm         # the broadcast
        r.restart()
        assert not r.counts.any() and np.array_equal(r.base, warm)
        for i in order:
            r.apply(msgs[i], UNIT_DIVISOR)
        finals.append(r.params.copy())
    for other in finals[1:]:
        np.testing.assert_array_equal(finals[0], other)


# -- end to end on digits ------------------------------------------------------------------------
def dr(n, tmp_path, digits_h5, *extra, steps=900):
    return train(n, "--strategy", "deadreckon", "--data", str(digits_h5), "--run-dir",
                 str(tmp_path), "--steps", str(steps), "--timeout", "60", *extra, *QUICK)


def test_warm_start_releases_every_partition_of_every_replica(digits_h5, tmp_path):
    """R = 2, P = 2: partition p of replica 0 broadcasts to partition p of replica 1. Replica
    0 trained alone first, so the replicas end identical only if both partitions of replica 1
    took its weights (and a partition left waiting would end the job at --timeout)."""
    run = dr(4, tmp_path, digits_h5, "--partitions", "2", "--warmup-steps", "150")
    s = assert_learned(run, tmp_path, digits_h5)
    assert "warm start: replica 0 trains alone for 150 steps" in run.stdout
    assert "warm start done" in run.stdout
    assert s["replicas"] == 2 and s["partitions"] == 2 and s["step"] == 900
    assert s["replicas_identical"] is True and len(s["replica_checksums"]) == 4
    # partition p's checksum is the same in both replicas, and the partitions differ
    by_part = s["replica_checksums"]
    assert len(set(by_part)) == 2, by_part
    evals = records(tmp_path, "eval")
    assert evals[0]["step"] <= 150 and evals[0]["test_accuracy"] > 0.5  # replica 0 alone


def test_replicas_identical_after_warm_start(digits_h5, tmp_path):
    """Three replicas, a warm start, then dead reckoning with two Hogwild threads each."""
    run = dr(3, tmp_path, digits_h5, "--warmup-steps", "100", "--threads", "2", steps=600)
    assert run.returncode == 0, run.output
    s = records(tmp_path, "summary")[-1]
    assert s["replicas_identical"] is True and len(set(s["replica_checksums"])) == 1
    assert len(s["replica_checksums"]) == 3 and s["step"] >= 600
    assert "warm start done" in run.stdout
    # an update from a replica ahead of the receiver is not late: staleness is never negative
    assert all(r["staleness"] >= 0 for r in records(tmp_path, "progress"))
    assert s["mean_staleness"] >= 0


def test_run_shorter_than_the_warm_start_and_resume_skips_it(digits_h5, tmp_path):
    """--steps below --warmup-steps: replica 0 does all of it and still releases the others
    (who have nothing left to do); resuming from its checkpoint starts no warm start."""
    first, second = tmp_path / "a", tmp_path / "b"
    run = dr(3, first, digits_h5, "--warmup-steps", "500", steps=120)
    assert run.returncode == 0, run.output
    s = records(first, "summary")[-1]
    assert s["step"] == 120 and s["replicas_identical"] is True
    run = dr(3, second, digits_h5, "--resume", str(first / "checkpoint.h5"), steps=240)
    assert run.returncode == 0, run.output
    assert "warm start" not in run.stdout and "resumed from" in run.stdout
    s = records(second, "summary")[-1]
    assert s["step"] == 240 and s["replicas_identical"] is True


def test_defaults_learn_at_eight_replicas(digits_h5, tmp_path):
    """Eight replicas on 2 cores with the defaults of --lr, --tau, --lr-scaling and
    --warmup-steps: every replica applies the sum of eight replicas' steps, arriving late
    (whole time slices of steps), and still learns."""
    run = dr(8, tmp_path, digits_h5)
    s = assert_learned(run, tmp_path, digits_h5)
    assert s["replicas"] == 8 and s["replicas_identical"] is True
    rule = deadreckon.STRATEGY.defaults["lr_scaling"]
    said = "8 replicas apply each other's steps"
    if rule == "sum":  # each replica thresholds at --lr itself, and says nothing of scaling
        assert replica_lr(0.1, 8, rule) == 0.1 and said not in run.stdout, run.stdout
    else:
        assert f"{said}: each thresholds lr 0.1 scaled {rule} = " \
               f"{replica_lr(0.1, 8, rule):.4g}" in run.stdout, run.stdout
