"""Synchronous data-parallel SGD: every step, replicas allreduce their gradients.

Each replica computes the gradient of its own mini-batch, the gradients are summed with one
allreduce over the partition communicator (the R replicas) and divided by R, and every replica
applies the same update to its own full copy of the parameters. The result is the update one
process would make on the R mini-batches concatenated, so with the same seed every replica
holds the same weights, step after step. No servers, no staleness; each step waits for the
slowest replica, which is the price of that determinism.

One optimizer update consumes R mini-batches: the global step advances by R.

With P partitions per replica, the allreduce runs over the partition communicator: each
partition sums its own slice of the gradient with the same partition of the other replicas.
"""
from hpcps.options import LOOP_OPTIONS, check_loop_options, WIRE_DTYPE
from hpcps.strategies.lr_rule import (DEFAULT_WARMUP_STEPS, LR_RULE_OPTIONS, check_lr_rule,
                                      describe_rate)
from hpcps.strategies.registry import Strategy


def _describe(cfg, n_train: int, replicas: int | None = None) -> str:
    return f"{cfg.optimizer} {describe_rate(cfg, replicas)}, batch {cfg.batch_size}/replica"


def _validate(cfg) -> None:
    check_loop_options(cfg)
    check_lr_rule(cfg, "linear")


STRATEGY = Strategy(
    name="sync",
    help="replicas allreduce their gradients every step and apply the same update: one "
         "large-batch SGD, no servers, no staleness",
    roles={"replica": "hpcps.strategies.sync.replica:run"},
    options=(*LR_RULE_OPTIONS, *LOOP_OPTIONS, WIRE_DTYPE),
    validate=_validate,
    defaults={"lr": 0.01, "batch_size": 32, "prefetch": 2, "lr_rule": "linear",
              "lr_warmup_steps": DEFAULT_WARMUP_STEPS},
    describe=_describe,
    cost="hpcps.strategies.sync.cost:COST",
)
