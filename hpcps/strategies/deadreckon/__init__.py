"""Dead reckoning with thresholded 1-bit updates (Strom 2015, sections 2.3-2.6). No servers.

Every replica keeps a full copy of the model and a per-weight *residual*. After each
mini-batch it adds its SGD step (-lr * gradient) to the residual, and every element whose
residual passed +-tau becomes one 32-bit word (index and sign) of a message, with +-tau taken
out of the residual (the rest, quantization error included, waits for later steps). The
message, Golomb-Rice coded, goes to every peer of the partition communicator with
non-blocking sends, and the replica applies it to its own copy. Before each mini-batch it
applies whatever messages have arrived from peers, without waiting for any: a slow peer
never stalls the others.

Every replica applies the same deltas, in different orders. Adding +-tau to float32 weights
in different orders would round differently, so a replica keeps, per weight, the net number
of steps applied, counted in units of ``unit`` (an integer: order does not matter) and sets a
touched weight to ``w0 + unit * count``. Tau is always an integer multiple ``m`` of the unit,
and each message carries its sender's ``m`` next to its step, so a replica whose tau adapts
(``--tau auto``, :mod:`hpcps.compress.threshold`) needs no agreement with the others: receivers add
``+-m`` per word. Once all messages are drained, every replica holds bit-identical weights;
the summary reports a checksum per replica to show it.

Momentum (``--optimizer momentum``) runs on each replica before thresholding, with Deep
Gradient Compression's correction: the velocity of the mini-batch gradients accumulates into
the residual and is cleared where an element was sent (:class:`hpcps.compress.threshold.Velocity`).
The velocity is the replica's own state, like the residual; the weights stay the sum of the
messages, so the replicas stay identical.

At the end each replica's residual (deltas smaller than tau that were never sent) is dropped,
as in the paper: it is at most tau per weight.

Learning rate for R replicas (``--lr-scaling``). Every replica applies every replica's
steps, so one round of R mini-batches moves each weight by the sum of R steps, each computed
on weights a few rounds old. ``sum`` (the default) thresholds ``lr`` of each gradient: a
round moves ``R * lr`` times the mean gradient of the R mini-batches, which is the linear
scaling rule for a batch R times larger (Goyal et al. 2017), made safe early on by the warm
start. ``sqrt`` thresholds ``lr / sqrt(R)`` (a round moves ``sqrt(R) * lr`` times the mean,
the square-root rule) and ``mean`` thresholds ``lr / R`` (a round is one step of ``lr`` on the
mean gradient, as sync takes at the one-replica rate). The threshold tau caps what any one
message moves a weight, and what a scaled-down gradient leaves below tau waits in the
residual, so the smaller rates only slow training: on MNIST (4 epochs, 8-16 replicas) ``sum``
reached 97.8-97.9%, ``sqrt`` 96.5-97.0% and ``mean`` 92.9-95.2% (docs/consistency.md). The
rule's R is the number of replicas whose steps each one applies.

Warm start (``--warmup-steps W``, Strom's section 3.3: fewer nodes early in training, where
large combined batches make SGD diverge). Replica 0 trains alone for W of its mini-batches,
plain SGD at ``--lr``, sending nothing; the others wait. It then broadcasts its weights over
the partition communicator (partition p of replica 0 to partition p of every replica), and
every replica restarts its dead reckoning from them: ``w0`` becomes the broadcast weights,
counts and residuals zero. Every replica starts the same, so the bit-identity argument above
holds from there on. Not applied when resuming (the checkpoint is past the start) or with
one replica (nobody to release).
"""
from __future__ import annotations

import math

from hpcps.errors import ConfigError
from hpcps.options import (AUTO, COMPRESSION, GOLOMB, LOOP_OPTIONS, TAU, WARMUP_STEPS, Option,
                           check_compression, check_loop_options, describe_tau)
from hpcps.strategies.registry import Strategy, message_tags

# UPDATE: a compressed weight-delta message, peer to peer; DONE: no more from this replica
Tag = message_tags("deadreckon", "UPDATE", "DONE")
LR_SCALINGS = ("sum", "sqrt", "mean")


def replica_lr(lr: float, replicas: int, rule: str) -> float:
    """The rate each of ``replicas`` replicas thresholds its gradient at, when every replica
    applies every replica's steps: ``lr`` (``sum``), ``lr / sqrt(R)`` (``sqrt``) or
    ``lr / R`` (``mean``); ``lr`` is the rate for one replica alone."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if rule == "sum":
        return lr
    if rule == "mean":
        return lr / replicas
    if rule == "sqrt":
        return lr / math.sqrt(replicas)
    raise ValueError(f"lr scaling is one of {LR_SCALINGS}, got {rule!r}")


def _validate(cfg) -> None:
    check_loop_options(cfg)
    check_compression(cfg, STRATEGY.defaults["tau"])
    if cfg.nesterov == "on":
        raise ConfigError("--strategy deadreckon runs momentum on each replica before "
                          "thresholding (Deep Gradient Compression's correction), without "
                          "Nesterov's variant: use --nesterov off")


def _describe(cfg, n_train: int) -> str:
    rate = {"sum": "", "mean": " / R", "sqrt": " / sqrt(R)"}[cfg.lr_scaling]
    opt = f"momentum {cfg.momentum} (corrected)" if cfg.optimizer == "momentum" else "sgd"
    how = f"{opt} lr={cfg.lr}{rate}, batch {cfg.batch_size}/replica, {describe_tau(cfg)}"
    if cfg.warmup_steps and not cfg.resume:
        how += f", warm start {cfg.warmup_steps} steps"
    return how


def _summary_lines(f: dict) -> list[str]:
    if f["compression_ratio"] is None:
        sent = "no updates sent (the run ended within the warm start)"
    else:
        sent = (f"{f['updates_per_step']:.0f} updates per step, {f['bits_per_update']:.1f} bits "
                f"per update, compression {f['compression_ratio']:.0f}x of the dense gradient")
    return [f"{sent}; replicas identical after draining: {f['replicas_identical']}"]


LR_SCALING = Option("lr_scaling", str, "the rate each of R replicas thresholds its gradient "
                    "at, as every replica applies every replica's steps: sum (--lr, the "
                    "default: a round of R steps moves R * lr times the mean gradient), sqrt "
                    "(--lr / sqrt(R)) or mean (--lr / R: a round is one step of --lr on the "
                    "mean gradient)", choices=LR_SCALINGS)

STRATEGY = Strategy(
    name="deadreckon",
    help="Strom's thresholded 1-bit weight deltas sent peer to peer, each replica applying "
         "every replica's deltas (dead reckoning); no servers",
    roles={"replica": "hpcps.strategies.deadreckon.replica:run"},
    options=(LR_SCALING, WARMUP_STEPS, TAU, *COMPRESSION, GOLOMB, *LOOP_OPTIONS),
    validate=_validate,
    defaults={"lr": 0.1, "tau": AUTO, "golomb": "on", "batch_size": 32, "prefetch": 2,
              "lr_scaling": "sum", "warmup_steps": 100},
    # an Adagrad state would differ between replicas, so their weights would drift apart;
    # momentum runs on the replica's own gradients, before thresholding
    optimizers=("sgd", "momentum"),
    describe=_describe,
    summary_lines=_summary_lines,
    tags=Tag,
    cost="hpcps.strategies.deadreckon.cost:COST",
)
