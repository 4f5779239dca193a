"""The batch scripts in jobs/, submitted to a live one-node Slurm cluster.

The cluster is the one ``jobs/slurm-local/setup.sh`` brings up (CI installs Slurm and munge
and starts it before pytest; see .ci/run). These tests skip, saying why, where Slurm is not
installed or the cluster is not running and cannot be started (starting needs root); where
it is installed and this is root, a cluster that fails to start fails the tests. A cluster
this module started is stopped at its end.

Every job runs a few seconds on the digits dataset; every wait has a time limit, and a
failing test prints the job's output file.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mpirun import ROOT, mpi_flavor

from hpcps.io import checkpoint
from hpcps.errors import PREEMPTED_EXIT

SETUP = ROOT / "jobs" / "slurm-local" / "setup.sh"
JOBS = ROOT / "jobs"
SMALL = ["--layers", "64,32,10", "--batch-size", "16", "--progress-every", "0.1",
         "--eval-every", "100", "--checkpoint-every", "0", "--timeout", "60"]
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def _sh(*cmd, timeout=60, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def cluster():
    """A running one-node Slurm cluster (started here if need be, and stopped again)."""
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "munged")
               if shutil.which(c) is None and not Path(f"/usr/sbin/{c}").exists()]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): as root, "
                    f"{SETUP.relative_to(ROOT)} start --install installs slurm-wlm and munge "
                    "with apt-get and starts a one-node cluster")
    if _sh(SETUP, "status").returncode == 0:
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster is not running and starting it needs root: "
                    f"sudo {SETUP.relative_to(ROOT)} start")
    run = _sh(SETUP, "start", timeout=120)
    if run.returncode == 4:
        pytest.skip(f"this machine has a Slurm configuration of its own: {run.stderr.strip()}")
    assert run.returncode == 0, f"{SETUP} start failed:\n{run.stdout}{run.stderr}"
    yield
    _sh(SETUP, "stop", timeout=60)


def job_env(**extra) -> dict:
    """sbatch passes the environment on: this Python first on PATH, the checkout importable."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def submit(workdir: Path, script: str, sbatch_args=(), args=(), **env) -> str:
    run = _sh("sbatch", "--parsable", f"--chdir={workdir}", *sbatch_args, JOBS / script, *args,
              env=job_env(**env))
    assert run.returncode == 0, f"sbatch {script} failed: {run.stderr}"
    return run.stdout.strip().split(";")[0]


def job_states(job: str) -> list[dict]:
    """``scontrol show job -o`` as dicts (one per array task)."""
    run = _sh("scontrol", "show", "job", "-o", job)
    assert run.returncode == 0, f"scontrol show job {job}: {run.stderr}"
    out = []
    for line in run.stdout.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        out.append(fields)
    return out


