"""Stalls explain themselves (hpcps.stacks): every rank's stack lands in the run directory and
the error says who waited for whom, what for, and where each rank was.

In-process tests of the mechanism (the watchdog answers a request, a stale request or dump of
another job is ignored, the summary puts the rank not waiting first, a live job answers every
ask), then the issue's check on 4 ranks for downpour and sync: ``--timeout 6 --inject-slow
2:stall``, and ``python -m hpcps.stacks`` asking a running job that goes on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from faultinject import wait_for_step
from mpirun import ROOT, end_launch, mpiexec, tagged_env, train

from hpcps.runtime import stacks
from hpcps.mpi.comm import PeerTimeout


def _dumper(tmp_path, rank=0, size=2, token="job-1"):
    return stacks.StackDumper(tmp_path, rank, size, "replica", token, "testhost")


def _waits_forever(what, started, release):
    """Stands in for comm.wait_all: a frame named wait_all holding ``what``."""
    def wait_all(reqs, timeout, what):
        started.set()
        release.wait(30)
    wait_all.__code__ = wait_all.__code__.replace(co_filename="/x/hpcps/mpi/comm.py")
    wait_all([], 1.0, what)


def test_watchdog_answers_a_request_with_every_thread(tmp_path):
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_waits_forever, name="waiter",
                              args=("the gradient allreduce", started, release))
    worker.start()
    started.wait(5)
    dumper = _dumper(tmp_path, rank=1).start()
    try:
        (tmp_path / "stacks").mkdir(exist_ok=True)
        (tmp_path / "stacks" / "request-job-1").write_text("rank 0 timed out: test\n")
        deadline = time.monotonic() + 10
        while not dumper.written.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        worker.join()
        dumper.stop()
    text = (tmp_path / "stacks" / "rank-1.txt").read_text()
    assert "Thread MainThread" in text and "Thread waiter" in text, text
    assert "hpcps-stack-watchdog" not in text
    d = stacks.read_dump(tmp_path / "stacks" / "rank-1.txt", "job-1")
    # the main thread waits on no peer here, the "waiter" thread does: it is reported
    assert d.rank == 1 and d.waiting == "the gradient allreduce", text
    assert "reason: rank 0 timed out: test" in text


def test_a_request_of_another_job_is_ignored(tmp_path):
    """Ordered by events, not by a sleep: the other job's request is there before the
    watchdog starts, and an ask of this job comes after; the ask is answered, so the watchdog
    has looked at least once while the other job's request lay there, and it did not answer
    that (it answers a request before an ask, and stops after a request)."""
    (tmp_path / "stacks").mkdir(exist_ok=True)
    (tmp_path / "stacks" / "request-job-1").write_text("old\n")
    dumper = _dumper(tmp_path, token="job-2").start()
    try:
        (tmp_path / "stacks" / f"{stacks.ASK}-job-2").write_text("q1\n")
        deadline = time.monotonic() + 60
        while not dumper.path(0).exists():  # an answer to an ask sets no event
            assert time.monotonic() < deadline, "the watchdog answered no ask within 60 s"
            time.sleep(0.05)
        answered = stacks.read_dump(dumper.path(0), "job-2")
        assert answered.reason == f"{stacks.ASKED}q1", answered
        assert not dumper.written.is_set()  # no final dump: the other job's request is not ours
    finally:
        dumper.stop()
    old = _dumper(tmp_path, token="job-1")
    old.write("earlier job")
    assert stacks.read_dump(old.path(0), "job-2") is None
    assert stacks.read_dump(old.path(0), "job-1").rank == 0


def test_the_timed_out_rank_explains_and_the_second_one_defers(tmp_path):
    a, b = _dumper(tmp_path, rank=0), _dumper(tmp_path, rank=1)
    b.write("stalled")  # rank 1 is not waiting on anyone
    try:
        raise PeerTimeout("waited 10 s for the gradient allreduce")
    except PeerTimeout as exc:
        text, defer = a.explain(exc, timeout=10)
        again, later = b.explain(exc, timeout=10)
    assert defer == 0.0 and later > 0, "only the first to time out reports for the job"
    assert "stacks of 2 of 2 ranks" in text
    assert "not waiting on another rank (the likely cause): rank 1" in text
    dump = stacks.read_dump(a.path(0), "job-1")
    assert dump.where.startswith("test_the_timed_out_rank_explains"), dump.where


def test_summary_names_the_missing_ranks(tmp_path):
    a = _dumper(tmp_path, rank=0, size=3)
    try:
        raise PeerTimeout("waited 1 s")
    except PeerTimeout as exc:
        a.write("x", exc)
    dumps = a.collect(0.3)
    text = stacks.summarize(dumps, 3, a.dir, 0.3)
    assert "no stack written within 0 s by rank(s) 1, 2" in text, text


def test_ranks_the_failure_found_gone_are_not_waited_for(tmp_path):
    """A failure that names lost ranks (a dead shard, PeerTimeout's ``lost``) waits for their
    stacks only LOST_GRACE_S past the live ranks' (a dead rank writes none, and the job ends
    that much sooner), and says so; a live rank's stack is still waited for."""
    a, b = _dumper(tmp_path, rank=0, size=3), _dumper(tmp_path, rank=1, size=3)
    b.write("alive")
    started = time.monotonic()
    try:
        raise PeerTimeout("every copy of chunk set 0 is lost", lost=(2, 0))
    except PeerTimeout as exc:
        text, defer = a.explain(exc, timeout=60)  # would wait 30 s for rank 2
    took = time.monotonic() - started
    assert took < stacks.LOST_GRACE_S + stacks.REFRESH_S + 3, took
    assert defer == 0.0 and "stacks of 2 of 3 ranks" in text, text
    assert "no stack written by rank(s) 2, which the run had already lost" in text, text
    assert "no stack written within" not in text, text
    # without the loss named, rank 2 is waited for (and then reported missing)
    assert stacks.summarize(a.collect(0.3), 3, a.dir, 0.3).count("within 0 s by rank(s) 2")


