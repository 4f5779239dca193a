"""Compressed updates end to end on digits: ``--tau auto`` with clipping, sparsity warm-up and
momentum correction, in deadreckon (replicas bit-identical after draining while every
replica's tau changes) and in ``downpour --compress threshold``. The math is tested without
MPI in tests/test_threshold.py; the runs' timeouts name the ranks waited on (tests/mpirun.py).
"""
from __future__ import annotations

import pytest
from test_train import LAYERS, QUICK, assert_learned, records, train

from hpcps.io import checkpoint
from hpcps.strategies.deadreckon.replica import START_TAU
from hpcps.strategies.downpour import DOWNPOUR_TAU

DIAGNOSTICS = ("tau", "density", "residual_norm")
RECORDS = ["--progress-every", "0.01"]  # after QUICK's: several windows in a short run


def assert_diagnostics(run_dir, density):
    """Every progress record holds tau, density and residual norm, and the adaptive rule
    holds the density near its target once the warm start and the sparsity warm-up are over:
    the mean over the windows between the records of the run's second half, weighted by
    their steps (a run of 900 digits steps can take 0.2 s: the callers ask for a record every
    0.01 s, so a fixed interval gives several windows however fast the machine)."""
    progress = records(run_dir, "progress")
    assert progress and all(all(k in p for k in DIAGNOSTICS) for p in progress), progress
    last = progress[-1]
    # what was not sent stays in the residual: never none of it, while density < 1
    assert last["tau"] > 0 and 0 < last["residual_norm"] < float("inf"), last
    tail = progress[len(progress) // 2:]
    spans = [(b["step"] - a["step"], b["density"]) for a, b in zip(tail, tail[1:])
             if b["step"] > a["step"]]
    assert spans, progress
    mean = sum(n * d for n, d in spans) / sum(n for n, _ in spans)
    assert 0.4 * density < mean < 2.5 * density, (mean, spans)


@pytest.mark.parametrize("n,extra", [
    (2, ["--sparsity-warmup", "100", "--residual-clip", "4", "--optimizer", "momentum",
         "--lr", "0.01"]),
    (3, ["--grad-clip", "5", "--warmup-steps", "0"]),
])
def test_deadreckon_auto_tau_keeps_replicas_identical(n, extra, digits_h5, tmp_path):
    """Every replica adapts its own tau (so the taus differ between replicas and change every
    step); once drained, all replicas hold the same bits. Learning is checked at 2 ranks
    (at 3 the 2 cores make the staleness too large for digits; see test_train)."""
    run = train(n, "--strategy", "deadreckon", "--data", str(digits_h5), "--run-dir",
                str(tmp_path), "--steps", "900", "--tau", "auto", "--density", "0.02",
                *extra, *QUICK, *RECORDS)
    if n == 2:
        s = assert_learned(run, tmp_path, digits_h5)
    else:
        assert run.returncode == 0, run.output
        s = records(tmp_path, "summary")[-1]
    assert s["replicas_identical"] is True and len(set(s["replica_checksums"])) == 1, s
    assert s["final_tau"] != pytest.approx(START_TAU)  # tau moved
    assert s["residual_warning"] is False
    assert_diagnostics(tmp_path, 0.02)
    assert "tau auto (density 0.02" in run.stdout
    if "momentum" in extra:  # the checkpoint holds replica 0's velocity; resuming takes it
        again = tmp_path / "resumed"
        run = train(n, "--strategy", "deadreckon", "--data", str(digits_h5), "--run-dir",
                    str(again), "--steps", "1200", "--tau", "auto", "--density", "0.02",
                    "--resume", str(tmp_path / "checkpoint.h5"), *extra, *QUICK)
        assert run.returncode == 0, run.output
        saved_tau = checkpoint.load(tmp_path / "checkpoint.h5").metrics["tau"]
        assert saved_tau == pytest.approx(s["final_tau"])  # replica 0's, at the end
        assert f"--tau auto resumes from the checkpoint's tau {saved_tau:.6g}" in run.stdout
        s = records(again, "summary")[-1]
        assert s["step"] == 1200 and s["replicas_identical"] is True


def test_downpour_compressed_auto_tau_with_momentum_correction(digits_h5, tmp_path):
    run = train(3, "--data", str(digits_h5), "--run-dir", str(tmp_path), "--steps", "900",
                "--compress", "threshold", "--tau", "auto", "--density", "0.05",
                "--optimizer", "momentum", "--lr", "0.05", "--residual-clip", "4",
                "--grad-clip", "5", *QUICK, *RECORDS)
    s = assert_learned(run, tmp_path, digits_h5)
    assert s["final_tau"] != pytest.approx(DOWNPOUR_TAU) and s["residual_warning"] is False
    assert s["compression_ratio"] > 1
    assert_diagnostics(tmp_path, 0.05)
    assert "momentum on the replicas, corrected; SGD on the shards" in run.stdout


@pytest.mark.parametrize("partitions", [1, 2])
def test_deadreckon_compression_counts_each_partitions_slice_once(partitions, digits_h5,
                                                                  tmp_path):
    """With P partitions each message covers a 1/P slice of the model: the summary's ratio is
    the dense bytes of the whole model per replica step over the bytes sent for it, which
    bits per update and updates per step give exactly (no warm start: every step sends), and
    the progress records' ratios (the chief's slice) agree with it."""
    run = train(2 * partitions, "--strategy", "deadreckon", "--partitions", str(partitions),
                "--data", str(digits_h5), "--run-dir", str(tmp_path), "--steps", "300",
                "--tau", "0.003", "--warmup-steps", "0", *QUICK)
    assert run.returncode == 0, run.output
    s = records(tmp_path, "summary")[-1]
    sizes = [int(k) for k in LAYERS.split(",")]
    n = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    assert s["compression_ratio"] == pytest.approx(
        32 * n / (s["bits_per_update"] * s["updates_per_step"]), rel=1e-9)
    shown = [p["compression"] for p in records(tmp_path, "progress") if p.get("compression")]
    assert shown and 0.5 < s["compression_ratio"] / sorted(shown)[len(shown) // 2] < 2, shown
