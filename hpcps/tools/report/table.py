"""The summary table: one row per run (:func:`table_rows`), as Markdown that also reads as
plain text (:func:`format_table`), written to ``summary.md`` (:func:`write_table`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcps.errors import ConfigError
from hpcps.tools.report.runs import METRICS_FILE, Run, _number, preemptions


def _layout(run: Run) -> str:
    s = run.last("summary")
    if s is not None and all(_number(s.get(k)) for k in ("ranks", "replicas", "partitions")):
        parts = []
        spares = int(s["spares"]) if _number(s.get("spares")) else 0
        if s.get("servers"):
            # a rank beyond the servers, the replicas' partitions and the spares is a
            # coordinator (sandblaster's)
            extra = s["ranks"] - s["servers"] - s["replicas"] * s["partitions"] - spares
            coordinator = " + coordinator" if extra == 1 else ""
            parts.append(f"{s['servers']} server{'s' if s['servers'] != 1 else ''}{coordinator}")
        parts.append(f"{s['replicas']} replica{'s' if s['replicas'] != 1 else ''}"
                     + (f" x {s['partitions']} partitions" if s["partitions"] > 1 else ""))
        if spares:
            parts.append(f"{spares} spare{'s' if spares != 1 else ''}")
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
    checkpoint written: ``--resume auto`` continues it), ``stopping at step N (why), no
    summary`` (a stop was recorded, then the job ended before its summary: by the failure that
    stopped it, or killed; ``checkpointed`` when the checkpoint of that step was recorded),
    or ``no summary (stopped?)`` (killed, or still running)."""
    stop, saved = None, set()
    for rec in reversed(run.records):
        kind = rec.get("kind")
        if kind == "summary":
            return "stopped early" if rec.get("stopped_early") else "finished"
        if kind == "start":
            break
        if kind == "stop" and stop is None:
            stop = rec
        if kind == "checkpoint":
            saved.add(rec.get("step"))
    if stop is None:
        return "no summary (stopped?)"
    why = stop.get("signal") or "a failure"
    kept = ", checkpointed" if stop.get("step") in saved else ""
    return f"stopping at step {stop.get('step')} ({why}{kept}), no summary"


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
