"""The heartbeat thread (hpcps.ps.liveness) against a rank that takes no messages, on K ranks.

Launched with the other multi-rank tests by ``tests/test_mpi_suites.py`` (K = 2-4).
"""
from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from hpcps.mpi.protocol import Message, Tag
from hpcps.mpi.topology import world_comm
from hpcps.ps.liveness import HeartbeatThread

BEATING_S = 1.5


@pytest.mark.mpi(min_size=2)
def test_heartbeats_to_a_rank_that_takes_none_never_block():
    """Rank 1 makes no MPI call for a while (as a dead rank not yet known dead): MPICH's
    shared-memory queue to it fills after about 64 small messages, and a blocking send then
    waits. Rank 0's heartbeat thread, beating every millisecond, keeps going (one heartbeat
    in flight per rank, the others skipped), so it goes on beating its other peers and stops
    at once when told."""
    comm = world_comm()
    rank = comm.Get_rank()
    if rank == 1:
        time.sleep(BEATING_S + 1.0)  # no MPI call: nothing is taken off the queue
        comm.Barrier()
        msg, st = Message(0), MPI.Status()
        taken = 0
        while comm.Iprobe(0, Tag.HEARTBEAT, st):
            comm.Recv(msg.buf, 0, Tag.HEARTBEAT)
            taken += 1
        assert taken >= 1
    elif rank == 0:
        hb = HeartbeatThread(comm, [1], 0, 0.001).start()
        time.sleep(BEATING_S)
        t0 = time.monotonic()
        hb.stop()
        stopped_s = time.monotonic() - t0
        # a blocked thread would have made ~64 rounds, and stop() would wait for rank 1
        assert hb.sent > 150 and hb.skipped > 0, (hb.sent, hb.skipped)
        assert stopped_s < 0.5, stopped_s
        comm.Barrier()
    else:
        comm.Barrier()
    comm.Barrier()  # rank 1 has taken every heartbeat: rank 0's sends have completed
