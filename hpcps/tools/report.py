"""Figures and a summary table from the metrics of one or more training runs.

Usage::

    python -m hpcps.report runs/downpour-1 runs/sync-1 --out report
    python -m hpcps.report runs/* --no-figures        # the table only (needs no matplotlib)

Each RUN_DIR is a run directory of ``hpcps.train`` (``--run-dir``); its ``metrics.jsonl``
holds one JSON record per line (:mod:`hpcps.runtime.metrics`): ``start`` (config, dataset, ranks),
``progress`` (step, loss, examples/s, bytes per step, staleness and the strategy's own
figures), ``eval`` (test accuracy and loss), ``checkpoint`` and ``summary`` (the run's final
figures). A run resumed into the same directory appends a new ``start`` ... ``summary``
segment; its wall time is counted on from where the previous segment stopped. Where a run was
stopped (a ``stop`` record: SIGTERM or SIGUSR1), killed (a segment with neither a stop nor a
summary) and resumed (each later ``start``) is marked in every figure drawn against step or
time, as a vertical line in the run's colour (:func:`preemptions`), and listed in
``summary.md``.

Written to ``--out`` (default ``report`` in the current directory):

``summary.md``
    One row per run: strategy, layout of ranks, status (finished; stopped early by a signal,
    checkpointed; or no summary: killed or still running), global step, final test accuracy
    and loss, training and wall time, and examples/s (over all segments of a resumed run).
    The same table is printed.
``*.png``
    Figures overlaying the runs (one colour per run), each written only when some run has
    its figures: ``loss`` (training loss from progress records, test loss from evaluations,
    against step and against wall time), ``accuracy`` (test accuracy, likewise),
    ``examples_per_s``, ``bytes_per_step`` and ``staleness`` (progress over steps beside
    each run's summary value), ``compression`` (deadreckon's and compressed downpour's ratio
    to dense messages), ``lbfgs_step_length`` (sandblaster's line-search step per
    iteration) and ``ssp_waits`` (downpour with ``--staleness-bound``: the largest clock
    lead over steps, fetches held and seconds held per shard). :data:`FIGURES` declares them.

Written only when asked for:

``--csv DIR``: ``DIR/<run>.csv``
    Each run's curves, one row per progress or eval record (an evaluation on the row of the
    progress record at its step), ordered by step: columns ``step``, ``epoch``, ``time_s``,
    ``segment`` and every numeric field of those records (:func:`curve_rows`).
``--tensorboard DIR``: ``DIR/<run>/events.out.tfevents.*``
    The same figures as TensorBoard scalars at their global step, tagged ``train/loss``,
    ``eval/test_accuracy``, ``speed/examples_per_s``, ... (:func:`scalars`,
    :func:`scalar_tag`); needs tensorboardX (``pip install "hpcps[tensorboard]"``; without it
    the option is refused, exit 2, before anything is written).

``<run>`` is the run's label with characters other than letters, digits, ``.``, ``_`` and
``-`` replaced (:func:`output_names`).

A cut last line (a run killed while writing it) is skipped with a note, as is any other line
that is not a JSON record; a directory without ``metrics.jsonl`` is refused
(:class:`ConfigError`, exit 2). Figures need matplotlib (``pip install "hpcps[report]"``);
drawn on :class:`matplotlib.figure.Figure` objects, never through pyplot, so no display and no
global state is involved (PNG output goes through the Agg renderer). Without matplotlib the
table is still written, then the command says how to install it and exits with code 1.

:func:`load_run`, :func:`table_rows`, :func:`curve_rows` and :func:`plan_figures` read and
decide without matplotlib; :func:`draw` alone imports it, :func:`write_tensorboard` alone
tensorboardX.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcps.errors import ConfigError, HpcpsError

METRICS_FILE = "metrics.jsonl"
INSTALL_HINT = 'pip install "hpcps[report]"'
TENSORBOARD_HINT = 'pip install "hpcps[tensorboard]"'


class MissingDependency(HpcpsError):
    """An optional package a command needs is not installed (exit code 1)."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------
# reading runs


