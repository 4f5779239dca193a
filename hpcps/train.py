"""Train under MPI: ``mpiexec -n N python -m hpcps.train [options]`` (``--help`` lists them).

``--help`` and ``--version`` are answered here, before MPI is loaded (they work on a login node
without an MPI launcher, once per job rather than once per rank), and so is a command line
whose options or layout of ranks are refused (:func:`refuse_early`); everything else runs the
job (:mod:`hpcps.job`).

Examples::

    mpiexec -n 4 python -m hpcps.train                       # downpour, 1 shard + 3 replicas, MNIST
    mpiexec -n 4 python -m hpcps.train --strategy sync       # allreduce SGD on 4 replicas
    mpiexec -n 6 python -m hpcps.train --servers 2 --n-push 4 --epochs 5
    mpiexec -n 3 python -m hpcps.train --resume runs/downpour-20261122-101500/checkpoint.h5
    mpiexec -n 4 python -m hpcps.train --run-dir runs/long --resume auto  # requeue-safe
"""
from __future__ import annotations

import os
import signal
import sys
import time

# One BLAS thread per rank unless the user says otherwise: ranks already fill the cores, and
# OpenBLAS's own threads on top oversubscribe them (measured 4x slower with 4 ranks on 2 cores).
# This must happen before NumPy is first imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# the rank a launcher gives this process, read without MPI (MPICH/Hydra, Open MPI, Slurm)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as the launcher set it, 0 when started without one."""
    for name in RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


# the number of ranks a launcher starts, read without MPI: MPICH's Hydra, Open MPI
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def launcher_size(environ=os.environ) -> int | None:
    """The number of ranks the launcher started, None when no launcher said it or when
    ``srun`` started this task (whose PMI the MPI library may not speak: then MPI sees a
    different number, which the job's own check reports:
    :func:`hpcps.runtime.slurm.check_tasks`)."""
    if "SLURM_PROCID" in environ:
        return None
    for name in SIZE_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def _refused(exc, environ=os.environ) -> int:
    """Print ``exc`` as the one ``hpcps: error`` line (on the first rank, as the job's vote
    would) and return its exit code."""
    if launcher_rank(environ) == 0:
        print(f"hpcps: error: {exc}", file=sys.stderr, flush=True)
    return exc.exit_code


def refuse_early(argv: list[str], environ=os.environ) -> int | None:
    """Judge the command line before NumPy and MPI load: the options (:func:`hpcps.config.parse`)
    and, where the launcher says how many ranks it started, the layout
    (:func:`hpcps.config.plan`). These depend on nothing but the arguments and that number, so
    every rank judges them alike and no vote is needed: on a refusal the first rank prints the
    one message the job's checks would print, and every rank returns the exit code without
    having started MPI (a refused start then costs each rank a fraction of a second instead of
    its imports and ``MPI_Init``). None: nothing refused here, or a ``--config`` file was given
    (a file may read differently on another node): the job checks everything again, files too,
    with its vote."""
    from hpcps.errors import ConfigError
    try:
        from hpcps import config  # declares every strategy: a plug-in may fail to import
        if vars(config.build_parser().parse_args(argv)).get("config"):
            return None
        cfg = config.parse(argv)
        size = launcher_size(environ)
        if size is not None:
            config.plan(cfg, size)
    except ConfigError as exc:
        return _refused(exc, environ)
    except Exception:  # a bug, not bad input: the job's check shows where, on the rank it hit
        return None
    return None


def catch_early(signals=(signal.SIGTERM, signal.SIGUSR1)) -> list[tuple[int, float]]:
    """Record ``signals`` from now on, until the job installs its own handlers
    (:meth:`hpcps.runtime.stop.SignalFlag.install`, which takes what was recorded): a
    preemption that reaches a rank while it imports NumPy and starts MPI (about a second)
    then stops the run with its checkpoint and exit code 75 like a later one, instead of
    killing the rank (under the keeper, a killed rank is a lost rank and the job exited 0)."""
    caught: list[tuple[int, float]] = []

    def note(signum, frame):
        caught.append((signum, time.monotonic()))

    for s in signals:
        signal.signal(s, note)
    from hpcps.runtime.keeper import READY_ENV  # no NumPy, no MPI
    ready = os.environ.pop(READY_ENV, None)
    if ready is not None and ready.isdigit():  # the keeper holds its signals until this byte
        try:
            os.write(int(ready), b"r")
            os.close(int(ready))
        except OSError:
            pass
    return caught


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv or "--version" in argv:
        if launcher_rank() == 0:
            if "--version" in argv:
                from hpcps import __version__
                print(f"hpcps {__version__}")
            else:
                from hpcps.errors import ConfigError
                try:
                    from hpcps import config
                    config.build_parser().print_help()
                except ConfigError as exc:  # a plug-in that cannot be imported
                    return _refused(exc)
        return 0
    early = catch_early()
    refused = refuse_early(argv)
    if refused is not None:
        return refused
    try:
        from hpcps import job
        return job.main(argv, early=early)
    except KeyboardInterrupt:  # while the job starts (guarded's handles it once it runs)
        from hpcps.errors import INTERRUPTED_EXIT, interrupted
        interrupted(launcher_rank())
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            # the others may be waiting on this rank in a collective, where a Ctrl-C of
            # their own is not seen until it returns: end them all
            mpi.COMM_WORLD.Abort(INTERRUPTED_EXIT)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
