"""Kill one rank of a running ``mpiexec`` job, for the fault tests: find it by its rank among
the launcher's descendants (Hydra sets PMI_RANK in each rank's environment, Open MPI
OMPI_COMM_WORLD_RANK)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from mpirun import descendants


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the ``hpcps.train`` process of world rank ``rank`` started by the launcher
    ``launcher_pid`` (not the ``hpcps.keeper`` that started it), or of a ``hpcps.join``
    launch's rank ``rank``."""
    want = {f"{name}={rank}".encode() for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")}
    for pid in descendants(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want & set(env) and (b"hpcps.train" in cmd or b"hpcps.join" in cmd):
            return pid
    return None


def find_rank(launcher_pid: int, rank: int, timeout: float) -> int:
    """The pid of world rank ``rank`` once it has started (see :func:`rank_pid`). A test that
    kills at a step looks it up first: a scan of /proc on a busy machine takes long enough
    for a fast run to end before the signal lands."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = rank_pid(launcher_pid, rank)
        if pid is not None:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} not found under launcher pid {launcher_pid} "
                         f"within {timeout} s")


def wait_for_step(metrics: Path, step: int, timeout: float) -> int:
    """Wait until the run's metrics hold a progress record at ``step`` or beyond; that
    record's step. The file is read on from where the last look stopped, every 20 ms."""
    deadline = time.monotonic() + timeout
    seen = 0
    pending = b""
    while time.monotonic() < deadline:
        if metrics.exists():
            with open(metrics, "rb") as fh:
                fh.seek(seen)
                chunk = fh.read()
            seen += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("kind") == "progress" and rec.get("step", 0) >= step:
                    return rec["step"]
        time.sleep(0.02)
    raise AssertionError(f"no progress record at step {step} in {metrics} within {timeout} s")


def kill_rank(launcher_pid: int, rank: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` (SIGKILL unless given) to world rank ``rank``'s process; its pid."""
    pid = rank_pid(launcher_pid, rank)
    if pid is None:
        raise AssertionError(f"rank {rank} not found under launcher pid {launcher_pid}")
    os.kill(pid, sig)
    return pid


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The run's metrics records (of ``kind``, else all), skipping a line being written."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if kind is None or rec["kind"] == kind:
            out.append(rec)
    return out
