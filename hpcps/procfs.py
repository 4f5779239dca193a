"""A process as Linux's /proc shows it: its command name, state, parent and start time. The
one reader of ``/proc/PID/stat`` for every layer (a joined peer's liveness, the launcher's
name, the ancestry of a rank)."""
from __future__ import annotations

from typing import NamedTuple


class Stat(NamedTuple):
    name: str   # the command name (``comm``: up to 15 bytes, may hold spaces and parentheses)
    state: str  # R, S, D, T, Z (a zombie), X (dead), ...
    ppid: int   # the parent's pid
    start: int  # when it started, in clock ticks after boot (with the pid: one process)


def stat(pid: int) -> Stat | None:
    """Process ``pid`` from ``/proc/PID/stat``, or None if it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
        # the name is between the first "(" and the last ")": it may contain either
        head, tail = raw.rsplit(b")", 1)
        fields = tail.split()
        return Stat(head[head.index(b"(") + 1:].decode(errors="replace"), fields[0].decode(),
                    int(fields[1]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None
