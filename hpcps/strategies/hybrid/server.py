"""A hybrid server shard: rows only (the dense layers live on the replicas). It serves pulls
and pushes until every replica is done and the chief has finished its final evaluation,
writes its rows when the chief checkpoints and at the end, and tells the chief each time (it
writes ``checkpoint.h5`` only once every shard's table file of the step is in)."""
from __future__ import annotations

from hpcps.mpi.protocol import H, Tag
from hpcps.ps.serve import serve
from hpcps.strategies.context import Context
from hpcps.strategies.embedding import row_shard, write_rows
from hpcps.strategies.rows_summary import row_figures


def run(ctx: Context) -> dict:
    cfg, grid = ctx.cfg, ctx.grid
    layout = grid.layout
    s, R = grid.role.shard, layout.replicas
    rows = row_shard(ctx)
    done: set[int] = set()
    state = {"step": ctx.start_step, "released": False, "written": None}

    def on_save(src: int, status) -> bool:
        step = int(rows.header(src, Tag.SAVE_ROWS)[H.STEPS])
        write_rows(ctx, rows, step)
        rows.saved(src, step)  # the chief writes checkpoint.h5 once every shard's file is in
        return False

    def finished() -> bool:
        if len(done) == R and state["written"] is None:  # every push is in: the final rows
            write_rows(ctx, rows, state["step"])
            rows.saved(0, state["step"])  # world rank 0, the chief, writes the final checkpoint
            state["written"] = state["step"]
        return len(done) == R and state["released"]

    def on_done(src: int, status) -> bool:
        h = rows.header(src, Tag.DONE)
        done.add(int(h[H.SENDER]))
        state["step"] = max(state["step"], int(h[H.STEPS]))
        return finished()

    def on_release(src: int, status) -> bool:
        rows.header(src, Tag.ROWS_DONE)
        state["released"] = True
        return finished()

    # the replicas wait on each other in the dense allreduce, and a replica's death is theirs
    # to find (the chief then asks for the rows, writes the checkpoint and ends the job with
    # 75, as sync's): a shard that hears nothing waits twice as long before it reports
    serve(grid.world, {**rows.handlers(), Tag.SAVE_ROWS: on_save, Tag.DONE: on_done,
                       Tag.ROWS_DONE: on_release}, 2 * cfg.timeout,
          lambda: (f"{R - len(done)} replica(s) to finish (done: {sorted(done)})"
                   + ("" if state["released"] else "; the chief's final evaluation")),
          ctx.stop_tick)
    return {**rows.figures(), "shard": s, "step": state["step"]}


def summarize(ctx: Context, results: list[dict]) -> dict:
    """The dense allreduce's and the rows' traffic, and the rows the shards hold."""
    reps = [r for r in results if "replica_steps" in r]
    shards = [r for r in results if "shard" in r]
    out = dict(results[ctx.reporter].get("figures", {}))
    trained = max(1, results[ctx.reporter].get("step", ctx.start_step) - ctx.start_step)
    out.update(row_figures(ctx.cfg, shards, reps, trained))
    return out
