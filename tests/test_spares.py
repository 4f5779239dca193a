"""Spare ranks (--spares K, downpour): the layout, a replica that leaves on SIGTERM, killed
replicas and shards replaced or failed over, and a spare that dies before it could take over."""
from __future__ import annotations

import signal
import time

import pytest

from faultinject import records
from test_faults import Job

from hpcps.errors import ConfigError
from hpcps.mpi.topology import Layout

STEPS = ["--steps", "8000"]  # long enough for four failures and their replacements


# -- pure ----------------------------------------------------------------------------------------
def test_layout_puts_spares_last_and_numbers_them_after_the_replicas():
    lay = Layout.plan(8, servers=3, spares=2)
    assert (lay.replicas, lay.spares, lay.trainers) == (3, 2, 5)
    assert [lay.role(r).kind for r in range(8)] == ["replica"] * 3 + ["server"] * 3 + \
        ["spare"] * 2
    assert [lay.role(r).spare for r in (6, 7)] == [0, 1]
    assert [lay.trainer_rank(r) for r in range(5)] == [0, 1, 2, 6, 7]
    assert lay.role(7).may_die and lay.role(0).may_die and not lay.role(3).may_die
    with pytest.raises(ConfigError, match=r"1 spare\(s\)"):
        Layout.plan(2, servers=1, spares=1)


# -- runs ----------------------------------------------------------------------------------------
def _run(tmp_path, mnist_h5, n, args, schedule, steps=STEPS):
    """Launch, then for each (step, rank, signal, records[, pause]) of ``schedule``: wait for
    ``step`` (None: at once), signal that rank, wait until rank 0 has made ``records``
    replacement records (0: not at all; so each failure is handled in turn) and sleep
    ``pause`` seconds; the output and summary."""
    with Job(tmp_path, mnist_h5, n, [*steps, *args], what=f"run with {schedule}") as job:
        for step, rank, sig, handled, *pause in schedule:
            if step is not None:
                job.at_step(step, 120)
            job.signal(rank, sig)
            job.wait("replacement", handled, "the failures handled in turn", 60)
            time.sleep(pause[0] if pause else 0)
    assert job.proc.returncode == 0, job.out[-4000:]
    return job.out, job.summary


def test_leave_shard_deaths_and_a_replacement_that_dies(mnist_h5, tmp_path):
    """3 replicas, 3 shards with 2 copies of each set, 3 spares (ranks 6-8). Rank 1 leaves
    on SIGTERM: spare 0 takes its data shard without waiting for a timeout. Shard 1 (rank 4)
    is SIGKILLed: its sets fail over and spare 1 becomes shard 4, a copy of both. Spare 0, now
    training, is SIGKILLed: spare 2 takes the same data shard. Shard 2 (rank 5) is
    SIGKILLed: set 1 then lives on shard 4 alone (the spare is its primary), which without
    the spare would have lost it. Every set applied exactly the pushes committed, every
    replica's counted, the lost ones' included."""
    out, s = _run(tmp_path, mnist_h5, 9, ["--servers", "3", "--ps-copies", "2", "--spares",
                                          "3"],
                  [(500, 1, signal.SIGTERM, 1), (1500, 4, signal.SIGKILL, 2),
                   (2500, 6, signal.SIGKILL, 3), (3500, 5, signal.SIGKILL, 4)])
    assert s["left_ranks"] == [1], out[-3000:]
    assert s["lost_ranks"] == [4, 5, 6], out[-3000:]
    reps = s["replacements"]
    assert [(r["replica"], r["how"], r["spare"], r["as_replica"], r["data_shard"])
            for r in reps] == [(1, "left", 0, 3, 1), (3, "lost", 2, 5, 1)], reps
    assert all(r["training_again_s"] is not None for r in reps), reps
    assert reps[0]["silent_s"] == 0.0  # a departure is known at once, not after a silence
    healed = s["shard_replacements"]
    assert [(r["shard"], r["spare"], r["as_shard"]) for r in healed] == \
        [(1, 1, 4), (2, None, None)], healed
    assert healed[0]["sets_restored"] == [0, 1] and healed[0]["copies_again_s"] is not None
    # set 0 on shards 0 and 4; sets 1 (shard 4) and 2 (shard 0) on one copy: no spare left
    assert s["copies_at_end"] == {"0": 2, "1": 1, "2": 1}, s["copies_at_end"]
    assert s["sets_with_c_copies_at_end"] == 1
    assert {(t["set"], t["by_shard"]) for t in s["takeovers"]} >= {(1, 4), (2, 0)}, \
        s["takeovers"]
    # each set applied exactly the pushes its copies counted from every replica (the sets may
    # differ by one: a dead replica's last push, whole on one shard and broken off on another)
    assert s["committed_equals_applied"], s
    assert s["pushes_committed_by_set"] == s["ps_applied"]
    assert len(s["pushes_committed_by_replica"]) == 6  # replicas 0-2, then the spares 3-5
    assert s["pushes_acknowledged"] < min(s["ps_applied"])  # rank 6's are not acknowledged
    assert s["spares_idle_at_end"] == 0
    assert s["test_accuracy"] > 0.9, s["test_accuracy"]
    assert "rank(s) [1] left the run on SIGTERM" in out
    assert "spare 2 (rank 8) took data shard 1 as replica 5" in out
    assert "spare 1 (rank 7) became shard 4, holding sets [0, 1]" in out
    assert len(records(tmp_path, "replacement")) == 4


