"""sync's cost model (:mod:`hpcps.strategies.cost`): every step the replicas compute, then a
ring allreduce of the n+1 floats (``2 (R-1) alpha + 2 (R-1)/R * 4 (n+1) * beta``, and each node
sums (R-1)/R of them, ``reduce_s_per_param``), then the update. No MPI."""
from __future__ import annotations

from hpcps.strategies.cost import CostModel, Workload, allreduce_s


class SyncCost(CostModel):
    def bytes_per_step(self, w: Workload, R: int) -> float:
        # the replica's summary: 2 (R-1)/R of the n values and the float32 loss
        return 2 * (w.value_bytes * w.n_params + 4) * (R - 1) / R

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, R = w.n_params, nodes
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        gamma = w.reduce_s_per_param * share
        t = w.compute(nodes)
        t += n * w.update_s_per_param * share \
            + allreduce_s(w.value_bytes * n + 4, R, alpha, beta, gamma, allreduce)
        return R * w.batch / t


COST = SyncCost()
