"""sandblaster's cost model (:mod:`hpcps.strategies.cost`): one batch evaluation, the batch
split over the replicas' portions; each replica fetches the parameters once and pushes its
accumulated gradient every ``--flush-every`` portions it computed (and its remainder),
through one shard; the coordinator's commands are small (alpha each). R = N - 2 (one shard,
one coordinator). On shared cores only the replicas compete for them: the coordinator and
the shard wait for messages without computing. No MPI."""
from __future__ import annotations

from hpcps.strategies.cost import CostModel, Workload


def transfers(w: Workload, R: int) -> int:
    """Parameter vectors a batch evaluation moves: a fetch per replica, and per replica a push
    of every ``flush_every`` portions of its share (about portions / R; the last push may be
    short)."""
    return R + R * -(-w.portions // (R * w.flush_every))


class SandblasterCost(CostModel):
    ring_like = False  # a replica talks to the shard, one pair's link at a time
    calibrate = "hpcps.strategies.sandblaster.calibrate:measure"

    def bytes_per_step(self, w: Workload, R: int) -> float:
        # per batch evaluation: each replica's fetch and pushes
        return w.value_bytes * w.n_params * transfers(w, R)

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, b = w.n_params, w.batch
        R = nodes - 2
        if R < 1:
            return 0.0
        per_example = w.portion_s_per_example or w.compute_s / b
        # on shared cores only the replicas compete: the coordinator and the shard wait
        # for messages without computing (their loops sleep between polls)
        share = w.share(R)
        work = share * per_example * w.batch_examples / R
        shard = transfers(w, R) * (alpha + w.value_bytes * n * beta)  # fetches, pushes: one link
        commands = 20 * alpha * 2  # the coordinator's L-BFGS commands, round trips
        return w.batch_examples / (work + shard + commands
                                   + 4 * n * w.update_s_per_param * share)

    def computing_beside(self, w, nodes, link) -> float:
        """The other R - 1 replicas, computing their portions (the coordinator and the shard
        wait without computing)."""
        return float(max(0, nodes - 3))


COST = SandblasterCost()
