"""--epoch-quorum: the epoch plan, the keeper's count, and runs with a straggler."""
from __future__ import annotations

import json
import math

import pytest
from mpirun import train

from hpcps.ps.epochs import EpochCount, epoch_plan


# -- the plan (pure) -----------------------------------------------------------------------------
@pytest.mark.parametrize("start,total,per_epoch,R,warmup", [
    (0, 360, 89.8, 4, 200), (0, 3750, 1875.0, 4, 200), (0, 100, 33.3, 3, 0),
    (1000, 3750, 1875.0, 4, 0), (0, 7, 10.0, 4, 0), (0, 50, 12.5, 1, 30), (17, 18, 4.0, 2, 0)])
def test_the_plan_covers_the_run_once(start, total, per_epoch, R, warmup):
    plan = epoch_plan(start, total, per_epoch, R, warmup)
    assert sum(sum(shares) for _, shares in plan) == total - start
    epochs = [e for e, _ in plan]
    assert epochs == list(range(epochs[0], epochs[0] + len(plan)))
    assert epochs[0] == int(start // per_epoch)
    pos = start
    for e, shares in plan:  # each epoch ends at its boundary (or the run's end)
        pos += sum(shares)
        assert pos == min(total, round((e + 1) * per_epoch))
        assert max(shares[1:], default=0) - min(shares[1:], default=0) <= 1


def test_the_warm_start_is_replica_0s_alone():
    plan = epoch_plan(0, 360, 90.0, 4, 200)
    assert plan[0][1] == [90, 0, 0, 0] and plan[1][1] == [90, 0, 0, 0]
    assert plan[2][1] == [20 + 18, 18, 17, 17]  # 20 warm-start steps, then 70 in four blocks
    assert plan[3][1] == [23, 23, 22, 22]


def test_a_resumed_run_starts_in_its_epoch():
    plan = epoch_plan(2000, 3750, 1875.0, 2, 0)
    assert plan == [(1, [875, 875])]


# -- the count (pure) ----------------------------------------------------------------------------
def test_an_epoch_ends_at_the_quorum_and_in_order():
    c = EpochCount([[5, 5, 5, 5], [5, 5, 5, 5]], 0.75)
    assert c.need(0) == (4, 3)
    assert c.done(0, 1) == [] and c.done(1, 1) == [] and c.done(2, 1) == []
    assert c.done(0, 0) == [] and c.done(1, 0) == []
    assert c.done(2, 0) == [0, 1]  # epoch 1 had its quorum already: it ends with epoch 0
    assert c.over and c.waited_for == [3, 3] and c.of == [4, 4]


def test_no_share_no_wait_and_done_counts_for_every_epoch():
    c = EpochCount([[9, 0, 0], [3, 3, 3], [3, 3, 3]], 1.0)
    assert c.done(0, 0) == [0]  # replicas 1 and 2 have no share in epoch 0
    assert c.leave(1) == []  # replica 1 sent DONE (stopped early): finished with every epoch
    assert c.done(0, 1) == [] and c.done(2, 1) == [1]
    assert c.leave(2, lost=True) == []  # lost: no longer counted, but 0 and 1 must finish 2
    assert c.done(0, 2) == [2] and c.of == [1, 3, 2]


def test_losing_the_last_replica_it_waits_for_ends_the_epoch():
    c = EpochCount([[4, 4]], 1.0)
    assert c.done(0, 0) == []
    assert c.leave(1, lost=True) == [0]


def test_quorum_bounds():
    with pytest.raises(ValueError):
        EpochCount([[1]], 1.5)
    assert EpochCount([[1] * 4], 0.75).need(0) == (4, 3)
    assert EpochCount([[1] * 4], 0.5).need(0) == (4, 2)
    assert EpochCount([[1] * 3], 0.75).need(0) == (3, 3)  # ceil(2.25)


# -- runs ----------------------------------------------------------------------------------------
def summary(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "summary"][-1]


COMMON = ["--strategy", "downpour", "--layers", "64,32,10", "--batch-size", "16",
          "--eval-every", "0", "--checkpoint-every", "0", "--timeout", "60"]


@pytest.mark.parametrize("n,layout,slow,quorum", [
    (5, [], "3:25", 0.75), (6, ["--partitions", "2"], "3:25", 0.5),
    (6, ["--servers", "2", "--threads", "2"], "2:25", 0.75)])
def test_a_straggler_leaves_its_share_at_the_quorum(n, layout, slow, quorum, digits_h5,
                                                     tmp_path):
    """One replica 25x slower: with Adam's 75% (half with two replicas) every epoch in which
    all replicas have a share ends when the others have run theirs, and the straggler leaves
    the rest of its share; the run completes and learns. With --epoch-quorum 1 (checked with
    P = 1, S = 1, T = 1) nobody leaves anything and the run takes every step."""
    common = [*COMMON, *layout, "--data", str(digits_h5), "--epochs", "6",
              "--inject-slow", slow]
    fast = train(n, *common, "--epoch-quorum", str(quorum), "--run-dir", str(tmp_path / "q"),
                 timeout=240)
    assert fast.returncode == 0, fast.output[-3000:]
    s = summary(tmp_path / "q")
    assert s["epochs_ended"] == s["epochs_planned"] >= 6
    R = s["replicas"]
    shared = [(a, b) for a, b in zip(s["epoch_finished"], s["epoch_counted"]) if b == R]
    assert shared and all(a == math.ceil(quorum * R) < R for a, _ in shared), s
    assert s["epoch_left_steps"] > 0 and s["test_accuracy"] >= 0.85, s
    assert f"epoch quorum {quorum:g}" in fast.stdout
    if layout:  # the full barrier, which runs at the straggler's pace, once is enough
        return
    full = train(n, *common, "--epoch-quorum", "1", "--run-dir", str(tmp_path / "all"),
                 timeout=240)
    assert full.returncode == 0, full.output[-3000:]
    s1 = summary(tmp_path / "all")
    assert s1["epoch_finished"] == s1["epoch_counted"] and s1["epoch_left_steps"] == 0
    assert s1["step"] >= s["step"] and s1["test_accuracy"] >= 0.85
