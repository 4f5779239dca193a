"""``python -m hpcps.report``: figures and a summary table from real runs' metrics.

Two real runs on digits cover every figure: downpour with compressed pushes and a staleness
bound (compression, SSP waits, staleness) and sandblaster (L-BFGS step lengths).
"""
from __future__ import annotations

import io
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
    assert pngs == ALL_FIGURES - {"auc"}, pngs  # AUC: binary models' (test_ctr_server.py)
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
    # a stop recorded before the end: where and why, and whether its checkpoint was written
    cut = [json.loads(line) for line in lines[:-1] if line.startswith("{")]
    step = max(r["step"] for r in cut if "step" in r)
    for kept in (False, True):
        ended = cut + [{"kind": "stop", "time_s": 9.0, "step": step, "signal": None,
                        "reason": "a collective failed: waited 15 s"}]
        if kept:
            ended.append({"kind": "checkpoint", "time_s": 9.1, "step": step, "path": "c.h5"})
        (killed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ended))
        (row,) = table_rows([load_run(killed)])
        assert row["status"] == (f"stopping at step {step} (a failure"
                                 f"{', checkpointed' if kept else ''}), no summary")
    ended[-2]["signal"] = "SIGTERM"
    (killed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ended))
    assert table_rows([load_run(killed)])[0]["status"] == (
        f"stopping at step {step} (SIGTERM, checkpointed), no summary")


METRICS_ONTO_A_FULL_DISK = """
import io, json, resource, signal, sys
from hpcps.runtime.metrics import Metrics
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
log = Metrics(sys.argv[1], stream=io.StringIO())
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))  # the disk fills
for step in range(40):
    log.record("progress", echo=False, step=step, pad="x" * 50)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
log.record("summary", echo=False, step=40)  # room again
log.close()
"""


def test_metrics_onto_a_full_disk_warn_once_and_write_again_when_there_is_room(tmp_path):
    """A full disk (a file-size limit, lifted later) does not end the run: one warning with
    the reason, one when records are written again, and the file holds the records written
    before and after, each on a line of its own (the one cut short alone lost)."""
    run = subprocess.run([sys.executable, "-c", METRICS_ONTO_A_FULL_DISK, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    path = tmp_path / "metrics.jsonl"
    warned = run.stderr.splitlines()
    assert len(warned) == 2, warned
    assert warned[0].startswith(f"hpcps: warning: cannot write {path}: File too large; "
                                "training goes on"), warned
    lines = path.read_text().splitlines()
    kept = [json.loads(line) for line in lines if line.endswith("}")]
    assert len(lines) - len(kept) <= 1  # the record the limit cut
    steps = [r["step"] for r in kept]
    assert steps[-1] == 40 and kept[-1]["kind"] == "summary"
    assert steps[:-1] == list(range(len(steps) - 1)) and 10 < len(steps) < 40, steps
    missing = 40 - (len(steps) - 1)
    assert warned[1] == (f"hpcps: warning: writing {path} again: {missing} record(s) are "
                         "missing from it"), warned


def test_a_resumed_run_appends_after_a_record_cut_short_without_losing_its_own(tmp_path):
    """The run before was killed while it wrote a record (no newline at the end of the file):
    the resumed run's first record goes on a line of its own, so only the torn one is lost."""
    from hpcps.runtime.metrics import Metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "start", "time_s": 0.0}\n{"kind": "progress", "ti')
    log = Metrics(tmp_path, stream=io.StringIO())
    log.record("resume", echo=False, step=3)
    log.record("summary", echo=False, step=5)
    lines = path.read_text().splitlines()
    assert lines[1] == '{"kind": "progress", "ti'
    assert [json.loads(line)["kind"] for line in lines[2:]] == ["resume", "summary"]
    run = load_run(tmp_path)
    assert any("skipped line 2: not JSON" in note for note in run.notes), run.notes
    assert [r["kind"] for r in run.records] == ["start", "resume", "summary"]


def test_the_layout_names_spares_and_a_coordinator_apart(tmp_path):
    """A downpour run of 6 ranks with 2 shards, 3 replicas and a spare: its layout names the
    spare (one extra rank read as a coordinator before); sandblaster's extra rank is its
    coordinator."""
    def layout(name, **summary):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"kind": "summary", "partitions": 1, "step": 9,
                                                     **summary}) + "\n")
        return table_rows([load_run(d)])[0]["layout"]

    assert layout("spare", strategy="downpour", ranks=6, servers=2, replicas=3, spares=1) == \
        "6 ranks: 2 servers, 3 replicas, 1 spare"
    assert layout("sb", strategy="sandblaster", ranks=4, servers=1, replicas=2, spares=0) == \
        "4 ranks: 1 server + coordinator, 2 replicas"


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


