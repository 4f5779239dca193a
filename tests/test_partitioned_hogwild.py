"""Hogwild threads inside the partitions of a replica (``--threads T --partitions P``), no MPI:
P partition "ranks" are threads of this process, each running its own T Hogwild threads, with
one in-process exchange per thread slot (thread t of every partition meets only thread t)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_model import ThreadExchange

from hpcps.engine import conv_hogwild
from hpcps.errors import ConfigError
from hpcps.model.convnet import ConvNet, PartitionedConvNet
from hpcps.model.mlp import MLP, PartitionedMLP
from hpcps.engine.partitioned_hogwild import (
    HogwildThreadTimeout,
    PartitionedHogwild,
    thread_rows,
)

SIZES = (12, 9, 7, 5)  # 9 and 7 split unevenly over 2 and 3 partitions


def run_ranks(parts, threads, fn, exchanges=None, timeout=30.0, activation="relu"):
    """fn(engine, p) on P partition threads; returns [(result or None, exception or None)]."""
    slots = exchanges or [ThreadExchange(parts) for _ in range(threads)]
    out = [(None, None)] * parts

    def rank(p):
        try:
            engine = PartitionedHogwild(SIZES, activation, parts, p,
                                        [s.for_part(p) for s in slots], timeout)
            try:
                out[p] = (fn(engine, p), None)
            finally:
                engine.close()
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[p] = (None, e)

    ranks = [threading.Thread(target=rank, args=(p,), daemon=True) for p in range(parts)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(60)
        assert not r.is_alive(), "a partition rank hung"
    return out


def data(n, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], n)


@pytest.mark.parametrize("parts,threads", [(2, 2), (3, 2), (2, 3)])
def test_with_lr_zero_each_thread_computes_the_whole_models_gradient_of_its_rows(parts, threads):
    """lr = 0: nothing moves, so no race can change anything; thread t's gradient across the
    partitions is the whole model's gradient on rows t*B .. (t+1)*B, and the loss is the
    whole model's on every row."""
    batch = 8
    whole = MLP(SIZES)
    full = whole.init_params(4)
    x, y = data(threads * batch)

    def job(engine, p):
        params = engine.models[0].init_params(4)
        before = params.copy()
        delta = np.zeros_like(params)
        loss_sum, n = engine.train(params, x, y, 0.0, delta=delta)
        return loss_sum, n, params, before, delta, [g.copy() for g in engine.grads]

    out = run_ranks(parts, threads, job)
    assert all(e is None for _, e in out), out
    model = PartitionedMLP(SIZES, "relu", parts, 0)
    expect_loss = 0.0
    for t in range(threads):
        assert thread_rows(threads * batch, threads, t) == (t * batch, (t + 1) * batch)
        rows = slice(t * batch, (t + 1) * batch)
        loss, grad = whole.loss_and_grad(full, x[rows], y[rows])
        expect_loss += loss * batch
        got = model.full_from_parts([r[5][t] for r, _ in out])
        np.testing.assert_allclose(got, grad, rtol=1e-5, atol=1e-6)
    for (loss_sum, n, params, before, delta, _), _ in out:
        assert n == threads * batch
        assert loss_sum == pytest.approx(expect_loss, rel=1e-5)
        np.testing.assert_array_equal(params, before)
        assert not delta.any()


def test_one_thread_takes_exactly_the_whole_models_sgd_step():
    whole = MLP(SIZES)
    full = whole.init_params(2)
    x, y = data(16)
    _, grad = whole.loss_and_grad(full, x, y)
    stepped = full - np.float32(0.1) * grad

    def job(engine, p):
        params = engine.models[0].init_params(2)
        delta = np.zeros_like(params)
        engine.train(params, x, y, 0.1, delta=delta)
        return params, delta

    out = run_ranks(2, 1, job)
    model = PartitionedMLP(SIZES, "relu", 2, 0)
    np.testing.assert_allclose(model.full_from_parts([r[0] for r, _ in out]), stepped,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.full_from_parts([r[1] for r, _ in out]), stepped - full,
                               rtol=1e-4, atol=1e-6)


def test_threads_in_partitions_learn():
    """Racy, so no exact figures: 60 Hogwild rounds on a fixed teacher cut the loss."""
    teacher = MLP(SIZES)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, SIZES[0])).astype(np.float32)
    y = np.argmax(teacher.forward(teacher.init_params(9), x)[-1], axis=1)

    def job(engine, p):
        params = engine.models[0].init_params(1)
        first = last = None
        for i in range(60):
            lo = (i * 32) % 256
            loss_sum, n = engine.train(params, x[lo:lo + 32], y[lo:lo + 32], 0.1)
            first = loss_sum / n if first is None else first
            last = loss_sum / n
        return params, first, last

    out = run_ranks(2, 2, job)
    assert all(e is None for _, e in out), out
    model = PartitionedMLP(SIZES, "relu", 2, 0)
    final = model.full_from_parts([r[0] for r, _ in out])
    init = teacher.init_params(1)
    assert teacher.loss(final, x, y) < 0.7 * teacher.loss(init, x, y)


