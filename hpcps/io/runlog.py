"""A run directory's ``metrics.jsonl`` read back while a job may still append to it
(:class:`hpcps.runtime.metrics.Metrics` writes it): whether its newest run has ended.

For what looks at a job from outside, without MPI: ``python -m hpcps.stacks`` (which
otherwise waits for ranks that are gone) and a launch deciding whether it can join
(:mod:`hpcps.mpi.joins`). Every run appends a ``start`` record first; it ends with a
``summary``, or with a ``stop`` (stopped early on a signal, or by a failed collective: the
summary may never come), so either one after the newest start means the run is over.
"""
from __future__ import annotations

import os
from pathlib import Path

TAIL_BYTES = 1 << 16  # the end of the file that is read: records are far shorter
ENDS = ("summary", "stop")


def run_ended(run_dir: str | os.PathLike) -> str | None:
    """How the newest run in ``run_dir`` ended, when its metrics say so ("its summary is
    written", "its stop is written"); None while it runs, or when there are no metrics.

    Only the file's last :data:`TAIL_BYTES` are read, so a look costs the same on a day-long
    run: a start record within them begins the newest run; without one, the newest run
    began before them and every record read is its own."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - TAIL_BYTES))
            text = b"\n" + fh.read()  # a record at the file's first byte starts a line too
    except OSError:
        return None
    at = text.rfind(b'\n{"kind": "start"')
    return ended_in(text[at:] if at >= 0 else text)


def ended_in(newest: bytes) -> str | None:
    """:func:`run_ended` for the newest run's records already read (its lines, from its
    start record on, or a tail of them that begins with a line break)."""
    for kind in ENDS:
        if b'\n{"kind": "%s"' % kind.encode() in newest:
            return f"its {kind} is written"
    return None
