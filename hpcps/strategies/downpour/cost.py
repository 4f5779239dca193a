"""downpour's cost model (:mod:`hpcps.strategies.cost`). Every step a replica computes, pushes
its 4n-byte gradient and fetches 4n bytes of parameters from the S shards (the reply waits for
the shard to apply the push ahead of it); a shard's loop, one request at a time, takes R
pushes, applies them and serves R fetches per round of steps: the job runs at the slower of
the replicas and the shards. S nodes are shards (``Workload.servers``), so R = N - S. No MPI.
"""
from __future__ import annotations

from hpcps.mpi.protocol import HEADER_BYTES
from hpcps.strategies.cost import CostModel, Workload


class DownpourCost(CostModel):
    ring_like = False  # a replica talks to its shards, one pair's link at a time

    def bytes_per_step(self, w: Workload, R: int) -> float:
        # the client's count: per shard a push, an ask and a reply
        return 2 * w.value_bytes * w.n_params + 3 * HEADER_BYTES * w.servers

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, b = w.n_params, w.batch
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        S = w.servers
        R = nodes - S
        if R < 1:
            return 0.0
        # a replica talks to every shard: a push, an ask and a reply of n/S parameters each;
        # the reply waits for the shard to apply the push ahead of the ask
        replica = w.compute(nodes) + 3 * S * alpha + 2 * w.value_bytes * n * beta \
            + n / S * w.update_s_per_param * share
        # a shard's loop does one thing at a time (ps/gradient_shard.py): per replica step it
        # receives the push, applies it, answers the ask with its n/S parameters
        shard = R * (3 * alpha + 2 * w.value_bytes * n / S * beta
                     + n / S * w.update_s_per_param * share)
        return R * b / max(replica, shard)

    def computing_beside(self, w, nodes, link) -> float:
        """The other R - 1 replicas for the part of their step they compute, which depends on
        how fast the shard's link runs: the fixed point, found by bisection (more computing
        slows the link, which lengthens the step and so shortens the part spent computing)."""
        R = nodes - w.servers
        lo, hi = 0.0, float(max(0, R - 1))
        for _ in range(40):
            mid = (lo + hi) / 2
            eps = self.examples_per_s(w, nodes, *link(mid))
            step = R * w.batch / eps if eps > 0 else float("inf")
            if (R - 1) * min(1.0, w.compute(nodes) / step) > mid:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


COST = DownpourCost()
