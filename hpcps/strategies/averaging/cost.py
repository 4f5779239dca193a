"""averaging's cost model (:mod:`hpcps.strategies.cost`): every step compute and update; every k
steps (``--average-every``, ``Workload.average_every``) a ring allreduce of the parameters and
the optimizer state, and the average's own copies in and out of its buffer
(``average_s_per_param``, measured on the replica's own code by
:mod:`hpcps.strategies.averaging.calibrate`). No MPI."""
from __future__ import annotations

from hpcps.strategies.cost import CostModel, Workload, allreduce_s


class AveragingCost(CostModel):
    calibrate = "hpcps.strategies.averaging.calibrate:measure"

    def bytes_per_step(self, w: Workload, R: int) -> float:
        # the replica's summary: sync's figure per average, every k steps
        return 2 * w.value_bytes * w.n_params * (1 + w.state_vectors) * (R - 1) / R \
            / w.average_every

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, R = w.n_params, nodes
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        gamma = w.reduce_s_per_param * share
        t = w.compute(nodes)
        average = allreduce_s(w.value_bytes * n * (1 + w.state_vectors), R, alpha, beta, gamma,
                              allreduce) \
            + (n * w.average_s_per_param * share if R > 1 else 0.0)  # one: no average
        t += n * w.update_s_per_param * share + average / w.average_every
        return R * w.batch / t


COST = AveragingCost()
