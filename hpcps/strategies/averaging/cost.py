"""averaging's cost model (:mod:`hpcps.strategies.cost`): every step compute and update; every k
steps (``--average-every``, ``Workload.average_every``) a ring allreduce of the parameters and
the optimizer state, and the average's own copies in and out of its buffer
(``average_s_per_param``, measured on the replica's own code by
:mod:`hpcps.strategies.averaging.calibrate`). No MPI."""
from __future__ import annotations

import math

from hpcps.strategies.cost import CostModel, Workload, allreduce_s


def averages_per_step(w: Workload) -> float:
    """Averages per replica step: one every k steps, and (a run of ``run_steps``) one more at
    the end when the last ones were fewer than k (every replica ends on the same weights)."""
    if w.run_steps:
        return math.ceil(w.run_steps / w.average_every) / w.run_steps
    return 1.0 / w.average_every


class AveragingCost(CostModel):
    calibrate = "hpcps.strategies.averaging.calibrate:measure"

    def bytes_per_step(self, w: Workload, R: int) -> float:
        # the replica's summary: sync's figure per average, every k steps
        return 2 * w.value_bytes * w.n_params * (1 + w.state_vectors) * (R - 1) / R \
            * averages_per_step(w)

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, R = w.n_params, nodes
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        gamma = w.reduce_s_per_param * share
        t = w.compute(nodes)
        average = allreduce_s(w.value_bytes * n * (1 + w.state_vectors), R, alpha, beta, gamma,
                              allreduce) \
            + (n * w.average_s_per_param * share if R > 1 else 0.0)  # one: no average
        t += n * w.update_s_per_param * share + average * averages_per_step(w)
        return R * w.batch / t


COST = AveragingCost()