@dataclass
class Run:
    """One run directory's records.

    Attributes
    ----------
    path : Path
        The run directory.
    label : str
        Its name in legends and the table (the directory name, made unique).
    records : list of dict
        The parsed records, in file order.
    times : list of float
        Wall time of each record since the run first started, counted across resumed
        segments (each segment's ``time_s`` restarts at 0).
    notes : list of str
        What was skipped while reading, for the user.
    """

    path: Path
    label: str
    records: list[dict]
    times: list[float]
    notes: list[str] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def last(self, kind: str) -> dict | None:
        found = self.of_kind(kind)
        return found[-1] if found else None

    @property
    def strategy(self) -> str:
        for rec in reversed(self.records):
            if rec.get("kind") == "summary" and isinstance(rec.get("strategy"), str):
                return rec["strategy"]
            if rec.get("kind") == "start" and isinstance(rec.get("config"), dict):
                return str(rec["config"].get("strategy", "?"))
        return "?"


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Parse a ``metrics.jsonl``; return its records and notes on the lines skipped.

    A last line without its newline that does not parse is a record cut short (the run was
    killed while writing it); other lines that are not a JSON object with a ``kind`` are
    skipped too, each with a note naming its line number.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    lines = text.split("\n")
    cut = lines[-1] != ""  # "a\nb\n" splits into [..., ""]: a complete last line
    if not cut:
        lines.pop()
    records, notes = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            if cut and number == len(lines):
                notes.append(f"{path}: skipped line {number}, cut short (the run was stopped "
                             f"while writing it): {line[:60]!r}")
            else:
                notes.append(f"{path}: skipped line {number}: not JSON ({exc})")
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
            notes.append(f"{path}: skipped line {number}: not a metrics record (no 'kind')")
            continue
        records.append(rec)
    return records, notes


def _cumulative_times(records: list[dict]) -> list[float]:
    times, offset, last = [], 0.0, 0.0
    for i, rec in enumerate(records):
        t = rec.get("time_s")
        t = float(t) if _number(t) else last
        if rec.get("kind") == "start" and i > 0:
            offset += last  # a resumed segment: its clock restarts
            last = 0.0
        last = max(last, t)
        times.append(offset + t)
    return times


