"""What sandblaster's roles share: message sizes, the chunk plan, the batches' rows."""
from __future__ import annotations


import numpy as np


from hpcps.ps.chunks import ChunkPlan, chunk_elements
from hpcps.model.optim import LBFGS
from hpcps.strategies.context import Context

TASK_SLOTS = 8     # kind, evaluation, portion, lo, hi, accept previous, vector id, data batch
RESULT_SLOTS = 6   # kind, batch, portion, loss sum (or test loss), examples (or accuracy), spare
PORTION_CHUNK = 256  # rows per engine step when a replica sums a portion's gradient


def vector_names(ctx: Context) -> list[str]:
    return LBFGS.vector_names(ctx.cfg.lbfgs_history)


def shard_plan(ctx: Context) -> ChunkPlan:
    """Which shard holds which ``--chunk-bytes`` chunk of the parameters
    (:mod:`hpcps.ps.chunks`)."""
    n, S = ctx.full_model.n_params, ctx.grid.layout.servers
    return ChunkPlan(n, chunk_elements(ctx.cfg.chunk_bytes, n, S), S)


def batch_order(ctx: Context, batch: int) -> np.ndarray:
    """Rows of the training set in batch ``batch`` (the same on every rank: a function of the
    seed). The whole set when the batch is the whole set; otherwise consecutive windows of a
    per-epoch permutation."""
    n = ctx.dataset.n_train
    size = ctx.cfg.batch(n)
    if size >= n:
        return np.arange(n)
    per_epoch = n // size
    epoch, k = divmod(batch, per_epoch)
    perm = np.random.default_rng(ctx.cfg.seed * 7919 + epoch).permutation(n)
    return perm[k * size:(k + 1) * size]
