"""Each run's curves as data (no matplotlib): CSV files (:func:`curve_rows`,
:func:`write_csv`) and TensorBoard event files (:func:`scalars`,
:func:`write_tensorboard`), named after the runs (:func:`output_names`)."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any

from hpcps.errors import ConfigError
from hpcps.tools.report.output import _publish
from hpcps.tools.report.runs import Run, _number

TENSORBOARD_HINT = 'pip install "hpcps[tensorboard]"'


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
