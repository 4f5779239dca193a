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
from hpcps.options import LOOP_OPTIONS, check_loop_options
from hpcps.strategies.registry import Strategy

STRATEGY = Strategy(
    name="sync",
    help="replicas allreduce their gradients every step and apply the same update: one "
         "large-batch SGD, no servers, no staleness",
    roles={"replica": "hpcps.strategies.sync.replica:run"},
    options=LOOP_OPTIONS,
    validate=check_loop_options,
    defaults={"lr": 0.01, "batch_size": 32, "prefetch": 2},
    describe=lambda cfg, n_train: f"{cfg.optimizer} lr={cfg.lr}, batch "
                                  f"{cfg.batch_size}/replica",
    cost="hpcps.strategies.sync.cost:COST",
)
