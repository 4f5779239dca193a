"""A write to an HDF5 file that the file system refuses (a full disk, a quota, an I/O error),
told in one line.

HDF5 reports such a failure from deep in its cache, as an OSError or a RuntimeError whose
text carries the system's message ("file write failed: ... errno = 28, error message = 'No
space left on device'"), often only when the file is flushed or closed, and closing it then
fails with errors of its own ("slist already enabled?"). As their objects are freed, h5py's
datasets and files fail once more, each printing a traceback on stderr: dozens of lines that
bury the reason. :func:`write_failure` finds the reason in the chain of exceptions and
:class:`WriteGuard` keeps those reports off stderr while the file is written and let go.
"""
from __future__ import annotations

import gc
import os
import re
import sys
import threading
import traceback

import h5py


def write_failure(exc: BaseException | None) -> str | None:
    """The system's reason when ``exc``, or an exception it was raised while handling, says a
    file could not be written, else None."""
    seen = 0
    while exc is not None and seen < 10:
        said = re.search(r"error message = '([^']*)'", str(exc))
        if said and isinstance(exc, (OSError, RuntimeError)):
            return said.group(1)
        if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
            return exc.strerror
        if isinstance(exc, OSError) and str(exc).startswith("a write failed: "):
            return str(exc)[len("a write failed: "):]
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


FAILED: list[str] = []  # the writes this process saw fail (see :func:`leave`)


def leave(code: int) -> int:
    """``code``, or, in a process that saw a write fail, the end of the process with
    ``code`` at once: HDF5's library is then left holding a file it could not close, and its
    clean-up at the interpreter's exit can crash (a segmentation fault in place of the exit
    code the command chose). The commands that write HDF5 files end through this."""
    if FAILED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class WriteGuard:
    """For the life of a file being written: h5py's objects that fail a write as they are
    freed report it (never raised) through ``sys.excepthook`` and ``sys.unraisablehook``,
    each a traceback on stderr; those reports are recorded in :attr:`failed` instead, and
    every other report goes on as before. Nothing else is held, so another thread's
    messages are never delayed or lost.

    :meth:`close` lets go of the failed file's objects (a garbage collection) and puts the
    hooks back. Guards are taken one at a time (a lock: a rank's checkpoint writer thread and
    its main thread). Use it as a context manager, or :meth:`check` between writes and
    :meth:`close` at the end."""

    _lock = threading.RLock()

    def __init__(self) -> None:
        self.failed: list[str] = []
        self._lock.acquire()
        self._excepthook, self._unraisablehook = sys.excepthook, sys.unraisablehook
        sys.excepthook, sys.unraisablehook = self._except, self._unraisable
        self._open = True

    def _taken(self, exc: BaseException | None) -> bool:
        why = write_failure(exc)
        if why is not None:
            self.failed.append(why)
        return why is not None

    def _except(self, kind, exc, tb) -> None:
        if not self._taken(exc):
            self._excepthook(kind, exc, tb)

    def _unraisable(self, unraisable) -> None:
        if not self._taken(unraisable.exc_value):
            self._unraisablehook(unraisable)

    def check(self) -> None:
        """Raise an OSError with the reason if a write has failed, unseen, meanwhile."""
        if self.failed:
            raise OSError(f"a write failed: {self.failed[0]}")

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        try:
            gc.collect()
        finally:
            sys.excepthook, sys.unraisablehook = self._excepthook, self._unraisablehook
            FAILED.extend(self.failed)
            self._lock.release()

    def __enter__(self) -> "WriteGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release(exc: BaseException) -> None:
    """Let go of what the frames of ``exc``'s traceback hold (a failed write's h5py objects),
    so that they are freed now, inside a :class:`WriteGuard`, not when the exception is."""
    tb = exc.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)


def unbuffered(path) -> h5py.File:
    """A new HDF5 file at ``path``, for writing a dataset a part at a time: without HDF5's
    sieve buffer, each part goes to the file as it is written, so a refused write (a full
    disk) fails there, as one ``OSError``. With the buffer, parts smaller than it (64 KiB)
    wait in it, the failure comes out of the file's close, and HDF5 then crashed (a
    segmentation fault) freeing the file's objects."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_sieve_buf_size(0)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl))


def replace_whole(tmp, path, write) -> str | None:
    """``write(tmp)`` (which writes, flushes and closes the file ``tmp``), then ``tmp`` renamed
    onto ``path``, under a :class:`WriteGuard`. Returns None, or the system's reason when the
    file system refused a write: ``tmp`` is then removed and ``path`` left as it was. Any other
    failure is raised, ``tmp`` removed."""
    why = None
    with WriteGuard() as guard:
        try:
            write(tmp)
            guard.check()
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            why = write_failure(exc)
            if why is None:
                raise
            guard.failed.append(why)  # (for leave: the process saw a write fail)
            release(exc)
        # (a failed write's h5py objects are freed here, with the exception, quietly)
    return why
