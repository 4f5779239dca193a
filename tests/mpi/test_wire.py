"""The collectives of ``--wire-dtype bf16`` (hpcps.mpi.comm) on K ranks: the allreduce plan
and the exchanges inside a model-parallel replica, against the sums of the values each rank
sent as bfloat16.

Launched with the other multi-rank tests by ``tests/test_mpi_suites.py`` (K = 1-4).
"""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.compress.bf16 import BF16, FP32, round_trip
from hpcps.model import optim
from hpcps.model.mlp import MLP
from hpcps.mpi.comm import SUM, ReplicaExchange, SumAllreduce
from hpcps.mpi.topology import world_comm
from hpcps.strategies.sync.replica import sync_step

TIMEOUT = 60.0


def everyone(comm, seed: int, shape) -> list[np.ndarray]:
    """Every rank's random float32 array (rank r's from seed + r), known to every rank."""
    return [np.random.default_rng(seed + r).standard_normal(shape).astype(np.float32)
            for r in range(comm.Get_size())]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 5, 1000, 40001])
def test_bf16_allreduce_sums_what_each_rank_sent_and_every_rank_gets_the_same_bits(n):
    comm = world_comm()
    me, size = comm.Get_rank(), comm.Get_size()
    xs = everyone(comm, 10 + n, n + 1)
    buf = xs[me].copy()
    plan = SumAllreduce(comm, n + 1, BF16, exact=1)
    plan(buf, SUM, TIMEOUT, "the test allreduce")
    sent = sum(round_trip(x[:n]).astype(np.float64) for x in xs)
    # the float32 sum of what was sent, rounded once more to bf16 (a relative 2**-8), plus
    # float32 rounding of the partial sums
    tol = 2.0 ** -8 * np.abs(sent) + 1e-6 * sum(np.abs(x[:n]) for x in xs)
    assert (np.abs(buf[:n] - sent) <= tol).all()
    assert buf[n] == pytest.approx(sum(float(x[n]) for x in xs), rel=1e-6)  # exact slot
    bits = comm.allgather(buf.view(np.uint32).copy())
    for other in bits:
        np.testing.assert_array_equal(other, bits[0])
    assert plan.bytes_sent() == pytest.approx(2 * (2 * n + 4) * (size - 1) / size)


@pytest.mark.mpi
def test_the_fp32_plan_is_mpis_allreduce():
    comm = world_comm()
    xs = everyone(comm, 3, 777)
    buf = xs[comm.Get_rank()].copy()
    SumAllreduce(comm, 777, FP32)(buf, SUM, TIMEOUT, "the test allreduce")
    np.testing.assert_allclose(buf, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_bf16_model_parallel_exchanges():
    comm = world_comm()
    me, size = comm.Get_rank(), comm.Get_size()
    widths = [3 + q for q in range(size)]
    batch = 7
    ex = ReplicaExchange(comm, TIMEOUT, BF16)
    blocks = [np.random.default_rng(q).standard_normal((widths[q], batch)).astype(np.float32)
              for q in range(size)]
    got = ex.gather(blocks[me], widths)
    np.testing.assert_array_equal(got, round_trip(np.concatenate(blocks)).reshape(got.shape))
    partials = everyone(comm, 50, (sum(widths), batch))
    out = ex.scatter_sum(partials[me], widths)
    lo = sum(widths[:me])
    want = sum(round_trip(p).reshape(p.shape)[lo:lo + widths[me]].astype(np.float64)
               for p in partials)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert ex.bytes_sent == 2 * blocks[me].size * (size - 1) + 2 * (partials[me].size - out.size)


@pytest.mark.mpi
def test_sync_on_the_bf16_wire_keeps_replicas_identical_and_near_one_process():
    """R replicas with their parts of each batch: on the bf16 wire every replica still holds
    the same weights, within the gradient's rounding of one process on the whole batch."""
    comm = world_comm()
    R, r = comm.Get_size(), comm.Get_rank()
    model = MLP((20, 16, 5), "tanh")
    B, steps = 6, 5
    rng = np.random.default_rng(123)
    xs = rng.standard_normal((steps, R * B, 20)).astype(np.float32)
    ys = rng.integers(0, 5, (steps, R * B))
    opt = optim.make("sgd", 0.05)
    params, state = model.init_params(7), opt.init_state(model.n_params)
    serial = params.copy()
    buf = np.zeros(model.n_params + 1, np.float32)
    plan = SumAllreduce(comm, len(buf), BF16, exact=1)
    for t in range(steps):
        mine = slice(r * B, (r + 1) * B)
        loss = sync_step(comm, lambda p, x, y, g: model.loss_and_grad(p, x, y, grad=g)[0], opt,
                         params, state, xs[t, mine], ys[t, mine], buf, TIMEOUT, reduce=plan)
        serial_loss, g = model.loss_and_grad(serial, xs[t], ys[t])
        opt.apply(serial, g, {})
        # the loss rides as float32: exact at the first step, then the weights differ a little
        assert loss == pytest.approx(serial_loss, rel=1e-5 if t == 0 else 1e-3)
    np.testing.assert_allclose(params, serial, rtol=0, atol=0.05 * 2.0 ** -8 * steps * 4)
    for other in comm.allgather(params):
        np.testing.assert_array_equal(other, params)
