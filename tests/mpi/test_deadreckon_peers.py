"""Deadreckon's peer exchange under MPI: one poll takes every message that has arrived.

MPICH's non-blocking progress may answer an ``Iprobe`` with "nothing" while messages sit in
its shared-memory queues. A poll that stopped at the first miss fell behind its peers for the
whole run (at 12 replicas on MNIST the applied updates grew seconds old and the model ended
at chance). Here the senders' messages have all left (their sends completed) before the
receiver polls once; the receiver learns that through files, not MPI, so that no other MPI
call moves the messages along first.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcps.compress import codec as compress
from hpcps.mpi.comm import wait_all
from hpcps.strategies.deadreckon.replica import Peers

N_WEIGHTS = 20000
MESSAGES = 30


@pytest.mark.mpi(min_size=2)
def test_one_poll_takes_every_message_that_has_arrived():
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    flags = comm.bcast(tempfile.mkdtemp(prefix="hpcps-peers-") if rank == 0 else None)
    peers = Peers(comm, N_WEIGHTS, timeout=30.0)
    got = None
    try:
        comm.Barrier()
        if rank > 0:
            peers.peers = [0]  # every other rank sends to rank 0 only
            comp = compress.Compressor(N_WEIGHTS, 0.01)
            rng = np.random.default_rng(rank)
            for step in range(1, MESSAGES + 1):
                msg, _ = comp.compress(rng.standard_normal(N_WEIGHTS).astype(np.float32) * 0.01)
                peers.send(msg, step, 1024)
            wait_all([r for reqs, _ in peers.pending for r in reqs], 30.0,
                     "rank 0 to take the sent messages")
            peers.pending.clear()
            open(os.path.join(flags, str(rank)), "w").close()
        else:
            deadline = time.monotonic() + 30.0
            while len(os.listdir(flags)) < size - 1:
                missing = sorted(set(range(1, size)) - {int(f) for f in os.listdir(flags)})
                assert time.monotonic() < deadline, f"ranks {missing} never finished sending"
                time.sleep(0.01)
            got = peers.poll(lambda words, multiple: None)
        comm.Barrier()
        if rank == 0:
            while peers.poll(lambda words, multiple: None):  # leave nothing behind for other tests
                pass
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(flags, ignore_errors=True)
        comm.Free()
    if rank == 0:
        assert got == MESSAGES * (size - 1), (
            f"one poll took {got} of the {MESSAGES * (size - 1)} messages that had arrived")
