"""One parameter-server shard: a loop that receives pushes and fetches until every replica is done.

The shard owns a contiguous slice of the flat parameter vector and the optimizer state for it.
It is handed the update rule as a callable (``apply(w, g, state)``, from :mod:`hpcps.optim`) and
knows nothing of its internals. Messages are handled in arrival order from any replica: a push
is applied at once (no replica ever waits for another), a fetch is answered with the slice as it
is now. Every message kind is a :class:`hpcps.protocol.Tag`.

Staleness of a push = updates this shard applied between the replica's fetch and its push.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from hpcps.protocol import HEADER_BYTES, H, ByteMessage, Message, Tag
from hpcps.ps.waiting import PeerTimeout, Poller


@dataclass
class ShardStats:
    """What a shard saw, for metrics and the bench."""

    pushes: int = 0
    fetches: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    wall_s: float = 0.0
    done_replicas: list[int] = field(default_factory=list)


class ShardServer:
    """Serve one shard's slice until all ``n_replicas`` replicas have sent DONE.

    Parameters
    ----------
    comm : communicator shared with the replicas (the world duplicate).
    params, state : this shard's slice of the parameters and of the optimizer state (updated
        in place).
    apply : ``apply(params, grad, state)``, the update rule.
    n_replicas : how many replicas will send DONE.
    step : global step (mini-batches applied) the shard starts from (non-zero on resume).
    timeout : seconds without any message before failing, naming the replicas still expected.
    on_boundary : called as ``on_boundary(step_boundary)`` each time the global step crosses a
        multiple of ``boundary_every`` (used for checkpoints; every shard crosses the same
        boundaries because every push goes to every shard, so a collective inside is safe).
    packed : for variable-size pushes, ``(max_bytes, tag, handle(header, body))``: the largest
        message body to accept, the tag such pushes carry, and a callable that turns a
        received body into a dense gradient for ``apply`` (compressed pushes), or applies the
        update itself and returns None (activation pushes). The strategy builds it; the
        server only knows bytes come in.
    """

    def __init__(self, comm, params: np.ndarray, state: dict, apply: Callable,
                 n_replicas: int, step: int = 0, timeout: float = 600.0,
                 on_boundary: Callable[[int], None] | None = None, boundary_every: int = 0,
                 packed: tuple[int, int, Callable] | None = None):
        self.comm = comm
        self.params = params
        self.state = state
        self.apply = apply
        self.n_replicas = n_replicas
        self.step = int(step)
        self.version = 0
        self.examples = 0
        self.timeout = timeout
        self.on_boundary = on_boundary
        self.boundary_every = boundary_every
        self.stats = ShardStats()
        n = len(params)
        self._push = Message(n)
        self._reply = Message(n)
        self._small = Message(0)
        self._packed = ByteMessage(packed[0]) if packed else None
        self._packed_tag = packed[1] if packed else None
        self._handle = packed[2] if packed else None
        # recent-window figures reported back with each fetch reply
        self._win_loss = 0.0
        self._win_steps = 0
        self._win_stale = 0.0
        self._win_stale_max = 0.0
        self._win_pushes = 0
        self._last_loss = float("nan")

    def serve(self) -> ShardStats:
        status = MPI.Status()
        comm = self.comm
        done: set[int] = set()
        poll = Poller()
        t0 = time.perf_counter()
        last_msg = time.monotonic()
        while len(done) < self.n_replicas:
            if not comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                if time.monotonic() - last_msg > self.timeout:
                    raise PeerTimeout(f"server shard heard nothing for {self.timeout:.0f} s; "
                                      f"{self.n_replicas - len(done)} replica(s) have not "
                                      f"finished (done: {sorted(done)})")
                poll.pause()
                continue
            poll.reset()
            last_msg = time.monotonic()
            src, tag = status.Get_source(), status.Get_tag()
            if tag == Tag.PUSH:
                comm.Recv(self._push.buf, source=src, tag=Tag.PUSH)
                self._on_push(self._push.header, self._push.payload, self._push.buf.nbytes)
            elif tag == self._packed_tag:
                size = status.Get_count(MPI.BYTE)
                if size > len(self._packed.buf):
                    raise RuntimeError(f"push of {size} bytes from rank {src} is larger than "
                                       "any valid message for this shard")
                comm.Recv(self._packed.buf[:size], source=src, tag=tag)
                body = self._packed.body[:size - HEADER_BYTES]
                self._on_push(self._packed.header, self._handle(self._packed.header, body),
                              size)
            elif tag == Tag.FETCH:
                comm.Recv(self._small.buf, source=src, tag=Tag.FETCH)
                self._on_fetch(src)
            elif tag == Tag.DONE:
                comm.Recv(self._small.buf, source=src, tag=Tag.DONE)
                done.add(int(self._small.header[H.SENDER]))
            else:
                raise RuntimeError(f"server shard got unexpected tag {tag} from rank {src}")
        self.stats.wall_s = time.perf_counter() - t0
        self.stats.done_replicas = sorted(done)
        return self.stats

    def _on_push(self, h: np.ndarray, grad: np.ndarray | None, nbytes: int) -> None:
        stale = self.version - h[H.VERSION]
        if grad is not None:  # None: the handler applied the update itself
            self.apply(self.params, grad, self.state)
        self.version += 1
        steps = int(h[H.STEPS])
        before = self.step
        self.step += steps
        self.stats.pushes += 1
        self.stats.bytes_in += nbytes
        self.stats.staleness_sum += stale
        self.stats.staleness_max = max(self.stats.staleness_max, stale)
        self._win_loss += h[H.LOSS_SUM]
        self._win_steps += steps
        self._win_stale += stale
        self._win_stale_max = max(self._win_stale_max, stale)
        self._win_pushes += 1
        if self.on_boundary is not None and self.boundary_every > 0:
            every = self.boundary_every
            for b in range((before // every + 1) * every, self.step + 1, every):
                self.on_boundary(b)

    def _on_fetch(self, src: int) -> None:
        r = self._reply
        r.payload[:] = self.params
        h = r.header
        h[:] = 0.0
        h[H.VERSION] = self.version
        h[H.STEPS] = self.step
        if self._win_steps:
            self._last_loss = self._win_loss / self._win_steps
        h[H.LOSS_SUM] = self._last_loss
        h[H.STALENESS] = self._win_stale / self._win_pushes if self._win_pushes else 0.0
        h[H.MAX_STALENESS] = self._win_stale_max
        self._win_loss = self._win_stale = self._win_stale_max = 0.0
        self._win_steps = self._win_pushes = 0
        # The replica posted its receive before asking, so this send cannot deadlock.
        self.comm.Send(r.buf, dest=src, tag=Tag.PARAMS)
        self.stats.fetches += 1
        self.stats.bytes_out += r.buf.nbytes
