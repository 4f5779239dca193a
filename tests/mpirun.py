"""Launch ``mpiexec -n N ...`` from a test with a hard time limit.

A hang must fail a test, not block CI: every launch has a timeout, after which the whole
process group is killed and the test fails saying which command hung and what it printed.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
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
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (hang?): {' '.join(cmd)}\n"
                             f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return Run(proc.returncode, out, err, time.monotonic() - t0)


def train(n: int, *args: str, timeout: float = 240, **kw) -> Run:
    return run_mpi(n, ["-m", "hpcps.train", *args], timeout=timeout, **kw)
