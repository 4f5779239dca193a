"""Replicated server shards' placement (:mod:`hpcps.ps.replicated.placement`): who holds which
set, who is its primary after deaths, and the state message's layout. No MPI."""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.ps.chunks import ChunkPlan
from hpcps.ps.replicated import placement as rp


@pytest.mark.parametrize("S,C", [(2, 2), (3, 2), (3, 3), (5, 3), (8, 2)])
def test_every_shard_holds_C_sets_and_every_set_C_shards(S, C):
    held = {s: rp.sets_of(s, S, C) for s in range(S)}
    for s, sets in held.items():
        assert len(sets) == C and s in sets  # its home set and C-1 others
    for h in range(S):
        hs = rp.holders(h, S, C)
        assert hs[0] == h and len(set(hs)) == C
        assert all(h in held[x] for x in hs)
        assert sum(h in held[x] for x in range(S)) == C


def test_the_primary_is_the_first_live_holder_and_every_survivor_agrees():
    S, C = 5, 3
    assert [rp.primary(h, S, C, ()) for h in range(S)] == list(range(S))
    assert rp.primary(2, S, C, {2}) == 3
    assert rp.primary(2, S, C, {2, 3}) == 4
    assert rp.primary(2, S, C, {2, 3, 4}) is None  # every copy lost
    assert rp.primary(4, S, C, {4}) == 0  # the ring wraps
    # a death moves only the dead shard's sets, each to the next holder
    before = [rp.primary(h, S, C, ()) for h in range(S)]
    after = [rp.primary(h, S, C, {1}) for h in range(S)]
    assert [h for h in range(S) if before[h] != after[h]] == [1] and after[1] == 2
    assert rp.collector(S, ()) == 0 and rp.collector(S, {0, 1}) == 2


def test_state_payloads_assemble_to_the_global_vectors():
    rng = np.random.default_rng(3)
    n, keys = 10_007, ["g2"]
    plan = ChunkPlan(n, 1000, 3)
    params = rng.standard_normal(n).astype(np.float32)
    acc = rng.random(n).astype(np.float32)
    R = 4
    parts = {}
    for h in range(3):
        p = np.concatenate([plan.take(h, params), plan.take(h, acc),
                            np.arange(1, R + 1, dtype=np.float32)])  # the replicas' seqs
        assert len(p) == rp.state_size(plan.sizes[h], len(keys), R)
        parts[h] = p
    got, state = rp.assemble(plan, parts, keys)
    np.testing.assert_array_equal(got, params)
    np.testing.assert_array_equal(state["g2"], acc)
