"""Progress lines on the terminal and the same figures as JSON lines in the run directory.

One rank (the chief, world rank 0) owns a :class:`Metrics`; others get a disabled one so the
calling code needs no ``if rank == 0``. Each record is a JSON object with ``kind``
(``progress``, ``eval``, ``checkpoint``, ``summary``, ...), the wall time since start and the
figures; ``metrics.jsonl`` in the run directory receives every record, the terminal a short line
per record (progress at most every ``progress_every`` seconds).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
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


class Metrics:
    """Append records to ``run_dir/metrics.jsonl`` and print them.

    Parameters
    ----------
    run_dir : where metrics.jsonl goes (created); None for a disabled logger.
    progress_every : minimum seconds between two printed progress lines.
    """

    def __init__(self, run_dir: str | Path | None, progress_every: float = 5.0, stream=None):
        self.enabled = run_dir is not None
        self.progress_every = progress_every
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()
        self._last_progress = 0.0
        self._fh = None
        if self.enabled:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.path = Path(run_dir) / "metrics.jsonl"
            self._fh = open(self.path, "a", buffering=1)

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
        self._fh.write(json.dumps(_strict(rec)) + "\n")
        if echo:
            body = "  ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
            print(f"[hpcps {rec['time_s']:8.1f}s] {kind:<10} {body}", file=self.stream, flush=True)
        return rec

    def message(self, text: str) -> None:
        if self.enabled:
            print(f"[hpcps {self.elapsed():8.1f}s] {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
