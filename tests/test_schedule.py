"""PortionScheduler: affinity, backup tasks, lost replicas, and a randomized simulation."""
from __future__ import annotations

import heapq
import random

import pytest

from hpcps.strategies.sandblaster.schedule import PortionScheduler


def drain(s, r, now=0.0):
    """Portions ``r`` gets when it computes each one instantly until none is left."""
    got = []
    while (p := s.next_for(r, now)) is not None:
        assert s.completed(r, p, now)
        got.append(p)
    return got


# -- affinity --------------------------------------------------------------------------------

def test_regions_are_balanced_first_ones_larger():
    s = PortionScheduler(10, [7, 8, 9])
    # Regions [0..3], [4..6], [7..9]: each replica starts at the head of its own.
    assert [s.next_for(r, 0.0) for r in (7, 8, 9)] == [0, 4, 7]


def test_single_fast_replica_gets_consecutive_runs_and_steals_from_the_end():
    s = PortionScheduler(12, [0, 1, 2], max_copies=1)
    assert s.next_for(1, 0.0) == 4  # slow replicas hold one portion each
    assert s.next_for(2, 0.0) == 8
    fast = drain(s, 0)
    # Own region in order, then from the end of the richest region (ties: earlier region),
    # so the owners keep 5.. and 9.. at the head of theirs.
    assert fast == [0, 1, 2, 3, 7, 11, 6, 10, 5, 9]
    assert s.completed(1, 4, 1.0) and s.completed(2, 8, 1.0)
    assert s.next_for(1, 1.0) is None


def test_owner_keeps_its_run_while_a_helper_steals():
    s = PortionScheduler(8, [0, 1], max_copies=1)
    seq = {0: [], 1: []}
    for r in [0, 1, 1, 1, 1, 1, 0, 1, 0, 1]:
        p = s.next_for(r, 0.0)
        if p is None:
            continue
        assert s.completed(r, p, 0.0)
        seq[r].append(p)
    # The helper works its way down from the end of region 0; the owner keeps the head.
    assert seq == {0: [0, 1], 1: [4, 5, 6, 7, 3, 2]}


@pytest.mark.parametrize("n,replicas",
                         [(1, [0]), (5, [0, 1, 2]), (2, [0, 1, 2, 3]), (17, [3, 1, 2])])
def test_every_portion_assigned_once_without_backups(n, replicas):
    s = PortionScheduler(n, replicas, max_copies=1)
    rng = random.Random(n)
    got = []
    busy = {}
    while not s.finished:
        r = rng.choice(replicas)
        if r in busy:
            assert s.completed(r, busy.pop(r), 0.0)
            s.flushed(r)
        else:
            p = s.next_for(r, 0.0)
            if p is not None:
                busy[r] = p
                got.append(p)
    assert sorted(got) == list(range(n))
    assert s.stats["assigned"] == n and s.stats["reissued"] == 0
    assert sum(s.stats["completed"].values()) == n


# -- backup tasks ----------------------------------------------------------------------------

def test_idle_fast_replica_gets_copy_of_slow_ones_portion_and_late_result_is_discarded():
    s = PortionScheduler(4, ["fast", "slow"])
    assert s.next_for("slow", 0.0) == 2
    for p in (0, 1, 3):  # its own region, then the slow one's tail
        assert s.next_for("fast", 0.5) == p and s.completed("fast", p, 0.5)
    assert s.next_for("fast", 1.0) == 2   # backup copy of the slow replica's portion
    assert s.stats["reissued"] == 1
    assert s.completed("fast", 2, 2.0)
    assert not s.completed("slow", 2, 9.0)
    assert s.stats["duplicates"] == 1
    assert s.next_for("slow", 9.0) is None
    assert s.flushed("slow") == []
    assert s.flushed("fast") == [0, 1, 2, 3]
    assert s.finished
    assert s.stats["completed"] == {"fast": 4, "slow": 0}


def test_backup_picks_the_portion_handed_out_longest_ago():
    s = PortionScheduler(3, [0, 1, 2, 3])
    assert s.next_for(1, 5.0) == 1
    assert s.next_for(0, 2.0) == 0
    assert s.next_for(2, 3.0) == 2
    assert s.next_for(3, 6.0) == 0  # region 3 is empty, pool is empty: oldest outstanding


