"""Multi-rank tests, run under ``mpiexec -n K python -m pytest --with-mpi -n 0 tests/mpi``.

``tests/test_mpi_suites.py`` launches this file at K = 1, 2, 3 and 4 with a timeout, so the
plain ``pytest`` command runs these too. Every test here is rank-generic.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.model import optim
from hpcps.model.mlp import MLP
from hpcps.ps.client import Client
from hpcps.ps.gradient_shard import GradientShard, ShardPolicy
from hpcps.strategies.sync.replica import sync_step
from hpcps.mpi.topology import Layout, build_grid, shard_range, world_comm

TIMEOUT = 60.0


@pytest.fixture
def comm():
    c = world_comm()
    yield c
    c.Free()


@pytest.mark.mpi
def test_grid_communicators_match_layout(comm):
    size = comm.Get_size()
    servers = 1 if size > 1 else 0
    grid = build_grid(comm, Layout.plan(size, servers, 1))
    if grid.role.is_server:
        assert grid.server_comm.Get_size() == servers and grid.partition_comm is None
    else:
        assert grid.partition_comm.Get_size() == size - servers
        assert grid.replica_comm.Get_size() == 1
        assert grid.partition_comm.Get_rank() == grid.role.replica


@pytest.mark.mpi
def test_sync_equals_one_process_on_the_concatenated_batch(comm):
    """R replicas, each with its part of a batch, end with the weights one process gets from
    the whole batch, and with identical weights on every replica."""
    R, r = comm.Get_size(), comm.Get_rank()
    model = MLP((20, 16, 5), "tanh")
    B, steps = 6, 5
    rng = np.random.default_rng(123)  # same stream on every rank
    xs = rng.standard_normal((steps, R * B, 20)).astype(np.float32)
    ys = rng.integers(0, 5, (steps, R * B))
    opt = optim.make("adagrad", 0.05)
    params, state = model.init_params(7), opt.init_state(model.n_params)
    serial, serial_state = params.copy(), opt.init_state(model.n_params)
    buf = np.zeros(model.n_params + 1, np.float32)
    for t in range(steps):
        mine = slice(r * B, (r + 1) * B)
        loss = sync_step(comm, lambda p, x, y, g: model.loss_and_grad(p, x, y, grad=g)[0], opt,
                         params, state, xs[t, mine], ys[t, mine], buf, TIMEOUT)
        serial_loss, g = model.loss_and_grad(serial, xs[t], ys[t])
        opt.apply(serial, g, serial_state)
        assert loss == pytest.approx(serial_loss, rel=1e-5)
    np.testing.assert_allclose(params, serial, rtol=1e-5, atol=1e-6)
    everyone = comm.allgather(params)
    for other in everyone:
        np.testing.assert_array_equal(other, params)


@pytest.mark.mpi(min_size=2)
def test_shard_applies_every_push_from_every_replica(comm):
    """The last rank serves one shard; the others push known gradients asynchronously.
    Whatever the arrival order, SGD with lr=1 must end at init - sum of all pushes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    n, pushes, server = 1000, 7, size - 1
    init = np.arange(n, dtype=np.float32)
    opt = optim.make("sgd", 1.0)
    if rank == server:
        params = init.copy()
        srv = GradientShard(comm, params, {}, opt.apply, n_replicas=size - 1, timeout=TIMEOUT)
        stats = srv.serve()
        expected = init - sum((r + 1) * pushes for r in range(size - 1))
        np.testing.assert_allclose(params, expected)
        assert stats.pushes == pushes * (size - 1) and srv.step == 2 * pushes * (size - 1)
        assert stats.done_replicas == list(range(size - 1))
        # each replica fetches once, then pushes: its k-th push finds at least its own k
        # earlier pushes applied since, and never more than all the others
        assert pushes - 1 <= stats.staleness_max <= pushes * (size - 1) - 1, stats
    else:
        client = Client(comm, [server], [shard_range(n, 1, 0)], rank, TIMEOUT)
        seen = np.empty(n, np.float32)
        client.fetch(seen)
        # what a replica fetches is always init minus whole pushes (each push is applied
        # atomically with respect to fetches)
        assert np.all((init - seen) == (init - seen)[0])
        g = np.full(n, rank + 1, np.float32)
        for _ in range(pushes):
            client.push(g, steps=2, loss_sum=1.0)
        client.done()
        assert client.bytes_sent > pushes * 4 * n


