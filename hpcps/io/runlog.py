"""A run directory's ``metrics.jsonl`` read back while a job may still append to it
(:class:`hpcps.runtime.metrics.Metrics` writes it): whether its newest run has ended.

For what looks at a job from outside, without MPI: ``python -m hpcps.stacks`` (which
otherwise waits for ranks that are gone) and a launch deciding whether it can join
(:mod:`hpcps.mpi.joins`). Every run appends a ``start`` record first; it ends with a
``summary``, or with a ``stop`` (stopped early on a signal, or by a failed collective: the
summary may never come), so either one after the newest start means the run is over.

Also the lock that keeps one job per run directory (:func:`hold`), and :func:`replace_text`,
how the small files of a run directory (stacks, join files, the trace) are written whole.
"""
from __future__ import annotations

import os
from pathlib import Path

TAIL_BYTES = 1 << 16  # the end of the file that is read: records are far shorter


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole: ``text`` into a hidden temporary file beside it (never matched by
    a reader's pattern), renamed over it, so a reader sees the old text or the new, never a
    part. On a failure (a full disk) the temporary file is removed and the OSError raised."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
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


# --------------------------------------------------------------------------------------------
# One job per run directory

LOCK_NAME = ".hpcps-lock"  # in the run directory; locked by the job's rank 0 while it lives
_HELD: dict[str, int] = {}  # run directory -> the descriptor holding its lock, in this process
# seconds a job waits for the lock before it refuses: the launcher of a job that has just
# ended may return before its rank 0 is gone (Open MPI after an abort), and a run resumed at
# once (--resume auto) would be refused
LOCK_WAIT_S = 10.0


def hold(run_dir: str | os.PathLike) -> None:
    """Lock ``run_dir`` for this process's lifetime (its job's rank 0), or refuse: two jobs
    in one run directory would write over each other's checkpoint and interleave their
    metrics (a job launched twice, a requeued job while the old one still runs).

    The lock is ``flock`` on :data:`LOCK_NAME`, which the kernel drops when the process
    ends, however it ends: a killed job leaves nothing to clean up. A lock held is waited
    for :data:`LOCK_WAIT_S` seconds first (a job that has just ended may still be going).
    The file names its holder (pid, host, start), for the message. A file system that
    cannot lock (some network file systems) leaves the directory unguarded, as before.

    Raises
    ------
    ConfigError
        Another live process holds the lock: the message names it.
    """
    import fcntl
    import socket
    import time

    from hpcps.errors import ConfigError

    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process"
        os.close(fd)
        raise ConfigError(f"run directory {run_dir} is in use by a running job ({holder}): "
                          "two jobs in one directory would overwrite each other's checkpoint "
                          "and metrics; give another --run-dir, or let that job end first "
                          "(--resume auto then continues it)") from None
    except OSError:  # no locks on this file system: unguarded
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _HELD[key] = fd
