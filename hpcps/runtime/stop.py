"""Stopping a job early, on every rank at once: preemption, time limits, ``scancel --signal``.

On SIGTERM or SIGUSR1 (what Slurm sends before it preempts a job or when its time runs out,
``#SBATCH --signal=B:USR1@120``), a run stops training at the next safe point, writes its
checkpoint and ends with exit code 75 (:data:`hpcps.errors.PREEMPTED_EXIT`), so that the job
script can requeue itself and ``--resume auto`` continues where it stopped.

A signal may reach one rank, some or all of them: ``mpiexec`` (Hydra) and ``srun`` forward
SIGTERM and SIGUSR1 to every rank, ``kill`` of one rank's pid reaches that rank alone, and
Slurm's ``B:`` signals reach only the batch shell (``jobs/*.sbatch`` forward them to the job
step). The signal handler only sets a flag (:class:`SignalFlag`). The ranks learn of one
another's flags through :class:`StopVote`: rounds of a non-blocking ``Iallreduce`` of two
integers (ranks whose flag is set, ranks that have finished) on a communicator of its own, so
the vote never mixes with training traffic and no wait on it can hang (every wait has the
run's ``--timeout``).

Two ways to use a vote, one per kind of strategy:

* **lockstep** (:meth:`StopVote.agreed_at`): ranks that run the same number of iterations
  (sync, averaging; and the partitions of one model-parallel replica) start a round every
  ``every`` iterations and read it ``every`` iterations later, all at the same iteration, so
  every rank stops after the same iteration and the collectives of the strategy stay matched.
* **asynchronous** (:meth:`StopVote.poll`): ranks that run at their own pace (downpour and
  deadreckon replicas, parameter-server shards, sandblaster's coordinator and replicas) test
  the current round at each safe point and start the next one once it completed; a rank acts
  on its own flag at once and on the others' as soon as a round brings them. Each strategy's
  normal ending already copes with ranks ending at different steps (DONE messages to the
  shards, the deadreckon drain, the coordinator's STOP), so stopping early is ending early.

Every rank calls :meth:`StopVote.finish` after its role: it joins rounds, marked finished,
until a round shows every rank finished. Every rank sees the same sequence of round results,
so they all leave after the same round and no request is left pending at ``MPI_Finalize``.

A run whose ranks may die (``--heartbeat-timeout``) has no vote: a collective over every
rank would hang on a dead one. A strategy that declares ``stops_alone`` keeps each rank's
:class:`SignalFlag` (:meth:`SignalFlag.without_vote`) and stops by its own messages
(``docs/fault-tolerance.md``): in downpour rank 0 stops on its flag, and its DONE makes the
shards tell the other replicas to end; in sandblaster the coordinator stops on its flag and
ends the run as at its last step. Elsewhere each rank gets the signals' usual actions back
(:meth:`SignalFlag.uninstall`).
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from hpcps.mpi.comm import SUM, done, start_allreduce, wait_all

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LOCKSTEP_EVERY = 4  # iterations between two lockstep rounds (a stop lands 4-8 iterations late)


DUPLICATE_S = 2.0  # a SIGTERM this soon after the first is the same request, delivered twice


class SignalFlag:
    """Records SIGTERM and SIGUSR1 instead of dying. A second SIGTERM kills the process as
    SIGTERM normally does (a user who insists, or a rank stuck beyond help), unless it comes
    within ``duplicate_s`` of the first: one request often arrives twice, once directly and
    once forwarded (``pkill -f hpcps.train`` or ``kill`` of the whole process group signals
    ``mpiexec``, which forwards SIGTERM to every rank, and every rank itself), and dying on
    the echo would lose the checkpoint the first asked for."""

    def __init__(self, duplicate_s: float = DUPLICATE_S):
        self.signum: int | None = None
        self.duplicate_s = duplicate_s
        self._first_term: float | None = None  # time.monotonic() of the first SIGTERM

    def install(self, signals=SIGNALS, early=()) -> "SignalFlag":
        """Install the handlers of ``signals`` (main thread only, as Python requires), and
        take the ``early`` ones first: (signal, ``time.monotonic()``) pairs that came before
        these handlers, caught by :func:`hpcps.train.catch_early` while the rank imported
        and MPI started (the default action would have ended the rank, and under the keeper
        a rank ended by a signal is a lost rank, not a stop)."""
        for signum, at in list(early):
            self._note(signum, at)
        for s in signals:
            signal.signal(s, self._handle)
        return self

    def without_vote(self, hydra: bool) -> None:
        """For runs without a stop vote whose strategy stops by its own messages
        (``Strategy.stops_alone``): SIGTERM stays recorded, and SIGUSR1 too unless the rank
        runs under ``hydra``, whose ``mpiexec -disable-auto-cleanup`` sends it to the
        survivors when a rank dies (it is ignored there)."""
        if hydra:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            if self.signum == signal.SIGUSR1:  # one that came early: Hydra's, not a stop
                self.signum = None

    def uninstall(self) -> None:
        """For runs without a stop vote (ranks may die, :mod:`hpcps.runtime.faults`): SIGTERM gets
        its default action back, and SIGUSR1 is ignored, since that is how Hydra's
        ``mpiexec -disable-auto-cleanup`` tells the survivors that a rank died (its default
        action would end them too)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.signum == signal.SIGTERM:  # one that came early: its usual action, now
            os.kill(os.getpid(), signal.SIGTERM)

    def _handle(self, signum, frame) -> None:
        self._note(signum, time.monotonic())

    def _note(self, signum: int, now: float) -> None:
        if signum == signal.SIGTERM:
            if self._first_term is None:
                self._first_term = now
            elif now - self._first_term > self.duplicate_s:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
        if self.signum is None or signum == signal.SIGTERM:
            self.signum = signum

    @property
    def raised(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


class StopVote:
    """Rounds of a non-blocking allreduce that tell every rank of ``comm`` whether any wants
    to stop (see the module docstring).

    Parameters
    ----------
    comm : a communicator for the vote alone (a duplicate); every rank of it votes.
    flag : this rank's :class:`SignalFlag` (what it contributes by default).
    timeout : seconds any wait on a round may take before PeerTimeout.
    every : iterations between two rounds in lockstep use.
    """

    def __init__(self, comm, flag: SignalFlag, timeout: float, every: int = LOCKSTEP_EVERY):
        self.comm = comm
        self.flag = flag
        self.timeout = timeout
        self.every = max(1, int(every))
        self.size = comm.Get_size()
        self._send = np.zeros(2, dtype=np.int64)   # [wants to stop, finished]
        self._recv = np.zeros(2, dtype=np.int64)
        self._req = None
        self.stopped = False   # a completed round said some rank wants to stop
        self.voters = 0        # how many ranks wanted to stop in the first such round
        self.rounds = 0

    def replace(self, comm) -> None:
        """Vote over ``comm`` from now on (the shrunk copy of the vote's communicator, after
        a rank died: the round in flight on the old one is dropped)."""
        self.comm, self.size, self._req = comm, comm.Get_size(), None

    # -- rounds --------------------------------------------------------------------------------
    def _start(self, wish: bool, finished: bool = False) -> None:
        self._send[:] = (int(wish), int(finished))
        self._req = start_allreduce(self.comm, self._send, self._recv, SUM)

    def _take(self) -> int:
        """Read the completed round; returns how many ranks said they had finished."""
        self._req = None
        self.rounds += 1
        if self._recv[0] > 0 and not self.stopped:
            self.stopped, self.voters = True, int(self._recv[0])
        return int(self._recv[1])

    def _wait(self, what: str) -> int:
        wait_all([self._req], self.timeout, what)
        return self._take()

    # -- the two uses --------------------------------------------------------------------------
    def poll(self, wish: bool | None = None) -> bool:
        """Asynchronous use, at a safe point: never waits. True once this rank should stop:
        its own flag is set, or a completed round said some rank's was."""
        if self._req is not None and done(self._req):
            self._take()
        if self._req is None:
            self._start(self.flag.raised if wish is None else wish)
        return self.stopped or self.flag.raised

    def agreed_at(self, iteration: int, wish: bool | None = None) -> bool:
        """Lockstep use, after iteration ``iteration`` (1, 2, ...): every rank of ``comm``
        calls it after every iteration and gets the same answer at the same iteration.
        ``wish``: what this rank votes (default: its signal flag)."""
        if iteration % self.every:
            return self.stopped
        if self._req is not None:
            self._wait(f"the other ranks to join the stop vote after iteration {iteration} "
                       f"(communicator of {self.size} ranks)")
        if not self.stopped:
            self._start(self.flag.raised if wish is None else wish)
        return self.stopped

    def finish(self) -> bool:
        """After this rank's role: vote 'finished' until every rank has; True when a stop was
        agreed. Collective over ``comm`` (every rank must call it)."""
        while True:
            if self._req is not None:
                if self._wait("every rank to finish its role (stop vote)") == self.size \
                        and self._send[1]:
                    return self.stopped
            self._start(self.flag.raised, finished=True)
