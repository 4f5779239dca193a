"""The averaging replica: trains alone, then one allreduce averages parameters and state (the
method: :mod:`hpcps.strategies.averaging`)."""
from __future__ import annotations

import numpy as np

from hpcps import trace
from hpcps.compress.bf16 import Wire
from hpcps.mpi.comm import SUM, SumAllreduce, allreduce
from hpcps.strategies.context import Context, finish_on_chief, gather_state
from hpcps.strategies.loop import AllReplicasLoop


class AveragingReplica(AllReplicasLoop):
    """Local optimizer steps; every k iterations, the average of all replicas."""

    lockstep = True  # every replica runs the same iterations; after_loop averages once more

    def __init__(self, ctx: Context):
        self.comm = ctx.grid.partition_comm
        self.R = self.comm.Get_size()
        super().__init__(ctx, -(-ctx.remaining_steps // self.R))
        cfg, n = ctx.cfg, ctx.model.n_params
        self.state = ctx.opt_state
        self.keys = list(self.state) if cfg.average_state == "on" else []
        self.grad = np.empty(n, dtype=np.float32)
        self.buf = np.empty(n * (1 + len(self.keys)) + 1, dtype=np.float32)
        wire = Wire.named(cfg.wire_dtype)
        self.reduce = SumAllreduce(self.comm, len(self.buf) - 1, wire)
        # On the bfloat16 wire the replicas send how far they moved since the last average
        # (their start, the same on every replica, before the first), never the weights
        # themselves: the weights and state stay float32 where the steps are smaller than
        # bf16's resolution of the weights, and only the moves are rounded.
        self.anchor = None
        if wire.bf16 and self.R > 1:
            self.anchor = np.empty(len(self.buf) - 1, dtype=np.float32)
            pack(self.buf, self.params, self.state, self.keys)
            self.anchor[:] = self.buf[:-1]
        self.every = cfg.average_every
        self.since = 0           # iterations since the last average
        self.rounds = 0
        self.spread = []         # replicas' RMS distance to the average, before each average
        self.bytes_sent = 0.0    # per rank, in the allreduces (ring estimate)

    def rebuild(self) -> None:
        wire = Wire.named(self.cfg.wire_dtype)
        self.reduce = SumAllreduce(self.comm, len(self.buf) - 1, wire)
        self.anchor = None  # every replica holds the chief's weights: the next moves from them
        if wire.bf16 and self.R > 1:
            self.anchor = np.empty(len(self.buf) - 1, dtype=np.float32)
            pack(self.buf, self.params, self.state, self.keys)
            self.anchor[:] = self.buf[:-1]
        self.since = 0

    def step(self, x, y) -> float:
        loss = self.source(self.params, x, y, self.grad)
        self.ctx.optimizer.apply(self.params, self.grad, self.state,
                                 step_scale=self.lr_factor())
        self.since += 1
        if self.since == self.every:
            self.average()
        return loss

    def average(self) -> None:
        """Replace parameters (and state) by their mean over the replicas. Collective."""
        self.since = 0
        self.rounds += 1
        if self.R == 1:  # one replica is its own mean
            return
        buf = self.buf
        pack(buf, self.params, self.state, self.keys)
        if self.anchor is not None:
            buf[:-1] -= self.anchor
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        self.reduce(buf[:-1], SUM, self.cfg.timeout, "the parameter average with the other "
                    f"replicas (ranks of the partition communicator, size {self.R})")
        if tr is not None:
            tr.message("allreduce parameters", self.reduce.payload_bytes(), t0)
        buf[-1] = to_mean(buf, self.params, self.R, self.anchor)
        allreduce(self.comm, buf[-1:], SUM, self.cfg.timeout,
                  "the replicas' spread before averaging")
        self.spread.append(float(np.sqrt(buf[-1] / (self.R * len(self.params)))))
        self.bytes_sent += self.reduce.bytes_sent()
        unpack(buf, self.params, self.state, self.keys)

    def progress_fields(self) -> dict:
        return {"averaging_rounds": self.rounds,
                "spread": round(self.spread[-1], 6) if self.spread else 0.0,
                "bytes_per_step": round(self.bytes_sent / max(1, self.done))}

    def checkpoint_state(self) -> dict:
        return self.state

    def after_loop(self) -> None:
        if self.since:  # every replica ends on the same weights
            self.average()

    def finish(self, train_s: float) -> dict:
        figures = {"bytes_per_step": self.bytes_sent / max(1, self.done),
                   "averaging_rounds": self.rounds,
                   "mean_spread": float(np.mean(self.spread)) if self.spread else 0.0}
        out = {"figures": figures}
        if self.first:
            full, full_state = gather_state(self.ctx, self.params, self.state)
            if self.ctx.grid.is_chief:
                out.update(finish_on_chief(self.ctx, full, full_state, self.global_step(),
                                           train_s))
        return out


def pack(buf: np.ndarray, params: np.ndarray, state: dict, keys: list) -> None:
    """The parameters, then each state vector of ``keys``, into ``buf`` (its last float, the
    spread's slot, zeroed)."""
    n = len(params)
    buf[:n] = params
    for i, k in enumerate(keys):
        buf[(i + 1) * n:(i + 2) * n] = state[k]
    buf[-1] = 0.0


def to_mean(buf: np.ndarray, params: np.ndarray, R: int, anchor=None) -> float:
    """The allreduced sums in ``buf`` divided by ``R`` (sums of moves from ``anchor``, if
    given: then the mean is added to it, and it becomes the mean); returns this replica's
    squared distance to the mean (summed over the replicas, the spread)."""
    buf[:-1] *= np.float32(1.0 / R)
    if anchor is not None:
        buf[:-1] += anchor
        anchor[:] = buf[:-1]
    return float(np.sum((params - buf[:len(params)]) ** 2, dtype=np.float64))


def unpack(buf: np.ndarray, params: np.ndarray, state: dict, keys: list) -> None:
    """The averaged parameters and state back from ``buf``."""
    n = len(params)
    params[...] = buf[:n]
    for i, k in enumerate(keys):
        state[k][...] = buf[(i + 1) * n:(i + 2) * n]


def run(ctx: Context) -> dict:
    return AveragingReplica(ctx).run()
