"""What the strategies that train embedding models share: the shard's rows (built, or read
back from a checkpoint's table files) and where they are written."""
from __future__ import annotations

from pathlib import Path

from hpcps.io.tables import TABLES_DIR, shard_file, table_files
from hpcps.ps.rows import RowShard
from hpcps.strategies.context import Context


def tables_path(ctx: Context, shard: int) -> Path:
    """Where server shard ``shard`` writes its rows: ``tables/shard-<s>-of-<S>.h5``."""
    return shard_file(ctx.run_dir / TABLES_DIR, shard, ctx.grid.layout.servers)


def row_shard(ctx: Context) -> RowShard:
    """This server shard's rows of the model's tables: empty, or with ``--resume`` its share
    of the checkpoint's rows, from files written by any number of shards."""
    cfg, model = ctx.cfg, ctx.full_model
    rows = RowShard(ctx.grid.world, model.n_tables, model.dim, cfg.seed, cfg.row_optimizer,
                    cfg.row_lr, cfg.adagrad_eps, cfg.row_l2, cfg.row_init_scale)
    if cfg.resume:
        files = table_files(Path(cfg.resume).parent / TABLES_DIR, ctx.start_step,
                            model.n_tables, model.dim)
        rows.load(files, ctx.grid.role.shard, ctx.grid.layout.servers)
    return rows
