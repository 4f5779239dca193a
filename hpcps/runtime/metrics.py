"""Progress lines on the terminal and the same figures as JSON lines in the run directory.

One rank (the chief, world rank 0) owns a :class:`Metrics`; others get a disabled one so the
calling code needs no ``if rank == 0``. Each record is a JSON object with ``kind``
(``progress``, ``eval``, ``checkpoint``, ``summary``, ...), the wall time since start and the
figures; ``metrics.jsonl`` in the run directory receives every record, the terminal a short line
per record (progress at most every ``progress_every`` seconds). On a terminal, progress
records carrying ``done_pct`` are drawn as one bar rewritten in place
(:mod:`hpcps.runtime.progress`).

:class:`DivergenceWatch` decides when a training loss is diverging (the rule is in its
docstring and in ``docs/errors.md``); the training loop records its one ``warning``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpcps.runtime import progress
def _fmt(v: Any) -> str:
    if v is None:  # a figure with nothing to measure yet (say, a loss before the first step)
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if abs(v) >= 1000:
            return f"{v:.0f}"
        return f"{v:.4g}"
    return str(v)


def _strict(v: Any) -> Any:
    """JSON has no NaN: write null for a figure not known yet (strict parsers stay happy)."""
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # NumPy scalars
        return _strict(v.item())
    return v


def _append_to(path: Path) -> int:
    """``path`` opened to append lines: the file descriptor. A last record cut short (its run
    was killed as it wrote it, or the disk filled) is ended first, so that it stays a line of
    its own: the next record, appended by a resumed run, would otherwise join it and be lost
    with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end > 0 and os.pread(fd, 1, end - 1) != b"\n":
            os.write(fd, b"\n")
    except OSError:
        os.close(fd)
        raise
    return fd


