"""A progress bar for a person watching a terminal: one line, rewritten in place.

:class:`hpcps.runtime.metrics.Metrics` draws each progress record as a bar when its stream is a
terminal, and as the usual plain line otherwise (a log file, a pipe, a batch job's output).

Under ``mpiexec`` no rank's standard output is a terminal: the launcher forwards it through
pipes. So :func:`wants_bar` also looks at the launcher: when this rank's parent (MPICH's
``hydra_pmi_proxy``) or grandparent (``mpiexec``) writes to a terminal, so is the user watching
one. That needs Linux's ``/proc`` and works for the ranks on the launching node, where the
reporting rank (world rank 0, or Sandblaster's coordinator on a one-node run) normally is.
``HPCPS_PROGRESS=bar`` or ``HPCPS_PROGRESS=lines`` decides instead of the detection.
"""
from __future__ import annotations

import os
import shutil

from hpcps import procfs

ENV = "HPCPS_PROGRESS"
CLEAR = "\r\x1b[K"  # back to the start of the line, erase it
_LAUNCHERS = ("hydra_pmi_proxy", "mpiexec", "mpiexec.hydra", "mpirun", "orted", "prterun",
              "srun", "slurmstepd")


def _writes_to_terminal(pid: int) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty"))


def launcher_on_terminal(pid: int | None = None, levels: int = 3) -> bool:
    """Whether an MPI launcher above ``pid`` (default: this process) writes to a terminal."""
    me = procfs.stat(os.getpid() if pid is None else pid)
    for _ in range(levels):
        if me is None or me.ppid <= 1:
            return False
        up = procfs.stat(me.ppid)
        if up is None:
            return False
        if up.name in _LAUNCHERS and _writes_to_terminal(me.ppid):
            return True
        me = up
    return False


def wants_bar(stream, environ=os.environ) -> bool:
    """Draw progress as a bar on ``stream``: ``HPCPS_PROGRESS`` if set, else whether the
    stream, or the launcher that forwards it, is a terminal."""
    choice = environ.get(ENV, "").strip().lower()
    if choice in ("bar", "lines"):
        return choice == "bar"
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    return launcher_on_terminal()


def _duration(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def bar_line(elapsed: float, fields: dict, width: int | None = None) -> str:
    """``[hpcps  12.3s] [########............]  42.0%  step 420  eta 01:12  loss 0.31  ...``,
    cut to ``width`` columns (the terminal's, by default) so it never wraps."""
    width = width or shutil.get_terminal_size((100, 20)).columns
    pct = float(fields.get("done_pct") or 0.0)
    cells = 20
    full = int(cells * min(max(pct, 0.0), 100.0) / 100.0)
    bar = "#" * full + "." * (cells - full)
    parts = [f"[hpcps {elapsed:8.1f}s] [{bar}] {pct:5.1f}%", f"step {fields.get('step')}",
             f"eta {_duration(fields.get('eta_s'))}"]
    for key, fmt in (("loss", "loss {:.4g}"), ("examples_per_s", "{:.0f} ex/s")):
        v = fields.get(key)
        if isinstance(v, (int, float)) and v == v:
            parts.append(fmt.format(v))
    return "  ".join(parts)[:max(20, width - 1)]
