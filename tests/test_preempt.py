"""Preemption under mpiexec: SIGTERM or SIGUSR1 mid-run stops every rank at a safe point with
a checkpoint and exit code 75; ``--resume auto`` continues the step count and the loss curve.

Each strategy is stopped once, with the signal sent either to mpiexec (which forwards it to
every rank) or to one rank alone (the others must learn of it through the stop vote), and
resumed. Every launch has a hard timeout (tests/mpirun.py) so a hang fails the test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from faultinject import records
from mpirun import ROOT, end_launch, mpi_flavor, mpiexec, tagged_env, train

from hpcps import config

from hpcps.io import checkpoint

from hpcps.runtime import keeper, slurm
from hpcps.errors import PREEMPTED_EXIT, CheckpointError, ConfigError

QUICK = ["--layers", "64,32,10", "--progress-every", "0.1",
         "--eval-every", "0", "--checkpoint-every", "0", "--timeout", "60"]


def rank_pids(root_pid: int) -> dict[int, int]:
    """{MPI rank: pid} of the python ranks below ``root_pid`` (PMI_RANK in their environment)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hpcps.train" not in cmd:
            continue
        for item in env:
            if item.startswith(b"PMI_RANK="):
                found[int(item.split(b"=", 1)[1])] = pid
    return found


