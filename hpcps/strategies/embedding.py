"""What the strategies that train embedding models share: the shard's rows (built, or read
back from a checkpoint's table files) and where they are written."""
from __future__ import annotations

import time
from pathlib import Path

from hpcps.io.tables import TABLES_DIR, shard_file, table_files
from hpcps.ps.rows import RowClient, RowShard
from hpcps.strategies.context import Context
from hpcps.strategies.gradients import EmbeddingSource


def tables_path(ctx: Context, shard: int, step: int) -> Path:
    """Where server shard ``shard`` writes its rows at ``step``:
    ``tables/shard-<s>-of-<S>.step-<N>.h5``."""
    return shard_file(ctx.run_dir / TABLES_DIR, shard, ctx.grid.layout.servers, step)


def write_rows(ctx: Context, rows: RowShard, step: int) -> Path:
    """This server shard's rows at global ``step`` in their table file (:func:`tables_path`).

    A shard writes while it serves nobody, and every rank waiting on it (replicas pulling
    rows, the other shards gathering, the chief waiting for the file, and the ranks waiting on
    those) fails after --timeout: a write that took over half of it is warned about, on the
    terminal, while raising --timeout still saves the next one (tables grow as rows are
    admitted)."""
    shard = ctx.grid.role.shard
    started = time.monotonic()
    path = rows.write(tables_path(ctx, shard, step), shard, ctx.grid.layout.servers, step)
    took = time.monotonic() - started
    if took > ctx.cfg.timeout / 2:
        size = path.stat().st_size / 2**30
        print(f"[hpcps] warning: server shard {shard} took {took:.1f} s to write its embedding "
              f"table file ({size:.1f} GiB, step {step}), over half of --timeout "
              f"{ctx.cfg.timeout:g} s; a rank whose wait on it (or on a rank waiting on it) "
              "passes --timeout fails the run: raise --timeout", flush=True)
    return path


def row_shard(ctx: Context) -> RowShard:
    """This server shard's rows of the model's tables: empty, or with ``--resume`` its share
    of the checkpoint's rows, from files written by any number of shards."""
    cfg, model = ctx.cfg, ctx.full_model
    rows = RowShard(ctx.grid.world, model.n_tables, model.dim, cfg.seed, cfg.row_optimizer,
                    cfg.row_lr, cfg.adagrad_eps, cfg.row_l2, cfg.row_init_scale,
                    max_rows=cfg.table_capacity, admit_after=cfg.admit_after or 1)
    if cfg.resume:
        files = table_files(Path(cfg.resume).parent / TABLES_DIR, ctx.start_step,
                            model.n_tables, model.dim)
        rows.load(files, ctx.grid.role.shard, ctx.grid.layout.servers)
    return rows


class EmbeddingRows:
    """Mixin of a replica loop (:class:`hpcps.strategies.loop.ReplicaLoop`) that trains an
    embedding model: its gradient source pulls and pushes the batch's rows
    (:class:`~hpcps.strategies.gradients.EmbeddingSource` over a
    :class:`~hpcps.ps.rows.RowClient` to every shard), the chief scores the model with the
    shards' rows, and progress records count the rows a step moves. Put it first among the
    bases; a strategy sends its shards whatever ends its run after :meth:`drain_rows`."""

    rows: RowClient
    source: EmbeddingSource
    ctx: Context
    done: int

    def make_source(self, ctx: Context) -> EmbeddingSource:
        model, grid = ctx.model, ctx.grid
        self.rows = RowClient(grid.world, grid.layout.server_ranks, model.n_tables, model.dim,
                              grid.role.replica, ctx.cfg.timeout)
        return EmbeddingSource(ctx, self.rows)

    def __init__(self, ctx: Context):
        super().__init__(ctx)  # type: ignore[call-arg]  # the loop's
        if ctx.grid.is_chief:
            ctx.evaluator = self.source.evaluate

    def progress_fields(self) -> dict:
        return {**super().progress_fields(),  # type: ignore[misc]
                "rows_per_step": round(self.rows.rows_pulled / max(1, self.done), 1)}

    def drain_rows(self) -> None:
        """The last row pushes on their way: they go before the message that ends this
        replica's run (a shard takes one replica's messages in order)."""
        self.rows.drain()

    def release_rows(self) -> None:
        """On the chief, after its final evaluation read the rows it needs: the shards may
        leave."""
        if self.ctx.grid.is_chief:
            self.rows.release()
