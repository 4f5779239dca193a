"""The learning rate that follows the batch: the linear scaling rule with a gradual warm-up
(Goyal et al. 2017, "Accurate, Large Minibatch SGD", sections 2.1-2.2). Pure, no MPI.

A strategy whose update consumes the mini-batches of R replicas, T each with ``--threads T``
(their mean gradient: one SGD step on a batch R * T times larger), trains per epoch R * T
times fewer updates at the same rate. The linear rule multiplies the rate by R * T; the
warm-up starts from the one-replica rate and raises it linearly to the scaled rate over the
first ``--lr-warmup-steps`` global steps (mini-batches of all replicas, as ``--steps``
counts them), because a large rate on the first steps, where the weights change fastest,
diverges. The multiplier sits on top of ``--lr-schedule`` (a cosine anneals the scaled rate).

The strategies that declare these options share the two Option objects below.
"""
from __future__ import annotations

from hpcps.errors import ConfigError
from hpcps.options import Option

LR_RULES = ("linear", "none")

LR_RULE = Option("lr_rule", str, "the rate for R replicas x T threads, whose update is the "
                 "mean gradient of R*T mini-batches: linear (Goyal et al.'s linear scaling "
                 "rule, --lr x R*T, reached after --lr-warmup-steps) or none (--lr whatever "
                 "R and T); the default is the strategy's (docs/options.md has the "
                 "measurements)", choices=LR_RULES)
LR_WARMUP_STEPS = Option("lr_warmup_steps", int, "with --lr-rule linear: global steps "
                         "(mini-batches of all replicas) over which the rate rises linearly "
                         "from --lr to --lr x R*T (0: the scaled rate from the first step)",
                         check="nonneg")
LR_RULE_OPTIONS = (LR_RULE, LR_WARMUP_STEPS)
# the warm-up when none is given: Goyal et al. warm up over 5 of 90 epochs; a few hundred
# mini-batches covers the fast first changes of the weights on the small sets hpcps trains
DEFAULT_WARMUP_STEPS = 500


def check_lr_rule(cfg, default_rule: str) -> None:
    """Refuse ``--lr-warmup-steps`` where the rule is ``none`` (given, or the strategy's
    ``default_rule``): there is no warm-up then, and the option would do nothing."""
    rule = getattr(cfg, "lr_rule", None) or default_rule
    if getattr(cfg, "lr_warmup_steps", None) is not None and rule == "none":
        raise ConfigError("--lr-warmup-steps is the warm-up of --lr-rule linear; the rule here "
                          "is none, which has no warm-up: give --lr-rule linear, or drop "
                          "--lr-warmup-steps")


def lr_multiplier(rule: str, replicas: int, threads: int, step: int, warmup: int) -> float:
    """The rate's multiplier at global step ``step`` for ``replicas`` x ``threads``: 1 for
    ``none``; for ``linear``, ``k = replicas * threads`` from step ``warmup`` on, and before
    it ``1 + (k - 1) * step / warmup`` (from the one-replica rate at step 0)."""
    if replicas < 1 or threads < 1:
        raise ValueError(f"replicas and threads must be >= 1, got {replicas} and {threads}")
    if rule == "none":
        return 1.0
    if rule != "linear":
        raise ValueError(f"the lr rule is one of {LR_RULES}, got {rule!r}")
    k = replicas * threads
    if warmup <= 0 or step >= warmup:
        return float(k)
    return 1.0 + (k - 1) * max(step, 0) / warmup


def describe_rate(cfg, replicas: int | None) -> str:
    """The rate for the start line: ``lr=0.01`` or, with the linear rule, the scaled rate and
    its warm-up (``replicas`` None: the number is not known here, the rule is named)."""
    rule = getattr(cfg, "lr_rule", None) or "none"
    if rule == "none":
        return f"lr={cfg.lr}"
    T = cfg.threads or 1
    warm = cfg.lr_warmup_steps or 0
    ramp = f", warm-up from {cfg.lr} over {warm} steps" if warm else ""
    if replicas is None:
        return f"lr={cfg.lr} x R*{T} (linear rule{ramp})"
    k = replicas * T
    return (f"lr={cfg.lr * k:g} (linear rule: {cfg.lr} x {replicas} replica{'s' * (replicas != 1)}"
            f" x {T} thread{'s' * (T != 1)}{ramp})")
