"""What hpcps reads from Slurm's environment: the job's identity and the step's task count.

Pure functions of an environment mapping (no MPI, no Slurm commands), so they are tested
without a cluster, and one reader of a run directory's ``start`` records. ``hpcps.train``
uses them for

* the default run directory, ``runs/slurm-<job id>`` (``runs/slurm-<array job id>_<task id>``
  for a task of a job array): the same directory when Slurm requeues the job, so
  ``--resume auto`` finds the checkpoint the preempted run left there;
* a check that this directory is not another run's: a second run in one job (a different
  configuration, or one without ``--resume auto``) is refused instead of overwriting or
  resuming the first (:func:`check_owner`);
* a check that ``srun`` really started one MPI job: ``srun`` without a PMI the MPI library
  speaks starts N processes that each believe they are rank 0 of 1, and would train N copies
  into one run directory;
* the ``slurm`` field of the run's ``start`` record in metrics.jsonl.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from hpcps.errors import ConfigError

# Options a run may change between its starts (a requeued job edits its config file: a
# longer run, other timeouts or reporting) and still be the same run; any other difference
# makes it another run. ``resume`` holds the checkpoint a start resumed from, ``config``
# the file's path.
CONTINUABLE = frozenset({
    "resume", "run_dir", "config", "steps", "epochs", "timeout", "replica_timeout",
    "heartbeat_timeout", "progress_every", "eval_every", "checkpoint_every", "persist_every",
    "flush_every", "trace", "inject_slow", "prefetch"})


def job_name(env: Mapping[str, str]) -> str | None:
    """``<job id>``, or ``<array job id>_<task id>`` for an array task; None outside Slurm."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else job


def describe(env: Mapping[str, str]) -> dict | None:
    """The job's identity for the metrics (None outside Slurm)."""
    name = job_name(env)
    if name is None:
        return None
    keys = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID",
            "array_task_id": "SLURM_ARRAY_TASK_ID", "restart_count": "SLURM_RESTART_COUNT",
            "nodelist": "SLURM_JOB_NODELIST", "ntasks": "SLURM_NTASKS",
            "step_id": "SLURM_STEP_ID", "step_tasks": "SLURM_STEP_NUM_TASKS",
            "cpus_per_task": "SLURM_CPUS_PER_TASK"}
    return {"name": name, **{k: env[v] for k, v in keys.items() if env.get(v)}}


def check_tasks(env: Mapping[str, str], world_size: int) -> None:
    """Refuse a ``srun`` step whose tasks did not join one MPI job.

    ``srun`` sets ``SLURM_STEP_NUM_TASKS`` (and ``SLURM_PROCID``) in each task it starts; when
    MPI then sees fewer ranks than tasks, the tasks run as separate singletons. ``mpiexec``
    inside a batch job starts its ranks itself, in the batch step (no ``SLURM_PROCID`` of a
    multi-task step), and is not checked.
    """
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if not tasks or "SLURM_PROCID" not in env:
        return
    try:
        n = int(tasks)
    except ValueError:
        return
    if n > 1 and world_size != n:
        raise ConfigError(
            f"srun started {n} tasks but MPI sees {world_size} rank(s): the tasks did not "
            "join one MPI job and would train separate copies. srun must use a PMI that the "
            "MPI library speaks, which the site's default (MpiDefault) may not be: "
            "srun --mpi=TYPE, where srun --mpi=list shows the site's types (srun --mpi=pmi2 "
            "for the mpich wheel and most MPICH builds, srun --mpi=pmix for Open MPI 5; in "
            "jobs/*.sbatch set HPCPS_SRUN_MPI=TYPE), or start the ranks with "
            "mpiexec -n $SLURM_NTASKS inside the allocation")


def last_start(run_dir: Path) -> dict | None:
    """The last ``start`` record of ``run_dir/metrics.jsonl``: the configuration of the run
    that wrote there last. None when there is no such file or no readable start record."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"start"' not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "start" and \
                isinstance(rec.get("config"), dict):
            return rec
    return None


def differences(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The options (by name) in which two runs' configurations differ, beyond those a run
    may change between its starts (:data:`CONTINUABLE`): the strategy first, then options
    both set (an option another strategy leaves unset follows from the strategy), by name.
    An option only one of them knows (another version of hpcps) is not compared."""
    saved, wanted = (json.loads(json.dumps(dict(c), default=str)) for c in (saved, wanted))
    keys = (set(saved) & set(wanted)) - CONTINUABLE  # compared as metrics.jsonl holds them
    diff = [k for k in keys if saved[k] != wanted[k]]
    return sorted(diff, key=lambda k: (k != "strategy", None in (saved[k], wanted[k]), k))


def check_owner(run_dir: Path, job: str, wanted: Mapping[str, Any], resume_auto: bool) -> None:
    """Refuse to write into the Slurm default run directory when it holds another run.

    Every run in one job (``srun`` twice in a batch script, a retry) gets the same default
    ``runs/slurm-<job>``. A run continues there when it is the same run (``--resume auto``
    and the same configuration, :func:`differences`): a requeued job, a retried step. Any
    other run is refused, naming the way out (``--run-dir``), instead of resuming the
    first run's checkpoint or overwriting it.
    """
    run_dir = Path(run_dir)
    checkpoints = sorted(p.name for p in run_dir.glob("checkpoint*.h5")) \
        if run_dir.is_dir() else []
    start = last_start(run_dir)
    if start is None and not checkpoints:
        return  # a new directory (or one holding nothing of a run)
    way_out = (f"give this run a directory of its own, e.g. --run-dir runs/slurm-{job}-2 "
               "(a second run in one Slurm job needs one)")
    if start is None:
        if resume_auto:
            return  # checkpoints without metrics: --resume auto checks them as usual
        raise ConfigError(f"run directory {run_dir} (this Slurm job's default) holds "
                          f"{', '.join(checkpoints)}, which this run would overwrite: "
                          f"{way_out}, or continue that run with --resume auto")
    diff = differences(start["config"], wanted)
    if not diff and resume_auto:
        return  # the same run again: a requeue or a retry continues it
    saved = start["config"]
    what = f"a {saved.get('strategy', '?')} run"
    if diff:
        shown = "; ".join(f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} here"
                          for k in diff[:4])
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise ConfigError(f"run directory {run_dir} (this Slurm job's default) holds "
                          f"{what} with another configuration ({shown}{more}), which this "
                          f"run would {'resume' if resume_auto else 'overwrite'}: {way_out}")
    raise ConfigError(f"run directory {run_dir} (this Slurm job's default) holds {what} "
                      "that this run would overwrite: continue it with --resume auto, or "
                      f"{way_out}")
