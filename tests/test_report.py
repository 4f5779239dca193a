"""``python -m hpcps.report``: figures and a summary table from real runs' metrics.

Two real runs on digits cover every figure: downpour with compressed pushes and a staleness
bound (compression, SSP waits, staleness) and sandblaster (L-BFGS step lengths).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpirun import ROOT, train
from test_train import QUICK, records

from hpcps.tools.report import FIGURES, draw, load_run, load_runs, main, plan_figures, table_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_FIGURES = {f.name for f in FIGURES}


@pytest.fixture(scope="module")
def runs(digits_h5, tmp_path_factory):
    """{name: run directory} of two finished runs of different strategies."""
    base = tmp_path_factory.mktemp("report-runs")
    quick = [a if a != "200" else "100" for a in QUICK]  # evaluate every 100 steps
    args = {
        "ssp": (4, "--compress", "threshold", "--staleness-bound", "1", "--steps", "400",
                "--warmup-steps", "0", *quick),
        "lbfgs": (3, "--strategy", "sandblaster", "--steps", "6", *quick),
    }
    dirs = {}
    for name, (n, *rest) in args.items():
        dirs[name] = base / name
        run = train(n, "--data", str(digits_h5), "--run-dir", str(dirs[name]), *rest)
        assert run.returncode == 0, run.output
    return dirs


def assert_real_png(path):
    from matplotlib.image import imread
    blob = path.read_bytes()
    assert blob[:8] == PNG_MAGIC, path
    width, height = int.from_bytes(blob[16:20], "big"), int.from_bytes(blob[20:24], "big")
    assert width >= 500 and height >= 300, (path, width, height)
    rgb = (imread(path)[..., :3] * 255).astype(np.uint32)
    # drawn on, not blank: many colours, and a fair share of pixels away from the white ground
    colours = np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])
    assert len(colours) > 100, (path, len(colours))
    assert np.mean(rgb.min(axis=2) < 230) > 0.02, path


def test_figures_and_table(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(runs["ssp"]), str(runs["lbfgs"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    pngs = {p.stem for p in out.glob("*.png")}
    assert pngs == ALL_FIGURES, pngs
    for name in sorted(pngs):
        assert_real_png(out / f"{name}.png")
    assert not list(out.glob("*.tmp-*"))

    ssp, lbfgs = (records(runs[k], "summary")[-1] for k in ("ssp", "lbfgs"))
    rows = {r["run"]: r for r in table_rows(load_runs([runs["ssp"], runs["lbfgs"]]))}
    for name, s in (("ssp", ssp), ("lbfgs", lbfgs)):
        row = rows[name]
        assert row["strategy"] == s["strategy"] and row["status"] == "finished"
        for key in ("step", "test_accuracy", "test_loss", "train_s", "wall_s",
                    "examples_per_s"):
            assert row[key] == s[key], (name, key)
    assert rows["ssp"]["layout"] == "4 ranks: 1 server, 3 replicas"
    assert rows["lbfgs"]["layout"] == "3 ranks: 1 server + coordinator, 1 replica"
    table = (out / "summary.md").read_text()
    for s in (ssp, lbfgs):
        cells = [f"{s['test_accuracy']:.2%}", f"{s['test_loss']:.4f}", f"{s['train_s']:.1f}",
                 f"{s['examples_per_s']:.0f}", s["strategy"]]
        line = next(ln for ln in table.splitlines() if f" {s['strategy']} " in ln)
        for cell in cells:
            assert f" {cell} " in line, (cell, line)
        assert line in printed


def test_only_figures_some_run_has_data_for(runs):
    def names(*dirs):
        return {fig.name for fig, _ in plan_figures([load_run(d) for d in dirs])}

    common = {"loss", "accuracy", "examples_per_s", "bytes_per_step", "staleness"}
    assert names(runs["ssp"]) == common | {"compression", "ssp_waits"}
    assert names(runs["lbfgs"]) == common | {"lbfgs_step_length"}
    # a panel holds only the runs with its data: step lengths are sandblaster's alone
    plans = dict((fig.name, panels) for fig, panels in
                 plan_figures([load_run(runs["ssp"]), load_run(runs["lbfgs"])]))
    (steps,) = plans["lbfgs_step_length"]
    assert [line.run for line in steps.lines] == [1]
    assert len(steps.lines[0].xs) == len([r for r in records(runs["lbfgs"], "progress")
                                          if "step_length" in r])


def test_a_killed_run_is_read_up_to_its_cut_line(runs, tmp_path, capsys):
    killed = tmp_path / "killed"
    killed.mkdir()
    lines = (runs["ssp"] / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "summary"
    body = lines[:-1]
    body.insert(2, "this line is not JSON")
    (killed / "metrics.jsonl").write_text("\n".join(body) + "\n" + lines[-1][:40])
    assert main([str(killed), "--out", str(tmp_path / "out"), "--no-figures"]) == 0
    captured = capsys.readouterr()
    assert f"skipped line {len(body) + 1}, cut short" in captured.err
    assert "skipped line 3: not JSON" in captured.err
    (row,) = table_rows([load_run(killed)])
    last_eval = records(runs["ssp"], "eval")[-1]
    assert row["status"] == "no summary (stopped?)" and row["train_s"] is None
    assert row["test_accuracy"] == last_eval["test_accuracy"]
    assert row["step"] == max(r["step"] for r in map(json.loads, lines[:-1]) if "step" in r)
    assert "no summary (stopped?)" in captured.out


def test_resumed_run_counts_time_on_and_adds_up(tmp_path):
    """A resume into the same run directory appends a second start..summary segment."""
    seg = [{"kind": "start", "time_s": 0.0, "ranks": 2, "config": {"strategy": "sync"}},
           {"kind": "progress", "time_s": 1.0, "step": 100, "loss": 1.0},
           {"kind": "summary", "time_s": 2.0, "strategy": "sync", "step": 100, "ranks": 2,
            "servers": 0, "replicas": 2, "partitions": 1, "train_s": 1.5, "wall_s": 2.0,
            "examples_per_s": 1000.0, "test_accuracy": 0.5, "test_loss": 1.2}]
    again = [dict(r) for r in seg]
    again[0]["time_s"], again[1]["time_s"], again[2]["time_s"] = 0.5, 1.5, 3.0
    again[1]["step"] = again[2]["step"] = 200
    again[2].update(train_s=0.5, wall_s=3.0, examples_per_s=3000.0, test_accuracy=0.75)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seg + again))
    run = load_run(tmp_path)
    assert run.times == [0.0, 1.0, 2.0, 2.5, 3.5, 5.0]
    (row,) = table_rows([run])
    assert row["step"] == 200 and row["test_accuracy"] == 0.75 and row["status"] == "finished"
    assert row["train_s"] == 2.0 and row["wall_s"] == 5.0
    assert row["examples_per_s"] == pytest.approx((1000 * 1.5 + 3000 * 0.5) / 2.0)
    # the last segment stopped by a signal: its summary says so, and so does the status;
    # an earlier segment's stop does not count
    seg[2]["stopped_early"] = True
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seg + again))
    assert table_rows([load_run(tmp_path)])[0]["status"] == "finished"
    again[2]["stopped_early"] = True
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seg + again))
    assert table_rows([load_run(tmp_path)])[0]["status"] == "stopped early"


def test_directories_without_metrics_are_refused(runs, tmp_path, capsys):
    parent = tmp_path / "runs"
    shutil.copytree(runs["lbfgs"], parent / "lbfgs")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    cases = [
        (tmp_path / "missing", "run directory", "not found"),
        (parent, "has no metrics.jsonl", "it holds run directories lbfgs"),
        (runs["lbfgs"] / "metrics.jsonl", "is not a directory", "--run-dir"),
        (empty, "holds no metrics record", "metrics.jsonl"),
    ]
    for path, *words in cases:
        assert main([str(path), "--out", str(tmp_path / "out")]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("hpcps.report: error: "), err
        for w in words:
            assert w in err, (w, err)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def report_without_matplotlib(*args: str) -> subprocess.CompletedProcess:
    """The command in a Python where ``import matplotlib`` fails, as when it is not installed."""
    code = ("import sys; sys.modules['matplotlib'] = None; from hpcps.tools.report import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_without_matplotlib_the_table_is_written_and_the_fix_named(runs, tmp_path):
    out = tmp_path / "out"
    proc = report_without_matplotlib(str(runs["ssp"]), "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert 'pip install "hpcps[report]"' in proc.stderr and "--no-figures" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "summary.md").exists() and not list(out.glob("*.png"))
    assert "| downpour" in proc.stdout
    proc = report_without_matplotlib(str(runs["ssp"]), "--out", str(out), "--no-figures")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _segmented_metrics(path):
    """Records of a run stopped on SIGUSR1 at step 300 and resumed by --resume auto, whose
    second segment was then killed (no stop, no summary) and resumed from step 400."""
    def rec(kind, t, **kw):
        return {"kind": kind, "time_s": t, **kw}
    seg1 = [rec("start", 0.0, ranks=2, config={"strategy": "sync"}, start_step=0),
            *(rec("progress", 1.0 + i, step=100 * (i + 1), loss=2.0 - 0.3 * i) for i in range(3)),
            rec("eval", 3.5, step=300, test_accuracy=0.6, test_loss=1.4),
            rec("stop", 3.6, step=300, signal="SIGUSR1", reason="SIGUSR1 received"),
            rec("summary", 4.0, strategy="sync", step=300, stopped_early=True, ranks=2,
                servers=0, replicas=2, partitions=1, train_s=3.5, wall_s=4.0,
                examples_per_s=900.0, test_accuracy=0.6, test_loss=1.4)]
    seg2 = [rec("start", 0.0, ranks=2, config={"strategy": "sync"}, start_step=300,
                resume_auto=True),
            rec("progress", 1.0, step=400, loss=1.0), rec("progress", 2.0, step=450, loss=0.9)]
    seg3 = [rec("start", 0.0, ranks=2, config={"strategy": "sync"}, start_step=400,
                resume_auto=True),
            rec("progress", 1.0, step=500, loss=0.8),
            rec("summary", 2.0, strategy="sync", step=600, ranks=2, servers=0, replicas=2,
                partitions=1, train_s=1.5, wall_s=2.0, examples_per_s=1000.0,
                test_accuracy=0.8, test_loss=0.7)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in seg1 + seg2 + seg3))
    return path


def test_preemption_segments_are_marked(runs, tmp_path):
    from hpcps.tools.report import preemptions
    seg = load_run(_segmented_metrics(tmp_path / "preempted"))
    marks = [(m.kind, m.step, m.text) for m in preemptions(seg)]
    assert marks == [("stopped", 300.0, "stopped on SIGUSR1"),
                     ("resumed", 300.0, "resumed (--resume auto) at step 300"),
                     ("killed", 450.0, "killed after step 450"),
                     ("resumed", 400.0, "resumed (--resume auto) at step 400")]
    assert preemptions(load_run(runs["ssp"])) == []
    # on a time axis, the marks sit on the run's cumulative clock: the stop at 3.6 s, the
    # first resume where the first segment ended (4.0 s), the kill at its last record (6.0 s)
    times = [m.time for m in preemptions(seg)]
    assert times == [3.6, 4.0, 6.0, 6.0]
    plans = dict((f.name, p) for f, p in plan_figures([load_run(runs["ssp"]), seg]))
    step_panel, time_panel = plans["loss"]
    assert [(i, x, m.kind) for i, x, m in step_panel.marks] == [
        (1, 300.0, "stopped"), (1, 300.0, "resumed"), (1, 450.0, "killed"),
        (1, 400.0, "resumed")]
    assert [x for _, x, _ in time_panel.marks] == times
    out = tmp_path / "out"
    assert main([str(runs["ssp"]), str(tmp_path / "preempted"), "--out", str(out),
                 "--no-figures"]) == 0
    both = [load_run(runs["ssp"]), seg]
    (loss,) = [(f, p) for f, p in plan_figures(both) if f.name == "loss"]
    draw([loss], both, out)  # one figure: drawing them all is slow on a loaded machine
    assert_real_png(out / "loss.png")
    summary = (out / "summary.md").read_text()
    assert "preempted/metrics.jsonl; stopped on SIGUSR1; resumed (--resume auto) at step 300" \
        in summary


def test_sandblaster_progress_says_how_far_along(runs):
    """Sandblaster's progress records carry done_pct and eta_s like the SGD strategies'."""
    prog = records(runs["lbfgs"], "progress")
    assert prog and all("done_pct" in r and "eta_s" in r for r in prog), prog
    assert prog[-1]["done_pct"] == 100.0 and prog[-1]["eta_s"] == 0.0
    assert [r["done_pct"] for r in prog] == sorted(r["done_pct"] for r in prog)
