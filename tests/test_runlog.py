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