def test_a_spare_dead_while_idle_and_a_replica_dropped_alive(mnist_h5, tmp_path):
    """1 shard, 3 replicas, 2 spares (ranks 4, 5). Spare 0 is SIGKILLed while idle. Replica 2
    is stopped (SIGSTOP) past the heartbeat timeout: the shard loses it, and the chief hands
    its data to spare 0, which never speaks, so the shard loses it too and the chief hands the
    data to spare 1. Replica 2 then continues (SIGCONT): its next fetch is answered DROPPED
    and it leaves instead of waiting. The run completes; the summary names both ranks the
    shard lost, the dropped one, and both replacements."""
    out, s = _run(tmp_path, mnist_h5, 6, ["--spares", "2"],
                  [(300, 4, signal.SIGKILL, 0), (700, 2, signal.SIGSTOP, 1),
                   (700, 2, signal.SIGCONT, 2)],
                  steps=["--steps", "20000"])  # one shard serves fast: two timeouts to outlast
    assert s["lost_ranks"] == [2, 4], out[-3000:]
    assert s["dropped_ranks"] == [2], out[-3000:]
    reps = s["replacements"]
    assert [(r["replica"], r["spare"], r["as_replica"], r["data_shard"]) for r in reps] == \
        [(2, 0, 3, 2), (3, 1, 4, 2)], reps
    assert reps[0]["training_again_s"] is None and reps[1]["training_again_s"] is not None
    assert s["test_accuracy"] > 0.9, s["test_accuracy"]
    assert "spare 0 (rank 4) took data shard 2 as replica 3 and did not start training" in out
    assert "rank(s) [2] were alive but silent past the heartbeat timeout" in out


def test_a_spare_killed_taking_over_and_a_primary_killed_copying_to_the_next(mnist_h5,
                                                                              tmp_path):
    """3 shards holding every set (--ps-copies 3), 2 spares (ranks 6, 7), both stopped
    (SIGSTOP) before they are handed anything, so the copies sent to them stay in flight.
    Shard 0 (rank 3) is SIGKILLed: spare 0 becomes shard 3, and is SIGKILLed while the
    primaries are copying the sets to it. The shards lose it by its silence and spare 1
    becomes shard 4; its first primary, shard 1 (rank 4, primary of sets 0 and 1), is
    SIGKILLed while copying them, and spare 1 continues (SIGCONT). Shard 2 takes sets 0 and
    1 over and copies them to shard 4 itself. The run completes with every set on its two
    live holders, and every set applied exactly the pushes committed."""
    kill, stop, cont = signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT
    args = ["--servers", "3", "--ps-copies", "3", "--spares", "2"]
    out, s = _run(tmp_path, mnist_h5, 8, args, [
        (300, 6, stop, 0), (None, 7, stop, 0),
        (None, 3, kill, 1, 0.5),  # spare 0 handed shard 0's sets; the copies stay in flight
        (None, 6, kill, 2, 0.3),  # spare 0 lost by its silence: spare 1 handed its sets
        (None, 4, kill, 0, 0.5),  # shard 1, copying sets 0 and 1 to the stopped spare
        (None, 7, cont, 0)],      # (within --heartbeat-timeout 2 of its assignment)
        steps=["--steps", "6000"])
    assert s["lost_ranks"] == [3, 4, 6], out[-3000:]
    healed = s["shard_replacements"]
    assert [(r["shard"], r["spare"], r["as_shard"]) for r in healed] == \
        [(0, 0, 3), (3, 1, 4), (1, None, None)], healed
    assert healed[0]["sets_restored"] == [] and healed[0]["copies_again_s"] is None, healed
    assert healed[1]["sets_restored"] == [0, 1, 2], healed
    assert {(t["set"], t["by_shard"]) for t in s["takeovers"]} >= {(0, 2), (1, 2)}, \
        s["takeovers"]
    assert s["copies_at_end"] == {"0": 2, "1": 2, "2": 2}, s["copies_at_end"]
    assert s["committed_equals_applied"], s
    assert s["test_accuracy"] > 0.9, s["test_accuracy"]


def test_a_primary_stopped_past_the_timeout_leaves_when_it_resumes(mnist_h5, tmp_path):
    """2 shards, 2 copies of each set, no spare. Shard 0 (rank 3, primary of set 0) is
    stopped (SIGSTOP) past --heartbeat-timeout: shard 1 takes set 0 over and the replicas
    re-route. Shard 0 then continues (SIGCONT), still holding both sets: the first message it
    sends is answered "you were found dead", and it leaves the run (exit 0, a line saying
    why) instead of serving beside its successor. The run completes, every set applied
    exactly the pushes committed."""
    out, s = _run(tmp_path, mnist_h5, 5, ["--servers", "2", "--ps-copies", "2"],
                  [(300, 3, signal.SIGSTOP, 0, 4.0),  # twice the timeout: set 0 taken over
                   (None, 3, signal.SIGCONT, 0)], steps=["--steps", "6000"])
    assert "found this shard 0 dead" in out and "it leaves the run" in out, out[-3000:]
    assert s["lost_ranks"] == [3], out[-3000:]
    assert [(t["set"], t["by_shard"]) for t in s["takeovers"]] == [(0, 1)], s["takeovers"]
    assert s["committed_equals_applied"], s
    assert s["test_accuracy"] > 0.9, s["test_accuracy"]
