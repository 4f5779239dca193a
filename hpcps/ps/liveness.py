"""Knowing which replicas are still alive: heartbeats, silence, and waits that give up.

MPI does not report a dead peer here (MPICH's fault-tolerant mode crashes at start with this
library; see ``docs/fault-tolerance.md``): a receive posted for a rank that died never
completes and never errors. So failure detection is the application's, as in Project Adam
(section 3.3): every replica rank runs a :class:`HeartbeatThread` that sends a header-only
``Tag.HEARTBEAT`` to its shards every ``timeout / HEARTBEATS_PER_TIMEOUT`` seconds, whatever
its main thread is doing (a long evaluation, the warm-start wait, a slow step), and a shard's
:class:`Liveness` calls a replica lost once it has heard nothing from it for ``timeout``
seconds. The thread needs ``MPI_THREAD_MULTIPLE``; hpcps refuses ``--heartbeat-timeout``
without it.

A replica can also die half-way through a message the shard is receiving, or right after
asking for parameters the shard is sending back; :func:`hpcps.mpi.comm.finished_by` waits for
such a transfer only until a deadline, so that the shard drops the replica instead of hanging.
"""
from __future__ import annotations

import threading
import time

from hpcps.mpi.comm import Transport, test
from hpcps.mpi.protocol import H, Message, Tag

HEARTBEATS_PER_TIMEOUT = 5  # a replica is lost after missing this many heartbeats in a row
DROPPED = -1.0  # STEPS of a header-only PARAMS reply: "you were lost; leave the run"


class Dropped(Exception):
    """A shard answered this replica's fetch with DROPPED: it was silent past the timeout
    (starved, not dead), the shards lost it and discard its pushes, so it leaves the run."""


class Dismissed(Exception):
    """The other shards found this shard dead (silent past the timeout: stopped or starved,
    not dead) and took its chunk sets over: it leaves the run, which goes on without it."""


def send_dropped(net: Transport, dest: int, h: int = 0) -> None:
    """On a shard: answer a fetch from a replica it lost with DROPPED (header only)."""
    msg = Message(0)
    msg.header[H.STEPS], msg.header[H.SET] = DROPPED, h
    net.send_eager(msg.buf, dest, Tag.PARAMS)


def take_heartbeats(net: Transport, st, handle) -> None:
    """Hand every heartbeat waiting to ``handle(source, status)``: called just before silence
    is judged. A server behind on its queue (pushes arriving faster than it applies them, or
    a long state transfer) would otherwise take a peer whose heartbeats wait in that queue
    for silent."""
    while net.probe(st, Tag.HEARTBEAT):
        handle(st.Get_source(), st)


class HeartbeatThread:
    """Send a heartbeat to each rank of ``dests`` every ``every`` seconds until :meth:`stop`.

    Parameters
    ----------
    comm : communicator the shards listen on.
    dests : ranks to send to.
    replica : this replica's index (the header's SENDER).
    every : seconds between two heartbeats.
    """

    def __init__(self, comm, dests, replica: int, every: float):
        self.comm = comm
        self.net = Transport(comm)
        self.dests = list(dests)
        self.every = every
        self.msg = Message(0)
        self.msg.header[H.SENDER] = replica
        self.sent = 0
        self.skipped = 0  # heartbeats not sent: the last one to that rank still pending
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcps-heartbeat", daemon=True)

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        # one heartbeat in flight per destination: a header-only message goes eagerly, but
        # MPICH's shared-memory queue to a rank holds about 64 of them, and once it is full a
        # blocking send to a dead rank (not yet known dead) waits forever; this thread would
        # then fall silent and its rank be taken for dead by everyone. A heartbeat whose
        # predecessor to the same rank is still pending is skipped instead.
        last: dict[int, object] = {}
        while not self._stop.is_set():
            for dest in list(self.dests):
                if dest in last and test(last[dest]) is not True:
                    self.skipped += 1
                    continue
                last[dest] = self.net.send_nowait(self.msg.buf, dest, Tag.HEARTBEAT)
            self.sent += 1
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Liveness:
    """The replicas that may die: when each of ``n`` was last heard from, which are lost,
    which world rank each runs on, and whose loss ends the job. One per shard process,
    shared by every set it serves (``--ps-copies``).

    Parameters
    ----------
    n : replicas 0 .. n-1.
    timeout : seconds of silence after which a replica still expected is lost.
    clock : the time source (``time.monotonic``; tests pass their own).
    replica_of : ``{world rank: replica}``, to name the replica whose message broke off (a
        spare taking a replica's place adds its rank: :meth:`moved`).
    fatal : replicas whose loss ends the job (the chief's).
    """

    def __init__(self, n: int, timeout: float, clock=time.monotonic,
                 replica_of: dict[int, int] | None = None, fatal=()):
        self.timeout = timeout
        self.clock = clock
        now = clock()
        self.last = [now] * n
        self.lost: dict[int, float] = {}  # replica -> seconds of silence when it was dropped
        self.replica_of = dict(replica_of or {})
        self.fatal = frozenset(fatal)
        self._looked: float | None = None  # when silence was last judged (silent())

    @classmethod
    def of_trainers(cls, layout, timeout: float) -> Liveness:
        """The trainers of ``layout`` (replica r at ``layout.trainer_rank(r)``), the chief's
        replica 0 fatal: it evaluates, writes the final checkpoint and reports."""
        return cls(layout.trainers, timeout,
                   replica_of={layout.trainer_rank(r): r for r in range(layout.trainers)},
                   fatal=(0,))

    def moved(self, replica: int, rank: int) -> None:
        """``replica`` runs at world ``rank`` from now on (a spare took its place), heard now."""
        self.replica_of[rank] = replica
        self.heard(replica)

    def heard(self, replica: int) -> None:
        self.last[replica] = self.clock()

    def silent(self, expected) -> list[int]:
        """Replicas among ``expected`` silent for longer than the timeout, not yet lost.

        If this judge itself did not look for longer than the timeout since its last look
        (its rank was stopped or starved, perhaps between taking the heartbeats and this
        call), everyone counts as heard now first (:meth:`heard_all`): their silence
        meanwhile says nothing about them, and a replica that did die is found one timeout
        later."""
        now = self.clock()
        if self._looked is not None and now - self._looked > self.timeout:
            self.heard_all()
        self._looked = now
        return [r for r in expected
                if r not in self.lost and now - self.last[r] > self.timeout]

    def heard_all(self) -> None:
        """Count everyone as heard now: the listener itself did not run for a while (stopped
        or starved), so their silence meanwhile says nothing about them."""
        now = self.clock()
        self.last = [now] * len(self.last)

    def drop(self, replica: int) -> None:
        self.lost[replica] = round(self.clock() - self.last[replica], 3)

