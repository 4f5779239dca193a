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

from hpcps.protocol import H


class StaleSynchronous:
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
