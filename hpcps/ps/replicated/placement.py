"""Who holds which chunk set of replicated shards (``--ps-copies C``), and the layout of a
set's state message. Pure: no MPI, so every rank computes any set's holders and primary from
the same list of dead shards, without communicating.

Set ``h`` is held by shards ``h, h+1, ..., h+C-1`` (mod S), in that order; its primary is the
first of them alive. The state message's payload is the set's parameters, each optimizer state
vector, then each replica's last push applied.
"""
from __future__ import annotations

import numpy as np


def holders(h: int, n_shards: int, copies: int) -> list[int]:
    """Shards holding set ``h``, in succession order: the primary while all live, first."""
    return [(h + i) % n_shards for i in range(copies)]


def sets_of(s: int, n_shards: int, copies: int) -> list[int]:
    """Sets shard ``s`` holds: its home set and the C-1 sets before it."""
    return sorted({(s - i) % n_shards for i in range(copies)})


def primary(h: int, n_shards: int, copies: int, dead) -> int | None:
    """The first live holder of set ``h`` (None: every copy is lost)."""
    return next((x for x in holders(h, n_shards, copies) if x not in dead), None)


def collector(n_shards: int, dead) -> int:
    """The live shard that assembles periodic checkpoints: the one of lowest index."""
    return min(x for x in range(n_shards) if x not in dead)


def state_size(n: int, n_keys: int, n_replicas: int) -> int:
    """float32 values of a set's state message: parameters, each optimizer state vector, and
    each replica's last push applied."""
    return n * (1 + n_keys) + n_replicas


def assemble(plan, parts: dict, keys) -> tuple[np.ndarray, dict]:
    """The global parameter and optimizer-state vectors from every set's state payload."""
    params = np.empty(plan.n, dtype=np.float32)
    state = {k: np.empty(plan.n, dtype=np.float32) for k in keys}
    for h, payload in parts.items():
        n = plan.sizes[h]
        plan.put(h, payload[:n], params)
        for i, k in enumerate(keys):
            plan.put(h, payload[(i + 1) * n:(i + 2) * n], state[k])
    return params, state
