"""A downpour spare (``--spares K``): idle until the chief hands it the data shard of a replica
that died or left, then a replica like the others (the protocol: :mod:`hpcps.ps.spares`)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from hpcps.io import data
from hpcps.model import convnet
from hpcps.mpi.comm import Transport
from hpcps.mpi.topology import Role
from hpcps.ps import spares
from hpcps.ps.liveness import HEARTBEATS_PER_TIMEOUT, HeartbeatThread
from hpcps.ps.replicated.client import live_ranks
from hpcps.strategies.context import VAL_HELD_OUT, Context, train_shard
from hpcps.strategies.downpour.replica import DownpourReplica
from hpcps.strategies.downpour.server import run_replicated_server


class SpareReplica(DownpourReplica):
    """A replica that joins mid-run: no warm start to wait for (replica 0's is over, or its
    parameters are on the shards anyway), and the time of its first step, for the summary's
    record of the replacement."""

    def __init__(self, ctx: Context, view: dict | None = None):
        super().__init__(ctx)
        self.warmup, self.released = 0, True
        self.first_step_at: float | None = None
        if view is not None:  # the chief's view of the shards (--ps-copies)
            self.client.adopt(view)

    def step(self, x, y) -> float:
        loss = super().step(x, y)
        if self.first_step_at is None:
            self.first_step_at = time.time()
            spares.report_joined(Transport(self.ctx.grid.world), self.replica,
                                 self.first_step_at)
        return loss


def as_replica(ctx: Context, replica: int, shard: int) -> Context:
    """This spare's context as replica index ``replica``, training on data shard ``shard`` of
    the R replicas' shards."""
    cfg, layout = ctx.cfg, ctx.grid.layout
    held = np.empty(0, dtype=np.int64)
    if ctx.val_source == VAL_HELD_OUT:  # the same rows every rank holds out
        held = data.holdout_rows(ctx.dataset.n_train, cfg.validation_fraction, cfg.seed)
    fields = train_shard(cfg, ctx.dataset, shard, layout.replicas, held, ctx.feed)
    if isinstance(ctx.full_model, convnet.ConvNet):  # dropout masks of its own
        ctx.full_model.seed_dropout(convnet.dropout_key(cfg.seed, replica, ctx.start_step))
    grid = dataclasses.replace(ctx.grid, role=Role("replica", replica=replica, partition=0))
    return dataclasses.replace(ctx, grid=grid, **fields)


def run_spare(ctx: Context) -> dict:
    k = ctx.grid.role.spare
    got = spares.wait_for_assignment(ctx.grid.world)
    if got is None:
        return {"spare": k, "as_replica": None}
    if got["role"] == "shard":  # a holder of the dead shard's chunk sets (--ps-copies)
        out = run_replicated_server(ctx, got["index"], got)
        return {**out, "spare": k, "as_replica": None, "assigned_at": got["assigned_at"]}
    replica, shard, assigned_at = got["index"], got["data"], got["assigned_at"]
    cfg, layout = ctx.cfg, ctx.grid.layout
    # the shards lose a replica silent past --heartbeat-timeout from the moment they expect
    # it: beat while the data loads and the replica is built (its own thread takes over)
    view = got.get("view")
    live = live_ranks(view, layout.shard_table) if view is not None else layout.server_ranks
    beat = HeartbeatThread(ctx.grid.world, live, replica,
                           cfg.heartbeat_timeout / HEARTBEATS_PER_TIMEOUT).start()
    try:
        loop = SpareReplica(as_replica(ctx, replica, shard), view)
    finally:
        beat.stop()
    out = loop.run()
    return {**out, "spare": k, "as_replica": replica, "data_shard": shard,
            "assigned_at": assigned_at, "first_step_at": loop.first_step_at}
