"""The sync replica: one allreduce of the gradients per step, the same update everywhere (the
method: :mod:`hpcps.strategies.sync`)."""
from __future__ import annotations

import numpy as np

from hpcps import trace
from hpcps.compress.bf16 import Wire
from hpcps.mpi.comm import SUM, SumAllreduce
from hpcps.strategies.context import Context, finish_on_chief, gather_state
from hpcps.strategies.loop import AllReplicasLoop


def sync_step(comm, gradient, optimizer, params, state, x, y, buf, timeout: float,
              step_scale: float = 1.0, reduce: SumAllreduce | None = None) -> float:
    """One synchronous step; returns the mean training loss over all replicas' batches.

    ``gradient(params, x, y, grad) -> loss`` computes this replica's mean gradient (one
    mini-batch, or T of them with Hogwild threads); ``buf`` is a float32 array of
    ``len(params) + 1`` (the loss rides along with the gradient, so one allreduce carries
    both). ``step_scale`` is the learning-rate schedule's multiplier of the update.
    ``reduce``: the allreduce plan for ``buf`` (its wire format; default float32, built here).
    """
    n = len(params)
    loss = gradient(params, x, y, buf[:n])
    buf[n] = loss
    if comm.Get_size() > 1:
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        if reduce is None:
            reduce = SumAllreduce(comm, len(buf), exact=1)
        reduce(buf, SUM, timeout, "the gradient allreduce with the other replicas "
               f"(ranks of the partition communicator, size {comm.Get_size()})")
        if tr is not None:
            tr.message("allreduce gradient", reduce.payload_bytes(), t0)
        buf *= np.float32(1.0 / comm.Get_size())
    optimizer.apply(params, buf[:n], state, step_scale=step_scale)
    return float(buf[n])


class SyncReplica(AllReplicasLoop):
    """Every iteration: this replica's gradient, one allreduce, the same update everywhere.

    One update consumes the R replicas' mini-batches (T each with threads): the global step
    advances by R * T.
    """

    lockstep = True  # one allreduce per iteration: every replica stops at the same one

    def __init__(self, ctx: Context):
        self.comm = ctx.grid.partition_comm
        self.R = self.comm.Get_size()
        super().__init__(ctx, -(-ctx.remaining_steps // self.R))
        self.state = ctx.opt_state
        self.buf = np.zeros(ctx.model.n_params + 1, dtype=np.float32)
        # the gradient in the wire's format (--wire-dtype), the loss beside it as float32
        self.reduce = SumAllreduce(self.comm, len(self.buf), Wire.named(self.cfg.wire_dtype),
                                   exact=1)
        # Bytes each rank sends per update in a ring allreduce, 2 (R-1)/R of the buffer;
        # summed over the R ranks and divided by the R mini-batches of an update, the same
        # figure per step.
        self.bytes_per_step = self.reduce.bytes_sent() / self.T

    def rebuild(self) -> None:
        self.reduce = SumAllreduce(self.comm, len(self.buf), Wire.named(self.cfg.wire_dtype),
                                   exact=1)
        self.bytes_per_step = self.reduce.bytes_sent() / self.T

    def step(self, x, y) -> float:
        return sync_step(self.comm, self.source, self.ctx.optimizer, self.params, self.state,
                         x, y, self.buf, self.cfg.timeout, self.lr_factor(), self.reduce)

    def loss_source(self) -> str:
        # the loss rides in the allreduce: every replica holds the same mean, and rank 0
        # reports it for the job
        return f"the {self.R} replicas' mini-batches (their mean, allreduced)"

    def progress_fields(self) -> dict:
        return {"staleness": 0, "bytes_per_step": round(self.bytes_per_step)}

    def checkpoint_state(self) -> dict:
        return self.state

    def finish(self, train_s: float) -> dict:
        out = {"figures": {"bytes_per_step": self.bytes_per_step}}
        if self.first:  # every replica holds the same weights
            full, full_state = gather_state(self.ctx, self.params, self.state)
            if self.ctx.grid.is_chief:
                out.update(finish_on_chief(self.ctx, full, full_state, self.global_step(),
                                           train_s))
        return out


def run(ctx: Context) -> dict:
    return SyncReplica(ctx).run()