def load_run(run_dir: str | os.PathLike, label: str | None = None) -> Run:
    """Read a run directory's ``metrics.jsonl``.

    Raises
    ------
    ConfigError
        If the directory does not exist, has no ``metrics.jsonl`` (the message names run
        directories found inside it, if any), or holds no readable record.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ConfigError(f"run directory {path} not found")
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory: pass the run directory that holds "
                          f"{METRICS_FILE} (hpcps.train --run-dir)")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        inside = sorted(p.parent.name for p in path.glob(f"*/{METRICS_FILE}"))
        hint = (f"; it holds run directories {', '.join(inside[:5])}"
                f"{', ...' if len(inside) > 5 else ''}: pass those") if inside else ""
        raise ConfigError(f"{path} has no {METRICS_FILE}: not an hpcps run directory (hpcps.train "
                          f"writes one into its --run-dir){hint}")
    records, notes = read_metrics(metrics)
    if not records:
        raise ConfigError(f"{metrics} holds no metrics record" + (f" ({notes[-1]})" if notes
                                                                  else ""))
    return Run(path=path, label=label or path.resolve().name, records=records,
               times=_cumulative_times(records), notes=notes)


def load_runs(run_dirs: list[str | os.PathLike]) -> list[Run]:
    """:func:`load_run` of each directory, labels made unique (a parent's name is prefixed to
    directory names that repeat; a number is appended when that does not separate them)."""
    paths = [Path(p) for p in run_dirs]
    names = [p.resolve().name for p in paths]
    labels = []
    for p, name in zip(paths, names):
        labels.append(f"{p.resolve().parent.name}/{name}" if names.count(name) > 1 else name)
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label} #{labels[:i + 1].count(label)}"
    return [load_run(p, label) for p, label in zip(paths, labels)]


@dataclass(frozen=True)
class Mark:
    """A point where a run was interrupted or continued, from its records.

    ``kind``: ``stopped`` (a ``stop`` record: SIGTERM or SIGUSR1, checkpoint written),
    ``killed`` (a segment that ended with neither a stop nor a summary record: its last
    record), or ``resumed`` (a ``start`` record after the first: ``--resume``, its start
    step). ``step`` may be None where the records hold none; ``time`` is on the run's
    cumulative clock (:attr:`Run.times`).
    """

    kind: str
    step: float | None
    time: float
    text: str


def preemptions(run: Run) -> list[Mark]:
    """Where ``run`` was stopped, killed and resumed, in order (empty for one segment)."""
    marks: list[Mark] = []
    started = ended = False  # a start seen; the current segment ended (stop or summary)
    last_step, last_time = None, 0.0
    for rec, t in zip(run.records, run.times):
        kind = rec.get("kind")
        if kind == "start":
            if started:
                if not ended:
                    marks.append(Mark("killed", last_step, last_time,
                                      "killed" + (f" after step {last_step:g}"
                                                  if last_step is not None else "")))
                step = rec.get("start_step")
                step = float(step) if _number(step) else None
                how = " (--resume auto)" if rec.get("resume_auto") else ""
                marks.append(Mark("resumed", step, t, "resumed" + how + (
                    f" at step {step:g}" if step is not None else "")))
            started, ended = True, False
        elif kind == "stop":
            step = float(rec["step"]) if _number(rec.get("step")) else last_step
            sig = rec.get("signal")
            marks.append(Mark("stopped", step, t, f"stopped on {sig}" if sig else "stopped"))
            ended = True
        elif kind == "summary":
            ended = True
        if _number(rec.get("step")):
            last_step = float(rec["step"])
        last_time = t
    return marks


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------------------------------------
# the summary table


def _layout(run: Run) -> str:
    s = run.last("summary")
    if s is not None and all(_number(s.get(k)) for k in ("ranks", "replicas", "partitions")):
        parts = []
        if s.get("servers"):
            # a rank beyond the servers and the replicas' partitions is a coordinator
            extra = s["ranks"] - s["servers"] - s["replicas"] * s["partitions"]
            coordinator = " + coordinator" if extra == 1 else ""
            parts.append(f"{s['servers']} server{'s' if s['servers'] != 1 else ''}{coordinator}")
        parts.append(f"{s['replicas']} replica{'s' if s['replicas'] != 1 else ''}"
                     + (f" x {s['partitions']} partitions" if s["partitions"] > 1 else ""))
        if _number(s.get("threads")) and s["threads"] > 1:
            parts.append(f"{s['threads']} threads")
        return f"{s['ranks']} ranks: " + ", ".join(parts)
    start = run.last("start")
    if start is not None and _number(start.get("ranks")):
        return f"{start['ranks']} ranks"
    return "?"


def table_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict per run: the table's values, unformatted (None where unknown).

    ``step``, ``test_accuracy`` and ``test_loss`` are the last summary's; a run without one
    (killed, or still running) shows its last evaluation and the last step recorded.
    ``train_s`` and ``wall_s`` add up every segment's summary; ``examples_per_s`` is their
    examples over their training time (one summary: its own figure).
    """
    rows = []
    for run in runs:
        summaries = run.of_kind("summary")
        row: dict[str, Any] = {"run": run.label, "strategy": run.strategy, "layout": _layout(run),
                               "status": _status(run)}
        final = summaries[-1] if summaries else None
        last_eval = run.last("eval")
        source = final if final is not None else last_eval
        steps = [r["step"] for r in run.records if _number(r.get("step"))]
        row["step"] = final["step"] if final is not None else (max(steps) if steps else None)
        for key in ("test_accuracy", "test_auc", "test_loss"):
            row[key] = source.get(key) if source is not None and _number(source.get(key)) else None
        timed = [s for s in summaries if _number(s.get("train_s"))]
        row["train_s"] = sum(s["train_s"] for s in timed) if timed else None
        walls = [s["wall_s"] for s in summaries if _number(s.get("wall_s"))]
        row["wall_s"] = sum(walls) if walls else None
        rated = [s for s in timed if _number(s.get("examples_per_s"))]
        if len(rated) == 1:
            row["examples_per_s"] = rated[0]["examples_per_s"]
        elif rated and sum(s["train_s"] for s in rated) > 0:
            row["examples_per_s"] = (sum(s["examples_per_s"] * s["train_s"] for s in rated)
                                     / sum(s["train_s"] for s in rated))
        else:
            row["examples_per_s"] = None
        rows.append(row)
    return rows


def _status(run: Run) -> str:
    """How the last segment (from the last start record) ended: ``finished`` (a summary),
    ``stopped early`` (a summary of a run stopped by SIGTERM or SIGUSR1 at a safe point, its
    checkpoint written: ``--resume auto`` continues it), or ``no summary (stopped?)`` (killed,
    or still running)."""
    for rec in reversed(run.records):
        if rec.get("kind") == "summary":
            return "stopped early" if rec.get("stopped_early") else "finished"
        if rec.get("kind") == "start":
            break
    return "no summary (stopped?)"


