"""Where downpour's parameters live and when its replicas run: what replicas and shards
both compute, the same on every rank."""
from __future__ import annotations

import numpy as np

from hpcps.ps.chunks import ChunkPlan, chunk_elements
from hpcps.ps import activations
from hpcps.ps.epochs import epoch_plan
from hpcps.mpi.protocol import Message
from hpcps.strategies.context import Context

TAU_BYTES = 4  # float32 tau in front of each compressed push: what each word stands for


def part_sizes(ctx: Context) -> list[int]:
    """Length of each partition's slice of the parameters (one entry when P = 1)."""
    return list(getattr(ctx.model, "part_sizes", [ctx.model.n_params]))


def clock_offsets(ctx: Context) -> list[int]:
    """Each replica's clock at start under a staleness bound: the replicas that join after
    replica 0's warm start begin with its warm-start steps (they start from its parameters)."""
    warmup = ctx.cfg.warmup_steps if ctx.start_step == 0 else 0
    return [0] + [warmup] * (ctx.grid.layout.trainers - 1)


def warmup_steps(ctx: Context) -> int:
    """Replica 0's warm-start steps in this run (none when resuming)."""
    return ctx.cfg.warmup_steps if ctx.start_step == 0 else 0


def epochs_of(ctx: Context) -> list[tuple[int, list[int]]]:
    """--epoch-quorum: the run's epochs and each replica's share of them
    (:func:`hpcps.ps.epochs.epoch_plan`; every rank computes the same)."""
    n = ctx.n_train
    return epoch_plan(ctx.start_step, ctx.total_steps, n / ctx.cfg.batch(n),
                      ctx.grid.layout.replicas, warmup_steps(ctx))


def partition_plan(ctx: Context, part: int) -> ChunkPlan:
    """Which of partition ``part``'s own S/P shards holds which chunk of its slice.

    Each partition has its own S/P shards (so a partition talks only to the shards that hold
    its parameters); its slice is cut into ``--chunk-bytes`` chunks hashed to them
    (:mod:`hpcps.ps.chunks`). Activation pushes keep one contiguous run of whole rows per shard.
    """
    per = ctx.grid.layout.servers // ctx.grid.layout.partitions
    if ctx.cfg.push == "activations":  # whole rows per shard (P = 1)
        return ChunkPlan.contiguous(activations.row_aligned_ranges(ctx.model, per))
    n = part_sizes(ctx)[part]
    return ChunkPlan(n, chunk_elements(ctx.cfg.chunk_bytes, n, per), per)


def shard_locals(ctx: Context) -> list[tuple[int, int, ChunkPlan, int]]:
    """For every shard in order: (partition, offset of the partition's slice in the global
    vector, the partition's plan, the shard's index among the partition's shards)."""
    sizes = part_sizes(ctx)
    base = np.cumsum([0] + sizes)
    out = []
    for part in range(len(sizes)):
        plan = partition_plan(ctx, part)
        out += [(part, int(base[part]), plan, j) for j in range(plan.n_shards)]
    return out


def final_message(ctx: Context) -> Message:
    """Buffer for the final whole-model state: parameters, then each optimizer state vector."""
    n = ctx.full_model.n_params
    return Message(n * (1 + len(ctx.optimizer.state_keys)))
