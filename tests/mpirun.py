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


_FLAVORS: dict[str, str] = {}


def mpi_flavor(launcher: str | None = None) -> str:
    """``"openmpi"`` or ``"mpich"``: the MPI whose launcher ``launcher`` (default
    :func:`mpiexec`) is, from what its ``--version`` prints ("mpirun (Open MPI) 5.0.11";
    Hydra's "HYDRA build details"). ``$HPCPS_MPI`` (``openmpi`` or ``mpich``) overrides it.
    Anything else is taken for MPICH, the suite's own MPI (the ``mpich`` wheel)."""
    forced = os.environ.get("HPCPS_MPI", "").lower()
    if forced in ("openmpi", "mpich"):
        return forced
    launcher = launcher or mpiexec()
    if launcher not in _FLAVORS:
        try:
            said = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            said = ""
        _FLAVORS[launcher] = "openmpi" if "Open MPI" in said else "mpich"
    return _FLAVORS[launcher]


def launch_flags(flavor: str | None = None) -> list[str]:
    """What every launch passes after the launcher, before ``-n``.

    MPICH's Hydra: nothing. Open MPI: ``--oversubscribe`` (the suite starts more ranks than a
    2-core machine has cores, which Hydra allows and Open MPI refuses without it), ``--bind-to
    none`` (Open MPI binds each rank to a core by default, Hydra binds nothing: a bound rank's
    Hogwild threads and heartbeat thread would share one core), and, as root,
    ``--allow-run-as-root`` (Open MPI refuses to start as root without it; CI runs as root).
    """
    if (flavor or mpi_flavor()) != "openmpi":
        return []
    flags = ["--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return flags


def mpiexec_cmd(n: int, *, survive_rank_death: bool = False, ulfm: bool = False) -> list[str]:
    """``[mpiexec, flags..., -n, n]`` for this MPI (:func:`launch_flags`). With
    ``survive_rank_death``, the launcher is told to leave the other ranks running when one
    dies: MPICH's ``-disable-auto-cleanup`` (with ranks started through ``hpcps.keeper``:
    :func:`rank_module`, docs/fault-tolerance.md), Open MPI's ``--enable-recovery``
    (docs/mpi.md), or with ``ulfm`` Open MPI's ``--with-ft ulfm`` (MPI then reports the
    death to the survivors as ``MPI_ERR_PROC_FAILED``)."""
    flavor = mpi_flavor()
    survive = []
    if survive_rank_death:
        survive = (["--with-ft", "ulfm"] if ulfm else ["--enable-recovery"]) \
            if flavor == "openmpi" else ["-disable-auto-cleanup"]
    return [mpiexec(), *launch_flags(flavor), *survive, "-n", str(n)]


def rank_module(survive_rank_death: bool = False) -> str:
    """The module each rank runs for training: ``hpcps.train``, or for a launch whose ranks
    may die under MPICH, ``hpcps.keeper`` (Hydra kills the others when a rank it started is
    killed; Open MPI with ``--enable-recovery`` does not, and needs no keeper)."""
    if survive_rank_death and mpi_flavor() == "mpich":
        return "hpcps.keeper"
    return "hpcps.train"


LAUNCH_TAG = "HPCPS_TEST_LAUNCH"  # environment variable naming one launch's processes


WATCHED_NICE = 10  # how far below the watching test a watched job's ranks run


def below_the_watcher() -> None:
    """``preexec_fn`` of a job that a test watches and acts on at a step (a kill, a stop, a
    join): its ranks (which inherit it) run at a lower CPU priority than the test, so the
    test sees each progress record as it is written. A test starved by the ranks it watches
    on a loaded 2-core machine saw records up to 5 s late, and its kill landed after the run's
    last step. The ranks share the cores among themselves as before.

    The job is started in a session of its own (``start_new_session``), and where the kernel
    groups processes by session (``/proc/sys/kernel/sched_autogroup_enabled``), the nice of
    a process weighs it only against its own session's: the session's group as a whole gets
    as much CPU as the test's. So the group's nice is lowered too, or the test kept about a
    quarter of a core beside 4 busy ranks (measured: a loop of Python work took 4-5x longer
    than with the group's nice set)."""
    os.nice(WATCHED_NICE)
    if os.getsid(0) != os.getpid():
        return  # not the leader of a session of its own: the group is the test's too
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(WATCHED_NICE))
    except OSError:
        pass  # no autogroup in this kernel: the process's nice is enough


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


def run_mpi(n: int, args: list[str], timeout: float = 240, cwd=None, env=None,
            survive_rank_death: bool = False) -> Run:
    """Run ``mpiexec -n n <python> args...``; kill it and fail if it outlives ``timeout``
    (``survive_rank_death``: :func:`mpiexec_cmd`'s)."""
    cmd = [*mpiexec_cmd(n, survive_rank_death=survive_rank_death), sys.executable, *args]
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

