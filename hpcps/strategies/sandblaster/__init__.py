"""Sandblaster L-BFGS (Dean et al. 2012, section 4.2): batch optimization through the shards.

Roles: S server shards, R replicas and one coordinator (the last rank).

* The **coordinator** runs L-BFGS (:class:`hpcps.model.optim.LBFGS`: two-loop recursion, history of
  m pairs, strong-Wolfe line search) without ever holding a parameter vector. Every vector
  operation (copy, axpy, scale, dot) is a command of a few bytes to every shard, answered with
  at most one scalar; parameters, gradient, direction and the (s, y) history live on the
  shards, each keeping its slice (:mod:`hpcps.ps.vectors`).
* Each **evaluation** of the objective (one batch: ``--batch-size`` examples, by default the
  whole training set) is cut into ``--portions`` small portions. The coordinator hands a
  portion to whichever replica is free (:class:`hpcps.strategies.schedule.PortionScheduler`): faster
  replicas do more; consecutive portions go to the same replica where possible; near the end
  outstanding portions are given again to idle replicas and the first result wins (backup
  tasks). A replica fetches the parameters once per batch and pushes the gradient it
  accumulated over accepted portions every ``--flush-every`` portions; its pushes count only
  once the coordinator commits them, so a replica that stops answering (``--replica-timeout``)
  loses nothing: its uncommitted portions are handed to the others.
* Replica 0 also evaluates test accuracy when asked; the coordinator logs and writes the
  summary. Checkpoints (written by shard 0) hold the L-BFGS history, so a resumed run takes
  the same next step.

A step, for ``--steps`` and the progress line, is one evaluation of a batch.

Numerical health: the coordinator checks the loss at the current point (a scalar) and
``g . g``, one DOT command to the shards, after every iteration, and stops the job on NaN or
infinity (the line search itself never accepts a non-finite trial point, so without the
check a NaN gradient would only reset the history at every iteration); shard 0's checkpoints
go through the writer that refuses non-finite state. A rising loss over mini-batches is
watched as in the SGD strategies, per iteration.

A replica computes each portion's gradient with the compiled engine
(:meth:`hpcps.engine.hogwild.HogwildEngine.gradient_sum`, which falls back to NumPy where the engine
is not built), with ``--threads T`` in T threads: the portion is split in T parts,
each thread sums its part's gradients into its own buffer, and the sums are added in thread
order. There are no Hogwild updates here — L-BFGS needs the exact gradient at the
point it chose — so the result is deterministic for a given T, and equal to the one-thread
gradient to rounding.
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from hpcps.errors import CheckpointError, ConfigError
from hpcps.options import (CHUNK_BYTES, DEFAULT_CHUNK_BYTES, HEARTBEAT_TIMEOUT, INJECT_SLOW,
                           Option, check_fault_options, parse_inject_slow, WIRE_DTYPE)
from hpcps.strategies.registry import SERVERS, Strategy, message_tags

if TYPE_CHECKING:
    from hpcps.strategies.context import Context

# CMD: coordinator -> shard, one vector operation (Op); REPLY: shard -> coordinator, its scalar
# result; TASK: coordinator -> replica (Task); RESULT: replica -> coordinator, a portion done,
# flushed or an evaluation; PUSH: replica -> shard, the accumulated gradient of accepted
# portions; PUSH_ACK: shard -> replica, applied; STATE: coordinator -> shard 0, the L-BFGS
# scalars and metrics for a checkpoint. Fetches of the parameters use the shared FETCH/PARAMS.
Tag = message_tags("sandblaster", "CMD", "REPLY", "TASK", "RESULT", "PUSH", "PUSH_ACK", "STATE")


class Op(IntEnum):
    """Sandblaster's vector operations, executed by every shard on its own slice."""

    COPY = 1          # v[a] = v[b]
    AXPY = 2          # v[a] += alpha * v[b]
    SCALE = 3         # v[a] *= alpha
    DOT = 4           # reply v[a] . v[b] (this shard's part; the coordinator adds them)
    RESET_ACC = 5     # gradients pushed from now on accumulate into v[a], starting from 0
    COMMIT = 6        # add replica a's pushed gradients into the accumulator
    BAN = 7           # replica a stopped answering: drop what it pushed, ignore it from now on
    CHECKPOINT = 8    # gather x, g and the history on shard 0, which writes a checkpoint
    FINISH = 9        # like CHECKPOINT, then leave the loop


class Task(IntEnum):
    """What a sandblaster replica is asked to do."""

    PORTION = 1       # compute the gradient of a portion of the batch
    FLUSH = 2         # push the accumulated gradient of accepted portions to the shards
    EVALUATE = 3      # fetch x and report the loss and accuracy on a split (replica 0; the
                      # task's portion slot: 0 the test set, 1 the validation split)
    STOP = 4

