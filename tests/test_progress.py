"""Progress a person can follow (hpcps.runtime.progress, hpcps.runtime.metrics): a bar
rewritten in place on a terminal, plain lines elsewhere. (Sandblaster's progress carrying
percent done and ETA is checked on test_report's sandblaster run.)"""
from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys

from mpirun import ROOT, end_launch, mpiexec, read_until, tagged_env

from hpcps.runtime import progress
from hpcps.runtime.metrics import Metrics


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_bar_line_fits_and_says_how_far():
    line = progress.bar_line(12.3, {"step": 420, "done_pct": 42.0, "eta_s": 72.4,
                                    "loss": 0.31234, "examples_per_s": 1500.7}, width=200)
    assert line.startswith("[hpcps     12.3s] [########............]  42.0%")
    assert "step 420" in line and "eta 01:12" in line and "loss 0.3123" in line
    assert "1501 ex/s" in line
    assert len(progress.bar_line(1.0, {"step": 1, "done_pct": 0.0, "eta_s": None},
                                 width=30)) <= 29
    assert "eta --:--" in progress.bar_line(1.0, {"step": 1, "done_pct": 0.0, "eta_s": None})
    assert "eta 1:01:01" in progress.bar_line(1.0, {"step": 1, "done_pct": 1.0, "eta_s": 3661})


def test_bar_on_a_terminal_lines_elsewhere(tmp_path):
    tty = Tty()
    m = Metrics(tmp_path / "a", stream=tty)
    assert m.bar
    m.record("progress", step=10, done_pct=10.0, eta_s=9.0, loss=1.0)
    m.record("progress", step=20, done_pct=20.0, eta_s=8.0, loss=0.9)
    m.record("eval", step=20, test_accuracy=0.5)
    m.message("finished")
    m.close()
    out = tty.getvalue()
    bars = out.split(progress.CLEAR)
    assert len(bars) == 3 and "10.0%" in bars[1] and "\n" not in bars[1], repr(out)
    # the bar as it stood stays above the next line, which starts a line of its own
    assert "20.0%" in bars[2] and "\n[hpcps" in bars[2] and "eval" in bars[2]
    assert out.endswith("finished\n")
    # metrics.jsonl is the same either way
    assert [json.loads(x)["kind"] for x in (tmp_path / "a" / "metrics.jsonl").read_text()
            .splitlines()] == ["progress", "progress", "eval"]
    plain = io.StringIO()
    m = Metrics(tmp_path / "b", stream=plain)
    assert not m.bar
    m.record("progress", step=10, done_pct=10.0, eta_s=9.0)
    assert progress.CLEAR not in plain.getvalue() and "done_pct=10" in plain.getvalue()


def test_the_environment_decides_when_set():
    assert progress.wants_bar(io.StringIO(), {"HPCPS_PROGRESS": "bar"})
    assert not progress.wants_bar(Tty(), {"HPCPS_PROGRESS": "lines"})
    assert progress.wants_bar(Tty(), {})


def test_under_mpiexec_on_a_terminal_rank_zero_draws_a_bar(digits_h5, tmp_path):
    """mpiexec forwards the ranks' output through pipes: the bar is drawn because the launcher
    writes to a terminal (a pseudo-terminal here)."""
    leader, follower = pty.openpty()
    env, tag = tagged_env(dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1"))
    env.pop("HPCPS_PROGRESS", None)
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hpcps.train", "--strategy", "sync",
           "--data", str(digits_h5), "--layers", "64,32,10", "--steps", "200", "--batch-size",
           "16", "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "0.2",
           "--run-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, env=env,
                            start_new_session=True)
    os.close(follower)
    try:
        data = read_until(leader, 120)  # until every writer has gone, or fail at the deadline
        assert proc.wait(timeout=30) == 0, data[-2000:]
    finally:
        end_launch(proc.pid, tag)  # nothing of a hung run outlives the test
        proc.wait()
        os.close(leader)
    out = data.decode(errors="replace")
    assert progress.CLEAR in out and "%  step " in out, out[-2000:]
    assert "progress   step=" not in out  # (without a terminal: plain lines, tests above)
