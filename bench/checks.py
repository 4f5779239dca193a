"""What every benchmark does before it prints a figure: check the result of what it timed.

A kernel that returns zeros, or a run that diverged, must not yield a speed: each benchmark
compares its outputs with NumPy (or its loss with the reference's) within a stated tolerance
and exits non-zero, saying what differed, when they do not agree.
"""
from __future__ import annotations

import math
import sys

import numpy as np


def fail(what: str) -> None:
    print(f"check failed, no figure printed: {what}", file=sys.stderr, flush=True)
    sys.exit(1)


def close(what: str, got, want, rtol: float, atol: float) -> None:
    """Exit non-zero unless ``got`` equals ``want`` within ``rtol`` and ``atol`` everywhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        fail(f"{what}: shape {got.shape}, expected {want.shape}")
    if not np.all(np.isfinite(got)):
        fail(f"{what}: {int((~np.isfinite(got)).sum())} values not finite")
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fail(f"{what}: {int(bad.sum())} of {bad.size} values differ beyond rtol {rtol:g}, "
             f"atol {atol:g} (first at flat index {i}: {got.flat[i]!r} vs {want.flat[i]!r})")


def loss_fell(what: str, first: float, last: float, at_most: float) -> None:
    """Exit non-zero unless the loss is finite and fell below ``at_most`` times its start
    (a run that diverged or did not learn has no speed worth printing; with ``at_most`` 1, a
    loss that did not move at all, as with a gradient of zeros, fails)."""
    if not (math.isfinite(first) and math.isfinite(last)):
        fail(f"{what}: loss not finite ({first!r} -> {last!r})")
    if not last < at_most * first:
        fail(f"{what}: loss {first:.4g} -> {last:.4g}, expected below {at_most:g}x the first")