COLUMNS = (  # (key, heading, format)
    ("run", "run", "{}"),
    ("strategy", "strategy", "{}"),
    ("layout", "layout", "{}"),
    ("status", "status", "{}"),
    ("step", "steps", "{}"),
    ("test_accuracy", "final accuracy", "{:.2%}"),
    ("test_auc", "final AUC", "{:.4f}"),  # binary models (embedding models: docs/ctr.md)
    ("test_loss", "test loss", "{:.4f}"),
    ("train_s", "train time (s)", "{:.1f}"),
    ("wall_s", "wall time (s)", "{:.1f}"),
    ("examples_per_s", "examples/s", "{:.0f}"),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, columns padded so it also reads as plain text. The AUC
    column shows when some run has one (binary models), the accuracy column unless every
    run that has a figure has an AUC instead."""
    has = {k: any(row.get(k) is not None for row in rows) for k in ("test_accuracy", "test_auc")}
    columns = [c for c in COLUMNS if c[0] != "test_auc" or has["test_auc"]]
    if has["test_auc"] and not has["test_accuracy"]:
        columns = [c for c in columns if c[0] != "test_accuracy"]
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(k) is None else fmt.format(row[k]).replace("|", "/")
                      for k, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    numeric = [k not in ("run", "strategy", "layout", "status") for k, _, _ in columns]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w)
                                 for c, w, num in zip(r, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                          for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


# ---------------------------------------------------------------------------------------------
# curves as data: CSV and TensorBoard (no matplotlib)

CURVE_KINDS = ("progress", "eval")
# the first columns of every CSV; the records' numeric fields follow
CURVE_AXES = ("step", "epoch", "time_s", "segment")


def curve_rows(run: Run) -> tuple[list[str], list[dict[str, Any]]]:
    """The run's curves as a table: its columns, and one row per progress or eval record.

    An eval record shares the row of the progress record at its step (in the same segment,
    when no field but the axes is in both); one without such a record has a row of its own.
    Columns: :data:`CURVE_AXES`, then every field that holds a finite number in some
    progress or eval record, in the order the records first name them. ``time_s`` is the row's first
    record's wall time since the run first started (:attr:`Run.times`: counted on across
    resumed segments), ``segment`` the number of the ``start`` record it follows (1 for a
    run never resumed), ``epoch`` the first of its records' epochs. A value absent from the
    row's records (or not a finite number) is None. Rows are ordered by step; rows of one
    step stay in file order (a step trained twice after a resume has a row per segment).
    Records without a numeric step are left out.
    """
    seen: dict[str, None] = {}  # every field name, in order of first appearance
    numeric: set[str] = set()   # those with a finite number somewhere
    rows: list[dict[str, Any]] = []
    kinds: list[set[str]] = []  # per row: the kinds of its records
    taken: list[set[str]] = []  # per row: the figures already in it
    by_step: dict[tuple[int, float], list[int]] = {}
    segment = 0
    for rec, t in zip(run.records, run.times):
        kind = rec.get("kind")
        if kind == "start":
            segment += 1
        if kind not in CURVE_KINDS or not _number(rec.get("step")):
            continue
        figures = {k: v for k, v in rec.items() if k not in CURVE_AXES and _number(v)}
        seen.update(dict.fromkeys(k for k in rec if k not in CURVE_AXES))
        numeric |= figures.keys()
        key = (max(segment, 1), float(rec["step"]))
        at = next((i for i in by_step.get(key, [])
                   if kind not in kinds[i] and not taken[i] & figures.keys()), None)
        if at is None:
            at = len(rows)
            rows.append({"step": rec["step"], "epoch": None, "time_s": round(t, 3),
                         "segment": key[0]})
            kinds.append(set())
            taken.append(set())
            by_step.setdefault(key, []).append(at)
        row = rows[at]
        if row["epoch"] is None and _number(rec.get("epoch")):
            row["epoch"] = rec["epoch"]
        row.update(figures)
        kinds[at].add(kind)
        taken[at] |= figures.keys()
    columns = [*CURVE_AXES, *(k for k in seen if k in numeric)]
    ordered = sorted(rows, key=lambda r: float(r["step"]))
    return columns, [{c: row.get(c) for c in columns} for row in ordered]


def output_names(runs: list[Run]) -> list[str]:
    """A file name per run, from its label: characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``; a name that repeats gets ``-2``, ``-3``, ..."""
    names: list[str] = []
    for run in runs:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", run.label).strip("._") or "run"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def write_csv(runs: list[Run], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``<run name>.csv`` (:func:`curve_rows`, :func:`output_names`) per run into
    ``out_dir`` (which exists); return the paths. Numbers are written as Python prints them
    (a float's shortest repr: read back, it is the record's value), absent values empty."""
    written = []
    for run, name in zip(runs, output_names(runs)):
        columns, rows = curve_rows(run)
        path = Path(out_dir) / f"{name}.csv"
        def write(tmp: Path, columns=columns, rows=rows) -> None:
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)  # None is written as an empty cell

        _publish(path, write)
        written.append(path)
    return written