def test_max_copies_respected_and_never_a_copy_of_its_own():
    s = PortionScheduler(2, [0, 1, 2, 3], max_copies=2)
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 1.0) == 1
    assert s.next_for(2, 2.0) == 0
    assert s.next_for(3, 3.0) == 1
    # Both portions are at two copies now; a finished replica finds nothing else to copy.
    assert s.completed(2, 0, 4.0)
    assert s.next_for(2, 4.0) is None  # 0 is completed, 1 is at max_copies
    assert not s.completed(0, 0, 5.0)
    assert s.next_for(0, 5.0) is None
    assert s.completed(1, 1, 6.0)
    assert not s.completed(3, 1, 7.0)
    assert s.stats["reissued"] == 2 and s.stats["duplicates"] == 2

    s = PortionScheduler(1, [0, 1])
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 0.0) == 0          # backup
    s = PortionScheduler(1, [0, 1], max_copies=1)
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 0.0) is None       # backups disabled


def test_backup_not_given_to_replica_that_completed_the_portion():
    s = PortionScheduler(2, [0, 1], max_copies=3)
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 0.0) == 1
    assert s.completed(1, 1, 1.0)
    assert s.next_for(1, 1.0) == 0   # copy of 0, not of its own 1
    assert s.completed(1, 0, 2.0)
    assert s.next_for(1, 2.0) is None  # both completed: nothing to copy


# -- lost replicas ---------------------------------------------------------------------------

def test_lost_replica_unflushed_portions_are_redone_by_others():
    s = PortionScheduler(6, [0, 1], max_copies=1)
    for p in (0, 1):
        assert s.next_for(0, 0.0) == p and s.completed(0, p, 0.0)
    assert s.flushed(0) == [0, 1]
    assert s.next_for(0, 1.0) == 2 and s.completed(0, 2, 1.0)
    assert s.next_for(0, 1.0) == 5                       # stolen from replica 1's end
    assert s.pending_flush(0) == [2]
    assert s.lost(0) == [2, 5]                            # unflushed 2 and outstanding 5
    assert s.stats["requeued"] == 2
    with pytest.raises(ValueError, match="lost"):
        s.next_for(0, 2.0)
    with pytest.raises(ValueError, match="lost"):
        s.completed(0, 5, 2.0)
    assert drain(s, 1, 2.0) == [3, 4, 5, 2]
    assert not s.finished
    assert s.flushed(1) == [2, 3, 4, 5]
    assert s.finished


def test_lost_replica_portion_kept_by_backup_copy_is_not_requeued():
    s = PortionScheduler(2, [0, 1, 2])
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 0.0) == 1
    assert s.next_for(2, 0.0) == 0   # backup of 0
    assert s.lost(0) == []           # 0 stays with replica 2
    assert s.completed(1, 1, 1.0)
    assert s.next_for(1, 1.0) == 0   # 0 is down to one copy again: a new backup
    assert s.completed(2, 0, 2.0)
    assert not s.completed(1, 0, 3.0)
    assert s.flushed(2) == [0] and s.flushed(1) == [1]
    assert s.finished and s.stats["requeued"] == 0


def test_lost_replica_accepted_portion_with_copy_in_flight_stays_with_the_copy():
    s = PortionScheduler(2, [0, 1])
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 0.0) == 1
    assert s.completed(0, 0, 1.0)
    assert s.next_for(0, 1.0) == 1  # backup of 1
    # Replica 1 finishes first and dies before flushing, while 0 still computes its copy.
    assert s.completed(1, 1, 2.0)
    assert s.lost(1) == []
    assert s.completed(0, 1, 3.0)   # the copy's result is now the accepted one
    assert s.flushed(0) == [0, 1]
    assert s.finished


