"""The waits of hpcps.mpi.comm on one rank: a bounded poll that names what it waited for, and
a request test that takes a failure for "not done"."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcps.mpi import comm as mpicomm
from hpcps.mpi.comm import PeerTimeout, done, wait_until


def test_wait_until_returns_once_ready():
    t = time.monotonic() + 0.05
    wait_until(lambda: time.monotonic() > t, 5.0, lambda: "nothing")


def test_wait_until_names_what_it_waited_for():
    with pytest.raises(PeerTimeout, match="waited 0 s for server rank 3 to answer"):
        wait_until(lambda: False, 0.05, lambda: "server rank 3 to answer")


def test_an_event_starts_the_timeout_again():
    t0 = time.monotonic()
    fired = []

    def moved() -> bool:  # one event, 0.12 s in
        if not fired and time.monotonic() > t0 + 0.12:
            fired.append(1)
            return True
        return False

    # without the event the 0.2 s timeout ends at t0 + 0.2; with it, at about t0 + 0.32
    wait_until(lambda: time.monotonic() > t0 + 0.26, 0.2, lambda: "x", events=moved)
    assert fired


def test_since_counts_the_timeout_from_an_earlier_start():
    with pytest.raises(PeerTimeout):
        wait_until(lambda: False, 1.0, lambda: "x", since=time.monotonic() - 2.0)


def test_a_null_request_is_done():
    assert done(MPI.REQUEST_NULL) and mpicomm.test(MPI.REQUEST_NULL) is True


def test_a_posted_receive_is_pending_until_its_message_arrives():
    comm = MPI.COMM_SELF.Dup()
    try:
        buf = bytearray(1)
        req = comm.Irecv(buf, source=0, tag=7)
        assert mpicomm.test(req) is False
        comm.Send(b"x", dest=0, tag=7)
        deadline = time.monotonic() + 5
        while not done(req):
            assert time.monotonic() < deadline
        assert bytes(buf) == b"x"
    finally:
        comm.Free()


def test_a_receive_given_up_keeps_its_buffer_until_mpi_is_done_with_it():
    """take_by gives up at its deadline; its buffer stays referenced while the receive is
    still posted (a peer only stopped may send later), and the late message lands in it,
    not in memory freed and reused. Once MPI is done, the next abandon lets it go."""
    net = mpicomm.Transport(MPI.COMM_SELF)
    buf = np.zeros(4)
    assert not net.take_by(buf, 0, 77, time.monotonic() + 0.01)
    assert any(kept is buf for _, kept in mpicomm._GIVEN_UP)
    MPI.COMM_SELF.Send(np.arange(4.0), dest=0, tag=77)  # the late message
    mpicomm.abandon(mpicomm.REQUEST_NULL, None)  # (prunes what has finished)
    assert not any(kept is buf for _, kept in mpicomm._GIVEN_UP)
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