def _publish(path: Path, write) -> None:
    """``write(tmp)`` beside ``path``, then rename it over ``path``, so a reader never sees a
    half-written file; ConfigError naming ``path`` if either fails."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {exc}") from exc


# progress fields by TensorBoard section; any other progress field is under train/
_PROGRESS_SECTIONS = {"epoch": "progress", "done_pct": "progress", "eta_s": "progress",
                      "iteration": "progress", "evaluations": "progress", "batch_s": "speed",
                      "compression": "comm", "updates_per_step": "comm", "tau": "comm",
                      "density": "comm", "residual_norm": "comm", "rows_per_step": "comm",
                      "commands": "comm"}


def scalar_tag(kind: str, name: str) -> str:
    """The TensorBoard tag of field ``name`` of a ``kind`` record: ``eval/<name>`` for an
    evaluation's figures; for progress, ``speed/`` (``*_per_s``, ``*_s_per_step``,
    ``batch_s``), ``comm/`` (``*bytes*``, ``compression``, ``updates_per_step``, the
    threshold compressor's ``tau``, ``density`` and ``residual_norm``, ``rows_per_step``,
    ``commands``), ``progress/`` (``epoch``, ``done_pct``, ``eta_s``, ``iteration``,
    ``evaluations``), and ``train/`` for the rest (``loss``, ``staleness``, ``step_length``,
    ...)."""
    if kind == "eval":
        return f"eval/{name}"
    section = _PROGRESS_SECTIONS.get(name)
    if section is None:
        section = ("speed" if name.endswith(("_per_s", "_s_per_step"))
                   else "comm" if "bytes" in name else "train")
    return f"{section}/{name}"


def scalars(run: Run) -> list[tuple[str, float, int, float]]:
    """``(tag, value, step, time)`` of every finite number in the run's progress and eval
    records (:func:`scalar_tag`), in file order: ``step`` the record's global step, ``time``
    its wall time since the run first started (:attr:`Run.times`). An eval record's epoch is
    left out (the progress records carry it); records without a numeric step are too."""
    out = []
    for rec, t in zip(run.records, run.times):
        kind = rec.get("kind")
        if kind not in CURVE_KINDS or not _number(rec.get("step")):
            continue
        skip = {"kind", "step", "time_s"} | ({"epoch"} if kind == "eval" else set())
        for name, value in rec.items():
            if name not in skip and _number(value):
                out.append((scalar_tag(kind, name), float(value), int(rec["step"]), t))
    return out


def _tensorboardx():
    # importing tensorboardX sets CRC32C_SW_MODE in os.environ (for the crc32c package, when
    # installed): left as it was found, so processes this one starts later do not inherit it
    before = os.environ.get("CRC32C_SW_MODE")
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise ConfigError(f"--tensorboard needs tensorboardX, which is not installed ({exc}); "
                          f"install it with: {TENSORBOARD_HINT}") from exc
    finally:
        if before is None:
            os.environ.pop("CRC32C_SW_MODE", None)
    return SummaryWriter


def write_tensorboard(runs: list[Run], out_dir: str | os.PathLike) -> list[Path]:
    """Write each run's :func:`scalars` as TensorBoard event files into ``out_dir/<run name>``
    (:func:`output_names`); return the directories. Event files an earlier export left
    there are replaced. Wall times are the seconds since the run started (TensorBoard's
    "relative" axis), not dates.

    Raises
    ------
    ConfigError
        If tensorboardX cannot be imported, or a directory cannot be written.
    """
    SummaryWriter = _tensorboardx()
    written = []
    for run, name in zip(runs, output_names(runs)):
        path = Path(out_dir) / name
        try:
            path.mkdir(exist_ok=True)
            for old in path.glob("events.out.tfevents.*"):
                old.unlink()
            writer = SummaryWriter(logdir=str(path), flush_secs=3600)
            try:
                for tag, value, step, t in scalars(run):
                    writer.add_scalar(tag, value, step, walltime=t)
            finally:
                writer.close()
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc}") from exc
        written.append(path)
    return written



# ---------------------------------------------------------------------------------------------
# which figures, with which data (no matplotlib)


@dataclass(frozen=True)
class Curve:
    """A line per run: ``field`` of the records of ``kinds``, against the panel's x."""

    field: str
    kinds: tuple[str, ...] = ("progress",)
    name: str = ""        # legend suffix when a panel holds several curves per run
    style: str = "-"
    marker: str = "."


