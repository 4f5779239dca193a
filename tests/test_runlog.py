"""hpcps.io.runlog: whether a run directory's newest run has ended, from its metrics' tail."""
from __future__ import annotations

import json

from hpcps.io import runlog


def write(path, kinds, pad=0):
    with open(path / "metrics.jsonl", "a") as fh:
        for kind in kinds:
            fh.write(json.dumps({"kind": kind, "time_s": 0.0, "pad": "x" * pad}) + "\n")


def test_the_newest_run_has_ended_once_its_summary_or_stop_follows_its_start(tmp_path):
    assert runlog.run_ended(tmp_path) is None  # no metrics yet
    write(tmp_path, ["start", "progress", "summary"])
    assert runlog.run_ended(tmp_path) == "its summary is written"
    write(tmp_path, ["start", "progress"])  # resumed: the newest run runs
    assert runlog.run_ended(tmp_path) is None
    write(tmp_path, ["stop"])  # stopped early (a failed collective writes no summary)
    assert runlog.run_ended(tmp_path) == "its stop is written"


def test_only_the_tail_is_read_and_a_start_before_it_still_counts(tmp_path):
    """A long run: its start lies before the last 64 KiB; a summary there is its own, and the
    older run's summary (before the newest start) is not."""
    write(tmp_path, ["start", "summary", "start"])
    write(tmp_path, ["progress"] * 400, pad=400)  # well past the tail
    assert runlog.run_ended(tmp_path) is None
    write(tmp_path, ["summary"])
    assert runlog.run_ended(tmp_path) == "its summary is written"
    assert (tmp_path / "metrics.jsonl").stat().st_size > 2 * runlog.TAIL_BYTES


def test_a_second_job_in_a_run_directory_in_use_is_refused_until_the_first_ends(tmp_path,
                                                                              digits_h5):
    """Two jobs in one run directory would write over each other's checkpoint and metrics:
    while a process holds the directory (here a stand-in for a job's rank 0, so the test
    needs no second job running), a job there ends at once with exit code 2 and one message
    naming the holder, and writes nothing. The kernel drops the lock however the holder
    ends: once it is SIGKILLed, the same job runs."""
    import os
    import signal
    import subprocess
    import sys

    from mpirun import train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hpcps.io import runlog; "
         "runlog.hold(sys.argv[1]); print('held', flush=True); time.sleep(300)", str(run_dir)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ("--strategy", "sync", "--layers", "64,32,10", "--data", str(digits_h5),
                "--steps", "20", "--run-dir", str(run_dir))
        run = train(2, *args, timeout=120)
        assert run.returncode == 2, run.output
        errors = [ln for ln in run.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and (f"run directory {run_dir} is in use by a running job (pid "
                                     f"{holder.pid} on ") in errors[0], run.stderr
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    run = train(2, *args, timeout=120)
    assert run.returncode == 0, run.output
    assert runlog.run_ended(run_dir) == "its summary is written"
    runlog.hold(run_dir)  # this process now; a second hold of its own is no conflict
    runlog.hold(run_dir)


def test_a_default_run_directory_of_the_same_second_gets_a_suffix(tmp_path, digits_h5):
    """Launches in the same second without --run-dir (a loop of runs) each get a directory:
    the stamped one is taken, so the run goes to ``<stamp>-2``. The stamps of the next
    seconds are taken ahead here, so the test does not depend on when the job starts."""
    import time

    from mpirun import train

    now = time.time()
    taken = {time.strftime("%Y%m%d-%H%M%S", time.localtime(now + s)) for s in range(60)}
    for stamp in taken:
        (tmp_path / "runs" / f"sync-{stamp}").mkdir(parents=True)
    run = train(2, "--strategy", "sync", "--layers", "64,32,10", "--data", str(digits_h5),
                "--steps", "20", cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.output
    used = [p for p in (tmp_path / "runs").iterdir() if any(p.iterdir())]
    assert len(used) == 1 and used[0].name.endswith("-2"), used
    assert used[0].name[len("sync-"):-2] in taken
    assert f"metrics: runs/{used[0].name}/metrics.jsonl" in run.stdout
