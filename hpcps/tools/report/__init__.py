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

By job: :mod:`.runs` (reading a run's records, its preemptions), :mod:`.table` (the summary
table), :mod:`.curves` (the curves as CSV and TensorBoard files), :mod:`.figures` (which
figures, with which data, and drawing them), :mod:`.output` (output directories, files written
whole); this module is the command (:func:`report`, :func:`main`) and names what callers import.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpcps.errors import ConfigError, HpcpsError
from hpcps.tools.report.curves import (CURVE_AXES, CURVE_KINDS, TENSORBOARD_HINT, _tensorboardx,
                                       curve_rows, output_names, scalar_tag, scalars, write_csv,
                                       write_tensorboard)
from hpcps.tools.report.figures import (FIGURES, INSTALL_HINT, MARK_STYLES, Bars, Curve, Figure,
                                        Line, MissingDependency, Panel, PanelData, draw,
                                        plan_figures, series)
from hpcps.tools.report.output import _make_dir, _output_dir
from hpcps.tools.report.runs import (METRICS_FILE, Mark, Run, load_run, load_runs, preemptions,
                                     read_metrics)
from hpcps.tools.report.table import COLUMNS, format_table, table_rows, write_table

__all__ = [  # what callers import from hpcps.tools.report
    "METRICS_FILE", "Run", "read_metrics", "load_run", "load_runs", "Mark", "preemptions",
    "COLUMNS", "table_rows", "format_table", "write_table",
    "CURVE_KINDS", "CURVE_AXES", "TENSORBOARD_HINT", "curve_rows", "output_names", "write_csv",
    "scalar_tag", "scalars", "write_tensorboard",
    "INSTALL_HINT", "MissingDependency", "Curve", "Bars", "Panel", "Figure", "FIGURES", "Line",
    "PanelData", "series", "plan_figures", "MARK_STYLES", "draw",
    "report", "main",
]


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
