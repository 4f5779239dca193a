"""Project Adam's end of epoch with a quorum (``--epoch-quorum Q``, downpour).

Adam (Chilimbi et al. 2014, section 3.1) ends a training epoch once a fraction of the model
replicas (75% in the paper) has processed all its images, instead of waiting for the slowest,
and randomizes the order so that the same images are not skipped every epoch. Here:

* **The plan** (:func:`epoch_plan`, pure): the run's global mini-batches ``[start, total)`` cut
  at epoch boundaries (``round(k * n_train / batch)``), and each epoch's mini-batches split
  among the replicas as the run's are (replica 0's warm start first, the rest in equal
  blocks). Every rank computes the same plan.
* **The keeper** (:class:`EpochKeeper`, on server shard 0): a replica's partition-0 rank sends
  it EPOCH_DONE when the replica has run its share of an epoch. Epoch ``i`` ends when
  ``ceil(Q * n)`` of the ``n`` live replicas with a share in it have finished it
  (:class:`EpochCount`); a replica that has sent DONE (run over, or stopped early) counts as
  finished for every epoch, and a lost one (``--heartbeat-timeout``) is no longer counted.
  The keeper then sends EPOCH_END to every rank of every replica still running.
* **The replica's clock** (:class:`EpochClock`): a replica that has run its share sends
  EPOCH_DONE and waits for the epoch's end (the barrier Adam's epochs have); a replica that
  learns of the end before it has run its share (a straggler) leaves the rest of its share
  and starts the next epoch's at once. Its data stream goes on where it stopped, a fresh
  permutation of its data shard on each pass, so the examples it did not reach are the first
  it takes next, not skipped for good. With ``--partitions P > 1`` the P ranks of a replica
  agree on the ends they have seen (one small allreduce per iteration), so they leave an epoch
  at the same iteration, as their exchange needs.
* **The end**: the run ends with the last epoch. A replica's DONE is answered by the keeper
  with a last EPOCH_END (epoch ``-1``), after every end it was sent, so each replica takes
  every message addressed to it before it leaves.

Without ``--epoch-quorum``, downpour has no epoch barrier at all: each replica runs its share
of the whole run and the run ends when the slowest has; ``--epoch-quorum 1`` is the plain
barrier (every replica finishes every epoch).
"""
from __future__ import annotations

import math
import time

import numpy as np

from hpcps.blocks import block_range
from hpcps.mpi.comm import MAX, allreduce, done, Transport, wait_all, wait_until
from hpcps.mpi.protocol import H, Message, Tag

LAST = -1  # EPOCH_END's epoch in the keeper's answer to DONE: nothing follows


