"""The end of a run whose replicas may die (hpcps.faults.finish), on K ranks.

Launched with the other multi-rank tests by ``tests/test_mpi_suites.py`` (K = 1-4).
"""
from __future__ import annotations

import pytest

from hpcps import faults
from hpcps.topology import Layout, world_comm


@pytest.mark.mpi(min_size=3)
def test_a_replica_that_dies_after_its_last_push_is_named_lost():
    """Replica rank 1 sends no final figures (it died after the shards stopped waiting for
    it, so no shard lost it): the reporter waits --timeout, names it lost with why, and every
    other rank ends normally instead of timing out."""
    comm = world_comm()
    size, rank = comm.Get_size(), comm.Get_rank()
    layout = Layout.plan(size, 1, 1)
    shard = layout.server_rank(0)
    if rank == 1:  # "dead": it never reports
        comm.Free()
        return
    seen = {}
    result = {"shard": 0, "lost_replicas": {}} if rank == shard else {"rank": rank}
    lost = faults.finish(comm, 0, result, layout, 2.0, lambda results: seen.update(
        results=results))
    assert lost
    if rank == 0:
        results = seen["results"]
        assert results[1]["lost"] and "no final figures within 2 s" in results[1]["why"]
        assert all(results[r] == {"rank": r} for r in range(2, size) if r != shard)
    comm.Free()
