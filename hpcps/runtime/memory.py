"""Resident memory per rank and per role, and what each byte per parameter pays for.

:func:`peak_rss_bytes` is this process's peak resident set (Linux ``VmHWM``; elsewhere
``getrusage``). Every rank adds its own to its result; :func:`by_role` turns the gathered
results into the summary's figures (largest peak per role, and every rank's).

:func:`bytes_per_param` is the formula for what Downpour's ranks hold per parameter they
own, by kind (weights, optimizer state, residuals, buffers); ``bench/bench_memory.py`` checks
it against the measured peaks of runs that differ only in P or S (``docs/performance.md``).
"""
from __future__ import annotations

import re
import resource
import sys

MIB = 2 ** 20


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes."""
    try:
        with open("/proc/self/status") as fh:
            found = re.search(r"^VmHWM:\s+(\d+)\s+kB", fh.read(), re.M)
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def by_role(results: list[dict]) -> dict:
    """Summary figures from every rank's result (each with ``role`` and ``peak_rss_bytes``).

    ``peak_rss_mib``: the largest peak per role, in MiB; ``peak_rss_mib_by_rank``: every
    rank's ``[role, MiB]`` in world-rank order."""
    per_rank = [[r.get("role", "lost"), round(r.get("peak_rss_bytes", 0) / MIB, 1)]
                for r in results]
    largest: dict[str, float] = {}
    for role, mib in per_rank:
        if role != "lost":  # a rank lost during the run reported nothing
            largest[role] = max(largest.get(role, 0.0), mib)
    return {"peak_rss_mib": largest, "peak_rss_mib_by_rank": per_rank}


def describe(figures: dict) -> str:
    """One line for the terminal: the largest peak of each role."""
    counts: dict[str, int] = {}
    for role, _ in figures["peak_rss_mib_by_rank"]:
        counts[role] = counts.get(role, 0) + 1
    parts = [f"{role} {mib:.0f} MiB (largest of {counts[role]})"
             for role, mib in figures["peak_rss_mib"].items()]
    return "peak resident memory: " + ", ".join(parts)


# Optimizer state vectors per parameter (float32 each), as hpcps.model.optim keeps them.
STATE_VECTORS = {"sgd": 0, "adagrad": 1, "momentum": 1}


def bytes_per_param(role: str, optimizer: str = "adagrad") -> dict:
    """Bytes a Downpour rank holds per parameter it owns, by kind (float32 everywhere).

    server shard (:mod:`hpcps.ps.gradient_shard`): its slice of the weights, the optimizer's
    state, and two message buffers of its slice (the push received, the reply sent).
    replica partition (:class:`hpcps.strategies.downpour.DownpourReplica`): the weights it
    computes with, the fresh weights drawn at start (kept by the context), the gradient and
    the accumulated gradient, one fetch buffer and two push buffers (double-buffered sends).
    Dense pushes (``--compress none --push gradients``); compressed pushes add a residual
    and packed buffers, not covered here.

    Returns ``{"weights", "optimizer_state", "residuals", "buffers", "total"}``.
    """
    if optimizer not in STATE_VECTORS:
        raise ValueError(f"no formula for optimizer {optimizer!r}")
    if role == "server":
        out = {"weights": 4, "optimizer_state": 4 * STATE_VECTORS[optimizer], "residuals": 0,
               "buffers": 8}
    elif role == "replica":
        out = {"weights": 8, "optimizer_state": 0,
               "residuals": 0, "buffers": 20}
    else:
        raise ValueError(f"no formula for role {role!r} (server or replica)")
    out["total"] = sum(out.values())
    return out