def start(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` (a launch) started in a session of its own with hpcps on its path, its output
    piped; ``proc.tag`` ends its processes alone (:func:`mpirun.end_launch`)."""
    env, tag = tagged_env({**os.environ, "OPENBLAS_NUM_THREADS": "1",
                           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    proc.tag = tag  # type: ignore[attr-defined]
    return proc


def run_and_signal(n: int, args: list[str], run_dir: Path, sig: int, target: str,
                   after_step: int, timeout: float = 120):
    """Start ``mpiexec -n n python -m hpcps.train args``; once a progress record past
    ``after_step`` is in ``run_dir``, send ``sig`` to mpiexec (``target="mpiexec"``), to
    one rank (``target="rank:R"``) or to mpiexec and every rank at once (``target="all"``,
    as ``pkill -f hpcps.train`` does: each rank gets it twice, directly and forwarded).
    Returns (exit code, output, the step signalled at)."""
    proc = start([mpiexec(), "-n", str(n), sys.executable, "-m", "hpcps.train", *args])
    deadline = time.monotonic() + timeout
    sent_at = None
    try:
        while sent_at is None:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before it was signalled:\n"
                                     f"{proc.stdout.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no progress past step {after_step} within {timeout} s")
            steps = [r["step"] for r in records(run_dir, "progress")]
            if steps and steps[-1] >= after_step:
                sent_at = steps[-1]
                if target == "mpiexec":
                    os.kill(proc.pid, sig)
                elif target == "all":
                    for pid in [proc.pid, *rank_pids(proc.pid).values()]:
                        os.kill(pid, sig)
                else:
                    rank = int(target.split(":")[1])
                    os.kill(rank_pids(proc.pid)[rank], sig)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        end_launch(proc.pid, proc.tag)
        proc.communicate()
        raise
    return proc.returncode, out, sent_at


# strategy, ranks, extra options, signal, who receives it
CASES = [
    ("sync", 3, ["--batch-size", "16"], signal.SIGUSR1, "mpiexec"),
    ("sync", 4, ["--partitions", "2"], signal.SIGTERM, "rank:3"),
    ("sync", 4, ["--partitions", "2"], signal.SIGTERM, "all"),
    ("averaging", 3, ["--average-every", "3"], signal.SIGTERM, "rank:2"),
    ("downpour", 4, ["--servers", "1", "--warmup-steps", "20"], signal.SIGUSR1, "rank:3"),
    ("downpour", 4, ["--partitions", "2", "--servers", "2", "--warmup-steps", "0"],
     signal.SIGTERM, "rank:1"),
    ("deadreckon", 2, ["--tau", "0.003", "--lr", "0.05", "--warmup-steps", "20"],
     signal.SIGUSR1, "rank:1"),
    ("sandblaster", 4, ["--portions", "8", "--batch-size", "200"],
     signal.SIGTERM, "rank:0"),
]


@pytest.mark.parametrize("strategy,n,extra,sig,target", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in CASES])
def test_signal_stops_checkpoints_and_resume_auto_continues(strategy, n, extra, sig, target,
                                                             digits_h5, tmp_path):
    extra = extra if strategy == "sandblaster" or "--batch-size" in extra else \
        ["--batch-size", "16", *extra]
    steps = "400" if strategy == "sandblaster" else "200000"  # far more than the test waits
    args = ["--strategy", strategy, "--data", str(digits_h5), "--run-dir", str(tmp_path),
            "--resume", "auto", "--steps", steps, *QUICK, *extra]
    after = 20 if strategy == "sandblaster" else 300
    code, out, sent_at = run_and_signal(n, args, tmp_path, sig, target, after)
    assert code == PREEMPTED_EXIT, out[-4000:]
    assert "no checkpoint in" in out and "starting fresh" in out, out[-2000:]
    assert "stopping early at step" in out and "exit code 75" in out, out[-3000:]
    first = records(tmp_path)
    summary = [r for r in first if r["kind"] == "summary"][-1]
    assert summary["stopped_early"] is True
    stopped = summary["step"]
    assert sent_at <= stopped < int(steps), (sent_at, stopped)
    ckpt = checkpoint.load(tmp_path / "checkpoint.h5")
    assert ckpt.step == stopped
    progress = [r for r in first if r["kind"] == "progress"]
    loss_before = [r["loss"] for r in progress if r["loss"] is not None][-1]

    # the requeued job: the same command; it must continue from the checkpoint
    total = stopped + (4 if strategy == "sandblaster" else 60 * n)
    args2 = [a if a != steps else str(total) for a in args]
    run = train(n, *args2, timeout=120)
    assert run.returncode == 0, run.output[-4000:]
    assert f"at step {stopped}" in run.stdout and "(--resume auto)" in run.stdout
    start = records(tmp_path, "start")
    assert len(start) == 2 and start[1]["start_step"] == stopped and start[1]["resume_auto"]
    later = [r for r in records(tmp_path, "progress")][len(progress):]
    # the step count continues (a first record may show the resumed step itself)
    assert later and all(r["step"] >= stopped for r in later), (stopped, later)
    assert later[-1]["step"] > stopped, (stopped, later)
    # the loss curve continues: not back at an untrained model's (about ln 10 = 2.3); a record
    # written before the resumed run's first step (a loaded machine) has no loss yet
    losses = [r for r in later if r["loss"] is not None]
    assert losses, later
    assert losses[0]["loss"] < max(1.5 * loss_before, 1.0), (loss_before, losses[0])
    final = records(tmp_path, "summary")[-1]
    assert final["stopped_early"] is False and final["step"] >= total
    assert checkpoint.load(tmp_path / "checkpoint.h5").step == final["step"]


FLAG_PROBE = """
import os, signal, sys, time
from hpcps.runtime.stop import SignalFlag
flag = SignalFlag(duplicate_s=float(sys.argv[1])).install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the same request, forwarded: still alive
print("alive", flag.name, flush=True)
time.sleep(float(sys.argv[1]) + 0.3)
os.kill(os.getpid(), signal.SIGTERM)  # a later one: the default action, death
time.sleep(5)
print("survived")
"""


def test_a_duplicate_sigterm_is_one_request_and_a_later_one_kills():
    run = subprocess.run([sys.executable, "-c", FLAG_PROBE, "0.5"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert run.stdout.split() == ["alive", "SIGTERM"], (run.stdout, run.stderr)
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stderr)


WITHOUT_VOTE_PROBE = """
import os, signal, sys
from hpcps.runtime.stop import SignalFlag
flag = SignalFlag().install()
flag.without_vote(hydra=sys.argv[1] == "hydra")
os.kill(os.getpid(), signal.SIGUSR1)
print(flag.name or "nothing", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print(flag.name, flush=True)
"""


def test_without_a_vote_sigusr1_asks_for_a_stop_except_under_hydra():
    """A run whose ranks may die keeps its signals as stop requests (downpour stops by its
    own messages), but under Hydra SIGUSR1 is the notice of a dead rank: ignored there."""
    got = {}
    for where in ("hydra", "srun"):
        run = subprocess.run([sys.executable, "-c", WITHOUT_VOTE_PROBE, where],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        got[where] = run.stdout.split()
    assert got == {"hydra": ["nothing", "SIGTERM"], "srun": ["SIGUSR1", "SIGTERM"]}


@pytest.mark.skipif(mpi_flavor() != "mpich", reason="Hydra is MPICH's launcher")
def test_hydra_is_recognised_by_the_environment_it_gives_its_ranks():
    """keeper.under_hydra reads a variable Hydra sets in every process it starts: this
    Hydra's ranks have it, and a process outside any launcher has not."""
    code = "from hpcps.runtime.keeper import under_hydra; print(under_hydra())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(keeper.HYDRA_ENV, None)
    run = subprocess.run([mpiexec(), "-n", "1", sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=60)
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert (run.stdout.strip(), alone.stdout.strip()) == ("True", "False"), (run, alone)


EARLY_PROBE = """
import os, signal, sys, time
from hpcps.train import catch_early
from hpcps.runtime.stop import SignalFlag
early = catch_early()
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
flag = SignalFlag().install(early=early)
if sys.argv[2] == "hydra":
    flag.without_vote(hydra=True)
elif sys.argv[2] == "uninstall":
    flag.uninstall()
    time.sleep(5)
print(flag.name or "nothing", flush=True)
"""


def test_a_signal_before_the_jobs_handlers_is_taken_when_they_come():
    """What :func:`hpcps.train.catch_early` records while a rank imports and starts MPI is
    the flag's, as if it came after; an early SIGUSR1 under Hydra (a rank died) is dropped
    with the rest of Hydra's, and an early SIGTERM in a run whose SIGTERM is a death
    (:meth:`SignalFlag.uninstall`) kills the rank then."""
    def probe(sig, how):
        return subprocess.run([sys.executable, "-c", EARLY_PROBE, sig, how], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert probe("SIGTERM", "vote").stdout.split() == ["SIGTERM"]
    assert probe("SIGUSR1", "vote").stdout.split() == ["SIGUSR1"]
    assert probe("SIGUSR1", "hydra").stdout.split() == ["nothing"]
    assert probe("SIGTERM", "hydra").stdout.split() == ["SIGTERM"]
    died = probe("SIGTERM", "uninstall")
    assert died.returncode == -signal.SIGTERM and not died.stdout, died


def _mpi_loaded(pid: int) -> bool:
    try:
        return "libmpi" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(mpi_flavor() != "mpich", reason="ranks found by PMI_RANK; the keeper")
@pytest.mark.parametrize("how", ["vote", "keeper"])
def test_a_signal_while_the_ranks_start_stops_the_run_with_75(how, digits_h5, tmp_path):
    """SIGTERM to mpiexec as soon as every rank has loaded MPI (it then still starts MPI and
    imports the rest of hpcps, about a second, before its handlers are installed): the run
    stops at its first steps with a checkpoint and exit code 75, as a later signal does.
    Before, the ranks died on the signal: mpiexec exited 15 (a Slurm script does not
    requeue that), and under the keeper 0, as if the run had completed."""
    n = 3
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "hpcps.train"]
    extra = []
    if how == "keeper":
        cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(n), sys.executable, "-m",
               "hpcps.keeper"]
        extra = ["--heartbeat-timeout", "5"]
    args = ["--data", str(digits_h5), "--run-dir", str(tmp_path), "--steps", "20000",
            "--batch-size", "16", *QUICK, *extra]
    proc = start([*cmd, *args])
    try:
        deadline = time.monotonic() + 60
        while True:
            pids = rank_pids(proc.pid)
            if len(pids) == n and all(_mpi_loaded(p) for p in pids.values()):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "no ranks with MPI"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    except BaseException:
        end_launch(proc.pid, proc.tag)
        proc.communicate()
        raise
    assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
    assert "was killed by" not in out, out[-3000:]
    (stop,) = records(tmp_path, "stop")
    summary = records(tmp_path, "summary")[-1]
    assert summary["stopped_early"] and stop["signal"] == "SIGTERM", (summary, stop)
    assert checkpoint.load(tmp_path / "checkpoint.h5").step == summary["step"] < 20000


@pytest.mark.skipif(mpi_flavor() != "mpich", reason="ranks found by PMI_RANK")
def test_ctrl_c_ends_the_job_with_130_and_one_line(digits_h5, tmp_path):
    """SIGINT to every rank of a running job (as Ctrl-C in a terminal reaches the foreground
    group): one line from rank 0, no traceback from any rank, exit code 130 at once (a
    rank interrupted in Python aborts the job; the others may be inside a collective, where
    a KeyboardInterrupt would not be seen until it returns)."""
    args = ["--strategy", "sync", "--data", str(digits_h5), "--run-dir", str(tmp_path),
            "--steps", "200000", "--batch-size", "16", *QUICK]
    proc = start([mpiexec(), "-n", "3", sys.executable, "-m", "hpcps.train", *args])
    try:
        deadline = time.monotonic() + 60
        while not [r for r in records(tmp_path, "progress") if r["step"] >= 200]:
            assert proc.poll() is None and time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        for pid in rank_pids(proc.pid).values():
            os.kill(pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    except BaseException:
        end_launch(proc.pid, proc.tag)
        proc.communicate()
        raise
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and out.count("interrupted (Ctrl-C)") == 1, out[-3000:]


def test_a_finished_run_exits_0_and_signals_after_it_change_nothing(digits_h5, tmp_path):
    """A run that was never signalled ends with 0; the vote adds no exit code of its own."""
    run = train(3, "--strategy", "downpour", "--data", str(digits_h5), "--run-dir",
                str(tmp_path), "--steps", "300", "--resume", "auto", *QUICK, timeout=120)
    assert run.returncode == 0, run.output
    assert records(tmp_path, "summary")[-1]["stopped_early"] is False


# -- no MPI: the pieces ---------------------------------------------------------------------------
def test_resume_auto_needs_a_stable_run_directory():
    cfg = config.parse(["--resume", "auto"])
    with pytest.raises(ConfigError, match="give --run-dir"):
        config.run_dir_for(cfg, "20260101-000000", None)
    assert config.run_dir_for(cfg, "x", "123") == Path("runs/slurm-123")
    cfg = config.parse(["--resume", "auto", "--run-dir", "r"])
    assert config.run_dir_for(cfg, "x", None) == Path("r")
    cfg = config.parse([])
    assert config.run_dir_for(cfg, "x", None) == Path("runs/downpour-x")


def test_slurm_environment():
    assert slurm.job_name({}) is None
    assert slurm.job_name({"SLURM_JOB_ID": "42"}) == "42"
    env = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm.job_name(env) == "40_3"
    assert slurm.describe(env)["array_task_id"] == "3"
    step = {"SLURM_JOB_ID": "42", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}
    slurm.check_tasks(step, 4)
    slurm.check_tasks({"SLURM_JOB_ID": "42", "SLURM_STEP_NUM_TASKS": "1"}, 1)
    with pytest.raises(ConfigError, match="srun --mpi=pmi2"):
        slurm.check_tasks(step, 1)


def test_latest_checkpoint_picks_the_newest_valid(digits_h5, tmp_path):
    run = train(1, "--strategy", "sync", "--data", str(digits_h5), "--run-dir", str(tmp_path),
                "--steps", "30", *QUICK, timeout=60)
    assert run.returncode == 0, run.output
    assert checkpoint.latest(tmp_path / "nothing-here") == (None, [])
    good = tmp_path / "checkpoint.h5"
    ckpt, skipped = checkpoint.latest(tmp_path)
    assert ckpt.step == 30 and skipped == []
    # a newer file of the same step whose weights are damaged is tried first and skipped,
    # with the reason; a temporary file is no candidate
    data = bytearray(good.read_bytes())
    with h5py.File(good, "r") as f:
        off = f["params/layer0/W"].id.get_chunk_info(0).byte_offset
    for i in range(off + 8, off + 64):
        data[i] ^= 0xFF
    (tmp_path / "checkpoint-new.h5").write_bytes(bytes(data))
    (tmp_path / "checkpoint.h5.tmp-99").write_bytes(bytes(data))
    ckpt, skipped = checkpoint.latest(tmp_path)
    assert ckpt.path == good and len(skipped) == 1 and "checkpoint-new.h5" in skipped[0]
    good.unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        checkpoint.latest(tmp_path)
