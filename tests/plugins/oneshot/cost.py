"""One-shot averaging's cost model (:mod:`hpcps.strategies.cost`): every step a replica
computes and updates alone, with no communication; at the end of the run one allreduce of the
parameters (a ring, or MPI's as measured), paid once and so spread over the run's
``run_steps`` steps per replica (none counted in a run of unknown length). The allreduce of
the replicas' distance to the average, one float, is left out. Bytes per step as its summary
counts them: 8 bytes per parameter once, over the replica's steps. No MPI."""
from hpcps.strategies.cost import CostModel, Workload, allreduce_s


class OneShotCost(CostModel):
    def bytes_per_step(self, w: Workload, R: int) -> float:
        return 8.0 * w.n_params / w.run_steps if w.run_steps else 0.0

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, R = w.n_params, nodes
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        t = w.compute(nodes) + n * w.update_s_per_param * share
        if w.run_steps:
            gamma = w.reduce_s_per_param * share
            t += allreduce_s(4 * n, R, alpha, beta, gamma, allreduce) / w.run_steps
        return R * w.batch / t


COST = OneShotCost()