@pytest.mark.skipif(not conv_hogwild.HAVE_EXTENSION, reason="the compiled conv engine is not built")
@pytest.mark.parametrize("parts,threads", [(2, 2), (3, 2)])
def test_compiled_conv_partitions_in_threads_compute_the_whole_models_gradient(parts, threads):
    """A conv model's partitions on the compiled engine (what ``--model`` with ``--threads``
    and ``--partitions`` trains), lr = 0: thread t's gradient across the partitions is the
    whole ConvNet's on its rows."""
    spec, shape, batch = "conv3x3x6p1,pool2,conv3x3x5,fc7,fc4", (1, 8, 8), 6
    whole = ConvNet(spec, shape)
    rng = np.random.default_rng(3)
    x = rng.random((threads * batch, 64)).astype(np.float32)
    y = rng.integers(0, 4, threads * batch)
    full = whole.init_params(2)
    slots = [ThreadExchange(parts) for _ in range(threads)]
    out = [None] * parts

    def rank(p):
        engine = PartitionedHogwild(None, "relu", parts, p, [s.for_part(p) for s in slots],
                                    30.0, make_model=lambda ex: conv_hogwild.compiled_partition(
                                        PartitionedConvNet(spec, shape, "relu", parts, p, ex),
                                        batch))
        try:
            assert all(isinstance(m, conv_hogwild.CompiledPartition) for m in engine.models)
            params = engine.models[0].model.local_from_full(whole.views(full))
            loss_sum, n = engine.train(params, x, y, 0.0)
            out[p] = (loss_sum, n, [g.copy() for g in engine.grads])
        finally:
            engine.close()

    ranks = [threading.Thread(target=rank, args=(p,), daemon=True) for p in range(parts)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(60)
    assert all(o is not None for o in out), "a partition rank failed or hung"
    model = PartitionedConvNet(spec, shape, "relu", parts, 0)
    expect = 0.0
    for t in range(threads):
        rows = slice(t * batch, (t + 1) * batch)
        loss, grad = whole.loss_and_grad(full, x[rows], y[rows])
        expect += loss * batch
        np.testing.assert_allclose(model.full_from_parts([o[2][t] for o in out]), grad,
                                   rtol=1e-5, atol=1e-5)
    for loss_sum, n, _ in out:
        assert n == threads * batch and loss_sum == pytest.approx(expect, rel=1e-5)


class FailingSlot:
    """An exchange slot whose gather fails on the chosen partitions."""

    def __init__(self, fail_on):
        self.fail_on = fail_on

    def for_part(self, p):
        fail = p in self.fail_on

        class One:
            @staticmethod
            def gather(local_t, widths):
                if fail:
                    raise RuntimeError(f"injected failure in partition {p}")
                time.sleep(120)  # would wait for the failed peer; must not hold up train()

            scatter_sum = gather
        return One


def test_a_failing_thread_fails_the_call_and_names_itself():
    t0 = time.monotonic()
    out = run_ranks(2, 2, lambda e, p: e.train(e.models[0].init_params(0), *data(16), 0.1),
                    exchanges=[ThreadExchange(2), FailingSlot({0, 1})])
    for _, exc in out:
        assert isinstance(exc, RuntimeError) and "injected failure" in str(exc)
        assert "in Hogwild thread 1 of 2" in "".join(getattr(exc, "__notes__", []))
    assert time.monotonic() - t0 < 20


def test_a_thread_stuck_on_its_peer_times_out_naming_the_thread():
    """Partition 0's thread 1 fails; partition 1's thread 1 waits for it, and partition 1's
    train() gives up after the timeout instead of hanging (under MPI the failed rank's abort
    would end it sooner)."""
    t0 = time.monotonic()
    out = run_ranks(2, 2, lambda e, p: e.train(e.models[0].init_params(0), *data(16), 0.1),
                    exchanges=[ThreadExchange(2), FailingSlot({0})], timeout=2.0)
    assert isinstance(out[0][1], RuntimeError)
    assert isinstance(out[1][1], HogwildThreadTimeout)
    assert "thread(s) 1 of this rank" in str(out[1][1])
    assert time.monotonic() - t0 < 20


def test_needs_a_row_per_thread_and_an_exchange():
    with pytest.raises(ConfigError):
        PartitionedHogwild(SIZES, "relu", 2, 0, [], 1.0)
    out = run_ranks(1, 2, lambda e, p: e.train(e.models[0].init_params(0), *data(1), 0.1))
    assert isinstance(out[0][1], ValueError)


def test_thread_multiple_is_required_only_for_threads_with_partitions():
    from mpi4py import MPI

    from hpcps.mpi.topology import check_thread_support
    check_thread_support(4, 1, MPI.THREAD_SINGLE)
    check_thread_support(1, 4, MPI.THREAD_SINGLE)
    check_thread_support(2, 2, MPI.THREAD_MULTIPLE)
    with pytest.raises(ConfigError, match="needs an MPI library with MPI_THREAD_MULTIPLE.*"
                                          "MPI_THREAD_SERIALIZED"):
        check_thread_support(2, 2, MPI.THREAD_SERIALIZED)


def test_an_hpcps_error_in_a_thread_keeps_its_message_and_names_the_thread():
    from hpcps.errors import HpcpsError

    class Refusing:
        def for_part(self, p):
            class One:
                @staticmethod
                def gather(local_t, widths):
                    raise HpcpsError("waited 1 s for the other partitions of this replica")

                scatter_sum = gather
            return One

    out = run_ranks(1, 2, lambda e, p: e.train(e.models[0].init_params(0), *data(16), 0.1),
                    exchanges=[ThreadExchange(1), Refusing()])
    assert str(out[0][1]) == ("waited 1 s for the other partitions of this replica "
                              "(in Hogwild thread 1 of 2 of this rank)")