_ENDING_RANK = """
import sys, time
from hpcps.runtime import stacks
me = stacks.StackDumper(sys.argv[1], 1, 3, "server", "tok", "here").start()
if sys.argv[2] == "stop":  # ending on its own once the announcement is out: left to it
    while not me.ending_path().exists():
        time.sleep(0.05)
    me.stop()
time.sleep(stacks.ENDING_GRACE_S + 2 if sys.argv[2] == "stop" else 60)
print("never ended")
"""


@pytest.mark.parametrize("then", ["ended", "stop"])
def test_a_rank_left_running_by_an_abort_ends_with_its_code(tmp_path, then):
    """Where an abort ends only the aborting rank (Open MPI under --enable-recovery), the
    aborting rank's announcement (``stacks/ending-<token>``) ends every other rank's process
    ENDING_GRACE_S later with the same exit code and one line, not after --timeout; the
    announcement of another job is ignored, and a rank ending on its own is left to it."""
    proc = subprocess.Popen([sys.executable, "-c", _ENDING_RANK, str(tmp_path), then],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    time.sleep(0.5)
    other_job = stacks.StackDumper(tmp_path, 0, 3, "replica", "old", "here")
    other_job.announce_end(9)
    time.sleep(stacks.POLL_S + 0.5)
    assert proc.poll() is None
    _dumper(tmp_path, rank=0, size=3, token="tok").announce_end(5)
    started = time.monotonic()
    out, err = proc.communicate(timeout=90)
    took = time.monotonic() - started
    if then == "stop":
        assert proc.returncode == 0 and "never ended" in out and not err, (out, err)
        return
    assert proc.returncode == 5 and "never ended" not in out, (proc.returncode, out, err)
    assert took < stacks.ENDING_GRACE_S + stacks.POLL_S + 3, took
    assert err.strip().splitlines() == [
        "hpcps: rank 1 of 3 on here (server) ends: rank 0 aborted the job (exit code 5) and "
        "MPI left this rank running"], err


@pytest.mark.parametrize("strategy", ["downpour", "sync"])
def test_a_stalled_rank_is_named_with_every_stack(strategy, digits_h5, tmp_path):
    """The issue's check: a stalled rank ends the job at --timeout with every rank's stack in
    the run directory and one error saying who waited for whom and where the stalled one was."""
    run = train(4, "--strategy", strategy, "--data", str(digits_h5), "--layers", "64,32,10",
                "--steps", "400", "--batch-size", "16", "--eval-every", "0",
                "--checkpoint-every", "0", "--timeout", "6", "--inject-slow", "2:stall",
                "--run-dir", str(tmp_path), timeout=90)
    # sync: the chief writes the checkpoint of the last completed step, exit code 75
    assert run.returncode == (75 if strategy == "sync" else 5), run.output
    for r in range(4):
        assert stacks.read_dump(tmp_path / "stacks" / f"rank-{r}.txt") is not None, \
            f"rank {r} wrote no stack\n{run.output}"
    err = run.stderr
    assert err.count("failed: ") == 1, err
    assert "stacks of 4 of 4 ranks" in err, err
    assert "not waiting on another rank (the likely cause): rank 2\n" in err, err
    assert "rank 2 (replica) was at stall (hpcps/strategies/loop.py" in err, err
    waited = {"sync": "was waiting for the gradient allreduce",
              "downpour": "(server) was waiting for a message from 1 replica(s) to finish"}
    assert waited[strategy] in err, err
    if strategy == "sync":
        assert "checkpoint written at step" in err or "the chief (rank 0) writes" in err, err


def test_a_live_job_answers_every_ask_and_a_time_out_still_reports(tmp_path):
    """ask(): rank 0 names the job; each new ask gets every rank's stack (without the
    time-out's mark, so a later time-out still writes its own)."""
    ranks = [_dumper(tmp_path, rank=r, size=2).start() for r in range(2)]
    try:
        assert (tmp_path / "stacks" / "job").read_text().split() == ["job-1", "2"]
        for _ in range(2):
            text, answered, size, ended = stacks.ask(tmp_path, wait_s=10)
            assert (answered, size, ended) == (2, 2, None), text
            assert "stacks of 2 of 2 ranks" in text and "likely cause" not in text, text
            assert "not waiting on another rank: rank 0, rank 1" in text, text
        assert not any(d.written.is_set() for d in ranks)
        (tmp_path / "stacks" / "request-job-1").write_text("rank 0 timed out: test\n")
        deadline = time.monotonic() + 10
        while not ranks[1].written.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "reason: rank 0 timed out" in ranks[1].path(1).read_text()
    finally:
        for d in ranks:
            d.stop()
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(FileNotFoundError, match="does not name a job"):
        stacks.ask(other, wait_s=0.1)


def test_python_m_hpcps_stacks_asks_a_running_job_which_goes_on(digits_h5, tmp_path):
    """The command a user runs on a job that seems stuck: every rank of a running 3-rank
    downpour job answers (its shard, the last rank, waits for the replicas), twice, and the job
    runs on until it is stopped (SIGTERM: exit 75, checkpoint written)."""
    run_dir = tmp_path / "run"
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env, tag = tagged_env(dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=path))
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "hpcps.train", "--data", str(digits_h5),
           "--layers", "64,32,10", "--batch-size", "16", "--steps", "1000000",
           "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "0.2",
           "--timeout", "60", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 200, 90)
        for _ in range(2):
            ask = subprocess.run([sys.executable, "-m", "hpcps.stacks", str(run_dir),
                                  "--wait", "20"], capture_output=True, text=True, env=env,
                                 timeout=60)
            assert ask.returncode == 0, ask.stdout + ask.stderr
            out = ask.stdout
            assert out.startswith("stacks of 3 of 3 ranks"), out
            assert "rank 2 (server) was waiting for a message from" in out, out
            for r in (0, 1):
                assert f"rank {r} (replica)" in out, out
        assert proc.poll() is None, "the job ended when asked"
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    except BaseException:
        end_launch(proc.pid, tag)
        proc.wait()
        raise
    assert proc.returncode == 75, out[-3000:]
    # the job has ended: said at once, not after --wait (10 s by default)
    asked = time.monotonic()
    gone = subprocess.run([sys.executable, "-m", "hpcps.stacks", str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert gone.returncode == 1, gone.stdout + gone.stderr
    assert f"the run in {run_dir} has ended (its summary is written)" in gone.stderr, gone.stderr
    assert time.monotonic() - asked < 8, "waited for the ranks of a job that has ended"


WRITE_UNDER_A_LIMIT = """
import resource, signal, sys
from pathlib import Path
from hpcps.io import runlog
from hpcps.runtime import stacks
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
for write in (runlog.replace_text, stacks._create_once):
    try:
        write(Path(sys.argv[1]) / write.__name__, "x" * 5000)
    except OSError as exc:
        print(exc.strerror)
"""


def test_a_stack_file_the_file_system_refuses_leaves_no_temporary_file(tmp_path):
    """A full disk (a file-size limit here): the writes of the stack directory fail with the
    reason (each caller says it in one line) and leave no half-written temporary file."""
    run = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_LIMIT, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.splitlines() == ["File too large"] * 2, run.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []

