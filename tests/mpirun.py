"""Launch ``mpiexec -n N ...`` from a test with a hard time limit.

A hang must fail a test, not block CI: every launch has a timeout, after which the whole
process tree is killed and the test fails saying which command hung and what it printed.

:func:`end_launch` is the one way the suite and the benchmarks end a launch: Hydra's proxies
and the ranks call ``setsid``, so ``os.killpg`` on mpiexec's group does not reach them. It
kills every descendant of the launcher (found through ``/proc``) and every process whose
environment carries the launch's tag (:func:`tagged_env`), which also finds a rank whose
parent died first. It never matches processes by name: other people's runs on the same
machine must live.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    """The mpiexec to use: $HPCPS_MPIEXEC, the one beside this Python (mpich wheel), or PATH."""
    env = os.environ.get("HPCPS_MPIEXEC")
    if env:
        return env
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: pip install mpich, or set HPCPS_MPIEXEC")
    return found


LAUNCH_TAG = "HPCPS_TEST_LAUNCH"  # environment variable naming one launch's processes


def tagged_env(env: dict | None = None) -> tuple[dict, str]:
    """A copy of ``env`` (default os.environ) with a tag unique to one launch, and the tag."""
    tag = uuid.uuid4().hex
    return {**(os.environ if env is None else env), LAUNCH_TAG: tag}, tag


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree (children, theirs, ...)."""
    children, out, todo = _children(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``LAUNCH_TAG=tag``."""
    want, me, found = f"{LAUNCH_TAG}={tag}".encode(), os.getpid(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != me:
            try:
                if want in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                continue  # gone, or not ours to read
    return found


def end_launch(pid: int, tag: str | None = None, timeout: float = 10.0) -> None:
    """SIGKILL the launcher ``pid``, every descendant of it and every process tagged ``tag``;
    repeat until none is left (a proxy may start a rank while we kill), at most ``timeout``
    seconds. The launcher is left for its parent to reap (``Popen.wait``)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in {pid, *descendants(pid), *(tagged(tag) if tag else [])}
                 if _running(p)]
        if not alive or time.monotonic() > deadline:
            break
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """True unless ``pid`` is gone or a zombie (dead, waiting to be reaped)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False


def read_line(fd: int, timeout: float) -> str:
    """The first line written to the pipe or pty ``fd``; AssertionError if none comes within
    ``timeout`` seconds (a blocking read would wait for ever on a writer that hangs)."""
    got = read_until(fd, timeout, lambda data: b"\n" in data)
    return got.split(b"\n", 1)[0].decode(errors="replace")


def read_until(fd: int, timeout: float, done=lambda data: False) -> bytes:
    """What is written to ``fd`` until ``done(everything so far)``, end of file, or (for a
    pty) every writer gone; AssertionError, with what came, if that takes over ``timeout``."""
    deadline, chunks = time.monotonic() + timeout, []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"nothing more within {timeout} s; read so far:\n"
                                 f"{b''.join(chunks)[-3000:].decode(errors='replace')}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # a pty reports EIO once every writer has gone
            break
        if not data:
            break
        chunks.append(data)
        if done(b"".join(chunks)):
            break
    return b"".join(chunks)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_mpi(n: int, args: list[str], timeout: float = 240, cwd=None, env=None) -> Run:
    """Run ``mpiexec -n n <python> args...``; kill it and fail if it outlives ``timeout``."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args]
    full_env = dict(os.environ)
    full_env.setdefault("OPENBLAS_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    full_env, tag = tagged_env(full_env)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_launch(proc.pid, tag)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (hang?): {' '.join(cmd)}\n"
                             f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return Run(proc.returncode, out, err, time.monotonic() - t0)


def train(n: int, *args: str, timeout: float = 240, **kw) -> Run:
    return run_mpi(n, ["-m", "hpcps.train", *args], timeout=timeout, **kw)


def last_summary(run_dir) -> dict:
    """The summary record of the last run in ``run_dir/metrics.jsonl`` (a resumed run
    appends its own)."""
    import json
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
            .splitlines()]
    return [r for r in recs if r["kind"] == "summary"][-1]

