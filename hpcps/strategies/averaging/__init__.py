"""Parameter averaging (the DL4J overview's first method): local training, periodic averages.

Every replica trains its own copy of the model with its own optimizer, on its own shard of
the data, for ``--average-every k`` iterations; then the replicas' parameters are averaged
(one allreduce over the partition communicator, divided by R) and every replica continues
from the average. With ``--average-state on`` (the default) the optimizer state (Adagrad's
sums of squared gradients) is averaged in the same allreduce, as DL4J does: otherwise each
replica's state keeps only its own history, and the replicas, though they restart from the
same weights, would take different step sizes from them. ``off`` halves the traffic of an
Adagrad run (plain SGD has no state, so the option changes nothing there).

With k = 1, plain SGD and equal mini-batches this is exactly ``sync``: averaging
``w - lr * g_r`` over r is ``w - lr * mean(g_r)`` (the overview's argument); the tests check
that to float tolerance. Larger k trades consistency for k times less communication.

Model parallelism: each partition averages its own slice with the same partition of the other
replicas. Hogwild threads: one iteration covers T mini-batches, as in the other strategies.
Periodic evaluations and checkpoints take replica 0's copy; the last iteration is always
followed by an average, so every replica ends with the same weights.
"""
from hpcps.options import LOOP_OPTIONS, Option, check_loop_options, WIRE_DTYPE
from hpcps.strategies.lr_rule import (DEFAULT_WARMUP_STEPS, LR_RULE_OPTIONS, check_lr_rule,
                                      describe_rate)
from hpcps.strategies.registry import Strategy


def _describe(cfg, n_train: int, replicas: int | None = None) -> str:
    return (f"{cfg.optimizer} {describe_rate(cfg, replicas)}, batch {cfg.batch_size}/replica, "
            f"average every {cfg.average_every} iteration(s), state averaged: "
            f"{cfg.average_state}")


def _validate(cfg) -> None:
    check_loop_options(cfg)
    check_lr_rule(cfg, "linear")


STRATEGY = Strategy(
    name="averaging",
    help="replicas train their own copies for --average-every iterations, then average "
         "their parameters (and optimizer state) with one allreduce; no servers",
    roles={"replica": "hpcps.strategies.averaging.replica:run"},
    options=(
        Option("average_every", int, "iterations each replica trains alone between two "
               "averages (default 4; 1 with plain SGD is sync)", check="positive"),
        Option("average_state", str, "on: average the optimizer state (Adagrad's sums) with "
               "the parameters (default: the replicas then take the same step sizes); off: "
               "each replica keeps its own", choices=("on", "off")),
        *LR_RULE_OPTIONS, *LOOP_OPTIONS, WIRE_DTYPE),
    validate=_validate,
    defaults={"lr": 0.01, "batch_size": 32, "prefetch": 2, "average_every": 4,
              "average_state": "on", "lr_rule": "linear",
              "lr_warmup_steps": DEFAULT_WARMUP_STEPS},
    describe=_describe,
    summary_lines=lambda f: [f"{f['averaging_rounds']} averages, replicas' mean RMS distance "
                             f"to the average before each: {f['mean_spread']:.3g}"],
    cost="hpcps.strategies.averaging.cost:COST",
)
