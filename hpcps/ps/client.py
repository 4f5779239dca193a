"""The replica's side of the parameter server: fetch each shard's chunks, push their gradients.

Buffers for every shard are allocated once. A push is non-blocking (two buffers per shard
alternate, so the replica computes the next gradient while the last one is on the wire); a
fetch waits only for the shards, never for another replica.
"""
from __future__ import annotations

import numpy as np

from hpcps import trace
from hpcps.compress.bf16 import FP32, Wire
from hpcps.ps.chunks import ChunkPlan
from hpcps.mpi.comm import REQUEST_NULL, Transport, reply_spin_s, wait_all
from hpcps.mpi.protocol import ByteMessage, H, Message, Tag
from hpcps.ps.liveness import DROPPED, Dropped


def fill_packed(msg: ByteMessage, body: np.ndarray, steps: int, loss_sum: float, rows: int,
                where: str) -> np.ndarray:
    """Put a variable-size push (``body``, uint8) and its header figures in ``msg``; return
    the bytes to send. ``where`` names the receiver in the error for a body over the bound."""
    msg.header[H.STEPS] = steps
    msg.header[H.LOSS_SUM] = loss_sum
    msg.header[H.EXAMPLES] = rows
    n = len(body)
    if n > len(msg.body):
        raise ValueError(f"message of {n} bytes exceeds the bound {len(msg.body)} for {where}")
    msg.body[:n] = body
    return msg.spec(n)


def unpersisted(headers) -> int:
    """Global steps since the last step every shard has on disk, counted from shard 0's
    step (the step a replica reports): each shard's reply says how many steps it applied
    since its last completed flush, and a persistence manifest holds the oldest shard's."""
    persisted = min(int(h[H.STEPS]) - int(h[H.UNPERSISTED]) for h in headers)
    return int(headers[0][H.STEPS]) - persisted


