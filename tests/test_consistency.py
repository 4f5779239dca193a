"""Consistency policies of the gradient shard, alone (no MPI): a stand-in shard records what
the policy applies, the test drives pushes, fetches and DONEs in a chosen order."""
import numpy as np
import pytest

from hpcps.mpi.protocol import H, HEADER_SLOTS
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


class OptimShard:
    """A stand-in gradient shard with a real optimizer: version, staleness, accounting."""

    def __init__(self, n, opt, n_replicas=2):
        from hpcps.model import optim
        self.opt = optim.make(*opt)
        self.params = np.linspace(-1, 1, n).astype(np.float32)
        self.state = self.opt.init_state(n)
        self.apply = self.opt.apply
        self.version = 0
        self.pushes = 0
        self.done, self.n_replicas = set(), n_replicas

    def staleness(self, h):
        return self.version - h[H.VERSION]

    def apply_update(self, grad):
        if grad is not None:
            self.opt.apply(self.params, grad, self.state)
        self.version += 1

    def account(self, h, stale):
        self.pushes += 1

    def apply_push(self, h, grad):
        stale = self.staleness(h)
        self.apply_update(grad)
        self.account(h, stale)


def header(version=0, sender=0):
    h = np.zeros(HEADER_SLOTS)
    h[H.VERSION], h[H.SENDER], h[H.STEPS] = version, sender, 1
    return h


@pytest.mark.parametrize("opt", [("sgd", 0.1), ("adagrad", 0.1)])
def test_softsync_of_one_without_scaling_is_downpours_rule(opt):
    from hpcps.ps.consistency import SoftSync
    from hpcps.ps.gradient_shard import ShardPolicy
    rng = np.random.default_rng(4)
    a, b = OptimShard(50, opt), OptimShard(50, opt)
    soft, now = SoftSync(50, 1, False), ShardPolicy()
    for i in range(6):
        g = rng.standard_normal(50).astype(np.float32)
        soft.on_push(a, i % 2, header(version=max(0, i - 2)), g)
        now.on_push(b, i % 2, header(version=max(0, i - 2)), g)
    np.testing.assert_array_equal(a.params, b.params)
    assert a.version == b.version == 6 and a.pushes == 6


def test_staleness_scaling_gives_lr_over_tau():
    from hpcps.ps.consistency import SoftSync
    shard = OptimShard(8, ("sgd", 0.5))
    shard.version = 4                       # 4 updates since the sender fetched: tau = 4
    w0, g = shard.params.copy(), np.ones(8, np.float32)
    SoftSync(8, 1, staleness_lr=True).on_push(shard, 0, header(version=0), g)
    np.testing.assert_allclose(shard.params, w0 - 0.5 / 4 * g, rtol=1e-6)
    fresh = OptimShard(8, ("sgd", 0.5))     # tau = 0 counts as 1: the full step
    SoftSync(8, 1, staleness_lr=True).on_push(fresh, 0, header(version=0), g)
    np.testing.assert_allclose(fresh.params, w0 - 0.5 * g, rtol=1e-6)
    assert shard.version == 5 and fresh.version == 1  # each push is one update


def test_staleness_scales_adagrads_rate_not_its_accumulator():
    """Adagrad at tau = 4: the step is lr / 4 * g / sqrt(g^2), and the sum of squares takes
    g^2 as it is (a scaled gradient would put g^2 / 16 there, and every later step would be
    up to 4x too large)."""
    from hpcps.ps.consistency import SoftSync
    shard = OptimShard(8, ("adagrad", 0.2))
    shard.version = 4
    w0, g = shard.params.copy(), np.linspace(0.5, 2.0, 8).astype(np.float32)
    SoftSync(8, 1, staleness_lr=True).on_push(shard, 0, header(version=0), g)
    np.testing.assert_allclose(shard.params, w0 - 0.2 / 4 * np.sign(g), rtol=1e-5)
    np.testing.assert_allclose(shard.state["accum"], g * g, rtol=1e-6)


def test_a_softsync_group_takes_the_rate_of_its_mean_staleness():
    """Two pushes of staleness 2 and 6: their mean gradient at lr / 4."""
    from hpcps.ps.consistency import SoftSync
    shard = OptimShard(4, ("sgd", 1.0))
    shard.version = 6
    w0 = shard.params.copy()
    policy = SoftSync(4, 2, staleness_lr=True)
    policy.on_push(shard, 0, header(version=4), np.full(4, 2.0, np.float32))   # tau 2
    policy.on_push(shard, 1, header(version=0), np.full(4, 6.0, np.float32))   # tau 6
    np.testing.assert_allclose(shard.params, w0 - 4.0 / 4)


def test_softsync_applies_the_mean_of_each_group_and_flushes_the_rest():
    from hpcps.ps.consistency import SoftSync
    shard = OptimShard(4, ("sgd", 1.0), n_replicas=2)
    policy = SoftSync(4, 3, staleness_lr=False)
    w0 = shard.params.copy()
    grads = [np.full(4, v, np.float32) for v in (1.0, 2.0, 6.0, 4.0)]
    for g in grads[:2]:
        policy.on_push(shard, 0, header(), g)
    assert shard.version == 0 and np.array_equal(shard.params, w0)   # still collecting
    policy.on_push(shard, 1, header(), grads[2])
    assert shard.version == 1
    np.testing.assert_allclose(shard.params, w0 - 3.0)                # mean of 1, 2, 6
    policy.on_push(shard, 1, header(), grads[3])
    shard.done = {0, 1}
    policy.on_done(shard, 1)                                         # the last replica ends
    np.testing.assert_allclose(shard.params, w0 - 7.0)                # + the lone 4
    assert (policy.updates, policy.combined, shard.pushes) == (2, 4, 4)


