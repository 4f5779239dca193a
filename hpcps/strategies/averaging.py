"""Parameter averaging (the DL4J overview's first method): local training, periodic averages.

Every replica trains its own copy of the model with its own optimizer, on its own shard of
the data, for ``--average-every k`` iterations; then the replicas' parameters are averaged
(one allreduce over the partition communicator, divided by R) and every replica continues
from the average. With ``--average-state on`` (the default) the optimizer state (Adagrad's
sums of squared gradients) is averaged in the same allreduce, as DL4J does: otherwise each
replica's state keeps only its own history, and the replicas, though they restart from the
same weights, would take different step sizes from them. ``off`` halves the traffic of an
Adagrad run (plain SGD has no state, so the option changes nothing there).

With k = 1, plain SGD and equal mini-batches this is exactly ``sync``: averaging
``w - lr * g_r`` over r is ``w - lr * mean(g_r)`` (the overview's argument); the tests check
that to float tolerance. Larger k trades consistency for k times less communication.

Model parallelism: each partition averages its own slice with the same partition of the other
replicas. Hogwild threads: one iteration covers T mini-batches, as in the other strategies.
Periodic evaluations and checkpoints take replica 0's copy; the last iteration is always
followed by an average, so every replica ends with the same weights.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpcps import trace
from hpcps.comm import wait_all
from hpcps.options import Option
from hpcps.strategies.context import Context, finish_on_chief, gather_state
from hpcps.strategies.loop import LOOP_OPTIONS, ReplicaLoop, check_options
from hpcps.strategies.registry import Strategy


class AveragingReplica(ReplicaLoop):
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
        self.every = cfg.average_every
        self.since = 0           # iterations since the last average
        self.rounds = 0
        self.spread = []         # replicas' RMS distance to the average, before each average
        self.bytes_sent = 0.0    # per rank, in the allreduces (ring estimate)

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
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        wait_all([self.comm.Iallreduce(MPI.IN_PLACE, buf[:-1], op=MPI.SUM)],
                 self.cfg.timeout, "the parameter average with the other replicas "
                 f"(ranks of the partition communicator, size {self.R})")
        if tr is not None:
            tr.message("allreduce parameters", buf[:-1].nbytes, t0)
        buf[-1] = to_mean(buf, self.params, self.R)
        wait_all([self.comm.Iallreduce(MPI.IN_PLACE, buf[-1:], op=MPI.SUM)],
                 self.cfg.timeout, "the replicas' spread before averaging")
        self.spread.append(float(np.sqrt(buf[-1] / (self.R * len(self.params)))))
        self.bytes_sent += 2 * 4 * (len(buf) - 1) * (self.R - 1) / self.R
        unpack(buf, self.params, self.state, self.keys)

    def global_step(self) -> int:
        return self.ctx.start_step + self.done * self.R

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


def to_mean(buf: np.ndarray, params: np.ndarray, R: int) -> float:
    """The allreduced sums in ``buf`` divided by ``R``; returns this replica's squared
    distance to the mean (summed over the replicas, the spread)."""
    buf[:-1] *= np.float32(1.0 / R)
    return float(np.sum((params - buf[:len(params)]) ** 2, dtype=np.float64))


def unpack(buf: np.ndarray, params: np.ndarray, state: dict, keys: list) -> None:
    """The averaged parameters and state back from ``buf``."""
    n = len(params)
    params[...] = buf[:n]
    for i, k in enumerate(keys):
        state[k][...] = buf[(i + 1) * n:(i + 2) * n]


def run(ctx: Context) -> dict:
    return AveragingReplica(ctx).run()


STRATEGY = Strategy(
    name="averaging",
    help="replicas train their own copies for --average-every iterations, then average "
         "their parameters (and optimizer state) with one allreduce; no servers",
    roles={"replica": run},
    options=(
        Option("average_every", int, "iterations each replica trains alone between two "
               "averages (default 4; 1 with plain SGD is sync)", check="positive"),
        Option("average_state", str, "on: average the optimizer state (Adagrad's sums) with "
               "the parameters (default: the replicas then take the same step sizes); off: "
               "each replica keeps its own", choices=("on", "off")),
        *LOOP_OPTIONS),
    validate=check_options,
    defaults={"lr": 0.01, "batch_size": 32, "prefetch": 2, "average_every": 4,
              "average_state": "on"},
    describe=lambda cfg, n_train: (f"{cfg.optimizer} lr={cfg.lr}, batch {cfg.batch_size}/"
                                   f"replica, average every {cfg.average_every} iteration(s)"
                                   f", state averaged: {cfg.average_state}"),
    summary_lines=lambda f: [f"{f['averaging_rounds']} averages, replicas' mean RMS distance "
                             f"to the average before each: {f['mean_spread']:.3g}"],
)
