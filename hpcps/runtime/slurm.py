"""What hpcps reads from Slurm's environment: the job's identity and the step's task count.

Pure functions of an environment mapping (no MPI, no Slurm commands), so they are tested
without a cluster. ``hpcps.train`` uses them for

* the default run directory, ``runs/slurm-<job id>`` (``runs/slurm-<array job id>_<task id>``
  for a task of a job array): the same directory when Slurm requeues the job, so
  ``--resume auto`` finds the checkpoint the preempted run left there;
* a check that ``srun`` really started one MPI job: ``srun`` without ``--mpi=pmi2`` (or
  another PMI the MPI library understands) starts N processes that each believe they are
  rank 0 of 1, and would train N copies into one run directory;
* the ``slurm`` field of the run's ``start`` record in metrics.jsonl.
"""
from __future__ import annotations

from typing import Mapping

from hpcps.errors import ConfigError


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
            "step_tasks": "SLURM_STEP_NUM_TASKS", "cpus_per_task": "SLURM_CPUS_PER_TASK"}
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
            "join one MPI job and would train separate copies. Launch with srun --mpi=pmi2 "
            "(the mpich wheel's library speaks PMI-2), or with mpiexec -n $SLURM_NTASKS")
