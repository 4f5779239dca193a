"""Ranks that join a running job (--joins J, ``python -m hpcps.join RUN_DIR``): the slots, the
routing, and runs in which launches join as replicas and as spares, a joined spare replaces a
killed replica, a launch too large is refused, and joined replicas go on through a shard's
failover (--ps-copies) while a spare heals it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import mpi_flavor, mpiexec_cmd
from test_faults import ROOT, RUN, Job, output

from hpcps import procfs
from hpcps.errors import ConfigError
from hpcps.mpi.topology import Layout

pytestmark = pytest.mark.skipif(mpi_flavor() != "mpich", reason="joins need MPICH "
                                "(docs/fault-tolerance.md: Open MPI cannot connect two mpiruns)")

LIMIT_S = 120


# -- pure ----------------------------------------------------------------------------------------
def test_joined_ranks_come_after_the_world_as_spares_past_the_jobs_own():
    lay = Layout.plan(6, servers=2, spares=1, joins=3)
    assert (lay.replicas, lay.trainers) == (3, 7)
    # spares 0 (the job's rank 5), then 1-3 for the ranks that join: 6, 7, 8
    assert [lay.spare_rank(k) for k in range(4)] == [5, 6, 7, 8]
    assert [lay.trainer_rank(r) for r in range(7)] == [0, 1, 2, 5, 6, 7, 8]
    assert lay.shard_table == [3, 4, 5]  # a joined rank never becomes a shard
    assert lay.may_die(7) and lay.may_die(5) and not lay.may_die(3)


def test_slots_are_handed_out_in_order_and_refused_past_j_or_once_closed():
    from hpcps.mpi.joins import Slots
    slots = Slots(n_world=4, joins=3)
    assert slots.take(2) == (4, "")
    first, why = slots.take(2)
    assert first is None and "1 slot(s) left" in why and "2 rank(s)" in why
    assert slots.take(1) == (6, "")
    slots.open = False
    assert slots.take(1)[1] == "the run is ending"


@pytest.mark.parametrize("argv, match", [
    (["--joins", "1", "--staleness-bound", "2"], "--joins with --staleness-bound"),
    (["--joins", "1", "--partitions", "2"], "--joins with --partitions > 1"),
    (["--joins", "1", "--model", "embed8:sum,fc8,fc1"], "--joins"),
    (["--joins", "-1"], "joins"),
])
def test_refused_with_what_fixes_the_replicas_at_start(argv, match):
    from hpcps import config
    with pytest.raises(ConfigError, match=match):
        config.parse(["--strategy", "downpour", *argv])


def test_joins_bring_heartbeats():
    from hpcps import config
    cfg = config.parse(["--joins", "2"])
    assert cfg.heartbeat_timeout == 10.0 and cfg.joins == 2


def test_a_run_dir_that_cannot_be_joined_is_named_at_once(tmp_path):
    from hpcps.mpi.joins import not_joinable
    assert "is not a directory" in not_joinable(tmp_path / "nowhere")
    assert not_joinable(tmp_path) is None  # a job starting: its port is waited for
    start = {"kind": "start", "config": {"strategy": "downpour", "joins": 0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    assert "started without --joins" in not_joinable(tmp_path)
    start["config"]["joins"] = 2  # the newest run (a resumed one) is the one that counts
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(start) + "\n")
    assert not_joinable(tmp_path) is None
    for end in ("summary", "stop"):  # a run that ended, then one resumed from it
        with open(tmp_path / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"kind": "progress"}) + "\n" + json.dumps({"kind": end}) + "\n")
        assert f"has ended (its {end} is written)" in not_joinable(tmp_path)
        with open(tmp_path / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(start) + "\n")
        assert not_joinable(tmp_path) is None


def test_a_launch_stops_waiting_for_a_listener_that_closed_its_port(tmp_path):
    """A launch that waits for a port, or for its request to be claimed, gives up as soon as
    the run is seen ending (the listener's port file gone), not after its timeout."""
    import threading
    from hpcps.mpi import joins
    port = tmp_path / "port-0"
    port.write_text(json.dumps({"port": "x", "id": joins.identity()}))
    threading.Timer(0.3, port.unlink).start()
    t0 = time.monotonic()
    gone = lambda: joins._stopped(port, joins.identity())  # noqa: E731
    assert not joins._claimed(tmp_path / "r.to-0", 30.0, gone)
    assert time.monotonic() - t0 < 3 and not (tmp_path / "r.to-0").exists()
    assert "closed its port" in joins._stopped(port, joins.identity())
    t0 = time.monotonic()
    why = joins._wait_port(tmp_path, 1, 30.0, lambda: "the run has ended")
    assert why == "the run has ended" and time.monotonic() - t0 < 3
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = {"host": joins.HOST, "pid": dead.pid, "start": procfs.stat(dead.pid).start}
    dead.wait()
    port.write_text("{}")
    assert f"pid {dead.pid}) has ended" in joins._stopped(port, ident)
    assert joins._stopped(port, joins.identity()) is None  # alive, listening


class _Inter:
    """An intercommunicator stand-in that records the calls made on it."""

    def __init__(self):
        self.calls = []

    def Get_remote_size(self):
        return 1

    def Send(self, buf, dest, tag):
        self.calls.append(("Send", dest, tag))

    def Recv(self, buf, source, tag, status=None):
        self.calls.append(("Recv", source, tag))


def test_a_send_to_a_gone_peer_on_this_host_is_dropped_and_its_messages_still_taken():
    """A joined peer whose process has ended gets no more sends (one through UCX would end
    the sender), but what it sent before dying is still received; a live peer, and one on
    another host, get every send."""
    from hpcps.mpi import joins
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = {"host": joins.HOST, "pid": dead.pid, "start": procfs.stat(dead.pid).start}
    comm = joins.RoutedComm(None, 5, 2, 4)
    inters = {rank: _Inter() for rank in (2, 3, 4)}
    for rank, inter in inters.items():
        comm.add(inter, rank)
    comm.watch(2, ident)
    comm.watch(3, joins.identity())
    comm.watch(4, dict(ident, host="elsewhere"))
    assert not joins.is_gone(os.getpid(), joins.identity()["start"])
    dead.wait()
    assert joins.is_gone(dead.pid, ident["start"])
    assert joins.is_gone(os.getpid(), ident["start"] + 1)  # a reused pid is not the peer
    for rank in (2, 3, 4):
        comm.Send(b"x", rank, 7)
        comm.Recv(bytearray(1), rank, 8)
    assert inters[2].calls == [("Recv", 0, 8)]
    assert inters[3].calls == inters[4].calls == [("Send", 0, 7), ("Recv", 0, 8)]


def test_a_launch_ready_after_the_chief_ended_its_training_is_sent_away(monkeypatch):
    """A launch that says JOIN_READY once the chief has sent its DONE (the shards may have
    ended) leaves at once (RELEASE), even when the job had no idle spare to release; made a
    replica, it would wait for parameters nobody serves and fail after --timeout."""
    from hpcps.mpi.protocol import Tag
    from hpcps.ps import spares
    pool = spares.SparePool(object(), Layout.plan(3, servers=1, joins=1), timeout=0)
    sent = []
    monkeypatch.setattr(pool, "_send", lambda buf, dest, tag: sent.append((dest, tag)))
    monkeypatch.setattr(pool, "_assign", lambda *a: pytest.fail(f"assigned: {a}"))
    pool.release()  # the chief's training is over; no spare was idle
    pool._joined({"first": 3, "n": 1, "want": "replica"})
    assert sent == [(3, Tag.RELEASE)]
    assert pool.joins[0]["wants"] == "released" and pool.figures()["spares_idle_at_end"] == 0


def test_two_threads_finding_the_same_peer_gone_both_drop_their_sends(monkeypatch):
    """The heartbeat thread and the main thread may find one dead peer at once: each drops
    its send (a KeyError here once ended a joined replica with a traceback)."""
    from hpcps.mpi import joins
    comm = joins.RoutedComm(None, 5, 2, 4)
    inter = _Inter()
    comm.add(inter, 2)
    comm.watch(2, {"host": joins.HOST, "pid": 1, "start": 0})

    def gone_and_found_by_the_other_thread(pid, start):
        comm._local.pop(2, None)  # the other thread got there between the look and the drop
        return True
    monkeypatch.setattr(joins, "is_gone", gone_and_found_by_the_other_thread)
    comm.Send(b"x", 2, 7)
    assert comm.Isend(b"x", 2, 7) == joins.MPI.REQUEST_NULL and inter.calls == []


def test_join_help_needs_no_mpi():
    from test_plugin_strategy import BLOCK_MPI, python
    run = BLOCK_MPI + "import runpy; sys.argv = ['hpcps.join', *sys.argv[1:]]\n" \
        "runpy.run_module('hpcps.join', run_name='__main__')\n"
    helped = python(run, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--as" in helped.stdout and "RUN_DIR" in helped.stdout.upper()


def test_a_join_to_no_job_fails_in_one_line(tmp_path):
    out = subprocess.run([*mpiexec_cmd(1), sys.executable, "-m", "hpcps.join",
                          str(tmp_path / "nowhere")], capture_output=True, text=True,
                         timeout=LIMIT_S, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2, out
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert lines == [f"hpcps.join: {tmp_path / 'nowhere'} is not a directory: give the "
                     "running job's run directory (its --run-dir)"], out.stderr


# -- runs ----------------------------------------------------------------------------------------
def test_a_request_whose_launch_died_before_connecting_is_not_accepted(mnist_h5, tmp_path):
    """A launch that dies (SIGKILL: nothing defers it) after asking the chief for a
    connection: the chief claims the request, sees that its process is gone, and does not
    accept (MPI_Comm_accept has no timeout: it would wait for good, and the run with it).
    The job goes on and ends with exit code 0."""
    from hpcps.mpi import joins
    with Job(tmp_path / "run", mnist_h5, n=3, extra=["--steps", "3000", "--joins", "1"],
             what="a run asked for a connection by a dead launch") as job:
        job.at_step(200)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        ident = {"host": joins.HOST, "pid": dead.pid, "start": procfs.stat(dead.pid).start}
        dead.wait()
        request = joins.join_dir(job.run_dir) / "abc123.to-0"
        request.write_text(json.dumps(ident))
        deadline = time.monotonic() + 30
        while request.exists():  # claimed (renamed) within a look or two
            assert time.monotonic() < deadline, "the chief did not claim the request"
            time.sleep(0.05)
    assert job.proc.returncode == 0, job.report()
    assert not list(joins.join_dir(job.run_dir).glob("abc123.*")), "the claim was kept"


def test_a_launch_signalled_while_it_connects_connects_then_leaves(mnist_h5, tmp_path):
    """SIGTERM reaches the joining rank while it asks the chief for a connection (its
    request file is there): the launch holds it, connects to every listener, then leaves
    with exit code 143 and one line; no listener is left waiting in an accept, and the job
    goes on to exit code 0 (it takes the rank for lost, as any dead replica)."""
    from hpcps.mpi import joins
    with Job(tmp_path / "run", mnist_h5, n=3, extra=["--steps", "5000", "--joins", "1"],
             what="a run joined by a launch signalled while it connects") as job:
        job.at_step(200)
        newcomer = job.join(1, "replica")
        deadline = time.monotonic() + 60
        while not list(joins.join_dir(job.run_dir).glob("*.to-*")):
            assert newcomer.poll() is None and time.monotonic() < deadline, job.report()
            time.sleep(0.002)
        job.signal(0, signal.SIGTERM, launch=newcomer)
        out = output(newcomer, LIMIT_S)
    assert job.proc.returncode == 0, job.report()
    assert newcomer.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM while joining: connected, leaving now" in out, out[-3000:]


def test_launches_join_as_replica_and_spare_and_the_spare_replaces_a_killed_replica(
        mnist_h5, tmp_path):
    """1 shard and 2 replicas (3 ranks), --joins 3. One rank joins and trains at once (rank
    3, replica 2, data shard 0); one joins idle (rank 4, spare 1); replica 1 is SIGKILLed and
    the joined spare takes its data shard; a launch of 2 ranks finds 1 slot left and is
    refused in one line. Then rank 0 alone gets SIGTERM: it stops the run, and the joined
    replicas, which got no signal, end when the shards tell them; the job ends with 75 and
    its checkpoint, the joins with 0."""
    with Job(tmp_path / "run", mnist_h5, n=3, extra=["--steps", "20000", "--joins", "3"],
             what="a run joined by 2 launches") as job:
        job.at_step(1000)
        first = job.join(1, "replica")
        job.wait("join", 1, "a launch --as replica")
        second = job.join(1, "spare")
        job.wait("join", 2, "a launch --as spare")
        job.signal(1)
        job.wait("replacement", 1, "the joined spare replacing replica 1")
        big = job.join(2, "replica")
        out_big = output(big, LIMIT_S)
        job.signal(0, signal.SIGTERM)
    out, outs = job.out, [job.outs[first], job.outs[second]]
    assert job.proc.returncode == 75, out[-3000:]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert big.returncode == 2, out_big
    assert "1 slot(s) left, the launch has 2 rank(s)" in out_big
    assert "trained" in outs[0] and "as replica 2 on data shard 0" in outs[0]
    s = job.summary
    joins = {j["rank"]: j for j in s["joins"]}
    assert sorted(joins) == [3, 4]
    assert joins[3]["as_replica"] == 2 and joins[3]["data_shard"] == 0
    assert joins[3]["training_after_s"] is not None and joins[3]["training_after_s"] < 10
    assert joins[4]["wants"] == "spare"
    (rep,) = s["replacements"]
    assert (rep["replica"], rep["spare"], rep["spare_rank"], rep["data_shard"]) == (1, 1, 4, 1)
    # back in training within seconds of the death's detection, not after a timeout (30 s):
    # 2.5 s measured with another test process beside this one on 2 cores (2026-11-29)
    assert rep["training_again_s"] is not None and rep["training_again_s"] < 5.0, rep
    assert "trained" in outs[1] and "as replica 3 on data shard 1" in outs[1]
    assert s["test_accuracy"] > 0.9
    assert s["stopped_early"] and s["lost_ranks"] == [1] and s["step"] < 20000, s
    assert "rank 3 joined the run as spare 0: replica 2 on data shard 0" in out


@pytest.mark.parametrize("join_first", [True, False], ids=["join-then-kill", "kill-then-join"])
def test_joined_replica_goes_on_through_a_shard_failover_healed_by_a_spare(mnist_h5, tmp_path,
                                                                          join_first):
    """2 replicas, 2 shards holding 2 copies of each set and 1 spare (5 ranks), --joins 1: a
    rank joins as a replica (rank 5) and shard 1 (rank 3) is SIGKILLed, the join first or
    the death first (the launch then joins during the failover, perhaps before rank 0 knows:
    it does not connect to the dead shard). The spare becomes shard 2 and takes a copy of the
    dead one's sets while the joined replica trains on. Every set ends with 2 copies,
    committed = applied, the joined replica's pushes counted."""
    # 12,000 steps: a launch that joins before rank 0 knows of the death once waited up to 10 s
    # for the dead shard's connection before it trained, and 8,000 let the job end first (1
    # CI run); it now sees the shard's process gone, and the margin stays
    with Job(tmp_path / "run", mnist_h5, n=5,
             extra=["--steps", "12000", "--servers", "2", "--ps-copies", "2", "--spares", "1",
                    "--joins", "1"], what="a run with a join and a shard's death") as job:
        job.at_step(1000)
        if not join_first:
            job.signal(3)
        newcomer = job.join(1, "replica")
        job.wait("join", 1, "a launch --as replica")
        if join_first:
            time.sleep(1.0)
            job.signal(3)
        job.wait("replacement", 1, "the spare healing shard 1")
    assert job.proc.returncode == 0, job.out[-3000:]
    assert newcomer.returncode == 0, job.outs[newcomer]
    s = job.summary
    assert s["joins"][0]["as_replica"] == 3  # R + K + 0
    assert s["joins"][0]["unreached"] in ([], [3])  # the dead shard, if its death was not known
    assert s["sets_with_c_copies_at_end"] == 2
    assert s["committed_equals_applied"], s
    assert "trained" in job.outs[newcomer]


def test_a_spare_that_joined_after_a_failover_replaces_a_replica(mnist_h5, tmp_path):
    """3 replicas, 3 shards holding 2 copies of each set, 1 spare (7 ranks), --joins 1. Shard
    0 (rank 3) is SIGKILLed: its sets fail over and the spare (rank 6) takes a copy of them.
    Then a rank joins as a spare (rank 7), after the NEW_PRIMARY messages went out, and
    replica 1 is SIGKILLed: the joined spare takes its data shard and trains, routed to the
    sets' primaries as they are since the failover (rank 0 hands it its view of them)."""
    with Job(tmp_path / "run", mnist_h5, n=7,
             extra=["--steps", "7000", "--servers", "3", "--ps-copies", "2", "--spares", "1",
                    "--joins", "1"],
             what="a run with a failover, a join and a replica's death") as job:
        job.at_step(1000)
        job.signal(3)
        job.wait("replacement", 1, "the spare healing shard 0")
        newcomer = job.join(1, "spare")
        job.wait("join", 1, "a launch --as spare")
        job.signal(1)
        job.wait("replacement", 2, "the joined spare replacing replica 1")
    assert job.proc.returncode == 0, job.out[-3000:]
    assert newcomer.returncode == 0, job.outs[newcomer]
    s = job.summary
    rep = next(r for r in s["replacements"] if r["replica"] == 1)
    assert rep["spare_rank"] == 7 and rep["training_again_s"] is not None, rep
    assert "trained" in job.outs[newcomer], job.outs[newcomer]
    assert s["sets_with_c_copies_at_end"] == 3 and s["committed_equals_applied"], s


def test_joined_replicas_killed_while_their_pushes_are_read_do_not_abort_the_shard(mnist_h5,
                                                                                    tmp_path):
    """1 shard and 1 replica (2 ranks), a wide model (3.2 MB pushes, sent by rendezvous), and
    4 launches that join as replicas, each SIGKILLed while it pushes. Between two launches
    MPICH sends through UCX: its copy from a dead sender's memory (CMA) aborts the reader,
    and a send to a dead peer segfaults the sender. hpcps keeps UCX off CMA (``hpcps.mpi``)
    and drops sends to a joined peer whose process is gone (``RoutedComm``), so the shard
    outlives every death and the job ends with code 0 (without both: lost in 3 runs of 5)."""
    wide = [x if x != "784,64,10" else "784,1024,10" for x in RUN]
    with Job(tmp_path / "run", mnist_h5, n=2, run=wide, extra=["--steps", "3500", "--joins", "4"],
             what="a run whose joined replicas are killed") as job:
        job.at_step(200)
        for j in range(4):
            newcomer = job.join(1, "replica")
            job.wait("join", j + 1, "a launch --as replica")
            time.sleep(1.5)
            job.signal(0, launch=newcomer)
    assert job.proc.returncode == 0, job.report()
    assert "Aborted" not in job.out and "process_vm_readv" not in job.out, job.report()
    assert len(job.summary["joins"]) == 4


def test_a_joined_spare_that_replaced_a_dead_replica_is_not_called_idle():
    """A rank that joined idle (--as spare) and later took a dead replica's data shard: its
    join line says so (it said "idle until the end" while the replacement line and the join
    launch said it trained); one that joined and stayed idle is still idle."""
    from hpcps.strategies.downpour.summary import _spare_figures, join_line
    replaced = {"replica": 2, "rank": 2, "how": "lost", "data_shard": 2, "detected_at": 10.0,
                "silent_s": 1.0, "detected_by_shard": 0, "spare": 1, "spare_rank": 5,
                "as_replica": 4, "assigned_at": 10.1, "first_step_at": 10.5}

    def join(rank, spare):
        return {"rank": rank, "join": spare, "spare": spare, "wants": "spare", "at": 5.0,
                "unreached": [], "as_replica": None, "data_shard": None, "assigned_at": None,
                "first_step_at": None}

    chief = {"replacements": [replaced], "joins": [join(5, 1), join(6, 2)], "spares": 0,
             "spares_idle_at_end": 1}
    f = _spare_figures([chief, {}, {}, {}, {}, {}, {}])
    lines = [join_line(j) for j in f["joins"]]
    assert "rank 5 joined the run as spare 1: replica 4 on data shard 2, in dead replica 2's " \
        "place" in lines, lines
    assert "rank 6 joined the run as spare 2, idle until the end" in lines, lines