# --------------------------------------------------------------------------------
def _validate(cfg) -> None:
    if cfg.lr is not None:
        raise ConfigError("--lr does not apply to --strategy sandblaster: L-BFGS chooses each "
                          "step's length by its line search")
    if cfg.inject_slow is not None:
        parse_inject_slow(cfg.inject_slow)
    if cfg.validation_fraction:
        raise ConfigError(f"--validation-fraction {cfg.validation_fraction:g} does not apply "
                          "to --strategy sandblaster (each replica holds the whole training "
                          "set, and its batches index it): give a dataset file with a /val "
                          "split instead (python -m hpcps.data convert --validation-fraction "
                          "F, or write_dataset(..., val=...)), which sandblaster evaluates on")
    check_fault_options(cfg)


def _check_resume(cfg, ckpt) -> None:
    lbfgs = ckpt.metrics.get("lbfgs")
    if lbfgs and lbfgs.get("m") != cfg.lbfgs_history:
        raise CheckpointError(f"checkpoint {cfg.resume} holds an L-BFGS history of "
                              f"{lbfgs.get('m')} pairs; resume with --lbfgs-history "
                              f"{lbfgs.get('m')}")


def _describe(cfg, n_train: int) -> str:
    return (f"L-BFGS m={cfg.lbfgs_history}, batch {cfg.batch(n_train)} examples in "
            f"{cfg.portions} portions")


def _summary_lines(f: dict) -> list[str]:
    return [f"{f['iterations']} L-BFGS iterations, training loss {f['final_train_loss']:.4f}, "
            f"{f['median_batch_s']:.2f} s per batch, {f['coordinator_bytes_per_iteration']:.0f} "
            f"bytes of commands per iteration; {f['portions_reissued']} portions re-issued as "
            f"backups, {f['duplicates_discarded']} late duplicates discarded, "
            f"{len(f['lost_replicas'])} replica(s) lost"]


def _summarize(ctx: Context, results: list[dict]) -> dict:
    """The coordinator's figures, with ``bytes_per_step`` counting every byte a step (one
    batch evaluation) moves: the coordinator's commands and the replicas' parameter fetches
    and gradient pushes (``replica_bytes_per_step``)."""
    figures = dict(results[ctx.reporter].get("figures", {}))
    evaluations = max(1, figures.pop("evaluations", 1))
    replicas = sum(r.get("bytes_moved", 0) for r in results if r.get("role") == "replica")
    figures["replica_bytes_per_step"] = replicas / evaluations
    figures["bytes_per_step"] = figures.get("bytes_per_step", 0.0) + replicas / evaluations
    if ctx.cfg.heartbeat_timeout is not None:  # named as downpour names them
        figures["lost_ranks"] = sorted(figures["lost_replicas"])
    return figures


STRATEGY = Strategy(
    name="sandblaster",
    help="batch L-BFGS run by a coordinator through vector commands to the server shards; "
         "replicas compute portions of each batch, backup copies of the last ones "
         "(DistBelief's Sandblaster)",
    roles={"replica": "hpcps.strategies.sandblaster.replica:run_replica",
           "server": "hpcps.strategies.sandblaster.shard:run_shard",
           "coordinator": "hpcps.strategies.sandblaster.coordinator:run_coordinator"},
    servers=SERVERS,
    coordinator=True,
    options=(
        Option("lbfgs_history", int, "(s, y) pairs L-BFGS keeps (default 10)",
               check="positive"),
        Option("portions", int, "portions each batch is cut into and handed to free replicas "
               "(default 64)", check="positive"),
        Option("flush_every", int, "a replica pushes its accumulated gradient every this many "
               "portions (default 4)", check="positive"),
        INJECT_SLOW, HEARTBEAT_TIMEOUT,
        Option("replica_timeout", float, "seconds without an answer before a replica's "
               "portions go to the others (default 60)", check="positive"),
        CHUNK_BYTES, WIRE_DTYPE,
    ),
    defaults={"servers": 1, "batch_size": 0, "lbfgs_history": 10, "portions": 64,
              "flush_every": 4, "replica_timeout": 60.0, "chunk_bytes": DEFAULT_CHUNK_BYTES},
    optimizers=("lbfgs",),
    summarize=_summarize,
    model_parallel=False,
    whole_batch=True,
    epochs=40.0,  # a step is one evaluation of a whole batch (by default the whole set)
    replica_data="whole",  # any replica may be handed any portion
    validate=_validate,
    check_resume=_check_resume,
    describe=_describe,
    summary_lines=_summary_lines,
    cost="hpcps.strategies.sandblaster.cost:COST",
    tags=Tag,
    stops_alone=True,  # the coordinator's signal: final checkpoint, STOP to the replicas
)