@dataclass(frozen=True)
class Bars:
    """A bar per run: ``field`` of its last summary record."""

    field: str


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    items: tuple[Curve | Bars, ...]
    x: str = "step"       # "step" or "time"; ignored for bars
    log: bool = False     # log y axis (applied when every value is positive)


@dataclass(frozen=True)
class Figure:
    name: str             # file name without .png
    title: str
    panels: tuple[Panel, ...]


_TRAIN_LOSS = Curve("loss", name="training")
_TEST_LOSS = Curve("test_loss", ("eval", "summary"), name="test", style="--", marker="o")
_TEST_ACC = Curve("test_accuracy", ("eval", "summary"), name="test", marker="o")
# a run with a validation split evaluates on it (eval records with split "val") and scores
# the test set once, in its summary
_VAL_LOSS = Curve("val_loss", ("eval", "summary"), name="validation", style=":", marker="s")
_VAL_ACC = Curve("val_accuracy", ("eval", "summary"), name="validation", style=":",
                 marker="s")


def _over_step_and_time(what: str, ylabel: str, *items: Curve, log: bool = False):
    return (Panel(f"{what} against step", ylabel, items, "step", log),
            Panel(f"{what} against wall time", ylabel, items, "time", log))


def _progress_and_final(what: str, ylabel: str, progress: str, final: str):
    return (Panel(f"{what} during training", ylabel, (Curve(progress),), "step"),
            Panel(f"{what}: each run's summary", ylabel, (Bars(final),)))


# Every figure the report can write; one is written when any of its panels has data.
FIGURES: tuple[Figure, ...] = (
    Figure("loss", "Loss (training: from progress records; test and validation: from "
           "evaluations)",
           _over_step_and_time("loss", "mean cross-entropy (nats)", _TRAIN_LOSS, _TEST_LOSS,
                               _VAL_LOSS)),
    Figure("accuracy", "Accuracy (test; validation when the run has a validation split)",
           _over_step_and_time("accuracy", "fraction correct", _TEST_ACC, _VAL_ACC)),
    Figure("examples_per_s", "Throughput",
           _progress_and_final("examples/s", "examples per second", "examples_per_s",
                               "examples_per_s")),
    Figure("bytes_per_step", "Communication",
           _progress_and_final("bytes per step", "bytes moved per step", "bytes_per_step",
                               "bytes_per_step")),
    Figure("staleness", "Staleness (updates between a replica's read and its write)",
           (Panel("staleness during training", "staleness (steps)", (Curve("staleness"),)),
            Panel("mean staleness: each run's summary", "staleness (steps)",
                  (Bars("mean_staleness"),)),
            Panel("max staleness: each run's summary", "staleness (steps)",
                  (Bars("max_staleness"),)))),
    Figure("compression", "Compression (dense message bytes / bytes sent)",
           (Panel("compression during training (deadreckon)", "ratio", (Curve("compression"),)),
            Panel("compression: each run's summary", "ratio", (Bars("compression_ratio"),)))),
    Figure("lbfgs_step_length", "Sandblaster L-BFGS",
           (Panel("line-search step length of each iteration", "step length",
                  (Curve("step_length"),), log=True),)),
    Figure("ssp_waits", "Stale-synchronous parallel (downpour --staleness-bound)",
           (Panel("largest clock lead over the slowest replica", "steps",
                  (Curve("clock_lead_max"),)),
            Panel("fetches held per shard", "fetches", (Bars("ssp_held_fetches"),)),
            Panel("seconds held per shard", "seconds", (Bars("ssp_held_s"),)))),
)


@dataclass
class Line:
    run: int              # index into the runs
    curve: Curve
    xs: list[float]
    ys: list[float]


@dataclass
class PanelData:
    panel: Panel
    lines: list[Line] = field(default_factory=list)
    bars: list[tuple[int, float]] = field(default_factory=list)  # (run index, value)
    marks: list[tuple[int, float, Mark]] = field(default_factory=list)  # (run, x, mark)

    def empty(self) -> bool:
        return not self.lines and not self.bars


def series(run: Run, curve: Curve, x: str) -> tuple[list[float], list[float]]:
    """The points of ``curve`` for one run: x is the record's step or its wall time."""
    xs, ys = [], []
    for rec, t in zip(run.records, run.times):
        if rec.get("kind") not in curve.kinds or not _number(rec.get(curve.field)):
            continue
        xv = t if x == "time" else rec.get("step")
        if _number(xv):
            xs.append(float(xv))
            ys.append(float(rec[curve.field]))
    return xs, ys


