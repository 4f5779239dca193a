"""Runs whose replicas may die (``--heartbeat-timeout``): the launch check and the ending.

Two things differ from a run in which one failure ends the job (``docs/fault-tolerance.md``):

* **The launcher must let survivors live.** MPICH's ``mpiexec`` kills every rank when one
  dies unless started with ``-disable-auto-cleanup``, and even then often does when a rank is
  killed by a signal, unless each rank runs under :mod:`hpcps.keeper`. Slurm's ``srun`` ends
  the step when a task exits with a non-zero status or a signal under ``--kill-on-bad-exit``
  (or a site's ``KillOnBadExit=1``), which the keeper's exit 0 is not, and when a task has
  exited for ``--wait`` seconds (a site's ``WaitTime``), which ``--wait=0`` turns off
  (measured with Slurm 22.05, ``docs/fault-tolerance.md``; ``--no-kill`` is about failed
  nodes, not tasks). :func:`launcher_verdict` looks at this rank's ancestors (Hydra's
  ``mpiexec`` is an ancestor of every rank on its own node) and at ``HPCPS_KEEPER``, and says
  once, at start, when a failure would take the job down anyway, or when it cannot tell.
  Open MPI 5's ``mpirun`` (``prterun``) leaves the others running when started with
  ``--enable-recovery``, with ranks started directly (measured: docs/mpi.md).
* **The end uses no collective over the world.** A collective that includes a dead rank never
  completes, and ``MPI_Finalize`` waits for it. So every rank sends its final figures to the
  reporter point to point (:func:`finish`); the reporter waits only for the ranks the shards
  did not lose, writes the summary naming the lost ones, and tells every survivor whether
  anyone was lost. Then, if so, the survivors flush their output and leave with
  ``os._exit``, skipping ``MPI_Finalize`` (``mpiexec`` then returns the dead rank's status);
  if not, the run ends as usual.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from hpcps import procfs
from hpcps.mpi import joins
from hpcps.mpi.comm import PeerTimeout, Poller, Transport, source_of, status, test_obj
from hpcps.errors import ConfigError
from hpcps.runtime.keeper import KEEPER_ENV
from hpcps.mpi.protocol import Tag

LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra")
NO_CLEANUP = ("-disable-auto-cleanup", "--disable-auto-cleanup", "-disable-auto-cleanup=1")
# Open MPI 5: mpirun and mpiexec exec prterun, the ranks' parent on the launching node; with
# --enable-recovery it leaves the others running when one dies (docs/mpi.md)
OPEN_MPI_LAUNCHER = "prterun"
RECOVERY = ("--enable-recovery",)


def _recovers(argv: list[str]) -> bool:
    """Whether Open MPI's launcher leaves the others running when a rank dies: with
    ``--enable-recovery``, or ``--with-ft ulfm`` (ULFM: MPI then also reports the death,
    ``MPI_ERR_PROC_FAILED``, which :class:`hpcps.mpi.comm.Transport` handles)."""
    args = argv[1:]
    ulfm = any(a == "--with-ft=ulfm" or (a == "--with-ft" and b == "ulfm")
               for a, b in zip(args, args[1:] + [""]))
    return ulfm or any(a in RECOVERY for a in args)


def ancestry(pid: int | None = None, depth: int = 4) -> list[list[str]]:
    """Command lines (argv lists) of this process's parent, grandparent, ... (Linux /proc;
    empty where it cannot be read)."""
    out = []
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            break
        proc = procfs.stat(pid)
        if proc is None:
            break
        out.append([a.decode(errors="replace") for a in argv if a])
        pid = proc.ppid
        if pid <= 1:
            break
    return out


def launcher_verdict(ancestors: list[list[str]], environ) -> str | None:
    """None if a dead rank will leave the others running; else what to say, once.

    Parameters
    ----------
    ancestors : argv of the parent, grandparent, ... (:func:`ancestry`).
    environ : the environment (``SLURM_*``).
    """
    for argv in ancestors:
        if argv and Path(argv[0]).name == OPEN_MPI_LAUNCHER:
            if not _recovers(argv):
                return ("Open MPI's mpirun was started without --enable-recovery (or "
                        "--with-ft ulfm): it kills "
                        "every rank when one dies, so --heartbeat-timeout cannot keep the run "
                        "going (start it with mpirun --enable-recovery -n N python -m "
                        "hpcps.train ...)")
            return None
        if argv and Path(argv[0]).name in LAUNCHERS:
            if not any(a in NO_CLEANUP for a in argv[1:]):
                return (f"{Path(argv[0]).name} was started without -disable-auto-cleanup: "
                        "it kills every rank when one dies, so --heartbeat-timeout cannot keep "
                        "the run going (start it with mpiexec -disable-auto-cleanup -n N "
                        "python -m hpcps.keeper ...)")
            if environ.get(KEEPER_ENV) != "1":
                return ("ranks started without hpcps.keeper: Hydra often kills every rank "
                        "when one is killed even with -disable-auto-cleanup; start them with "
                        "mpiexec -disable-auto-cleanup -n N python -m hpcps.keeper ...")
            return None
    if "SLURM_STEP_ID" in environ or "SLURM_JOB_ID" in environ:
        if environ.get(KEEPER_ENV) == "1":
            return None  # srun's --wait (a site's WaitTime) cannot be seen from here: docs
        return ("under Slurm, ranks started without hpcps.keeper: srun ends the job step when "
                "one dies if --kill-on-bad-exit or the site's KillOnBadExit=1 is in force; "
                "start them with srun --wait=0 ... python -m hpcps.keeper ...")
    return ("cannot tell whether the launcher keeps the other ranks running when one dies "
            "(no mpiexec among this rank's ancestors, not under Slurm): with MPICH use "
            "mpiexec -disable-auto-cleanup -n N python -m hpcps.keeper, with Open MPI "
            "mpirun --enable-recovery -n N python -m hpcps.train, with Slurm "
            "srun --wait=0 ... python -m hpcps.keeper")


def check_thread_level(provided: int | None = None) -> None:
    """Refuse ``--heartbeat-timeout`` where MPI cannot send from a second thread: the
    heartbeats go from a thread of their own while the main thread computes or waits."""
    from hpcps.mpi.comm import has_thread_multiple
    if not has_thread_multiple(provided):
        raise ConfigError("--heartbeat-timeout needs an MPI library with MPI_THREAD_MULTIPLE "
                          "(each replica sends its heartbeats from a thread of its own)")


def lost_ranks(results: list, layout, reporter: int = 0) -> list[int] | None:
    """World ranks of the replicas lost, once that is known (else None): the reporter's own
    ``lost_ranks`` when it has them (sandblaster's coordinator), else the replicas and shards
    (``--ps-copies``) any shard lost, once every shard not lost has reported (replica r with
    P = 1 is world rank ``layout.replica_rank(r)``)."""
    mine = results[reporter]
    if mine is not None and "lost_ranks" in mine:
        return sorted(int(r) for r in mine["lost_ranks"])
    shards = [results[r] for r in layout.server_ranks if results[r] is not None]
    dead = {int(k) for s in shards for k in s.get("lost_shard_ranks", {})}
    if any(results[r] is None and r not in dead for r in layout.server_ranks):
        return None
    lost = {int(r) for s in shards for r in s.get("lost_replicas", {})}
    return sorted({layout.trainer_rank(r) for r in lost} | dead)


# The least a replica the shards did not lose gets to send its final figures once they ended
# (finish's grace is --heartbeat-timeout, at least this): on oversubscribed cores a live rank
# can wait seconds for a core, and one wrongly called lost loses its figures.
ENDING_GRACE_S = 10.0


def ending_grace(heartbeat_timeout: float) -> float:
    return max(float(heartbeat_timeout), ENDING_GRACE_S)


def finish(world, reporter: int, result: dict, layout, timeout: float,
           summarize, grace: float | None = None, leave_early: bool = True) -> bool:
    """End a run without world collectives. Returns whether ranks were lost.

    Parameters
    ----------
    world : the world communicator.
    reporter : the rank that writes the summary.
    result : this rank's final figures.
    layout : the grid (:func:`lost_ranks` reads the shards' figures with it).
    timeout : seconds to wait for a rank's figures before calling it lost too (a replica
        that dies after its last push, which its shards therefore never lost).
    summarize : ``summarize(results)``, on the reporter (lost ranks' entries are
        ``{"lost": True}``, with ``why`` and ``after_s`` for those lost here).
    grace : once the shards have ended and said whom they lost (downpour's end once every
        replica is done), a replica they did not lose has only its final figures left to
        send: seconds to wait for them before calling it lost (:func:`ending_grace` of
        ``--heartbeat-timeout``, the silence that means a death during the run); None:
        ``timeout``. Every lost rank is told the run's end, in case it was only late (or,
        lost during the run, alive but starved): it then leaves as the survivors do. A
        reporter that lists the lost itself says how long its live replicas may still be
        busy once it ended, ``ending_grace_s`` in its ``result`` (sandblaster's
        coordinator: a replica may still compute a portion it was given twice, for as long
        as ``--replica-timeout`` lets a busy replica be silent); that
        figure replaces ``grace`` and is not passed on to ``summarize``.
    leave_early : whether a rank that left the run (on SIGTERM, ``result["left"]``) may end
        its process now: where the launcher keeps the others running when one ends
        (:func:`launcher_verdict` None). Elsewhere (a plain ``mpiexec``, which kills every
        rank when one exits, even with status 0) it waits for the run's end as the others
        do, with no deadline (the run may go on for long without it; a launcher that ends
        the job on an exit also ends it, and this rank, on a death), and the end counts it
        among the survivors: a run stopped by SIGTERM to every rank then ends as usual.
    """
    rank = world.Get_rank()
    size = world.Get_size() + len(joins.joined(world))  # ranks that joined come after the world
    net = Transport(world)
    left = rank != reporter and bool(result.get("left"))
    if left and leave_early:  # left the run on SIGTERM: nothing to wait for
        net.send_obj(result, reporter, Tag.RESULT)
        return True
    if rank != reporter:
        net.send_obj({**result, "stays": True} if left else result, reporter, Tag.RESULT)
        req = net.post_recv_obj(reporter, Tag.RESULT)
        # the reporter may wait `timeout`; a rank that left waits for the whole run
        deadline = math.inf if left else time.monotonic() + 2 * timeout + 10
        poll = Poller()
        while True:
            done, lost = test_obj(req)
            if done:
                return bool(lost)
            if time.monotonic() > deadline:
                raise PeerTimeout(f"waited {timeout:.0f} s for the reporter (rank {reporter}) "
                                  "to end the run")
            poll.pause()
    result = dict(result)
    grace = result.pop("ending_grace_s", grace)  # the reporter's own, where it has one
    results: list = [None] * size
    results[reporter] = result
    lost: list[int] | None = None
    start = time.monotonic()
    ended = None  # when the lost ranks were known: the others' training was over then
    poll = Poller()
    while True:
        if lost is None:
            lost = lost_ranks(results, layout, reporter)
            ended = None if lost is None else time.monotonic()
        waiting = [r for r in range(size) if results[r] is None and r not in (lost or [])]
        if not waiting:
            break
        sender = _probe(net)
        if sender is not None:
            results[sender] = net.take_obj(sender, Tag.RESULT)
            continue
        now = time.monotonic()
        if now - start > timeout and any(not layout.may_die(r) for r in waiting):
            raise PeerTimeout(f"waited {timeout:.0f} s for the final figures of rank(s) "
                              f"{waiting}")
        graced = ended is not None and grace is not None
        waited, limit = (now - ended, grace) if graced else (now - start, timeout)
        replicas = [r for r in waiting if layout.may_die(r)]
        if waited > limit and replicas:  # died after the run had stopped waiting for it
            after = (f"within {limit:g} s of the end of training" if graced
                     else f"within {limit:g} s")
            for r in replicas:
                spare = r >= layout.n_world or layout.role(r).kind == "spare"
                results[r] = {"lost": True, "after_s": round(waited, 1),
                              "why": f"it sent no final figures {after}: " + (
                                  "a spare rank, it died during the run (an idle spare's "
                                  "death is found at the end) or after it" if spare else
                                  "it died after the training had stopped waiting for it")}
            lost = sorted(set(lost or []) | set(replicas))
            continue
        poll.pause()
    for r in lost:
        results[r] = results[r] if results[r] is not None else {"lost": True}
    summarize(results)
    left = [r for r in range(size) if results[r] is not None and results[r].get("left")
            and not results[r].get("stays")]  # gone: those that stayed wait for the end
    gone = sorted(set(lost) | set(left))  # the survivors skip MPI_Finalize if any rank is gone
    for r in range(size):
        if r != reporter and r not in gone:
            net.send_obj(gone, r, Tag.RESULT)
    for r in lost:  # never waited for: dead, or alive but taken for dead (a replica starved
        if r != reporter:  # past the timeout), which waits for this to leave as the others do
            net.send_obj_nowait(gone, r, Tag.RESULT)
    return bool(gone)


def _probe(net: Transport) -> int | None:
    st = status()
    return source_of(st) if net.probe(st, Tag.RESULT) else None


def leave(code: int) -> None:
    """End this process now, without ``MPI_Finalize`` (which would wait for a dead rank)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
