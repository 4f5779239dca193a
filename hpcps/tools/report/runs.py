"""Reading runs: a run directory's ``metrics.jsonl`` parsed into a :class:`Run` (wall times
counted on across resumed segments), and where it was stopped, killed and resumed
(:func:`preemptions`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcps.errors import ConfigError

METRICS_FILE = "metrics.jsonl"


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
