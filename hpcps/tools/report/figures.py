"""The figures: which ones, with which data (:data:`FIGURES`, :func:`plan_figures`: no
matplotlib), and drawing them as PNG files (:func:`draw`: matplotlib, imported there)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hpcps.errors import HpcpsError
from hpcps.tools.report.output import _publish
from hpcps.tools.report.runs import Mark, Run, _number, preemptions

INSTALL_HINT = 'pip install "hpcps[report]"'


class MissingDependency(HpcpsError):
    """An optional package a command needs is not installed (exit code 1)."""

    exit_code = 1


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


# binary models (embedding models, docs/ctr.md) report the area under the ROC curve
_TEST_AUC = Curve("test_auc", ("eval", "summary"), name="test", marker="o")
_VAL_AUC = Curve("val_auc", ("eval", "summary"), name="validation", style=":", marker="s")


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
    Figure("auc", "AUC of binary models (test; validation when the run has a validation "
           "split)", _over_step_and_time("AUC", "area under the ROC curve", _TEST_AUC,
                                         _VAL_AUC)),
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