def plan_figures(runs: list[Run],
                 figures: tuple[Figure, ...] = FIGURES) -> list[tuple[Figure, list[PanelData]]]:
    """The figures some run has data for, each with its non-empty panels' data."""
    plans = []
    for fig in figures:
        panels = []
        for panel in fig.panels:
            pd = PanelData(panel)
            for i, run in enumerate(runs):
                for item in panel.items:
                    if isinstance(item, Bars):
                        s = run.last("summary")
                        if s is not None and _number(s.get(item.field)):
                            pd.bars.append((i, float(s[item.field])))
                    else:
                        xs, ys = series(run, item, panel.x)
                        if xs:
                            pd.lines.append(Line(i, item, xs, ys))
            for i in dict.fromkeys(line.run for line in pd.lines):
                for mark in preemptions(runs[i]):
                    x = mark.time if panel.x == "time" else mark.step
                    if x is not None:
                        pd.marks.append((i, x, mark))
            if not pd.empty():
                panels.append(pd)
        if panels:
            plans.append((fig, panels))
    return plans


# ---------------------------------------------------------------------------------------------
# drawing (matplotlib)


def _matplotlib():
    try:
        from matplotlib.figure import Figure as MplFigure
    except ImportError as exc:
        raise MissingDependency(
            f"the figures need matplotlib, which is not installed ({exc}); install it with: "
            f"{INSTALL_HINT}   (or: pip install matplotlib). The summary table needs nothing "
            "extra: --no-figures writes it alone") from exc
    return MplFigure


MARK_STYLES = {"stopped": ":", "killed": (0, (1, 3)), "resumed": "-."}


def draw(plans: list[tuple[Figure, list[PanelData]]], runs: list[Run],
         out_dir: str | os.PathLike, dpi: int = 110) -> list[Path]:
    """Write one PNG per planned figure into ``out_dir``; return the paths.

    Raises
    ------
    MissingDependency
        If matplotlib cannot be imported.
    """
    MplFigure = _matplotlib()
    out_dir = Path(out_dir)
    written = []
    for fig_spec, panels in plans:
        fig = MplFigure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
        fig.suptitle(fig_spec.title)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, pd in zip(axes, panels):
            _draw_panel(ax, pd, runs)
        path = out_dir / f"{fig_spec.name}.png"
        _publish(path, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=dpi))
        written.append(path)
    return written


def _draw_panel(ax, pd: PanelData, runs: list[Run]) -> None:
    from matplotlib.lines import Line2D  # only reached after _matplotlib() succeeded

    panel = pd.panel
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if pd.bars:
        idx = [i for i, _ in pd.bars]
        values = [v for _, v in pd.bars]
        bars = ax.bar(range(len(idx)), values, color=[f"C{i % 10}" for i in idx])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set_xticks(range(len(idx)), [runs[i].label for i in idx],
                      rotation=20 if len(idx) > 2 else 0, ha="right" if len(idx) > 2 else "center",
                      fontsize=8)
        return
    for line in pd.lines:
        ax.plot(line.xs, line.ys, line.curve.style, marker=line.curve.marker, markersize=4,
                color=f"C{line.run % 10}")
    for i, x, mark in pd.marks:  # preemption segments: a vertical line in the run's colour
        ax.axvline(x, color=f"C{i % 10}", linestyle=MARK_STYLES[mark.kind], linewidth=1.2,
                   alpha=0.8)
    if panel.log and all(y > 0 for line in pd.lines for y in line.ys):
        ax.set_yscale("log")
    ax.set_xlabel("wall time (s)" if panel.x == "time" else "step (mini-batches applied)")
    # one entry per run (its colour), then one per curve kind (its line style) when several
    handles = [Line2D([], [], color=f"C{i % 10}", label=f"{runs[i].label} ({runs[i].strategy})")
               for i in dict.fromkeys(line.run for line in pd.lines)]
    curves = list(dict.fromkeys(line.curve for line in pd.lines))
    if len(curves) > 1:
        handles += [Line2D([], [], color="0.4", linestyle=c.style, marker=c.marker,
                           markersize=4, label=c.name) for c in curves]
    handles += [Line2D([], [], color="0.4", linestyle=MARK_STYLES[k], label=k)
                for k in dict.fromkeys(m.kind for _, _, m in pd.marks)]
    ax.legend(handles=handles, fontsize=8)


# ---------------------------------------------------------------------------------------------
# command line


