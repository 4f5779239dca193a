"""A hybrid replica: sync's step on the dense layers, with the batch's rows pulled from and
pushed to the shards (the method: :mod:`hpcps.strategies.hybrid`)."""
from __future__ import annotations

from hpcps.mpi.protocol import Tag
from hpcps.strategies.context import Context
from hpcps.strategies.embedding import EmbeddingRows
from hpcps.strategies.sync.replica import SyncReplica


class HybridReplica(EmbeddingRows, SyncReplica):
    """Every iteration: pull the batch's rows, compute, push the rows' gradients (no wait),
    allreduce the dense gradient and apply it. The chief scores the model with the shards'
    rows and releases them after its final evaluation."""

    def before_checkpoint(self, step: int) -> None:
        self.rows.tell(Tag.SAVE_ROWS, step)  # the rows at the checkpoint's step, written first
        self.rows.await_saved()

    def after_loop(self) -> None:
        self.drain_rows()
        self.rows.tell(Tag.DONE, self.global_step())
        if self.ctx.grid.is_chief:  # the shards' final rows are written before checkpoint.h5
            self.rows.await_saved()

    def finish(self, train_s: float) -> dict:
        out = super().finish(train_s)
        self.release_rows()
        r = self.rows
        figures = dict(out.get("figures", {}))
        figures["bytes_per_step"] = (figures.get("bytes_per_step", 0.0)
                                     + (r.bytes_sent + r.bytes_received) / max(1, self.done))
        return {**out, "figures": figures, "replica_steps": self.done,
                "rows_pulled": r.rows_pulled, "row_bytes": r.bytes_sent + r.bytes_received}


def run(ctx: Context) -> dict:
    return HybridReplica(ctx).run()


