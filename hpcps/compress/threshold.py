"""The threshold of compressed updates: who owns tau, how it adapts, and what bounds the residual.

Strom's thresholding (:mod:`hpcps.compress.codec`) sends every element whose residual passed
``+-tau``. A fixed tau trades compression for accuracy in a way a user cannot predict (the
overview of Ben-Nun and Hoefler calls it an extra hyperparameter to tune). This module keeps
tau in one place for every strategy that compresses (``deadreckon`` and ``downpour
--compress threshold``) and adds what the sources that followed Strom found necessary:

Adaptive threshold (``--tau auto``, ``--density D``)
    Deeplearning4j's ``AdaptiveThresholdAlgorithm`` moves the threshold so that the fraction
    of elements sent stays inside a band. Here the band is a point: after each step the
    measured density ``d = sent / n`` (this rank's words over its weights) enters a moving
    average ``a`` (weight ``SMOOTHING``), and tau moves multiplicatively,
    ``log tau += GAIN * log(a / target)``, by at most a factor ``MAX_STEP`` per step. At
    steady state density falls as tau rises, so this integral controller on ``log tau``
    reaches the target from either side and follows it as the gradients shrink. It must be
    slow: the residuals of many elements sit just under tau, so one step that lowers tau by
    a quarter releases a burst of words, and a controller fed each step's raw density
    (gain 0.1, steps up to 1.25x) swung between 0.1x and 7x the target every other step
    (tests/test_threshold.py's synthetic stream); with the average and the gains above, the
    mean density of every 200-step window stays within a few percent of the target.
    The target is at least ``MIN_WORDS`` words per step: on a small model a density meant
    for a large one would send a handful of words (5 per step on the tests' 2,410-weight
    digits model at 0.002), and the floor keeps its accuracy (docs/compression.md).

Tau as an integer multiple of a unit
    ``deadreckon`` replicas keep weights as ``w0 + unit * count`` (an integer per weight),
    which is what keeps replicas bit-identical when messages arrive in different orders. Tau
    is always ``m * unit`` with an integer ``m`` (``unit = initial tau / UNIT_DIVISOR``), and
    every message carries its sender's ``m``: a receiver adds ``+-m`` to the count, an
    integer sum, the same in any order. So replicas need not agree on tau at all: each one
    adapts its own, and bit-identity after draining holds exactly as with a fixed tau (a
    fixed tau is ``m = UNIT_DIVISOR`` for the whole run). ``downpour`` shards expand each
    push with the tau it carries.

Sparsity warm-up (``--sparsity-warmup STEPS``)
    Deep Gradient Compression (Lin et al. 2018) starts with a high density and lowers it
    exponentially over the first epochs (75% sparsity, then 93.75%, ...): early gradients
    change fast, and a stale residual hurts most then. The target density here falls
    geometrically from ``WARMUP_DENSITY_FACTOR * D`` (capped at 1) to ``D`` over ``STEPS``
    of this replica's steps, counted from the moment it starts sending (after the one-replica
    warm start of ``--warmup-steps``, when there is one).

Residual clipping (``--residual-clip C``)
    Deeplearning4j's ``ResidualClippingPostProcessor`` clips the residual to a few times the
    threshold, so that an element whose gradient keeps one sign for long cannot pile up a
    residual that it then sends for many steps after the gradient changed (the residual
    explosion the sources warn about). Here, after each threshold pass, every element of the
    residual is clipped to ``[-C * tau, C * tau]``. 0 turns it off.

Local gradient clipping (``--grad-clip G``)
    DGC clips each worker's gradient before it enters the residual, at ``G * R**-0.5``
    (R workers' clipped gradients summed have a norm of about G when they are independent).
    Here: the L2 norm of this replica's mini-batch gradient (before the learning rate) is
    scaled down to at most ``G / sqrt(R)``. 0 turns it off.

Momentum correction
    With momentum, DGC accumulates the *velocity* in the residual, not the gradient, and
    clears the velocity of every element just sent (momentum factor masking): the sparse
    updates then follow what dense momentum SGD would have done. :class:`Velocity` does this
    on the replica, before thresholding.

Diagnostics: :meth:`Threshold.fields` gives tau, the measured density and the residual's L2
norm for the progress line and JSONL; :class:`ResidualWatch` says once when the residual
norm has kept growing.

Pure NumPy, no MPI: tested on synthetic gradient streams (tests/test_threshold.py).
"""
from __future__ import annotations

import math

import numpy as np