class Client:
    """Talk to S shards, each holding some chunks of the flat parameter vector.

    Parameters
    ----------
    comm : the communicator the shards listen on.
    server_ranks : rank of each shard in ``comm``.
    ranges : which chunks each shard holds: a :class:`~hpcps.ps.chunks.ChunkPlan`, or one
        contiguous ``(lo, hi)`` slice per shard.
    replica : this replica's index (sent along, for the shard's bookkeeping).
    timeout : seconds to wait for a shard before failing with its rank.
    wire : the format of the values fetched and pushed (``--wire-dtype``).
    """

    def __init__(self, comm, server_ranks, ranges, replica: int, timeout: float,
                 packed_bytes: list[int] | None = None, wire: Wire = FP32):
        self.comm = comm
        self.net = Transport(comm)
        self.server_ranks = list(server_ranks)
        self.plan = ranges if isinstance(ranges, ChunkPlan) else ChunkPlan.contiguous(ranges)
        self.ranges = self.plan.ranges  # each shard's elements, in shard order
        self.replica = replica
        self.timeout = timeout
        sizes = self.plan.sizes
        if packed_bytes is None:
            self._push = [[Message(n, wire), Message(n, wire)] for n in sizes]
        else:  # compressed or activation pushes: variable-size messages, bounded per shard
            self._push = [[ByteMessage(bound), ByteMessage(bound)] for bound in packed_bytes]
        self._push_req = [[REQUEST_NULL, REQUEST_NULL] for _ in self.ranges]
        self._slot = 0
        self._params = [Message(n, wire) for n in sizes]
        self._ask = Message(0)
        self._ask.header[H.SENDER] = replica
        self.versions = np.zeros(len(self.ranges))
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_reply: dict[str, float] = {}

    def fetch(self, params: np.ndarray) -> dict[str, float]:
        """Fill ``params`` with the shards' current values; return the figures shard 0 sent."""
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        reqs = []
        for s, dest in enumerate(self.server_ranks):
            reqs.append(self.net.post_recv(self._params[s].buf, dest, Tag.PARAMS))
        for dest in self.server_ranks:  # header only, to a rank that posted its receive first
            self.net.send_eager(self._ask.buf, dest, Tag.FETCH)
        wait_all(reqs, self.timeout, f"parameters from server ranks {self.server_ranks}",
                 reply_spin_s())
        if any(m.header[H.STEPS] == DROPPED for m in self._params):
            raise Dropped("a server shard lost this replica (silent past the heartbeat "
                          "timeout) and discards its pushes")
        for s in range(len(self.server_ranks)):
            msg = self._params[s]
            msg.unpack()
            self.plan.put(s, msg.payload, params)
            self.versions[s] = msg.header[H.VERSION]
            self.bytes_received += msg.buf.nbytes
        self.bytes_sent += self._ask.buf.nbytes * len(self.server_ranks)
        if tr is not None:
            tr.message("fetch parameters", sum(m.buf.nbytes for m in self._params), t0,
                       shards=self.server_ranks)
        h = self._params[0].header
        self.last_reply = {"step": int(h[H.STEPS]), "loss": float(h[H.LOSS_SUM]),
                           "staleness": float(h[H.STALENESS]),
                           "max_staleness": float(h[H.MAX_STALENESS]),
                           "clock": float(h[H.CLOCK]),
                           "unpersisted": unpersisted([m.header for m in self._params]),
                           "stopping": any(m.header[H.STOP] for m in self._params)}
        return self.last_reply

    def _slot_for(self, s: int, slot: int):
        """The push buffer of shard ``s`` in ``slot``, once its previous send has finished."""
        req = self._push_req[s][slot]
        if req != REQUEST_NULL:
            wait_all([req], self.timeout,
                     f"server rank {self.server_ranks[s]} to take an earlier push")
        msg = self._push[s][slot]
        h = msg.header
        h[H.VERSION] = self.versions[s]
        h[H.SENDER] = self.replica
        return msg

    def push(self, grad: np.ndarray, steps: int, loss_sum: float) -> None:
        """Send each shard its slice of ``grad`` (a gradient accumulated over ``steps``)."""
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        slot = self._slot
        self._slot ^= 1
        for s in range(len(self.server_ranks)):
            msg = self._slot_for(s, slot)
            msg.header[H.STEPS] = steps
            msg.header[H.LOSS_SUM] = loss_sum
            self.plan.take(s, grad, out=msg.payload)
            msg.pack()
            self._push_req[s][slot] = self.net.send_nowait(msg.buf, self.server_ranks[s],
                                                           Tag.PUSH)
            self.bytes_sent += msg.buf.nbytes
        if tr is not None:
            tr.message("push gradient", sum(m[slot].buf.nbytes for m in self._push), t0,
                       shards=self.server_ranks)

    def push_packed(self, bodies, steps: int, loss_sum: float, tag: int = Tag.PUSH_COMPRESSED,
                    rows: int = 0) -> None:
        """Send shard s the message ``bodies[s]`` (uint8 array) for its slice: compressed
        words, or (``Tag.PUSH_ACTIVATIONS``) ``rows`` rows of layer inputs and errors."""
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        sent = 0
        slot = self._slot
        self._slot ^= 1
        for s, body in enumerate(bodies):
            data = fill_packed(self._slot_for(s, slot), body, steps, loss_sum, rows,
                               f"shard {s}")
            self._push_req[s][slot] = self.net.send_nowait(data, self.server_ranks[s], tag)
            self.bytes_sent += data.nbytes
            sent += data.nbytes
        if tr is not None:
            tr.message(f"push {Tag(tag).name.lower().replace('_', ' ')}", sent, t0,
                       shards=self.server_ranks)

    def done(self, stop: bool = False) -> None:
        """Wait for outstanding pushes, then tell every shard this replica is finished
        (``stop``: rank 0 stopped the run early, and the shards tell the other replicas to
        end)."""
        self._ask.header[H.STOP] = float(stop)
        pending = [r for pair in self._push_req for r in pair if r != REQUEST_NULL]
        wait_all(pending, self.timeout, f"server ranks {self.server_ranks} to take the last pushes")
        for dest in self.server_ranks:
            self.net.send_eager(self._ask.buf, dest, Tag.DONE)