def wait_for(job: str, done, timeout: float, workdir: Path, what: str) -> list[dict]:
    """Poll until ``done(states)``; on time out cancel the job and fail with its output."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(job)
        if done(states):
            return states
        if time.monotonic() > deadline:
            _sh("scancel", job)
            pytest.fail(f"job {job} did not {what} within {timeout} s: "
                        f"{[(s.get('JobId'), s.get('JobState'), s.get('Reason')) for s in states]}"
                        f"\n{outputs(workdir)}")
        time.sleep(0.3)


def finished(states) -> bool:
    return all(s.get("JobState") in DONE for s in states)


def outputs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                     for p in sorted(workdir.glob("hpcps*.out")))


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["kind"] == kind:
            out.append(rec)
    return out


def test_train_job(cluster, digits_h5, tmp_path):
    """train.sbatch as submitted: srun without --mpi (the site's MpiDefault), --threads from
    -c with one BLAS thread per rank, the run in runs/slurm-<job id>."""
    job = submit(tmp_path, "train.sbatch", ["--ntasks-per-node=3", "--cpus-per-task=2"],
                 ["--data", digits_h5, "--steps", "300", *SMALL])
    (state,) = wait_for(job, finished, 90, tmp_path, "finish")
    out = (tmp_path / f"hpcps-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out
    assert state["NumNodes"] == "1", state   # the script's default: one node
    assert "3 tasks x 2 CPUs, srun without --mpi (MpiDefault) --threads 2" in out, out
    run_dir = tmp_path / "runs" / f"slurm-{job}"   # hpcps.train read SLURM_JOB_ID
    assert checkpoint.load(run_dir / "checkpoint.h5").step == 300
    assert "final test accuracy" in out and "no checkpoint in" in out
    start = records(run_dir, "start")[0]
    assert start["ranks"] == 3 and start["slurm"]["job_id"] == job, start
    assert start["config"]["threads"] == 2 and start["slurm"]["cpus_per_task"] == "2", start
    assert records(run_dir, "summary")[0]["test_accuracy"] > 0.8


@pytest.mark.openmpi
def test_train_job_under_open_mpi_with_srun_pmix(cluster, digits_h5, tmp_path):
    """Open MPI 5 speaks PMIx only: train.sbatch with HPCPS_SRUN_MPI=pmix starts its 3 tasks
    as one MPI job of 3 ranks (not 3 singletons), and it trains."""
    if mpi_flavor() != "openmpi":
        pytest.skip("runs with an Open MPI build of mpi4py (CI's Open MPI step, "
                    ".ci/openmpi-smoke)")
    probe = _sh("srun", "--mpi=pmix", "-n", "1", "true", timeout=60)
    if probe.returncode != 0:
        pytest.skip("this Slurm cannot start a PMIx step (srun --mpi=pmix: "
                    f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else '?'}"
                    "); its mpi/pmix plugin needs libpmix.so: apt-get install libpmix-dev, "
                    "then restart slurmd")
    job = submit(tmp_path, "train.sbatch", ["--ntasks-per-node=3"],
                 ["--data", digits_h5, "--steps", "300", *SMALL], HPCPS_SRUN_MPI="pmix")
    (state,) = wait_for(job, finished, 120, tmp_path, "finish")
    out = (tmp_path / f"hpcps-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out
    assert "srun --mpi=pmix" in out, out
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    start = records(run_dir, "start")[0]
    assert start["ranks"] == 3, start
    assert records(run_dir, "summary")[0]["test_accuracy"] > 0.8


def test_blas_threads_are_one_per_rank(cluster, tmp_path):
    """What the scripts export reaches every task of the step, whatever -c is (a probe
    script in train.sbatch's place: the same environment lines, srun as it runs)."""
    lines = (JOBS / "train.sbatch").read_text().splitlines()
    head = lines[:next(i for i, line in enumerate(lines) if line.startswith("PREEMPTED="))]
    probe = tmp_path / "probe.sbatch"
    probe.write_text("\n".join(head) + "\nsrun $mpi --cpus-per-task=\"$cpus\" bash -c "
                     "'echo task $SLURM_PROCID: $OPENBLAS_NUM_THREADS $OMP_NUM_THREADS "
                     "$MKL_NUM_THREADS cpus $SLURM_CPUS_PER_TASK'\necho threads: $threads\n")
    run = _sh("sbatch", "--parsable", f"--chdir={tmp_path}", "--ntasks-per-node=2", "-c3",
              f"--output={tmp_path}/hpcps-probe.out", probe, env=job_env(
                  OPENBLAS_NUM_THREADS="8", OMP_NUM_THREADS="8", MKL_NUM_THREADS="8"))
    assert run.returncode == 0, run.stderr
    job = run.stdout.strip()
    (state,) = wait_for(job, finished, 60, tmp_path, "finish")
    out = (tmp_path / "hpcps-probe.out").read_text()
    assert state["ExitCode"] == "0:0", out
    assert sorted(x for x in out.splitlines() if x.startswith("task")) == \
        ["task 0: 1 1 1 cpus 3", "task 1: 1 1 1 cpus 3"], out
    assert "threads: --threads 3" in out, out


def test_preemptible_job_is_requeued_and_continues(cluster, digits_h5, tmp_path):
    """SIGUSR1 to the batch shell only, as ``--signal=B:USR1@120`` sends it: the script
    forwards it to the job step, every rank stops with a checkpoint (exit code 75), the
    script requeues the job, and the second start continues from the checkpoint."""
    stop_requeue_continue(tmp_path, digits_h5, "preemptible.sbatch", "hpcps-long",
                          ["--signal=USR1", "--batch"])


def test_train_job_is_requeued_on_a_stop(cluster, digits_h5, tmp_path):
    """SIGTERM to the batch shell: train.sbatch passes it to the job step as USR1 (a SIGTERM
    to srun would cancel the step), requeues on exit code 75 as preemptible.sbatch does, and
    the run continues in the same directory."""
    stop_requeue_continue(tmp_path, digits_h5, "train.sbatch", "hpcps",
                          ["--signal=TERM", "--batch"])


def test_a_run_that_survives_deaths_is_requeued_on_a_stop(cluster, digits_h5, tmp_path):
    """A downpour run whose ranks may die (--heartbeat-timeout: no stop vote) under
    train.sbatch: the USR1 the script passes to the job step reaches every rank (srun, not
    Hydra, so it means "stop"); rank 0 stops the run by its own messages, the checkpoint is
    written, the job exits 75, is requeued, and continues from that step."""
    stop_requeue_continue(tmp_path, digits_h5, "train.sbatch", "hpcps",
                          ["--signal=TERM", "--batch"],
                          extra=["--strategy", "downpour", "--heartbeat-timeout", "5"])


def long_run_past_step_300(tmp_path: Path, digits_h5, script: str,
                           extra=()) -> tuple[Path, str, Path]:
    """Submit ``script`` for a run of 1,000,000 steps (its length in a config file, which a
    test may shorten) and wait until it is past step 300: (config file, job id, run dir)."""
    conf = tmp_path / "run.toml"
    conf.write_text("steps = 1000000\n")
    job = submit(tmp_path, script, ["--nodes=1", "--ntasks-per-node=3"],
                 ["--data", digits_h5, "--config", conf, *SMALL, *extra])
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    deadline = time.monotonic() + 90
    while not [r for r in records(run_dir, "progress") if r["step"] >= 300]:
        if finished(job_states(job)) or time.monotonic() > deadline:
            pytest.fail(f"job {job} made no progress past step 300 before it ended or 90 s "
                        f"passed\n{outputs(tmp_path)}")
        time.sleep(0.1)
    return conf, job, run_dir


@pytest.mark.parametrize("script,tag", [("train.sbatch", "hpcps"),
                                        ("preemptible.sbatch", "hpcps-long")])
def test_a_plain_scancel_ends_the_job_with_a_checkpoint_and_no_requeue(cluster, digits_h5,
                                                                        tmp_path, script, tag):
    """``scancel JOB`` (no --signal) is the user ending the job: hpcps stops with its
    checkpoint (exit code 75) and the script does not requeue it (it did: the job started
    again and ran on), but says how to continue."""
    conf, job, run_dir = long_run_past_step_300(tmp_path, digits_h5, script)
    assert _sh("scancel", job).returncode == 0
    (state,) = wait_for(job, finished, 60, tmp_path, "end")
    time.sleep(2)  # Slurm marks the job CANCELLED at once; the script's last lines follow
    out = (tmp_path / f"hpcps-{job}.out").read_text()
    assert state["JobState"] == "CANCELLED", (state, out)
    assert job_states(job)[0]["Restarts"] == "0" and "requeueing" not in out, out
    if "exit code 75" in out:  # hpcps stopped with its checkpoint before Slurm's SIGKILL
        assert f"{tag}: job {job} cancelled (scancel): checkpoint written, not requeued" in out
        assert records(run_dir, "summary")[0]["stopped_early"] is True


def stop_requeue_continue(tmp_path: Path, digits_h5, script: str, tag: str,
                          signal: list[str], extra=()) -> None:
    """Submit ``script``, signal it with ``scancel SIGNAL`` past step 300, wait for its
    requeue, let it start again and check that the run continued to its end.

    The run's length comes from a config file, far longer than the test waits at first and
    shortened while the job waits to start again (the command line is the same at every
    start), so the test does not depend on how fast this machine is today. ``extra``: more
    options for the run (a downpour run whose ranks may die ends a few steps past its total:
    its replicas end one by one)."""
    conf, job, run_dir = long_run_past_step_300(tmp_path, digits_h5, script, extra)
    assert _sh("scancel", *signal, job).returncode == 0
    # srun passes the stop on through slurmd; once in CI it could not reach it ("Failure
    # sending signal 10 to StepId=...: Communication connection failure") and the run never
    # heard: ask again, as a user would, while the run has not begun to stop
    for _ in range(3):
        asked = time.monotonic()
        while time.monotonic() - asked < 15:
            if records(run_dir, "stop") or job_states(job)[0]["JobState"] != "RUNNING":
                break
            time.sleep(0.2)
        else:
            _sh("scancel", *signal, job)
            continue
        break
    wait_for(job, lambda s: s[0].get("Restarts") == "1" and s[0]["JobState"] == "PENDING",
             60, tmp_path, "requeue itself")
    (first,) = records(run_dir, "summary")
    assert first["stopped_early"] is True and first["step"] >= 300, first
    total = first["step"] + 600
    conf.write_text(f"steps = {total}\n")
    # Slurm holds a requeued job (BeginTime, about 2 minutes) so that the old incarnation's
    # credential is revoked before a new one is issued; a start in the same second fails
    # ("Job credential revoked"). Let it start again 3 s from now.
    assert _sh("scontrol", "update", f"jobid={job}", "starttime=now+3").returncode == 0
    (state,) = wait_for(job, finished, 90, tmp_path, "finish after its requeue")
    out = (tmp_path / f"hpcps-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", out
    assert f"exit code {PREEMPTED_EXIT}" in out and "requeueing job" in out, out
    assert out.count(f"{tag}: job {job} start") == 2, out   # two starts, one output file
    starts = records(run_dir, "start")
    assert starts[1]["start_step"] == first["step"] and starts[1]["resume_auto"] is True
    assert starts[1]["slurm"]["restart_count"] == "1"
    second = records(run_dir, "summary")[1]
    past = 0 if not extra else 16   # replicas ending one by one: each may push once more
    assert second["stopped_early"] is False and total <= second["step"] <= total + past
    steps = [r["step"] for r in records(run_dir, "progress")]
    assert steps == sorted(steps), steps   # one curve: the step count continues
    assert checkpoint.load(run_dir / "checkpoint.h5").step == second["step"]


def test_sweep_array_and_its_report(cluster, digits_h5, tmp_path):
    """Two array tasks with the PMI named by HPCPS_SRUN_MPI, then the report as the script's
    header submits it: a job that waits for the whole array (afterany) and compares both."""
    job = submit(tmp_path, "sweep.sbatch", ["--array=0-1", "--nodes=1", "--ntasks-per-node=2"],
                 ["--data", digits_h5, "--steps", "200", *SMALL],
                 HPCPS_SWEEP_STRATEGIES="sync averaging", HPCPS_SWEEP_LRS="0.05",
                 HPCPS_SRUN_MPI="pmi2")
    report = _sh("sbatch", "--parsable", f"--chdir={tmp_path}", f"--dependency=afterany:{job}",
                 "--output=hpcps-report-%j.out", "--wrap",
                 f"python -m hpcps.report runs/slurm-{job}_* --out runs/sweep-{job} "
                 "--no-figures", env=job_env())
    assert report.returncode == 0, report.stderr
    report_job = report.stdout.strip()
    states = wait_for(job, lambda s: len(s) == 2 and finished(s), 120, tmp_path, "finish")
    assert all(s["JobState"] == "COMPLETED" and s["ExitCode"] == "0:0" for s in states), \
        outputs(tmp_path)
    assert "srun --mpi=pmi2" in outputs(tmp_path)
    for task, strategy in enumerate(["sync", "averaging"]):
        run_dir = tmp_path / "runs" / f"slurm-{job}_{task}"
        config = records(run_dir, "start")[0]["config"]
        assert config["strategy"] == strategy and config["lr"] == 0.05, config
        assert records(run_dir, "summary")[0]["step"] >= 200
    (state,) = wait_for(report_job, finished, 60, tmp_path, "report")
    assert state["JobState"] == "COMPLETED", outputs(tmp_path)
    table = (tmp_path / "runs" / f"sweep-{job}" / "summary.md").read_text()
    assert f"slurm-{job}_0" in table and f"slurm-{job}_1" in table, table


def test_a_second_run_in_one_job_is_refused_not_mixed(cluster, digits_h5, tmp_path):
    """Two runs in one allocation share its default run directory: the first trains there,
    a retry of it continues it, a different run is refused (exit code 2, naming --run-dir)
    and runs where --run-dir says."""
    args = f"--data {digits_h5} --steps 100 {' '.join(SMALL)}"
    script = tmp_path / "two.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --output=hpcps-two-%j.out
train() {{ srun python -m hpcps.train {args} --resume auto "$@"; echo "exit code $?"; }}
train --strategy sync
train --strategy sync
train --strategy averaging
train --strategy averaging --run-dir runs/slurm-$SLURM_JOB_ID-2
""")
    run = _sh("sbatch", "--parsable", f"--chdir={tmp_path}", "--ntasks=2", script,
              env=job_env())
    assert run.returncode == 0, run.stderr
    job = run.stdout.strip()
    wait_for(job, finished, 120, tmp_path, "finish")
    out = (tmp_path / f"hpcps-two-{job}.out").read_text()
    assert [x for x in out.splitlines() if x.startswith("exit code")] == \
        ["exit code 0", "exit code 0", "exit code 2", "exit code 0"], out
    assert f"runs/slurm-{job} (this Slurm job's default) holds a sync run with another " \
        "configuration (strategy: 'sync' there, 'averaging' here" in out, out
    assert f"--run-dir runs/slurm-{job}-2" in out, out
    first = tmp_path / "runs" / f"slurm-{job}"
    assert [r["config"]["strategy"] for r in records(first, "start")] == ["sync", "sync"]
    assert records(first, "start")[1]["start_step"] == 100   # the retry continued it
    (other,) = records(tmp_path / "runs" / f"slurm-{job}-2", "start")
    assert other["config"]["strategy"] == "averaging"


def test_prepare_data_job(cluster, tmp_path):
    job = submit(tmp_path, "prepare-data.sbatch", args=["digits"])
    (state,) = wait_for(job, finished, 90, tmp_path, "finish")
    assert state["JobState"] == "COMPLETED", outputs(tmp_path)
    from hpcps.io.data import open_dataset
    assert open_dataset(tmp_path / "data" / "digits.h5").n_train == 1437
    job = submit(tmp_path, "prepare-data.sbatch", args=["digits"])   # kept, not redone
    (state,) = wait_for(job, finished, 90, tmp_path, "finish")
    assert "digits.h5 is already prepared" in (tmp_path / f"hpcps-data-{job}.out").read_text()


def test_srun_without_pmi_is_refused(cluster, digits_h5, tmp_path):
    """With a PMI the MPI library does not speak (--mpi=none) every task is rank 0 of 1:
    refused, not trained N times, with advice that names the site's types."""
    run = _sh("srun", "--mpi=none", "-n", "2", sys.executable, "-m", "hpcps.train",
              "--data", digits_h5, "--steps", "10", *SMALL, timeout=90, env=job_env(),
              cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "srun started 2 tasks but MPI sees 1 rank(s)" in run.stderr
    assert "srun --mpi=list" in run.stderr and "HPCPS_SRUN_MPI" in run.stderr, run.stderr
    assert not (tmp_path / "runs").exists()


def test_a_rank_killed_under_srun_leaves_the_others_running(cluster, digits_h5, tmp_path):
    """srun --kill-on-bad-exit=1 (what a site's KillOnBadExit=1 does) would cancel the step
    when a rank dies; started through hpcps.keeper with --wait=0, the other ranks of a
    downpour run with --heartbeat-timeout finish it, rank 2 named lost, exit code 0.

    Rank 2 is killed once the run's metrics show step 1,500 of 20,000. On a loaded machine
    this test's own process can be off the cores for seconds and see that step only after
    the training has ended (it takes about 5 s): such a kill tests something else (the
    survivors then wait up to 10 s for the dead rank's final figures,
    tests/mpi/test_faults_finish.py), so the job is ended and started again, at most three
    times, and the test fails saying so."""
    steps = 20000
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        outcome = _kill_rank_2_under_srun(digits_h5, run_dir, steps)
        if outcome is not None:
            break
    else:
        raise AssertionError("rank 2 was killed after the training had ended in all three "
                             "attempts: this test's process got too little CPU to act in time")
    code, out = outcome
    assert code == 0, out[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in recs if r["kind"] == "summary")
    assert summary["lost_ranks"] == [2] and summary["step"] >= steps, out[-3000:]
    assert "hpcps.keeper: rank 2" in out


def _kill_rank_2_under_srun(digits_h5, run_dir: Path, steps: int):
    """Start the job, kill its rank 2 at step 1,500 or later, wait for the end: (exit code,
    output), or None when the kill came after the training had ended (the job is killed)."""
    from faultinject import wait_for_step

    name = f"hpcps-test-{uuid.uuid4().hex[:12]}"  # this job step's own name, to end it

    def end() -> None:  # srun killed, and its step: killing srun leaves the tasks running
        os.killpg(proc.pid, 9)
        _sh("scancel", "--name", name)

    cmd = ["srun", f"--job-name={name}", "--mpi=pmi2", "-n", "4", "--overcommit",
           "--kill-on-bad-exit=1",
           "--wait=0", sys.executable, "-m", "hpcps.keeper", "--data", str(digits_h5),
           *SMALL, "--steps", str(steps), "--heartbeat-timeout", "2", "--eval-every", "0",
           "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=job_env(), start_new_session=True)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 1500, 90)
        victim = next(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                      and _is_rank(d, 2, run_dir))
        os.kill(victim, 9)
        at = max(json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
                 .splitlines() if '"progress"' in x)
        if at >= steps:  # too late: training had ended
            end()
            proc.communicate()
            return None
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        where = _where_ranks_are(run_dir)
        end()
        out, _ = proc.communicate()
        raise AssertionError(f"no end within 120 s after rank 2 was killed\n{where}\n"
                             f"--- output\n{out[-3000:]}") from None
    except BaseException:
        end()
        raise
    return proc.returncode, out


def _where_ranks_are(run_dir: Path) -> str:
    """For a test that timed out: where each live rank of the run is (python -m hpcps.stacks)
    and the run's last metrics records."""
    from hpcps.runtime import stacks
    try:
        text, _, _ = stacks.ask(run_dir, wait_s=10)
    except OSError as exc:
        text = f"(no stacks: {exc})"
    metrics = run_dir / "metrics.jsonl"
    tail = metrics.read_text().splitlines()[-5:] if metrics.exists() else []
    return text + "\n--- last metrics records\n" + "\n".join(tail)


def _is_rank(proc_dir: Path, rank: int, run_dir: Path) -> bool:
    """Whether /proc/<pid> is the hpcps.train process of Slurm task ``rank`` of this run."""
    try:
        env = (proc_dir / "environ").read_bytes().split(b"\0")
        cmd = (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
    return (f"SLURM_PROCID={rank}".encode() in env and b"hpcps.train" in cmd
            and str(run_dir).encode() in cmd)
