"""Keep a rank's death from taking the whole job down: ``python -m hpcps.keeper [train options]``.

Launch a run whose replicas may die as::

    mpiexec -disable-auto-cleanup -n N python -m hpcps.keeper --heartbeat-timeout 10 ...

``-disable-auto-cleanup`` alone is not enough with Hydra (MPICH 5.0.2, measured on this
machine, ``docs/fault-tolerance.md``): when a rank is killed, Hydra sometimes still kills every
other rank (in most trials with ranks started directly, none in trials through this keeper).
What it does reliably is what it does when the process it started exits *normally* while its
MPI connection closes: it sends SIGUSR1 to the others and lets them run.

So the keeper is the process Hydra starts: it starts ``python -m hpcps.train`` with the same
arguments as its child, closes its own copy of the PMI connection (so the child's death
closes it), forwards SIGTERM and SIGINT to the child (holding them until the child's
``hpcps.train`` catches them, which it says through a pipe, ``READY_ENV``: a stop during the
rank's start then stops the run, where the rank died of it), ignores Hydra's SIGUSR1 (its notice
that a rank died; under another launcher, such as ``srun``, SIGUSR1 is a stop request and is
forwarded too), waits, and exits with the child's exit code, or with 0 after printing which
signal killed it (a non-zero exit while other ranks run would make Hydra kill them). The
run's summary names the lost ranks. The keeper imports neither MPI nor NumPy.
"""
from __future__ import annotations

import os
import signal
import sys

KEEPER_ENV = "HPCPS_KEEPER"  # set in the child's environment: "started by hpcps.keeper"
# the child's end of a pipe: it writes a byte once it catches SIGTERM and SIGUSR1 itself
# (hpcps.train's catch_early); the keeper holds the signals it would forward until then
READY_ENV = "HPCPS_KEEPER_READY_FD"
HYDRA_ENV = "HYDI_CONTROL_FD"  # set by Hydra (MPICH's mpiexec) in every process it starts


def under_hydra(environ=None) -> bool:
    """Whether this process was started by Hydra, which sends SIGUSR1 to the survivors
    when a rank dies (with ``-disable-auto-cleanup``): there SIGUSR1 cannot mean "stop"."""
    return HYDRA_ENV in (os.environ if environ is None else environ)


USAGE = """usage: mpiexec -disable-auto-cleanup -n N python -m hpcps.keeper [train options]
       srun --wait=0 ... python -m hpcps.keeper [train options]

The keeper starts one rank of hpcps.train as its child and keeps that rank's death from ending
the whole job: it forwards SIGTERM and SIGINT to the child (and SIGUSR1, except under mpiexec's
Hydra, which sends it when a rank dies) and exits with the child's exit code, or with 0 (after
saying which signal killed the child) so that the launcher leaves the other ranks running. Use
it for runs whose replicas or shards may die (--heartbeat-timeout, --ps-copies > 1;
docs/fault-tolerance.md). Every option is passed to hpcps.train unchanged: python -m
hpcps.train --help lists them."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    # A signal to forward waits until the child catches it: one that came while the child
    # started (Python, before hpcps.train's first lines) killed it, and a rank killed by a
    # signal is a lost rank (exit 0): a job stopped in its first half-second ended 0 with
    # nothing saved, or hung with some ranks dead before MPI_Init and the others in it.
    held: list[int] = []
    child = [0]  # the child's pid once it is ready for signals

    def forward(signum, frame):
        if not child[0]:
            held.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT) + (() if under_hydra() else (signal.SIGUSR1,)):
        signal.signal(s, forward)
    if under_hydra():  # Hydra's "a rank died"
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    env = dict(os.environ, **{KEEPER_ENV: "1"})
    ready_r, ready_w = os.pipe()
    env[READY_ENV] = str(ready_w)
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.set_inheritable(ready_w, True)
        # ignored until the child catches them (an ignored signal stays so through exec):
        # Hydra's "a rank died", and stop requests their default action would die of (Hydra
        # signals the child too, not only this keeper, which sends them again once the
        # child is ready). Not SIGINT: Python would leave it ignored for good.
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        os.execve(sys.executable, [sys.executable, "-m", "hpcps.train", *argv], env)
    os.close(ready_w)
    fd = os.environ.get("PMI_FD")
    if fd and fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass
    os.read(ready_r, 1)  # a byte: ready; nothing: the child ended (or exec failed) first
    os.close(ready_r)
    child[0] = pid
    for signum in held:
        forward(signum, None)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        rank = os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "?"))
        print(f"hpcps.keeper: rank {rank} (pid {pid}) was killed by "
              f"{signal.Signals(-code).name}; the other ranks go on", file=sys.stderr,
              flush=True)
        return 0
    return code


if __name__ == "__main__":
    os._exit(main())
