"""The one-shot averaging replica: the shared replica loop with local steps, then one average."""
from __future__ import annotations

import numpy as np
from hpcps.mpi.comm import SUM, allreduce
from hpcps.strategies.context import Context, finish_on_chief, gather_state
from hpcps.strategies.loop import ReplicaLoop


class OneShotReplica(ReplicaLoop):
    lockstep = True  # every replica runs the same number of iterations, then averages

    def __init__(self, ctx: Context):
        self.comm = ctx.grid.partition_comm
        self.R = self.comm.Get_size()
        super().__init__(ctx, -(-ctx.remaining_steps // self.R))
        self.state = ctx.opt_state
        self.grad = np.empty(ctx.model.n_params, dtype=np.float32)
        self.spread = 0.0

    def step(self, x, y) -> float:
        loss = self.source(self.params, x, y, self.grad)
        self.ctx.optimizer.apply(self.params, self.grad, self.state,
                                 step_scale=self.lr_factor())
        return loss

    def global_step(self) -> int:
        return self.ctx.start_step + self.done * self.R

    def checkpoint_state(self) -> dict:
        return self.state

    def after_loop(self) -> None:
        mean = self.params.copy()
        allreduce(self.comm, mean, SUM, self.cfg.timeout,
                  f"the final average with the other {self.R - 1} replica(s)")
        mean *= np.float32(1.0 / self.R)
        dist = np.array([np.sum((self.params - mean) ** 2, dtype=np.float64)])
        allreduce(self.comm, dist, SUM, self.cfg.timeout, "the replicas' distance to the average")
        self.spread = float(np.sqrt(dist[0] / (self.R * len(mean))))
        self.params[...] = mean

    def finish(self, train_s: float) -> dict:
        out = {"figures": {"final_spread": self.spread,
                           "bytes_per_step": 8.0 * len(self.params) / max(1, self.done)}}
        if self.first:
            full, full_state = gather_state(self.ctx, self.params, self.state)
            if self.ctx.grid.is_chief:
                out.update(finish_on_chief(self.ctx, full, full_state, self.global_step(),
                                           train_s))
        return out


def run(ctx: Context) -> dict:
    return OneShotReplica(ctx).run()
