"""Replicated server shards (--ps-copies): the option's defaults and healthy runs (who holds what:
``test_replicated_placement.py``).

The deaths (a primary SIGKILLed mid-run) are in ``test_faults.py``."""
from __future__ import annotations

import json

import h5py
import pytest
from mpirun import train

from hpcps import config


def test_copies_bring_a_heartbeat_timeout_and_a_given_one_stays():
    cfg = config.parse(["--servers", "2", "--ps-copies", "2"])
    assert cfg.ps_copies == 2 and cfg.heartbeat_timeout == 10.0
    cfg = config.parse(["--servers", "2", "--ps-copies", "2", "--heartbeat-timeout", "3"])
    assert cfg.heartbeat_timeout == 3.0
    cfg = config.parse([])
    assert cfg.ps_copies == 1 and cfg.heartbeat_timeout is None
    with pytest.raises(Exception, match="applies only to --strategy downpour"):
        config.parse(["--strategy", "sync", "--ps-copies", "2"])


def _summary(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in recs if r["kind"] == "summary")


RUN = ["--layers", "64,32,10", "--steps", "400", "--batch-size", "16", "--eval-every", "0",
       "--progress-every", "0.5", "--timeout", "60"]


# Accuracy bars, from runs measured on 2026-11-26 (2 runs each, 2 shared cores, load 5-11):
# N4 0.922, 0.928; N5-T2 0.836, 0.833 (cosine to 0 and 2 pushes per step learn less in 400
# steps); N6 0.919, 0.903. Each bar is about 0.07-0.08 below the lowest (chance: 0.1).
@pytest.mark.parametrize("n,S,C,extra,bar", [
    (4, 2, 2, [], 0.85),
    (5, 3, 3, ["--threads", "2", "--n-push", "2", "--lr-schedule", "cosine"], 0.75),
    (6, 3, 2, ["--compress", "threshold", "--tau", "auto", "--density", "0.05",
               "--warmup-steps", "0"], 0.83),
], ids=["N4-S2-C2", "N5-S3-C3-T2", "N6-S3-C2-compressed"])
def test_healthy_runs_commit_every_push_on_every_copy(digits_h5, tmp_path, n, S, C, extra,
                                                      bar):
    """Without failures: every set applied exactly the pushes committed, the collector wrote
    the periodic checkpoints, and the final checkpoint resumes on another layout without
    copies."""
    run_dir = tmp_path / "run"
    r = train(n, "--data", str(digits_h5), *RUN, "--servers", str(S), "--ps-copies", str(C),
              "--checkpoint-every", "100", "--run-dir", str(run_dir), *extra, timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    s = _summary(run_dir)
    assert s["ps_copies"] == C and s["takeovers"] == [] and s["lost_ranks"] == []
    assert s["ps_applied"] == [s["pushes_committed"]] * S, s
    assert s["resent_pushes"] == 0
    # every copy beyond the first applied every push as a secondary
    assert s["replicated_pushes"] == (C - 1) * S * s["pushes_committed"], s
    assert "server shard 0 wrote checkpoint" in r.output and "at step 300" in r.output
    assert s["test_accuracy"] >= bar, s["test_accuracy"]
    with h5py.File(run_dir / "checkpoint.h5") as f:
        assert int(f.attrs["step"]) == s["step"]
    r2 = train(3, "--data", str(digits_h5), *RUN[:2], "--steps", str(s["step"] + 200),
               "--eval-every", "0", "--timeout", "60", "--resume",
               str(run_dir / "checkpoint.h5"), "--run-dir", str(tmp_path / "again"),
               timeout=120)
    assert r2.returncode == 0, r2.output[-3000:]
    assert _summary(tmp_path / "again")["test_accuracy"] >= s["test_accuracy"] - 0.05


# Copies compose with softsync and staleness-dependent rates: every copy runs the policy on the
# primary's order of pushes (state-machine replication, hpcps.ps.replicated.server.SetPolicy).
@pytest.mark.parametrize("extra,per_update", [
    (["--softsync", "2"], 2.0),
    (["--softsync", "2", "--staleness-lr", "on"], 2.0),
    (["--staleness-lr", "on"], 1.0),
], ids=["softsync2", "softsync2-staleness-lr", "staleness-lr"])
def test_copies_with_softsync_learn_and_commit_every_push(digits_h5, tmp_path, extra,
                                                         per_update):
    run_dir = tmp_path / "run"
    r = train(4, "--data", str(digits_h5), *RUN, "--servers", "2", "--ps-copies", "2",
              "--run-dir", str(run_dir), *extra, timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    s = _summary(run_dir)
    assert s["ps_copies"] == 2 and s["takeovers"] == [] and s["lost_ranks"] == []
    assert s["ps_applied"] == [s["pushes_committed"]] * 2, s
    assert s["replicated_pushes"] == 2 * s["pushes_committed"], s
    # each shard reports the sets it is primary of: every push of both sets was combined
    assert s["softsync"] == int(dict(zip(extra, extra[1:])).get("--softsync", 1))
    assert abs(s["pushes_per_update"] - per_update) < 0.05, s["pushes_per_update"]
    assert s["test_accuracy"] >= 0.85, s["test_accuracy"]


def test_copies_with_a_staleness_bound_hold_fetches_on_the_primary(digits_h5, tmp_path):
    """--staleness-bound with copies: each set's primary holds a fetch while its replica
    leads the slowest by more than the bound (clocks the same on every copy)."""
    run_dir = tmp_path / "run"
    r = train(5, "--data", str(digits_h5), *RUN, "--servers", "2", "--ps-copies", "2",
              "--staleness-bound", "0", "--warmup-steps", "50", "--run-dir", str(run_dir),
              timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    s = _summary(run_dir)
    assert s["ps_applied"] == [s["pushes_committed"]] * 2, s
    assert s["staleness_bound"] == 0 and 0 <= s["clock_lead_max"] <= 0, s
    assert s["ssp_held_fetches"] > 0, s
    assert s["test_accuracy"] >= 0.85, s["test_accuracy"]


def test_live_ranks_are_the_members_not_found_dead_in_shard_order():
    """The shards a replica beats to and a spare beats to while it loads (from the chief's
    view): members not found dead, as world ranks, in shard order."""
    from hpcps.ps.replicated.client import live_ranks
    view = {"route": [5, 3, 6], "dead": [1], "members": [3, 0, 1, 2]}
    assert live_ranks(view, [2, 3, 4, 5]) == [2, 4, 5]
    assert live_ranks({"route": [], "dead": [], "members": []}, [2, 3]) == []