# ---------------------------------------------------------------------------------------------
# --csv and --tensorboard: the curves as data


def _write_metrics(path, recs):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _curves_metrics(path):
    """A run's records by hand: a progress record without a loss yet, an evaluation at a
    progress record's step, one at a step of its own, one written after a later progress
    record, validation figures, an AUC, a field of one record only, and records that are not
    curves (checkpoint, warning, summary)."""
    def rec(kind, t, **kw):
        return {"kind": kind, "time_s": t, **kw}
    return _write_metrics(path, [
        rec("start", 0.1, ranks=3, config={"strategy": "downpour"}, start_step=0),
        rec("progress", 1.0, step=0, epoch=0.0, examples_per_s=0.0, loss=None, done_pct=0.0,
            eta_s=None, staleness=0.0, bytes_per_step=100),
        rec("progress", 2.0, step=100, epoch=1.5, examples_per_s=800.5, loss=1.25,
            done_pct=50.0, eta_s=2.0, staleness=0.5, bytes_per_step=100),
        rec("eval", 2.1, step=100, epoch=1.5, split="val", val_loss=1.5, val_accuracy=0.625),
        rec("checkpoint", 2.2, step=100, path="x/checkpoint.h5"),
        rec("eval", 2.5, step=150, epoch=2.25, split="test", test_loss=1.0,
            test_accuracy=0.75, test_auc=0.875),
        rec("progress", 3.0, step=200, epoch=3.0, examples_per_s=900.0, loss=0.75,
            done_pct=100.0, eta_s=0.0, staleness=1.0, bytes_per_step=100, clock_lead_max=2),
        rec("eval", 3.1, step=50, epoch=0.75, split="val", val_loss=2.0, val_accuracy=0.5),
        rec("warning", 3.2, reason="diverging", loss=9.0),
        rec("summary", 3.5, strategy="downpour", step=200, test_accuracy=0.8, test_loss=0.7),
    ])


def _read_csv(path):
    import csv
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        return header, [dict(zip(header, row)) for row in reader]


def _value(cell):
    return int(cell) if cell.lstrip("-").isdigit() else float(cell)


