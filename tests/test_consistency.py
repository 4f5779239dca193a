"""Consistency policies of the gradient shard, alone (no MPI): a stand-in shard records what
the policy applies, the test drives pushes, fetches and DONEs in a chosen order."""
import numpy as np
import pytest

from hpcps.protocol import H, HEADER_SLOTS
from hpcps.ps.consistency import StaleSynchronous


class FakeShard:
    def __init__(self):
        self.applied = []

    def apply_push(self, header, grad):
        self.applied.append(int(header[H.SENDER]))


def push(policy, shard, sender, steps=1):
    h = np.zeros(HEADER_SLOTS)
    h[H.SENDER], h[H.STEPS] = sender, steps
    policy.on_push(shard, sender, h, None)


@pytest.mark.parametrize("bound", [0, 1, 4])
def test_a_replica_may_lead_the_slowest_by_at_most_the_bound(bound):
    p, shard = StaleSynchronous(bound, 3), FakeShard()
    for step in range(bound + 1):
        assert p.may_answer(shard, 0), step
        push(p, shard, 0)
    assert not p.may_answer(shard, 0)            # bound + 1 ahead of replicas 1 and 2
    push(p, shard, 1)
    assert not p.may_answer(shard, 0)            # replica 2 is still the slowest
    push(p, shard, 2)
    assert p.may_answer(shard, 0)                # now exactly bound ahead
    assert shard.applied == [0] * (bound + 1) + [1, 2]  # pushes are never held


def test_a_finished_replica_does_not_hold_the_others():
    p, shard = StaleSynchronous(0, 2), FakeShard()
    push(p, shard, 0)
    assert not p.may_answer(shard, 0)
    p.on_done(shard, 1)
    assert p.may_answer(shard, 0)
    h = np.zeros(HEADER_SLOTS)
    p.on_answer(shard, 0, h)
    assert h[H.CLOCK] == 1 and p.max_lead == 0


def test_warm_start_offsets_and_multi_step_pushes():
    """Replicas 1.. join after replica 0's 10 warm-start steps with 10 on their clocks."""
    p, shard = StaleSynchronous(2, 3, offsets=[0, 10, 10]), FakeShard()
    assert not p.may_answer(shard, 1)            # 10 ahead of replica 0 during its warm start
    push(p, shard, 0, steps=10)
    assert p.may_answer(shard, 1) and p.may_answer(shard, 0)
    push(p, shard, 1, steps=3)                   # a push of 3 steps (--n-push 3 or threads)
    assert not p.may_answer(shard, 1) and p.may_answer(shard, 2)
    h = np.zeros(HEADER_SLOTS)
    p.on_answer(shard, 2, h)
    assert h[H.CLOCK] == 10


def test_negative_bound_is_refused():
    with pytest.raises(ValueError):
        StaleSynchronous(-1, 2)
