"""Resident memory per rank and per role, and what each byte per parameter pays for.

:func:`peak_rss_bytes` is this process's peak resident set (Linux ``VmHWM``; elsewhere
``getrusage``). Every rank adds its own to its result; :func:`by_role` turns the gathered
results into the summary's figures (largest peak per role, and every rank's).

:func:`bytes_per_param` is the formula for what Downpour's ranks hold per parameter they
own, by kind (weights, optimizer state, residuals, buffers); ``bench/bench_memory.py`` checks
it against the measured peaks of runs that differ only in P or S (``docs/performance.md``).
"""
from __future__ import annotations

import os
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


# -- the memory a rank may give its data ------------------------------------------------------
DATA_FRACTION = 0.5  # of what a rank may use: the rest is the model, buffers, MPI, Python


def data_budget(ranks_on_node: int, mem_available: int, cgroup_limit: int | None = None,
                cgroup_usage: int = 0, rlimit_as: int | None = None, vm_size: int = 0) -> int:
    """Bytes of data one rank holds in memory before it streams (``--data-memory`` unset).

    The node's free memory (``MemAvailable``, or what the cgroup's limit leaves, the smaller)
    is shared equally by the job's ranks on the node; a per-process address-space limit
    (``RLIMIT_AS``) caps a rank at what it leaves above the address space already mapped.
    The data may take :data:`DATA_FRACTION` of that. Pure: :func:`system_data_budget` reads
    the figures."""
    node = mem_available
    if cgroup_limit is not None:
        node = min(node, cgroup_limit - cgroup_usage)
    per_rank = node / max(1, ranks_on_node)
    if rlimit_as is not None:
        per_rank = min(per_rank, rlimit_as - vm_size)
    return max(0, int(DATA_FRACTION * per_rank))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as fh:
            found = re.search(rf"^{key}:\s+(\d+)\s+kB", fh.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def system_data_budget(ranks_on_node: int) -> tuple[int, str]:
    """:func:`data_budget` of this machine and process, and the rule's figures in words."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is None:  # not Linux: the physical memory
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 1 << 40
    limit = _read_int("/sys/fs/cgroup/memory.max")
    usage = _read_int("/sys/fs/cgroup/memory.current") or 0
    if limit is None:  # cgroup v1
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        if limit is not None and limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            limit = None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    rlimit = None if soft == resource.RLIM_INFINITY else soft
    vm = _proc_kib("/proc/self/status", "VmSize") or 0
    budget = data_budget(ranks_on_node, avail, limit, usage, rlimit, vm)
    why = f"{DATA_FRACTION:g} x (MemAvailable {avail / MIB:.0f} MiB"
    if limit is not None:
        why += f", cgroup limit {limit / MIB:.0f} MiB less {usage / MIB:.0f} MiB used"
    why += f") / {ranks_on_node} rank(s) on the node"
    if rlimit is not None:
        why += (f", or of RLIMIT_AS {rlimit / MIB:.0f} MiB less {vm / MIB:.0f} MiB mapped "
                "if smaller")
    return budget, why
