"""Join a running job: ``mpiexec -n K python -m hpcps.join RUN_DIR [--as replica|spare]``.

The job must have been started with ``--joins J`` (downpour), J >= K, and write its run
directory at RUN_DIR. Each of the K ranks becomes a spare of the job: with ``--as replica``
(the default) it trains at once, the j-th rank to join on data shard j mod R; with ``--as
spare`` it waits, idle, to take the place of a replica that dies or leaves. The ranks
connect through the MPI ports the job publishes in ``RUN_DIR/join`` (:mod:`hpcps.mpi.joins`);
they take the job's configuration from its chief, so no training option is given here.

Exit codes: 0 done (trained until the job ended, or released idle); 2 the job cannot be joined
(none listens in RUN_DIR, no slot left, the run is ending: one line says which); the job's
own codes for a failure while training. The job goes on whatever happens to a joined rank.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as hpcps.train: ranks fill the cores

CONNECT_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcps.join",
        description="Add ranks to a running hpcps job started with --joins J (downpour): "
                    "each becomes a replica that trains at once (--as replica) or an idle "
                    "spare (--as spare). Launch it as mpiexec -n K python -m hpcps.join "
                    "RUN_DIR on the same MPI (MPICH) as the job.")
    ap.add_argument("run_dir", help="the running job's run directory (its --run-dir)")
    ap.add_argument("--as", dest="want", choices=("replica", "spare"), default="replica",
                    help="train at once on data shard j mod R, j counting the ranks that "
                         "joined, or wait idle for a replica to replace (default: replica)")
    ap.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_S,
                    help="seconds to wait for the job to answer while connecting "
                         f"(default {CONNECT_TIMEOUT_S:g})")
    return ap


def _say(text: str, rank: int, err: bool = False) -> None:
    print(f"hpcps.join: {text}" if rank < 0 else f"hpcps.join: rank {rank}: {text}",
          file=sys.stderr if err else sys.stdout, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM and SIGINT wait until this launch has connected: a launch that died between
    # asking a listener for a connection and making it would hold that rank of the job in
    # MPI_Comm_accept for good (hpcps.mpi.joins)
    from hpcps.train import catch_early
    deferred = catch_early((signal.SIGTERM, signal.SIGINT))
    from hpcps import config, job
    from hpcps.errors import HpcpsError
    from hpcps.mpi import joins
    from hpcps.mpi.topology import Grid, Role
    from hpcps.runtime import faults, memory

    try:
        world, welcome = joins.connect(args.run_dir, args.want, args.timeout)
    except joins.JoinError as exc:
        if joins.launch_rank() == 0:
            _say(str(exc), -1, err=True)
        return exc.exit_code
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if deferred:  # connected (the job's listeners are free again): now the signal acts
        sig = deferred[0][0]
        _say(f"{signal.Signals(sig).name} while joining: connected, leaving now (the job "
             "goes on without this rank)", world.Get_rank(), err=True)
        faults.leave(128 + sig)
    cfg, n_world = welcome["cfg"], int(welcome["n_world"])
    me = world.Get_rank()
    try:
        layout = config.plan(cfg, n_world)
        info = job._check_dataset(cfg)
        k = layout.spares + me - n_world
        grid = Grid(world, layout, Role("spare", spare=k), None, None, None)
        ctx = job._setup(cfg, world, layout, info, None, job.Path(welcome["run_dir"]),
                         welcome["feed"], grid=grid)
        ctx.start_step = int(welcome["start_step"])
        _say(f"joined the job in {welcome['run_dir']} as spare {k} (its rank {me})", me)
        if welcome["unreached"]:
            _say(f"rank(s) {welcome['unreached']} of the job took no connection within "
                 "10 s (dead, their death not yet known to rank 0, or stuck): not reached", me)
        if welcome["closing"]:
            _say(f"rank(s) {welcome['closing']} of the job not connected: the run is ending",
                 me)
        result = cfg.spec.run(ctx)
        result = {**result, "role": "spare", "joined": True,
                  "peak_rss_bytes": memory.peak_rss_bytes(), "blas_used": job._blas_chosen(),
                  "first_layer": job._first_layer_chosen(), "train_rows": job._train_rows(ctx)}
        lost = faults.finish(world, ctx.reporter, result, layout, cfg.timeout, None,
                             grace=faults.ending_grace(cfg.heartbeat_timeout),
                             # alone in its launch, its exit ends no one else's rank
                             leave_early=joins.launch_size() == 1 or faults.launcher_verdict(
                                 faults.ancestry(), os.environ) is None)
    except HpcpsError as exc:  # this rank ends; the job goes on without it
        _say(f"failed: {exc}", me, err=True)
        faults.leave(exc.exit_code)
    if result.get("as_replica") is None:
        _say("released idle: the run ended without needing it", me)
    else:
        _say(f"trained {result.get('replica_steps', 0)} steps as replica "
             f"{result['as_replica']} on data shard {result['data_shard']}", me)
    joins.close(world)
    if lost:
        faults.leave(0)  # MPI_Finalize would wait for the dead ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