class HoldUntilVersion(ShardPolicy):
    """A toy shard policy: answer a fetch only once the shard has applied ``n`` pushes. The
    first time it holds one it tells ``wake`` (ranks on ``go``, a communicator of the test's
    own) that a fetch is held."""

    def __init__(self, n: int, go=None, wake=()):
        self.n, self.go, self.wake, self.sent = n, go, list(wake), []

    def may_answer(self, shard, sender) -> bool:
        if shard.version >= self.n:
            return True
        if self.wake:
            self.sent = [self.go.isend(sender, dest=r) for r in self.wake]
            self.wake = []
        return False


@pytest.mark.mpi(min_size=2)
def test_shard_policy_holds_a_fetch_until_it_may_answer(comm):
    """Replica 0 pushes and fetches at once; the others push only once the shard has held
    that fetch (ordered by a message, not a sleep: 4 ranks share 2 cores). The policy holds
    replica 0's fetch until every replica has pushed, so what it sees includes every push
    (answered at once, it would see only its own)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    n, server, replicas = 64, size - 1, size - 1
    init = np.zeros(n, dtype=np.float32)
    go = comm.Dup()
    if rank == server:
        params = init.copy()
        policy = HoldUntilVersion(replicas, go, range(1, replicas))
        srv = GradientShard(comm, params, {}, optim.make("sgd", 1.0).apply,
                            n_replicas=replicas, timeout=TIMEOUT, policy=policy)
        stats = srv.serve()
        for req in policy.sent:
            req.wait()
        assert stats.fetches == replicas and not srv.held
        if replicas > 1:  # replica 0's fetch, at least, was held
            assert stats.held_fetches >= 1, stats
    else:
        client = Client(comm, [server], [shard_range(n, 1, 0)], rank, TIMEOUT)
        if rank > 0:
            assert go.recv(source=server) == 0  # replica 0's fetch is held
        client.push(np.ones(n, np.float32), steps=1, loss_sum=0.0)
        seen = np.empty(n, np.float32)
        client.fetch(seen)
        np.testing.assert_array_equal(seen, init - replicas)
        client.done()
    go.Free()


@pytest.mark.mpi(min_size=3)
def test_two_shards_hold_their_own_slices(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    n, S = 1001, 2
    servers = [size - 2, size - 1]
    ranges = [shard_range(n, S, s) for s in range(S)]
    opt = optim.make("adagrad", 0.1)
    if rank in servers:
        s = servers.index(rank)
        lo, hi = ranges[s]
        params = np.zeros(hi - lo, np.float32)
        srv = GradientShard(comm, params, opt.init_state(hi - lo), opt.apply,
                          n_replicas=size - 2, timeout=TIMEOUT)
        srv.serve()
        # every element got the same sign of update from every replica: adagrad moved each
        # parameter by -0.1 on the first push and less after, all negative
        assert np.all(params < 0) and np.all(params >= -0.1 * (size - 2) * 3 - 1e-6)
    else:
        client = Client(comm, servers, ranges, rank, TIMEOUT)
        full = np.ones(n, np.float32)
        buf = np.empty(n, np.float32)
        for _ in range(3):
            client.fetch(buf)
            client.push(full, steps=1, loss_sum=0.5)
        client.done()


@pytest.mark.mpi
def test_partitioned_model_over_mpi_equals_the_whole_model(comm):
    """All ranks form one replica of P = size partitions, exchanging over MPI."""
    from hpcps.mpi.comm import ReplicaExchange
    from hpcps.model.mlp import PartitionedMLP
    P, p = comm.Get_size(), comm.Get_rank()
    sizes = (16, 11, 9, 5)
    whole = MLP(sizes, "relu")
    exchange = ReplicaExchange(comm, TIMEOUT)
    model = PartitionedMLP(sizes, "relu", P, p, exchange)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 16)).astype(np.float32)
    y = rng.integers(0, 5, 7)
    full = whole.init_params(2)
    loss, grad = whole.loss_and_grad(full, x, y)
    local = model.init_params(2)
    mine_loss, mine_grad = model.loss_and_grad(local, x, y)
    assert mine_loss == pytest.approx(loss, rel=1e-6)
    grads = comm.allgather(mine_grad)
    np.testing.assert_allclose(model.full_from_parts(grads), grad, rtol=1e-5, atol=1e-6)
    logits = model.forward(local, x)[0][-1]
    np.testing.assert_allclose(logits, whole.forward(full, x)[-1], rtol=1e-5, atol=1e-6)
    # what crossed the boundary: each rank sends its block of every layer to the P-1 others
    # (forward) and the others' rows of its error contributions (backward)
    B, w = 7, model.widths
    fwd = sum(w[l][p] * B * 4 * (P - 1) for l in range(3)) * 2  # forward() ran twice
    bwd = sum((sizes[l] - w[l - 1][p]) * B * 4 for l in (1, 2))
    assert exchange.bytes_sent == fwd + bwd
