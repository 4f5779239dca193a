"""The end of a run whose replicas may die (hpcps.runtime.faults.finish), on K ranks.

Launched with the other multi-rank tests by ``tests/test_mpi_suites.py`` (K = 1-4).
"""
from __future__ import annotations

import time

import pytest

from hpcps.runtime import faults
from hpcps.mpi.protocol import Tag
from hpcps.mpi.topology import Layout, world_comm


def _one_shard():
    """The world as downpour with one shard lays it out: (comm, size, rank, layout, the
    shard's rank)."""
    comm = world_comm()
    layout = Layout.plan(comm.Get_size(), 1, 1)
    return comm, comm.Get_size(), comm.Get_rank(), layout, layout.server_rank(0)


@pytest.mark.mpi(min_size=3)
def test_a_replica_that_dies_after_its_last_push_is_named_lost():
    """Replica rank 1 sends no final figures (it died after the shards stopped waiting for
    it, so no shard lost it): the reporter waits --timeout, names it lost with why, and every
    other rank ends normally instead of timing out."""
    comm, size, rank, layout, shard = _one_shard()
    if rank == 1:  # "dead": it never reports (then takes the notice sent to it, which a
        assert comm.recv(source=0, tag=Tag.RESULT) == [1]  # dead rank never would)
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


@pytest.mark.mpi(min_size=3)
def test_after_the_shards_ended_a_silent_replica_is_lost_within_the_grace():
    """Once the shards have reported (nobody lost), replica rank 1 sends nothing: the
    reporter names it lost after the grace, not after --timeout, and tells rank 1, which
    (alive here, only late) learns it was counted lost and can leave as the survivors do."""
    comm, size, rank, layout, shard = _one_shard()
    seen = {}
    t0 = time.monotonic()
    if rank == 1:  # late: it reports only after the reporter has given up on it
        told = comm.recv(source=0, tag=Tag.RESULT)
        assert told == [1] and time.monotonic() - t0 < 20
        comm.Free()
        return
    result = {"shard": 0, "lost_replicas": {}} if rank == shard else {"rank": rank}
    lost = faults.finish(comm, 0, result, layout, 60.0, lambda results: seen.update(
        results=results), grace=1.0)
    assert lost and time.monotonic() - t0 < 20  # the grace, not the 60 s timeout
    if rank == 0:
        why = seen["results"][1]["why"]
        assert "no final figures within 1 s of the end of training" in why, why
    comm.Free()


@pytest.mark.mpi(min_size=3)
def test_a_reporter_that_lists_the_lost_itself_gives_its_own_grace():
    """Sandblaster's coordinator reports whom it lost and how long a live replica may still
    be busy (``ending_grace_s``): a silent replica is named lost after that, not after
    --timeout nor the caller's grace, and the figure is not among the summarized results."""
    comm, size, rank, layout, shard = _one_shard()
    seen = {}
    t0 = time.monotonic()
    if rank == 1:  # late: it learns it was counted lost
        assert comm.recv(source=0, tag=Tag.RESULT) == [1]
        comm.Free()
        return
    result = {"lost_ranks": [], "ending_grace_s": 1.5} if rank == 0 else \
        {"shard": 0} if rank == shard else {"rank": rank}
    lost = faults.finish(comm, 0, result, layout, 60.0, lambda results: seen.update(
        results=results), grace=30.0)
    assert lost and time.monotonic() - t0 < 20  # its 1.5 s, not 30 s nor 60 s
    if rank == 0:
        results = seen["results"]
        assert "within 1.5 s of the end of training" in results[1]["why"], results[1]
        assert results[0] == {"lost_ranks": []}
        assert result == {"lost_ranks": [], "ending_grace_s": 1.5}  # the caller's untouched
    comm.Free()