def write_table(rows: list[dict[str, Any]], runs: list[Run], out_dir: Path) -> Path:
    """Write ``summary.md`` (the table and where each run's metrics came from)."""
    text = "# hpcps runs\n\n" + format_table(rows) + "\n\n" + "\n".join(
        f"- {run.label}: {run.path / METRICS_FILE}" + "".join(
            f"; {m.text}" for m in preemptions(run)) for run in runs) + "\n"
    path = out_dir / "summary.md"
    try:
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from exc
    return path


def _output_dir(path: str | os.PathLike, option: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option} {out} exists and is not a directory")
    return out


def _make_dir(out: Path, option: str) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {option} {out}: {exc}") from exc


def report(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike, figures: bool = True,
           csv_dir: str | os.PathLike | None = None,
           tensorboard_dir: str | os.PathLike | None = None,
           echo=print, note=lambda s: print(s, file=sys.stderr)) -> list[Path]:
    """Read the runs, print and write the table, write the curves as CSV (``csv_dir``) and
    TensorBoard event files (``tensorboard_dir``), then (``figures``) draw; return the files
    and directories written. Raises :class:`ConfigError` for unusable run or output
    directories, or ``tensorboard_dir`` without tensorboardX, before writing anything;
    :class:`MissingDependency` after the table and curves when matplotlib is missing."""
    runs = load_runs(run_dirs)
    out = _output_dir(out_dir, "--out")
    outputs = [(out, "--out")]
    if csv_dir is not None:
        outputs.append((_output_dir(csv_dir, "--csv"), "--csv"))
        for name in output_names(runs):
            if (Path(csv_dir) / f"{name}.csv").is_dir():
                raise ConfigError(f"--csv: {Path(csv_dir) / name}.csv is a directory: the "
                                  "curves of that run cannot be written there")
    if tensorboard_dir is not None:
        outputs.append((_output_dir(tensorboard_dir, "--tensorboard"), "--tensorboard"))
        for name in output_names(runs):
            sub = Path(tensorboard_dir) / name
            if sub.exists() and not sub.is_dir():
                raise ConfigError(f"--tensorboard: {sub} exists and is not a directory: the "
                                  "event files of that run go into a directory of that name")
        _tensorboardx()  # installed? (refused before anything is written)
    for run in runs:
        for text in run.notes:
            note(f"note: {text}")
    for path, option in outputs:
        _make_dir(path, option)
    rows = table_rows(runs)
    echo(format_table(rows))
    written = [write_table(rows, runs, out)]
    if csv_dir is not None:
        written += write_csv(runs, csv_dir)
    if tensorboard_dir is not None:
        written += write_tensorboard(runs, tensorboard_dir)
    if figures:
        try:
            written += draw(plan_figures(runs), runs, out)
        except MissingDependency:
            echo("wrote " + ", ".join(str(p) for p in written))
            raise
    echo("wrote " + ", ".join(str(p) for p in written))
    return written


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.report",
        description=(
            "Compare hpcps training runs: read each run directory's metrics.jsonl, print a "
            "summary table (strategy, layout, steps, final accuracy, time, examples/s) and "
            "write it to OUT/summary.md, and write PNG figures overlaying the runs into OUT: "
            "loss and test accuracy against step and wall time, examples/s, bytes per step, "
            "staleness, and per strategy compression ratio, L-BFGS step length and SSP waits "
            "(only the figures some run has data for). --csv and --tensorboard also write "
            "each run's curves as CSV files and TensorBoard event files."
        ),
        epilog=f"Figures need matplotlib: {INSTALL_HINT}. Exit status: 0 on success, "
        f"{ConfigError.exit_code} for an unusable run or output directory (or --tensorboard "
        "without tensorboardX), "
        f"{MissingDependency.exit_code} when matplotlib is missing (the table is written first).",
    )
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                        help="run directory of hpcps.train (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="DIR", default="report",
                        help="where summary.md and the figures go (created; default: report)")
    parser.add_argument("--no-figures", action="store_true",
                        help="write the summary table only (no matplotlib needed)")
    parser.add_argument("--csv", metavar="DIR",
                        help="also write each run's curves as DIR/<run>.csv: one row per "
                        "progress or eval record, by step; columns step, epoch, time_s, "
                        "segment and every numeric field of those records (created)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write each run's curves as TensorBoard event files in "
                        "DIR/<run>/ (train/, eval/, speed/, comm/, progress/ scalars at their "
                        f"global step; needs tensorboardX: {TENSORBOARD_HINT})")
    args = parser.parse_args(argv)
    try:
        report(args.run_dirs, args.out, figures=not args.no_figures, csv_dir=args.csv,
               tensorboard_dir=args.tensorboard)
    except HpcpsError as exc:
        print(f"{parser.prog.split()[-1]}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