from hpcps.options import AUTO, DEFAULT_DENSITY, MIN_WORDS, parse_tau

__all__ = ["AUTO", "parse_tau", "warmup_density", "clip_norm", "Threshold", "Velocity",
           "ResidualWatch", "residual_norm", "DEFAULT_DENSITY", "MIN_WORDS", "target_density"]

UNIT_DIVISOR = 2**16         # tau = m * unit; the initial tau is m = 65536 units
MAX_MULTIPLE = 2**40         # tau at most 2**30 times the initial tau (counts are int64)
GAIN = 0.05                  # log tau moves by GAIN * log(smoothed / target density) per step
MAX_STEP = 1.1               # ... but by at most this factor in one step
SMOOTHING = 0.1              # weight of the newest step in the density's moving average
WARMUP_DENSITY_FACTOR = 64.0  # the sparsity warm-up starts at 64x the target density


def target_density(density: float, n: int, min_words: int = MIN_WORDS) -> float:
    """The density ``--tau auto`` aims at on a rank thresholding ``n`` elements: ``density``,
    raised to ``min_words / n`` where that is more (capped at 1)."""
    return min(1.0, max(density, min_words / max(1, n)))


def warmup_density(step: int, target: float, warmup_steps: int) -> float:
    """The target density at ``step`` (0-based, counted from the first step that sends):
    geometric from ``min(1, WARMUP_DENSITY_FACTOR * target)`` down to ``target`` over
    ``warmup_steps`` steps, then ``target``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    start = min(1.0, WARMUP_DENSITY_FACTOR * target)
    frac = step / warmup_steps
    return math.exp((1 - frac) * math.log(start) + frac * math.log(target))


def clip_norm(grad: np.ndarray, max_norm: float) -> float:
    """Scale ``grad`` in place so that its L2 norm is at most ``max_norm``; return the norm
    it had (``max_norm <= 0``: no clipping)."""
    norm = math.sqrt(float(np.dot(grad, grad)))
    if max_norm > 0 and norm > max_norm:
        grad *= np.float32(max_norm / norm)
    return norm


class Threshold:
    """One rank's tau, as ``multiple * unit``, fixed or following a target density.

    Parameters
    ----------
    tau0 : float
        The initial (and for a fixed threshold, the only) tau; sets ``unit``.
    n : int
        Elements this rank thresholds (the density is words / n).
    density : float or None
        Target density for an adaptive tau; None keeps tau fixed.
    warmup_steps : int
        Sparsity warm-up length in steps (0: none); only with an adaptive tau.
    residual_clip : float
        Clip the residual to ``+-residual_clip * tau`` after each pass (0: no clipping).
    """

    def __init__(self, tau0: float, n: int, density: float | None = None,
                 warmup_steps: int = 0, residual_clip: float = 0.0):
        if not (math.isfinite(tau0) and tau0 > 0):
            raise ValueError(f"tau0 must be positive and finite, got {tau0}")
        if density is not None and not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if residual_clip < 0 or warmup_steps < 0:
            raise ValueError("residual_clip and warmup_steps must be >= 0")
        self.unit = float(tau0) / UNIT_DIVISOR
        self.multiple = UNIT_DIVISOR
        self.n = max(1, int(n))
        self.density = density
        self.warmup_steps = int(warmup_steps) if density is not None else 0
        self.residual_clip = float(residual_clip)
        self.steps = 0            # passes so far (the warm-up's clock)
        self.last_density = 0.0
        self._log_m = math.log(self.multiple)
        self._avg: float | None = None  # moving average of the measured density
        self._win = [0, 0]        # words and passes since the last fields()

    @classmethod
    def from_config(cls, cfg, n: int, default_tau: float) -> Threshold:
        """The threshold a run's options ask for (``--tau``, ``--density``,
        ``--sparsity-warmup``, ``--residual-clip``); ``default_tau`` starts ``--tau auto``."""
        auto = cfg.tau == AUTO
        return cls(default_tau if auto else float(cfg.tau), n,
                   density=target_density(cfg.density or DEFAULT_DENSITY, n) if auto else None,
                   warmup_steps=cfg.sparsity_warmup or 0,
                   residual_clip=cfg.residual_clip or 0.0)

    @property
    def adaptive(self) -> bool:
        return self.density is not None

    @property
    def tau(self) -> float:
        """The current threshold, ``multiple * unit`` (what :func:`compress.threshold` uses)."""
        return self.multiple * self.unit

    def target(self) -> float:
        """The density the controller aims at for the next pass (warm-up included)."""
        if self.density is None:
            raise ValueError("a fixed tau has no target density")
        return warmup_density(self.steps, self.density, self.warmup_steps)

    def after_pass(self, residual: np.ndarray, sent: int) -> None:
        """Account one threshold pass that sent ``sent`` words: clip the residual, then (if
        adaptive) move tau towards the target density for the next pass."""
        if self.residual_clip > 0:
            lim = np.float32(self.residual_clip * self.tau)
            np.clip(residual, -lim, lim, out=residual)
        self.last_density = sent / self.n
        self._win[0] += sent
        self._win[1] += 1
        if self.adaptive:
            measured = sent / self.n
            avg = measured if self._avg is None else \
                self._avg + SMOOTHING * (measured - self._avg)
            self._avg = avg
            target = self.target()
            self.steps += 1
            # no word sent yet: as if half a word (log of zero)
            move = GAIN * math.log(max(avg, 0.5 / self.n) / target)
            move = max(-math.log(MAX_STEP), min(math.log(MAX_STEP), move))
            self._log_m = min(max(self._log_m + move, 0.0), math.log(MAX_MULTIPLE))
            self.multiple = max(1, int(round(math.exp(self._log_m))))

    def fields(self, residual: np.ndarray) -> dict:
        """tau, the density since the last call, and the residual's L2 norm (progress)."""
        words, passes = self._win
        self._win = [0, 0]
        return {"tau": float(f"{self.tau:.4g}"),
                "density": float(f"{words / max(1, passes) / self.n:.3g}"),
                "residual_norm": float(f"{residual_norm(residual):.4g}")}


