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


class _Clock:
    """The clock of hpcps.mpi.comm's waits, moved only by the test: what a wait decides then
    depends on the polls, not on how long a loaded machine took between them."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_event_starts_the_timeout_again(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(mpicomm, "time", clock)
    fired = []

    def ready() -> bool:  # each poll takes 10 ms; ready 0.26 s in
        clock.now += 0.01
        return clock.now > 0.26

    def moved() -> bool:  # one event, 0.12 s in
        if not fired and clock.now > 0.12:
            fired.append(clock.now)
            return True
        return False

    # with the event the 0.2 s timeout starts again at 0.12 s and ends at about 0.32 s
    wait_until(ready, 0.2, lambda: "x", events=moved)
    assert fired
    clock.now = 0.0  # without it, it ends at 0.2 s, before the wait is ready
    with pytest.raises(PeerTimeout):
        wait_until(ready, 0.2, lambda: "x", events=lambda: False)


def test_since_counts_the_timeout_from_an_earlier_start():
    with pytest.raises(PeerTimeout):
        wait_until(lambda: False, 1.0, lambda: "x", since=time.monotonic() - 2.0)


def _sleeps(monkeypatch) -> list:
    """Every time.sleep the waits of hpcps.mpi.comm call from now on (they still sleep)."""
    calls: list = []
    real = time.sleep

    def counted(s):
        calls.append(s)
        real(s)
    monkeypatch.setattr(mpicomm.time, "sleep", counted)
    return calls


def _after(calls: int):
    """A predicate that turns true on its ``calls``-th call: counts polls, not time (a loaded
    machine may take longer than any fixed time to yield 200 times)."""
    n = [0]

    def ready() -> bool:
        n[0] += 1
        return n[0] >= calls
    return ready


def test_a_wait_with_a_spin_never_sleeps_within_it_and_backs_off_after(monkeypatch):
    slept = _sleeps(monkeypatch)
    wait_until(_after(300), 60.0, lambda: "x", spin_s=60.0)  # 300 polls within the spin
    assert slept == []
    wait_until(_after(300), 60.0, lambda: "x")  # no spin: 200 idle rounds of yields, then sleeps
    assert len(slept) == 300 - 200


def test_ranks_with_a_core_each_spin_while_waiting_for_replies(monkeypatch):
    monkeypatch.setattr(mpicomm, "host", lambda: "n1")
    monkeypatch.setattr(mpicomm, "_reply_spin_s", 0.0)  # restored after the test
    # two ranks bound to a core each, a third on another host
    assert mpicomm.dedicate([("n1", (0,)), ("n1", (1,)), ("n2", (0,))])
    assert mpicomm.reply_spin_s() == mpicomm.SPIN_S > 0
    # unbound, two ranks on two cores; with two threads each they would share them
    assert mpicomm.dedicate([("n1", (0, 1)), ("n1", (0, 1))])
    assert not mpicomm.dedicate([("n1", (0, 1)), ("n1", (0, 1))], threads=2)
    assert mpicomm.reply_spin_s() == 0.0
    # three ranks on two cores; two ranks bound to the same core
    assert not mpicomm.dedicate([("n1", (0, 1))] * 3)
    assert not mpicomm.dedicate([("n1", (3,)), ("n1", (3,))])
    assert mpicomm.dedicate([("n1", (3,))])


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


class _DyingSender:
    """A communicator on which one message from rank 1 was probed, but ULFM reports rank 1
    dead when it is taken (Open MPI fails such a receive), and nothing else comes."""

    def __init__(self):
        self.queue = [(1, 9)]
        self.acked = 0

    def Iprobe(self, source, tag, status):
        if not self.queue:
            return False
        status.Set_source(self.queue[0][0])
        status.Set_tag(self.queue[0][1])
        return True

    def Recv(self, buf, source, tag):
        self.queue.pop(0)  # ULFM purges a dead sender's messages
        raise MPI.Exception(MPI.ERR_OTHER)

    def Ack_failed(self):
        self.acked += 1


def test_a_message_whose_sender_died_before_it_was_taken_is_dropped(monkeypatch):
    """The serving loop drops a probed message that ULFM says cannot be taken (its sender
    died meanwhile) and goes on serving, where it used to end the rank with the error; a
    loop outside it sees ``taken`` False."""
    from hpcps.ps.serve import serve
    monkeypatch.setattr(mpicomm, "PEER_FAILURE", frozenset({MPI.ERR_OTHER}))
    fake = _DyingSender()
    handled, ticks = [], []

    def on_nine(src, status):
        mpicomm.Transport(fake).take(bytearray(8), src, 9)
        handled.append(src)  # never reached: the take raised
        return True

    def tick():
        ticks.append(1)
        return True

    serve(fake, {9: on_nine}, timeout=5.0, waiting_for=lambda: "nothing", tick=tick)
    assert handled == [] and ticks == [1] and fake.acked == 1
    fake = _DyingSender()
    assert mpicomm.Transport(fake).taken(bytearray(8), 1, 9) is False and fake.acked == 1
    # any other MPI error is raised, not taken for a death
    monkeypatch.setattr(mpicomm, "PEER_FAILURE", frozenset())
    with pytest.raises(MPI.Exception):
        mpicomm.Transport(_DyingSender()).take(bytearray(8), 1, 9)


@pytest.mark.parametrize("how", ["take", "wait"])
def test_a_sender_dead_before_its_large_message_is_copied_is_named(how):
    """MPICH copies a large message on one node from the sender's memory, and fails the
    receive when the sender has died (``process_vm_readv``: no such process). The receiver
    reports the dead rank in one line (exit code 5), where it printed MPI's error stack: a
    downpour shard whose replica was killed (or ran out of memory) mid-push, without
    ``--heartbeat-timeout``. ``tests/scripts/dead_sender.py`` sets the death up."""
    import json

    from mpirun import ROOT, mpi_flavor, run_mpi
    if mpi_flavor() != "mpich":
        pytest.skip("MPICH's copy from the sender's memory (Open MPI moves it otherwise)")
    run = run_mpi(2, [str(ROOT / "tests" / "scripts" / "dead_sender.py"), how], timeout=120,
                  survive_rank_death=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.output[-3000:]
    out = json.loads(lines[-1])
    if how == "take":
        assert out["raised"] == "PeerDied" and out["lost"] == [1], out
        assert out["message"].startswith("rank 1 died while this rank received its PUSH "
                                         "message"), out
    else:
        assert out["raised"] == "PeerFailed", out
        assert out["message"].startswith("rank 1's push: a rank it received from died"), out
    assert out["exit_code"] == 5