def test_staleness_histogram_bins():
    from hpcps.ps.gradient_shard import STALENESS_BINS, staleness_bin
    assert [staleness_bin(s) for s in (0, 1, 2, 3, 4, 7, 8, 255, 256, 10**6)] == \
        [0, 1, 2, 2, 3, 3, 4, 8, 9, STALENESS_BINS - 1]


# -- copies of a replicated set (--ps-copies): the same policy on the same pushes -------------
def _copy(policy, n=8):
    """A gradient shard (no MPI: its serving loop is not used) running Adagrad under
    ``policy`` wrapped as a replicated set's policy."""
    from hpcps.model import optim
    from hpcps.ps.gradient_shard import GradientShard
    from hpcps.ps.replicated import SetPolicy
    opt = optim.make("adagrad", 0.1)
    state = {k: np.zeros(n, dtype=np.float32) for k in opt.state_keys}
    params = np.linspace(-1, 1, n).astype(np.float32)
    return GradientShard(None, params, state, opt.apply, n_replicas=3,
                         policy=SetPolicy(5, policy))


def _pushes(n=8, count=11, seed=0):
    """(sender, header, gradient) of pushes with staleness 0-3."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        h = np.zeros(HEADER_SLOTS)
        h[H.SENDER], h[H.STEPS], h[H.LOSS_SUM] = i % 3, 1, 0.5
        h[H.VERSION] = max(0, i // 2 - int(rng.integers(0, 4)))
        out.append((i % 3, h, rng.standard_normal(n).astype(np.float32)))
    return out


def _feed(shard, pushes):
    for sender, h, g in pushes:
        shard.policy.on_push(shard, sender, h.copy(), g.copy())


@pytest.mark.parametrize("group,rates", [(2, False), (3, True), (1, True)],
                         ids=["softsync2", "softsync3-staleness-lr", "staleness-lr"])
def test_copies_that_run_softsync_on_the_same_pushes_stay_equal(group, rates):
    """State-machine replication: two copies fed the same pushes in the same order hold the
    same parameters, optimizer state, version and buffer, bit for bit; a third copy that
    takes the first's state (parameters and the policy's snapshot, as SET_STATE carries it)
    half-way, mid-group, ends equal too; the end-of-run flush (on the primary as the set
    closes) leaves equal copies; and DONEs reaching a copy do not flush it (they reach copies
    at different points of the push order)."""
    from hpcps.ps.consistency import SoftSync
    pushes = _pushes()
    a, b, c = (_copy(SoftSync(8, group, rates)) for _ in range(3))
    _feed(a, pushes)
    _feed(b, pushes[:5])
    for r in range(3):  # every replica done, as this copy hears it: nothing is applied
        b.policy.on_done(b, r)
    _feed(b, pushes[5:])
    _feed(c, pushes[:8])  # c ran ahead (a push the old primary forwarded to it alone) ...
    ref = _copy(SoftSync(8, group, rates))
    _feed(ref, pushes[:7])
    c.params[:] = ref.params  # ... and takes the new primary's state after 7 pushes
    for k in c.state:
        c.state[k][:] = ref.state[k]
    c.version, c.step = ref.version, ref.step
    c.policy.restore(ref.policy.snapshot())
    _feed(c, pushes[7:])
    for x in (a, b, c):
        x.policy.on_end(x)
    for x in (b, c):
        assert x.version == a.version and x.step == a.step
        assert np.array_equal(x.params, a.params)
        for k in a.state:
            assert np.array_equal(x.state[k], a.state[k])
        assert np.array_equal(x.policy.snapshot(), a.policy.snapshot())
    assert a.policy.inner.count == 0 and a.policy.inner.combined == len(pushes)
    header = np.zeros(HEADER_SLOTS)
    a.policy.on_answer(a, 0, header)
    assert header[H.SET] == 5


def test_copies_that_run_ssp_on_the_same_pushes_hold_the_same_clocks():
    """SSP under copies: the clocks advance in on_push, which every copy runs in the
    primary's order, so a copy that took another's snapshot half-way (SET_STATE), after
    running ahead, holds and releases the same fetches as the copy it replaced."""
    pushes = _pushes(count=9)
    a, c = _copy(StaleSynchronous(1, 3)), _copy(StaleSynchronous(1, 3))
    _feed(a, pushes[:5])
    _feed(c, pushes[:6])                 # ran ahead ...
    c.policy.restore(a.policy.snapshot())  # ... and takes the new primary's clocks
    for x in (a, c):
        _feed(x, pushes[5:])
        x.policy.on_done(x, 2)
    assert a.policy.inner.clock == c.policy.inner.clock == {0: 3, 1: 3, 2: 3}
    for r in range(3):
        assert a.policy.may_answer(a, r) == c.policy.may_answer(c, r)
    header = np.zeros(HEADER_SLOTS)
    a.policy.on_answer(a, 0, header)
    assert header[H.SET] == 5 and header[H.CLOCK] == 3


def test_staleness_lr_alone_combines_half_the_replicas():
    """--staleness-lr on without --softsync: groups of R/2 pushes (the paper's recipe; the
    rate rule alone fell short at R = 8); --softsync given wins; off: each push alone."""
    from hpcps import config
    from hpcps.strategies.downpour import softsync_group
    on = config.new(strategy="downpour", staleness_lr="on")
    assert [softsync_group(on, r) for r in (1, 2, 3, 8, 9)] == [1, 1, 1, 4, 4]
    assert softsync_group(config.new(strategy="downpour", staleness_lr="on", softsync=3), 8) == 3
    assert softsync_group(config.new(strategy="downpour"), 8) == 1