def epoch_plan(start: int, total: int, per_epoch: float, replicas: int,
               warmup: int = 0) -> list[tuple[int, list[int]]]:
    """The epochs of global steps ``[start, total)``: ``[(epoch, [share of each replica])]``.

    ``per_epoch`` is the number of mini-batches in one pass over the training set
    (``n_train / batch``): epoch ``k`` covers the global steps ``[round(k * per_epoch),
    round((k + 1) * per_epoch))``, the first and last possibly cut by ``start`` and ``total``.
    Replica 0 runs the warm start (global steps ``[0, warmup)``) alone; the rest of each epoch
    is split in equal blocks (:func:`hpcps.blocks.block_range`). The shares of all epochs add
    up to ``total - start``.
    """
    if per_epoch <= 0 or replicas < 1:
        raise ValueError(f"per_epoch {per_epoch} and replicas {replicas} must be positive")

    def bound(k: int) -> int:
        return int(round(k * per_epoch))

    out = []
    k = max(0, int(start // per_epoch) - 1)
    while bound(k + 1) <= start:
        k += 1
    pos = start
    while pos < total:
        end = min(total, bound(k + 1))
        if end > pos:
            warm = max(0, min(end, warmup) - pos)
            rest = end - pos - warm
            shares = [hi - lo for lo, hi in (block_range(rest, replicas, r)
                                             for r in range(replicas))]
            shares[0] += warm
            out.append((k, shares))
            pos = end
        k += 1
    return out


class EpochCount:
    """Which epochs have ended: the keeper's bookkeeping, without MPI.

    ``shares[i][r]``: replica r's share of the plan's epoch ``i``. A replica with no share in
    an epoch is not waited for in it.
    """

    def __init__(self, shares: list[list[int]], quorum: float):
        if not 0 < quorum <= 1:
            raise ValueError(f"quorum {quorum} must be in (0, 1]")
        self.shares = shares
        self.quorum = quorum
        self.next = 0  # the first epoch not ended
        self.finished = [set() for _ in shares]  # replicas done with each epoch
        self.gone: set[int] = set()  # sent DONE: finished with every epoch
        self.lost: set[int] = set()
        self.waited_for: list[int] = []  # replicas that had run their share when each ended
        self.of: list[int] = []  # replicas counted in each epoch (share, not lost)

    @property
    def over(self) -> bool:
        return self.next >= len(self.shares)

    def need(self, i: int) -> tuple[int, int]:
        """(replicas counted in epoch i, how many of them must have finished it)."""
        counted = [r for r, s in enumerate(self.shares[i]) if s > 0 and r not in self.lost]
        return len(counted), math.ceil(self.quorum * len(counted) - 1e-9)

    def done(self, replica: int, i: int) -> list[int]:
        """Replica finished its share of epoch i; returns the epochs that ended now."""
        if 0 <= i < len(self.shares):
            self.finished[i].add(replica)
        return self._ended()

    def leave(self, replica: int, lost: bool = False) -> list[int]:
        """Replica sent DONE (``lost`` False) or was lost; returns the epochs that ended now."""
        (self.lost if lost else self.gone).add(replica)
        return self._ended()

    def _ended(self) -> list[int]:
        out = []
        while not self.over:
            i = self.next
            n, need = self.need(i)
            counted = [r for r, s in enumerate(self.shares[i]) if s > 0 and r not in self.lost]
            ran = [r for r in counted if r in self.finished[i]]
            if len(ran) + len([r for r in counted if r in self.gone and r not in ran]) < need:
                break
            self.waited_for.append(len(ran))  # fewer than needed: the others had left
            self.of.append(n)
            out.append(i)
            self.next += 1
        return out


class EpochKeeper:
    """Server shard 0's side: count EPOCH_DONE, announce each epoch's end (see the module).

    ``ranks[r]``: the world ranks of replica r (one per partition; partition 0's first).
    """

    def __init__(self, comm, plan: list[tuple[int, list[int]]], quorum: float,
                 ranks: list[list[int]]):
        self.comm = comm
        self.net = Transport(comm)
        self.plan = plan
        self.count = EpochCount([s for _, s in plan], quorum)
        self.ranks = ranks
        self.running = set(range(len(ranks)))  # replicas that may still be sent an end
        self.sends: list[tuple[int, object, Message]] = []  # (replica, request, buffer)
        self.t0 = time.perf_counter()
        self.ended_at: list[float] = []
        self._small = Message(0)

    def on_epoch_done(self, src: int, status) -> bool:
        """Handler for EPOCH_DONE (hpcps.ps.serve)."""
        self.net.take(self._small.buf, src, Tag.EPOCH_DONE)
        h = self._small.header
        self._announce(self.count.done(int(h[H.SENDER]), int(h[H.STEPS])))
        return False

    def on_done(self, replica: int) -> None:
        """Replica sent DONE: it counts as finished with every epoch; answer with LAST."""
        ended = self.count.leave(replica)
        self.running.discard(replica)
        self._announce(ended)
        self._send(replica, LAST)

    def on_lost(self, replica: int) -> None:
        self.running.discard(replica)
        self._announce(self.count.leave(replica, lost=True))

    def _announce(self, ended: list[int]) -> None:
        for i in ended:
            if not self.running:  # every replica has left (a stop): nothing ends any more
                return
            self.ended_at.append(time.perf_counter() - self.t0)
            for r in sorted(self.running):
                self._send(r, i)

    def _send(self, replica: int, epoch: int) -> None:
        for rank in self.ranks[replica]:
            msg = Message(0)
            msg.header[H.STEPS] = epoch
            self.sends.append((replica, self.net.send_nowait(msg.buf, rank, Tag.EPOCH_END),
                               msg))
        self.sends = [s for s in self.sends if not done(s[1])]

    def close(self, timeout: float) -> None:
        """Complete the sends to replicas not lost (a lost one's may never complete)."""
        live = [req for r, req, _ in self.sends if r not in self.count.lost]
        wait_all(live, timeout, "replicas to take the end-of-epoch messages")

    def figures(self) -> dict:
        c = self.count
        starts = [0.0] + self.ended_at[:-1]
        n = len(self.ended_at)  # the epochs that ended while replicas were running
        return {"epochs_ended": n, "epochs_planned": len(self.plan),
                "epoch_s": [round(b - a, 3) for a, b in zip(starts, self.ended_at)],
                "epoch_finished": c.waited_for[:n], "epoch_counted": c.of[:n]}


class EpochClock:
    """A replica rank's side: its shares, where it is, the ends it has seen (see the module).

    ``agree``: with P > 1, the communicator of this replica's partitions (they agree on the
    ends seen); ``announce``: this rank sends EPOCH_DONE (partition 0 of the replica).
    """

    def __init__(self, comm, keeper: int, shares: list[int], replica: int, timeout: float,
                 announce: bool = True, agree=None):
        self.comm = comm
        self.net = Transport(comm)
        self.keeper = keeper
        self.shares = shares
        self.timeout = timeout
        self.announce = announce
        self.agree = agree
        self.pos = 0          # the plan's epoch this replica is in
        self.in_epoch = 0     # mini-batches run in it
        self.ended = -1       # the last epoch known to have ended
        self.left = 0         # mini-batches of its shares a straggler did not run
        self.waited_s = 0.0   # time spent waiting for epochs to end
        self.closed = False
        self._tell = Message(0)
        self._tell.header[H.SENDER] = replica
        self._msg = Message(0)
        self._req = self._post()
        self._skip_empty()

    @property
    def over(self) -> bool:
        return self.pos >= len(self.shares)

    def _skip_empty(self) -> None:
        """Move past epochs in which this replica has no share (nothing to wait for)."""
        while not self.over and self.shares[self.pos] == 0:
            self.pos += 1

    def _post(self):
        return self.net.post_recv(self._msg.buf, self.keeper, Tag.EPOCH_END)

    def _take(self) -> None:
        """The message just received: an epoch's end, or LAST."""
        epoch = int(self._msg.header[H.STEPS])
        if epoch == LAST:
            self.closed = True
            return
        self.ended = max(self.ended, epoch)
        self._req = self._post()

    def _poll(self) -> None:
        while not self.closed and done(self._req):
            self._take()

    def _wait_one(self, what: str) -> None:
        wait_until(lambda: done(self._req), self.timeout,
                   lambda: f"server shard 0 (rank {self.keeper}) to {what}; it, or the "
                   "replicas it counts, are stuck or dead")
        self._take()

    def advance(self, ran: int) -> bool:
        """After an iteration of ``ran`` mini-batches: leave an epoch that ended, or wait for
        the end of one whose share is done. True once the last epoch is over."""
        self.in_epoch += ran
        self._poll()
        if self.agree is not None:
            out = np.array([self.ended], dtype=np.int64)
            allreduce(self.agree, out, MAX, self.timeout,
                      "the other partitions of this replica to agree on the end of an epoch")
            self.ended = int(out[0])
        while not self.over:
            share = self.shares[self.pos]
            if self.pos > self.ended and self.in_epoch < share:
                break
            if self.pos > self.ended:  # share done: tell the keeper, wait
                if self.announce:
                    self._tell.header[H.STEPS] = self.pos
                    self.net.send_eager(self._tell.buf, self.keeper, Tag.EPOCH_DONE)
                t = time.perf_counter()
                while self.ended < self.pos:
                    self._wait_one(f"end epoch {self.pos}")
                self.waited_s += time.perf_counter() - t
            else:  # it ended: leave what is left of the share
                self.left += max(0, share - self.in_epoch)
            self.pos += 1
            self.in_epoch = 0
            self._skip_empty()
        return self.over

    def drain(self) -> None:
        """After DONE: take every message the keeper sent this rank, up to its LAST."""
        while not self.closed:
            self._wait_one("answer this replica's DONE")