def test_lost_replica_outstanding_portion_already_completed_elsewhere_is_not_requeued():
    s = PortionScheduler(1, [0, 1])
    assert s.next_for(0, 0.0) == 0
    assert s.next_for(1, 1.0) == 0
    assert s.completed(1, 0, 2.0)
    assert s.lost(0) == []
    assert s.flushed(1) == [0] and s.finished


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,match", [
    ((0, [0]), "n_portions"),
    ((3, []), "at least one"),
    ((3, [0, 1, 0]), "duplicate"),
    ((3, [0], 0), "max_copies"),
    ((2.5, [0]), "n_portions"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        PortionScheduler(*args)


def test_protocol_errors():
    s = PortionScheduler(4, [0, 1])
    with pytest.raises(ValueError, match="not a replica"):
        s.next_for(5, 0.0)
    assert s.next_for(0, 0.0) == 0
    with pytest.raises(ValueError, match="still computing"):
        s.next_for(0, 0.0)
    with pytest.raises(ValueError, match="not assigned"):
        s.completed(0, 1, 0.0)
    with pytest.raises(ValueError, match="not assigned"):
        s.completed(1, 0, 0.0)
    assert s.completed(0, 0, 0.0)
    with pytest.raises(ValueError, match="not assigned"):
        s.completed(0, 0, 0.0)  # twice
    s.lost(1)
    for call in (lambda: s.lost(1), lambda: s.flushed(1), lambda: s.pending_flush(1)):
        with pytest.raises(ValueError, match="lost"):
            call()


# -- randomized simulation -------------------------------------------------------------------

def simulate(seed):
    """Event-driven run of one batch: random speeds, losses, flush every k completions."""
    rng = random.Random(seed)
    n_rep = rng.randint(1, 5)
    replicas = rng.sample(range(100), n_rep)
    n = rng.randint(1, 40)
    max_copies = rng.randint(1, 3)
    k = rng.randint(1, 4)
    s = PortionScheduler(n, replicas, max_copies=max_copies)
    speed = {r: rng.choice([1.0, 1.0, 3.0, 20.0]) for r in replicas}

    events = []  # (time, seq, kind, replica, portion)
    seq = 0

    def push(t, kind, r, p=None):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, r, p))
        seq += 1

    for r in rng.sample(replicas, rng.randint(0, n_rep - 1)):
        push(rng.uniform(0, 30), "lose", r)

    live, waiting, since_flush = set(replicas), set(), {r: 0 for r in replicas}
    in_flight = {}  # replica -> portion
    final, calls, accepted, accepted_lost, dropped_in_flight = [], 0, 0, 0, 0

    def ask(r, now):
        p = s.next_for(r, now)
        if p is None:
            final.extend(s.flushed(r))  # push what it has before waiting
            since_flush[r] = 0
            waiting.add(r)
            return
        waiting.discard(r)
        in_flight[r] = p
        copies = sum(1 for q in in_flight.values() if q == p)
        assert copies <= max_copies
        push(now + speed[r] * rng.uniform(0.5, 1.5), "done", r, p)

    for r in replicas:
        ask(r, 0.0)
    while events:
        now, _, kind, r, p = heapq.heappop(events)
        if r not in live:
            continue
        if kind == "lose":
            accepted_lost += len(s.pending_flush(r))
            if r in in_flight:
                dropped_in_flight += 1
                del in_flight[r]
            s.lost(r)
            live.discard(r)
            waiting.discard(r)
        else:
            del in_flight[r]
            calls += 1
            if s.completed(r, p, now):
                accepted += 1
                since_flush[r] += 1
                if since_flush[r] == k:
                    final.extend(s.flushed(r))
                    since_flush[r] = 0
            ask(r, now)
        for w in sorted(waiting):
            ask(w, now)

    assert s.finished, (seed, "simulation stalled")
    assert sorted(final) == list(range(n))  # each portion final exactly once
    assert accepted - accepted_lost == n
    assert s.stats["duplicates"] + accepted == calls
    assert sum(s.stats["completed"].values()) == accepted
    assert s.stats["assigned"] == calls + dropped_in_flight
    assert s.stats["reissued"] <= s.stats["assigned"]
    if max_copies == 1:
        assert s.stats["reissued"] == 0 and s.stats["duplicates"] == 0
    return s.stats


@pytest.mark.parametrize("seed", range(300))
def test_random_event_sequences_keep_invariants(seed):
    simulate(seed)


def test_simulation_exercises_backups_and_losses():
    """Guard for the property test: across its seeds, every mechanism actually fires."""
    totals = {"reissued": 0, "duplicates": 0, "requeued": 0}
    for seed in range(300):
        stats = simulate(seed)
        for key in totals:
            totals[key] += stats[key]
    assert all(v > 0 for v in totals.values()), totals
