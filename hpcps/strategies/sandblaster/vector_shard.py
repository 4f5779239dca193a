"""Sandblaster's parameter-server shard: named vectors, operated on by small commands.

The shard holds its slice of every vector L-BFGS needs (parameters ``x``, gradient ``g``,
direction, trial point, the history pairs). The coordinator sends it one :class:`Op` at a
time (a few numbers: op, two vector ids, a scalar); the shard applies it to its slice and
answers with at most one scalar (its part of a dot product). No vector ever travels to the
coordinator.

Replicas fetch a vector slice at the start of a batch and push the gradient they
accumulated over accepted portions. Pushes go into a per-replica pending buffer and reach
the accumulator only when the coordinator COMMITs that replica (after it reported its flush),
so a replica declared lost (BAN) cannot leave half its work in the gradient.

Replicas that may die (``--heartbeat-timeout``, ``may_lose`` here): receiving a push and
sending a fetch reply wait at most that long, so a replica killed half-way through a message
does not hang the shard; the shard then ignores the replica from then on, as after a BAN
(the coordinator bans it too once it has been silent for ``--replica-timeout``).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hpcps.mpi.comm import Transport
from hpcps.mpi.protocol import H, Message, Tag
from hpcps.strategies.sandblaster import Op
from hpcps.strategies.sandblaster import Tag as SandblasterTag
from hpcps.compress.bf16 import FP32, Wire
from hpcps.ps.serve import serve

CMD_SLOTS = 6  # op, a, b, alpha, step, spare (float64)


class VectorShard:
    """Serve one shard until the coordinator sends FINISH.

    Parameters
    ----------
    comm : communicator shared with coordinator and replicas (the world duplicate).
    n : length of this shard's slice.
    n_vectors : how many named vectors (ids 0..n_vectors-1); id 0 is x.
    coordinator : rank of the coordinator in ``comm``.
    timeout : seconds without any message before failing.
    on_gather : called as ``on_gather(op, step)`` on CHECKPOINT and FINISH; every shard
        calls it at the same command, so it may run a collective over the shards.
    tick : called by the serving loop now and then (the job's stop vote, :mod:`hpcps.runtime.stop`).
    may_lose : seconds to wait for a transfer to or from a replica that may have died (None:
        replicas do not die, every transfer is waited for).
    wire : the format of the values fetched and pushed (``--wire-dtype``); the vectors and
        the sums of pushes stay float32.
    """

    def __init__(self, comm, n: int, n_vectors: int, coordinator: int, timeout: float,
                 on_gather: Callable[[int, int], None], tick: Callable[[], None] | None = None,
                 may_lose: float | None = None, wire: Wire = FP32):
        self.comm = comm
        self.net = Transport(comm)
        self.n = n
        self.vec = np.zeros((n_vectors, n), dtype=np.float32)
        self.coordinator = coordinator
        self.timeout = timeout
        self.on_gather = on_gather
        self.tick = tick
        self.may_lose = may_lose
        self.broken: list[int] = []  # replicas whose transfer broke off
        self.pending: dict[int, np.ndarray] = {}
        self.banned: set[int] = set()
        self.acc: int | None = None
        self.commands = 0
        self.note: dict = {}
        self._cmd = np.zeros(CMD_SLOTS, dtype=np.float64)
        self._reply = np.zeros(1, dtype=np.float64)
        self._push = Message(n, wire)
        self._params = Message(n, wire)
        self._ask = Message(0)
        self._ack = Message(0)

    def serve(self) -> None:
        """Serve commands, fetches and pushes until the coordinator sends FINISH."""
        serve(self.comm, {SandblasterTag.CMD: self._recv_command, Tag.FETCH: self._recv_fetch,
                          SandblasterTag.PUSH: self._recv_push,
                          SandblasterTag.STATE: self._recv_state},
              self.timeout, lambda: f"the coordinator (rank {self.coordinator}) and the replicas",
              self.tick)

    def _recv_command(self, src: int, status) -> bool:
        self.net.take(self._cmd, src, SandblasterTag.CMD)
        return self._command(self._cmd)

    def _recv_fetch(self, src: int, status) -> bool:
        self.net.take(self._ask.buf, src, Tag.FETCH)
        r = self._params
        r.payload[:] = self.vec[int(self._ask.header[H.VECTOR])]
        r.pack()
        if self.may_lose is None:
            self.net.send_eager(r.buf, src, Tag.PARAMS)  # the replica posted its receive
        elif not self.net.send_by(r.buf, src, Tag.PARAMS, time.monotonic() + self.may_lose):
            self._params = r.fresh()  # MPI may still read the old buffer
            self._drop(src)
        return False

    def _drop(self, src: int) -> None:
        """A transfer with replica rank ``src`` broke off: it died; ignore it from now on."""
        self.broken.append(src)
        self.banned.add(src)
        self.pending.pop(src, None)

    def _recv_push(self, src: int, status) -> bool:
        """Gradients of accepted portions wait in the replica's pending buffer until COMMIT."""
        if self.may_lose is None:
            self.net.take(self._push.buf, src, SandblasterTag.PUSH)
        elif not self.net.take_by(self._push.buf, src, SandblasterTag.PUSH,
                                  time.monotonic() + self.may_lose):
            self._push = self._push.fresh()  # MPI may still write the old buffer
            self._drop(src)
            return False
        if src not in self.banned:
            buf = self.pending.setdefault(src, np.zeros(self.n, dtype=np.float32))
            self._push.unpack()
            buf += self._push.payload
        self.net.send_eager(self._ack.buf, src, SandblasterTag.PUSH_ACK)
        return False

    def _recv_state(self, src: int, status) -> bool:
        """What the next checkpoint should record besides vectors (L-BFGS scalars)."""
        self.note = self.net.take_obj(src, SandblasterTag.STATE)
        return False

    def _command(self, cmd: np.ndarray) -> bool:
        """Apply one command; reply; True when it was FINISH."""
        op, a, b, alpha, step = int(cmd[0]), int(cmd[1]), int(cmd[2]), cmd[3], int(cmd[4])
        v = self.vec
        value = 0.0
        self.commands += 1
        if op == Op.COPY:
            v[a][...] = v[b]
        elif op == Op.AXPY:
            v[a] += np.float32(alpha) * v[b]
        elif op == Op.SCALE:
            v[a] *= np.float32(alpha)
        elif op == Op.DOT:
            value = float(np.dot(v[a].astype(np.float64), v[b].astype(np.float64)))
        elif op == Op.RESET_ACC:
            self.acc = a
            v[a][...] = 0.0
            for buf in self.pending.values():
                buf[...] = 0.0
        elif op == Op.COMMIT:
            buf = self.pending.get(a)
            if buf is not None and a not in self.banned:
                v[self.acc] += buf
                buf[...] = 0.0
        elif op == Op.BAN:
            self.banned.add(a)
            self.pending.pop(a, None)
        elif op in (Op.CHECKPOINT, Op.FINISH):
            self.on_gather(op, step)
        else:
            raise RuntimeError(f"unknown sandblaster operation {op}")
        self._reply[0] = value
        self.net.send_eager(self._reply, self.coordinator, SandblasterTag.REPLY)
        return op == Op.FINISH