def assert_csv_holds_records(path, run_dir):
    """Every number of every progress and eval record is in the CSV, on the row of its step
    and segment, with its exact value; every cell comes from such a record; rows by step."""
    header, rows = _read_csv(path)
    assert header[:4] == ["step", "epoch", "time_s", "segment"], header
    recs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    segment, expected_cells = 0, 0
    used = set()
    for rec in recs:
        segment += rec["kind"] == "start"
        if rec["kind"] not in ("progress", "eval"):
            continue
        figures = {k: v for k, v in rec.items() if k not in ("kind", "step", "epoch", "time_s")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert set(figures) <= set(header), (set(figures) - set(header), header)
        matches = [i for i, row in enumerate(rows)
                   if _value(row["step"]) == rec["step"] and int(row["segment"]) == segment
                   and all(row[k] != "" and _value(row[k]) == v for k, v in figures.items())]
        assert matches, (rec, rows)
        used.add(matches[0])
        expected_cells += len(figures)
    assert used == set(range(len(rows))), "rows that hold no record"
    numeric = set(header) - {"step", "epoch", "time_s", "segment"}
    assert sum(row[k] != "" for row in rows for k in numeric) == expected_cells
    steps = [_value(row["step"]) for row in rows]
    assert steps == sorted(steps)


def test_csv_rows_and_columns_are_the_records(tmp_path, capsys):
    run_dir = _curves_metrics(tmp_path / "hand")
    out = tmp_path / "curves"
    assert main([str(run_dir), "--out", str(tmp_path / "out"), "--no-figures",
                 "--csv", str(out)]) == 0
    assert str(out / "hand.csv") in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["hand.csv"]
    header, rows = _read_csv(out / "hand.csv")
    assert header == ["step", "epoch", "time_s", "segment", "examples_per_s", "loss",
                      "done_pct", "eta_s", "staleness", "bytes_per_step", "val_loss",
                      "val_accuracy", "test_loss", "test_accuracy", "test_auc",
                      "clock_lead_max"]
    table = [[row[c] for c in header] for row in rows]
    assert table == [
        ["0", "0.0", "1.0", "1", "0.0", "", "0.0", "", "0.0", "100", "", "", "", "", "", ""],
        ["50", "0.75", "3.1", "1", "", "", "", "", "", "", "2.0", "0.5", "", "", "", ""],
        ["100", "1.5", "2.0", "1", "800.5", "1.25", "50.0", "2.0", "0.5", "100", "1.5", "0.625",
         "", "", "", ""],
        ["150", "2.25", "2.5", "1", "", "", "", "", "", "", "", "", "1.0", "0.75", "0.875", ""],
        ["200", "3.0", "3.0", "1", "900.0", "0.75", "100.0", "0.0", "1.0", "100", "", "", "",
         "", "", "2"],
    ]
    assert_csv_holds_records(out / "hand.csv", run_dir)


def test_csv_of_a_resumed_run_counts_segments_and_time_on(tmp_path):
    """A step trained again after a resume from an earlier checkpoint has a row per segment;
    time_s goes on across segments, as on the report's time axis."""
    def rec(kind, t, **kw):
        return {"kind": kind, "time_s": t, **kw}
    run_dir = _write_metrics(tmp_path / "resumed", [
        rec("start", 0.0, start_step=0), rec("progress", 1.0, step=100, loss=2.0),
        rec("progress", 2.0, step=200, loss=1.5),  # killed here
        rec("start", 0.0, start_step=100, resume_auto=True),
        rec("progress", 1.5, step=200, loss=1.4), rec("eval", 1.6, step=200, test_loss=1.3),
        rec("summary", 2.0, step=200)])
    out = tmp_path / "csv"
    assert main([str(run_dir), "--out", str(tmp_path / "out"), "--no-figures",
                 "--csv", str(out)]) == 0
    header, rows = _read_csv(out / "resumed.csv")
    assert header == ["step", "epoch", "time_s", "segment", "loss", "test_loss"]
    assert [[row[c] for c in header] for row in rows] == [
        ["100", "", "1.0", "1", "2.0", ""], ["200", "", "2.0", "1", "1.5", ""],
        ["200", "", "3.5", "2", "1.4", "1.3"]]
    assert_csv_holds_records(out / "resumed.csv", run_dir)


def test_csv_of_real_runs(runs, tmp_path):
    out = tmp_path / "csv"
    assert main([str(runs["ssp"]), str(runs["lbfgs"]), "--out", str(tmp_path / "out"),
                 "--no-figures", "--csv", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["lbfgs.csv", "ssp.csv"]
    for name in ("ssp", "lbfgs"):
        assert_csv_holds_records(out / f"{name}.csv", runs[name])
    header, _ = _read_csv(out / "ssp.csv")
    assert {"loss", "examples_per_s", "staleness", "test_accuracy", "test_loss",
            "clock_lead_max", "bytes_per_step"} <= set(header), header
    assert "step_length" in _read_csv(out / "lbfgs.csv")[0]


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(run_tb_dir):
    """Every Event of the one event file in ``run_tb_dir``, from the TFRecord framing (uint64
    length, uint32 masked CRC-32C of the length, the data, uint32 masked CRC-32C of the
    data), each CRC checked."""
    import struct

    from tensorboardX.proto.event_pb2 import Event
    assert _crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    (path,) = run_tb_dir.glob("events.out.tfevents.*")
    blob, pos, events = path.read_bytes(), 0, []
    while pos < len(blob):
        header = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        assert length_crc == _masked_crc(header), (path, pos)
        data = blob[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length:pos + 16 + length])
        assert len(data) == length and data_crc == _masked_crc(data), (path, pos)
        events.append(Event.FromString(data))
        pos += 16 + length
    assert pos == len(blob)
    return events


def expected_scalars(run_dir):
    """(tag, step, value as float32) of every number of the progress and eval records."""
    sections = {"examples_per_s": "speed", "bytes_per_step": "comm", "compression": "comm",
                "bytes_sent_per_step": "comm", "updates_per_step": "comm",
                "coordinator_bytes": "comm", "commands": "comm", "batch_s": "speed",
                "tau": "comm", "density": "comm", "residual_norm": "comm",
                "epoch": "progress", "done_pct": "progress", "eta_s": "progress",
                "iteration": "progress", "evaluations": "progress"}
    out = []
    for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if rec["kind"] not in ("progress", "eval"):
            continue
        for k, v in rec.items():
            if k in ("kind", "step", "time_s") or (rec["kind"] == "eval" and k == "epoch"):
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tag = f"eval/{k}" if rec["kind"] == "eval" else f"{sections.get(k, 'train')}/{k}"
                out.append((tag, rec["step"], float(np.float32(v))))
    return sorted(out)


def scalars_in(events):
    return sorted((v.tag, e.step, v.simple_value) for e in events if e.HasField("summary")
                  for v in e.summary.value)


def test_tensorboard_event_files_hold_every_scalar_at_its_step(runs, tmp_path, capsys):
    hand = _curves_metrics(tmp_path / "hand")
    tb = tmp_path / "tb"
    assert main([str(hand), str(runs["ssp"]), str(runs["lbfgs"]), "--out",
                 str(tmp_path / "out"), "--no-figures", "--tensorboard", str(tb)]) == 0
    assert f"{tb / 'hand'}" in capsys.readouterr().out
    assert sorted(p.name for p in tb.iterdir()) == ["hand", "lbfgs", "ssp"]
    events = read_events(tb / "hand")
    assert events[0].file_version == "brain.Event:2"
    got = scalars_in(events)
    assert got == expected_scalars(hand)
    assert ("train/loss", 100, 1.25) in got and ("eval/test_accuracy", 150, 0.75) in got
    assert ("speed/examples_per_s", 200, 900.0) in got and ("eval/val_loss", 50, 2.0) in got
    assert ("progress/epoch", 100, 1.5) in got and ("comm/bytes_per_step", 0, 100.0) in got
    assert ("train/staleness", 100, 0.5) in got and ("train/clock_lead_max", 200, 2.0) in got
    assert not any(tag == "train/loss" and step == 0 for tag, step, _ in got)  # null: absent
    # wall time: seconds since the run started, as the records say
    times = {(v.tag, e.step): e.wall_time for e in events for v in e.summary.value}
    assert times[("eval/val_accuracy", 50)] == pytest.approx(3.1)
    for name in ("ssp", "lbfgs"):
        got = scalars_in(read_events(tb / name))
        assert got == expected_scalars(runs[name]) and len(got) > 20, name
    # exported again: the event files are replaced, not added to (an earlier export's file,
    # named by the second it was written in)
    (old,) = (tb / "hand").glob("events.out.tfevents.*")
    old.rename(tb / "hand" / "events.out.tfevents.1000000000.elsewhere")
    assert main([str(hand), "--out", str(tmp_path / "out"), "--no-figures",
                 "--tensorboard", str(tb)]) == 0
    assert scalars_in(read_events(tb / "hand")) == expected_scalars(hand)


def test_runs_of_one_name_get_files_of_their_own(tmp_path):
    a = _curves_metrics(tmp_path / "a" / "run")
    b = _curves_metrics(tmp_path / "b" / "run")
    out = tmp_path / "csv"
    assert main([str(a), str(b), "--out", str(tmp_path / "out"), "--no-figures",
                 "--csv", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a_run.csv", "b_run.csv"]


def test_csv_and_tensorboard_refusals(tmp_path, capsys):
    run_dir = _curves_metrics(tmp_path / "hand")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "csv-taken" / "hand.csv").mkdir(parents=True)
    (tmp_path / "tb-taken").mkdir()
    (tmp_path / "tb-taken" / "hand").write_text("x")
    (tmp_path / "no-metrics").mkdir()
    out = tmp_path / "out"
    cases = [
        ([str(tmp_path / "no-metrics"), "--csv", str(tmp_path / "c")],
         ["has no metrics.jsonl"]),
        ([str(tmp_path / "no-metrics"), "--tensorboard", str(tmp_path / "t")],
         ["has no metrics.jsonl"]),
        ([str(run_dir), "--csv", str(tmp_path / "a-file")],
         ["--csv", "a-file exists and is not a directory"]),
        ([str(run_dir), "--tensorboard", str(tmp_path / "a-file")],
         ["--tensorboard", "a-file exists and is not a directory"]),
        ([str(run_dir), "--csv", str(tmp_path / "csv-taken")], ["hand.csv is a directory"]),
        ([str(run_dir), "--tensorboard", str(tmp_path / "tb-taken")],
         ["hand exists and is not a directory"]),
    ]
    for args, words in cases:
        assert main([*args, "--out", str(out), "--no-figures"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("hpcps.report: error: ") and err.count("\n") == 1, err
        for w in words:
            assert w in err, (w, err)
        assert not out.exists() and not (tmp_path / "c").exists() \
            and not (tmp_path / "t").exists(), args  # refused before anything was written
    assert (tmp_path / "a-file").read_text() == "x"
    assert (tmp_path / "tb-taken" / "hand").read_text() == "x"
    # a directory that cannot be created (its parent is a file)
    assert main([str(run_dir), "--out", str(out), "--no-figures",
                 "--csv", str(tmp_path / "a-file" / "csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcps.report: error: cannot create --csv ") and "a-file" in err, err


def test_tensorboard_without_tensorboardx_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    run_dir = _curves_metrics(tmp_path / "hand")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as when it is not installed
    out, tb = tmp_path / "out", tmp_path / "tb"
    assert main([str(run_dir), "--out", str(out), "--tensorboard", str(tb)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpcps.report: error: --tensorboard "), err
    assert 'pip install "hpcps[tensorboard]"' in err and "Traceback" not in err, err
    assert not out.exists() and not tb.exists()
    # --csv needs nothing extra
    assert main([str(run_dir), "--out", str(out), "--no-figures",
                 "--csv", str(tmp_path / "csv")]) == 0
    assert (tmp_path / "csv" / "hand.csv").exists()
