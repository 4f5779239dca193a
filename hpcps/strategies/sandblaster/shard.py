"""A sandblaster server shard: the vector shard that runs the coordinator's commands."""
from __future__ import annotations




from hpcps.compress.bf16 import Wire
from hpcps.mpi.comm import gather_to_root
from hpcps.strategies.sandblaster import Op
from hpcps.strategies.sandblaster.vector_shard import VectorShard
from hpcps.strategies.context import Context, save_checkpoint
from hpcps.strategies.sandblaster.common import shard_plan, vector_names

# -- server shards ------------------------------------------------------------------------------
def run_shard(ctx: Context) -> dict:
    cfg, grid = ctx.cfg, ctx.grid
    s = grid.role.shard
    plan = shard_plan(ctx)
    names = vector_names(ctx)
    ids = {name: i for i, name in enumerate(names)}
    coord = grid.layout.n_world - 1
    saved = ["x", "g"] + [f"{k}{i}" for k in "sy" for i in range(cfg.lbfgs_history)]

    def on_gather(op: int, step: int) -> None:
        whole = {name: gather_to_root(grid.server_comm, shard.vec[ids[name]], plan.sizes,
                                      cfg.timeout,
                                      "the other server shards to join a checkpoint gather")
                 for name in saved}
        if s != 0:
            return
        whole = {name: plan.from_shard_order(v) for name, v in whole.items()}
        extra = shard.note  # sent by the coordinator just before this command
        metrics = dict(extra["metrics"], lbfgs=extra["lbfgs"])
        state = {name: whole[name] for name in saved[1:]}
        path = save_checkpoint(ctx, whole["x"], state, step, metrics)
        if op == Op.CHECKPOINT:
            print(f"[hpcps] server shard 0 wrote checkpoint {path} at step {step}", flush=True)

    shard = VectorShard(grid.world, plan.sizes[s], len(names), coord, cfg.timeout, on_gather,
                        ctx.stop_tick, may_lose=cfg.heartbeat_timeout,
                        wire=Wire.named(cfg.wire_dtype))
    plan.take(s, ctx.params, out=shard.vec[ids["x"]])
    for name, full in ctx.opt_state.items():  # resumed: gradient and history
        plan.take(s, full, out=shard.vec[ids[name]])
    shard.serve()
    return {"shard": s, "commands": shard.commands, "broken_transfers": shard.broken}