class Metrics:
    """Append records to ``run_dir/metrics.jsonl`` and print them.

    Parameters
    ----------
    run_dir : where metrics.jsonl goes (created); None for a disabled logger.
    progress_every : minimum seconds between two printed progress lines.
    stream : where lines go (standard output by default).
    bar : draw progress as a bar rewritten in place; None: when ``stream`` (or the MPI
        launcher forwarding it) is a terminal, or as ``HPCPS_PROGRESS`` says.
    """

    def __init__(self, run_dir: str | Path | None, progress_every: float = 5.0, stream=None,
                 bar: bool | None = None):
        self.enabled = run_dir is not None
        self.progress_every = progress_every
        self.stream = stream or sys.stdout
        # bar: progress as one rewritten line (None: when the stream is a terminal)
        self.bar = self.enabled and (progress.wants_bar(self.stream) if bar is None else bar)
        self._bar_shown = False
        self.t0 = time.perf_counter()
        self._last_progress = 0.0
        self._fd: int | None = None  # metrics.jsonl, opened at the first record
        self._torn = False  # the last record was cut short by a full disk
        self._lost_since: int | None = None  # records not written since a write failed
        if self.enabled:  # the file is opened at the first record: a run refused at start
            self.path = Path(run_dir) / "metrics.jsonl"  # (bad data) writes nothing

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def due(self) -> bool:
        """True when a progress line is due (cheap; call it every step)."""
        return self.enabled and self.elapsed() - self._last_progress >= self.progress_every

    def record(self, kind: str, echo: bool = True, **fields: Any) -> dict:
        """Write one record; print it unless ``echo`` is False."""
        rec = {"kind": kind, "time_s": round(self.elapsed(), 3), **fields}
        if not self.enabled:
            return rec
        if kind == "progress":
            self._last_progress = self.elapsed()
        self._append(json.dumps(_strict(rec)) + "\n")
        if echo and self.bar and kind == "progress" and "done_pct" in fields:
            self.stream.write(progress.CLEAR + progress.bar_line(rec["time_s"], fields))
            self.stream.flush()
            self._bar_shown = True
        elif echo:
            body = "  ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
            self._print(f"[hpcps {rec['time_s']:8.1f}s] {kind:<10} {body}")
        return rec

    def _append(self, line: str) -> None:
        """One record at the end of metrics.jsonl, in one write where it fits. A write the
        file system refuses (a full disk, a quota) does not end the run: it is said once, on
        stderr, and the records are written again once there is room (a record cut short
        stays a line of its own). A checkpoint that cannot be written ends the run, with its
        own message."""
        data = b"\n" + line.encode() if self._torn else line.encode()
        rest = memoryview(data)
        try:
            if self._fd is None:
                self._fd = _append_to(self.path)
            while rest:  # a write cut short by a full disk: the rest fails with its reason
                rest = rest[os.write(self._fd, rest):]
        except OSError as exc:
            self._torn = self._torn or len(rest) < len(data)
            self._lost(exc.strerror or str(exc))
            return
        self._torn = False
        if self._lost_since is not None:
            print(f"hpcps: warning: writing {self.path} again: {self._lost_since} record(s) "
                  "are missing from it", file=sys.stderr, flush=True)
            self._lost_since = None

    def _lost(self, why: str) -> None:
        if self._lost_since is None:
            self._lost_since = 0
            print(f"hpcps: warning: cannot write {self.path}: {why}; training goes on "
                  "without its records until there is room (hpcps.report reads them; a "
                  "checkpoint that cannot be written ends the run with exit code 4)",
                  file=sys.stderr, flush=True)
        self._lost_since += 1

    def _print(self, line: str) -> None:
        """A line of its own: a bar on screen stays, as it stood, on the line above (the next
        progress record draws a new one below)."""
        if self._bar_shown:
            self.stream.write("\n")
            self._bar_shown = False
        print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            self._print(f"[hpcps {self.elapsed():8.1f}s] {text}")

    def close(self) -> None:
        if self._bar_shown:  # leave the last bar on screen, and the cursor below it
            print(file=self.stream, flush=True)
            self._bar_shown = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DivergenceWatch:
    """Says once when the training loss has stayed far above its best for a while.

    The rule. The loss values fed to :meth:`update` (one per step) are smoothed with an
    exponential moving average over about ``span`` values (weight ``2 / (span + 1)``,
    starting at the first value). The lowest smoothed value so far is the *best*, from the
    first value on: a run whose loss explodes in its first steps (a learning rate far too
    large) is measured against its starting loss. The run is diverging once the smoothed
    loss has stayed above ``max(factor * best, best + margin)`` for ``window`` values in a
    row. The defaults (span 20, factor 2, margin 0.5 nats, window 100) leave the noise of
    small mini-batches alone (a healthy run's smoothed loss rarely doubles, and near zero
    doubling is not enough: it must also rise by half a nat, and stay there for 100 steps)
    and still catch a run whose loss climbs back towards chance (ln 10 = 2.3 for ten
    classes) or beyond it within a few hundred steps. A loss that never falls but does not
    rise either (stuck at chance) is not diverging by this rule. Non-finite values are not
    fed: they stop the run instead.

    Pure and cheap (a few float operations per step): tested without MPI.
    """

    def __init__(self, span: int = 20, window: int = 100, factor: float = 2.0,
                 margin: float = 0.5):
        if span < 1 or window < 1 or factor < 1 or margin < 0:
            raise ValueError("span and window must be >= 1, factor >= 1 and margin >= 0")
        self.span, self.window, self.factor, self.margin = span, window, factor, margin
        self.alpha = 2.0 / (span + 1)
        self.smooth = math.nan
        self.best = math.inf
        self.best_step = -1
        self.seen = 0
        self.above = 0          # consecutive values above the limit
        self.since_step = -1    # the step where the current run of such values began
        self.fired = False

    def update(self, step: int, loss: float) -> dict | None:
        """Feed one step's loss; return the warning's figures the one time the rule fires
        (``loss``: smoothed now, ``best``, ``best_step``, ``since_step``), else None."""
        if self.fired or not math.isfinite(loss):
            return None
        self.seen += 1
        self.smooth = loss if self.seen == 1 else self.smooth + self.alpha * (loss - self.smooth)
        if self.smooth < self.best:
            self.best, self.best_step = self.smooth, step
        if self.smooth > max(self.factor * self.best, self.best + self.margin):
            if self.above == 0:
                self.since_step = step
            self.above += 1
        else:
            self.above = 0
        if self.above < self.window:
            return None
        self.fired = True
        return {"loss": self.smooth, "best": self.best, "best_step": self.best_step,
                "since_step": self.since_step}

    def describe(self, fired: dict, step: int) -> str:
        """The warning's first sentence, from what :meth:`update` returned."""
        return (f"training loss diverging: its moving average is {fired['loss']:.4g} at step "
                f"{step}, and has been more than {self.factor:g}x and {self.margin:g} above its "
                f"best ({fired['best']:.4g} at step {fired['best_step']}) since step "
                f"{fired['since_step']}")