def residual_norm(residual: np.ndarray) -> float:
    return float(np.sqrt(np.dot(residual.astype(np.float64, copy=False),
                                residual.astype(np.float64, copy=False))))


class Velocity:
    """DGC's momentum correction on the replica: accumulate ``v = mu * v + g``, send the
    thresholded velocity, and clear the velocity of every element sent (momentum factor
    masking), so that an element's momentum does not keep pushing after it was applied."""

    def __init__(self, n: int, mu: float):
        if not 0.0 <= mu < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {mu}")
        self.mu = np.float32(mu)
        self.v = np.zeros(n, dtype=np.float32)

    def accumulate(self, grad: np.ndarray) -> np.ndarray:
        """``v = mu * v + grad``; write v into ``grad`` (what goes to the residual)."""
        self.v *= self.mu
        self.v += grad
        grad[:] = self.v
        return grad

    def mask(self, words: np.ndarray) -> None:
        """Clear the velocity at the indices of ``words`` (sent this step)."""
        if len(words):
            self.v[(words >> 1).astype(np.intp)] = 0.0


class ResidualWatch:
    """Says once when the residual has kept growing against the threshold: the residual's
    L2 norm in units of tau, over ``window`` progress records in a row, each larger than
    the one before, ending more than ``factor`` times above the smallest seen. A healthy
    residual levels off within a few records at about tau per element (more only where an
    element's gradient keeps its sign); measured in tau, a residual that grows only because
    an adaptive tau grew does not count."""

    def __init__(self, window: int = 5, factor: float = 4.0, adaptive: bool = True):
        """``adaptive``: tau follows a --density target (--tau auto); with a fixed tau the
        advice is a smaller --tau, since --density needs --tau auto."""
        if window < 1 or factor < 1:
            raise ValueError("window must be >= 1 and factor >= 1")
        self.window, self.factor = window, factor
        self.advice = ("--residual-clip (e.g. 4) or a larger --density" if adaptive else
                       "--residual-clip (e.g. 4), a smaller --tau, or --tau auto with a "
                       "--density")
        self.prev = math.nan
        self.low = math.inf
        self.rising = 0
        self.fired = False

    def update(self, norm: float, tau: float = 1.0) -> str | None:
        """Feed one record's residual norm and tau; the warning's text the one time it
        fires."""
        if self.fired or not (math.isfinite(norm) and tau > 0):
            return None
        x = norm / tau
        self.rising = self.rising + 1 if x > self.prev else 0
        self.prev = x
        self.low = min(self.low, x)
        if self.rising >= self.window and x > self.factor * self.low > 0:
            self.fired = True
            return (f"warning: the compression residual keeps growing (L2 norm {norm:.4g}, "
                    f"{x / self.low:.1f}x its lowest in units of tau, rising for "
                    f"{self.rising} progress records): updates are piling up unsent; set "
                    f"{self.advice}")
        return None
