"""Consistency models as policies of the gradient shard (:mod:`hpcps.ps.gradient_shard`).

:class:`StaleSynchronous` is stale-synchronous parallel (Ho et al. 2013): each replica has a
*clock*, the mini-batches it has pushed; a replica may not start step c while the slowest live
replica has not completed step c - s - 1. The shard enforces it where a replica reads: a fetch
from replica r is answered only when ``clock[r] - min(clock of live replicas) <= s``, else the
reply is held (the shard goes on serving everyone else, no busy waiting) and sent as soon as a
push or a finished replica moves the minimum. s = 0 is bulk-synchronous; no bound is Downpour.

Why the shard and not a separate clock service: every replica already talks to the shards at
every fetch and push, so the clocks come for free with the pushes (their step counts) and a
hold costs no extra message. Every shard of a partition sees the same pushes, so all shards
agree on the clocks without talking to each other.

Live replicas are those that have not sent DONE: a replica that finishes its data early drops
out of the minimum, so it never blocks the others. Replicas released after a warm start begin
with the warm-start steps on their clock (``offsets``): replica 0 trained those steps alone,
and the others start from its parameters, not behind it.
"""
from __future__ import annotations

import numpy as np

from hpcps.mpi.protocol import H
from hpcps.ps.gradient_shard import ShardPolicy


class StaleSynchronous(ShardPolicy):
    """Hold a replica's fetch while it is more than ``bound`` steps ahead of the slowest.

    Parameters
    ----------
    bound : s, the largest allowed lead in steps (>= 0).
    n_replicas : the replicas that will push (indices 0..n-1).
    offsets : each replica's clock at start (default 0); see the module docstring.
    """

    def __init__(self, bound: int, n_replicas: int, offsets=None):
        if bound < 0:
            raise ValueError(f"staleness bound must be >= 0, got {bound}")
        self.bound = int(bound)
        self.clock = {r: int(offsets[r]) if offsets else 0 for r in range(n_replicas)}
        self.live = set(range(n_replicas))
        self.max_lead = 0  # the largest lead over the slowest at an answered fetch

    def slowest(self) -> int:
        return min((self.clock[r] for r in self.live), default=0)

    def on_push(self, shard, sender: int, header: np.ndarray, grad) -> None:
        shard.apply_push(header, grad)
        self.clock[sender] += int(header[H.STEPS])

    def may_answer(self, shard, sender: int) -> bool:
        return self.clock[sender] - self.slowest() <= self.bound

    def on_done(self, shard, sender: int) -> None:
        self.live.discard(sender)

    def on_answer(self, shard, sender: int, header: np.ndarray) -> None:
        slowest = self.slowest()
        self.max_lead = max(self.max_lead, self.clock[sender] - slowest)
        header[H.CLOCK] = slowest

    def snapshot(self) -> np.ndarray:
        """Each replica's clock (the live set is not here: every copy hears each DONE)."""
        return np.array([self.clock[r] for r in sorted(self.clock)], dtype=np.float64)

    def restore(self, values: np.ndarray) -> None:
        for r in sorted(self.clock):
            self.clock[r] = int(values[r])


class SoftSync(ShardPolicy):
    """Soft synchronization and staleness-dependent rates (Zhang, Gupta et al. 2016).

    The shard collects ``group`` pushes, from any replicas, and applies their mean as one
    update (``group`` = 1: every push at once, as Downpour). With ``staleness_lr`` the update
    is taken at the rate ``lambda0 / max(1, tau)``, lambda0 the optimizer's rate and tau the
    push's staleness (updates the shard applied since its sender fetched), or for a group the
    mean staleness of its pushes, as in the paper. It is the rate that is scaled, not the
    gradient: Adagrad's accumulator takes the gradient as it is. (Scaling the gradient instead
    would leave the accumulator about tau^2 times too small, and a fresh push, at the end of a
    run when the other replicas have finished, would then take a step tau times too large.)
    Both go with any optimizer on the shard, and with each other. Pushes still buffered when
    the last replica finishes are applied then.
    """

    def __init__(self, n: int, group: int = 1, staleness_lr: bool = False):
        if group < 1:
            raise ValueError(f"softsync group must be >= 1, got {group}")
        self.group = int(group)
        self.staleness_lr = bool(staleness_lr)
        self.buf = np.zeros(n, dtype=np.float32)
        self.count = 0
        self.stale_sum = 0.0   # staleness of the pushes in the buffer
        self.updates = 0       # combined updates applied
        self.combined = 0      # pushes they held in all

    def on_push(self, shard, sender: int, header: np.ndarray, grad) -> None:
        stale = shard.staleness(header)
        if self.group == 1:
            self._apply(shard, grad, stale)
            self.updates += 1
            self.combined += 1
        else:
            self.buf += np.float32(1.0 / self.group) * grad
            self.count += 1
            self.stale_sum += stale
            if self.count == self.group:
                self._flush(shard)
        shard.account(header, stale)

    def _apply(self, shard, grad, stale: float) -> None:
        """One update of the shard's optimizer, at the rate its staleness gives."""
        if not self.staleness_lr or stale <= 1.0:
            shard.apply_update(grad)
        else:
            shard.apply(shard.params, grad, shard.state, lr_scale=1.0 / stale)
            shard.apply_update(None)  # applied: the shard only counts the update

    def _flush(self, shard) -> None:
        self._apply(shard, self.buf, self.stale_sum / self.count)
        self.updates += 1
        self.combined += self.count
        self.buf[...] = 0.0
        self.count = 0
        self.stale_sum = 0.0

    def on_done(self, shard, sender: int) -> None:
        if len(shard.done) >= shard.n_replicas:
            self.on_end(shard)

    def on_end(self, shard) -> None:
        if self.count:
            self.buf *= np.float32(self.group / self.count)  # the mean of what is left
            self._flush(shard)

    def snapshot(self) -> np.ndarray:
        """The buffer (float32 values, exact in float64), then count, staleness sum,
        updates and pushes combined."""
        return np.concatenate([self.buf.astype(np.float64),
                               [self.count, self.stale_sum, self.updates, self.combined]])

    def restore(self, values: np.ndarray) -> None:
        n = len(self.buf)
        self.buf[:] = values[:n]
        self.count, self.updates, self.combined = (int(values[n]), int(values[n + 2]),
                                                   int(values[n + 3]))
        self.stale_sum = float(values[n + 1])
