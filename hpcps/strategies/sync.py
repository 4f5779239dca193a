"""Synchronous data-parallel SGD: every step, replicas allreduce their gradients.

Each replica computes the gradient of its own mini-batch, the gradients are summed with one
allreduce over the partition communicator (the R replicas) and divided by R, and every replica
applies the same update to its own full copy of the parameters. The result is the update one
process would make on the R mini-batches concatenated, so with the same seed every replica
holds the same weights, step after step. No servers, no staleness; each step waits for the
slowest replica, which is the price of that determinism.

One optimizer update consumes R mini-batches: the global step advances by R.

With P partitions per replica, the allreduce runs over the partition communicator: each
partition sums its own slice of the gradient with the same partition of the other replicas.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from hpcps.data import Batches, Prefetcher
from hpcps.ps.waiting import wait_all
from hpcps.strategies.common import (Context, GradientSource, crossed, evaluate,
                                     gather_state, model_parallel_figures, rate,
                                     save_checkpoint)


def sync_step(comm, gradient, optimizer, params, state, x, y, buf, timeout: float) -> float:
    """One synchronous step; returns the mean training loss over all replicas' batches.

    ``gradient(params, x, y, grad) -> loss`` computes this replica's mean gradient (one
    mini-batch, or T of them with Hogwild threads); ``buf`` is a float32 array of
    ``len(params) + 1`` (the loss rides along with the gradient, so one allreduce carries
    both).
    """
    n = len(params)
    loss = gradient(params, x, y, buf[:n])
    buf[n] = loss
    if comm.Get_size() > 1:
        req = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        wait_all([req], timeout, "the gradient allreduce with the other replicas "
                 f"(ranks of the partition communicator, size {comm.Get_size()})")
        buf *= np.float32(1.0 / comm.Get_size())
    optimizer.apply(params, buf[:n], state)
    return float(buf[n])


def run(ctx: Context) -> dict:
    cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
    comm = grid.partition_comm
    n_rep = comm.Get_size()
    replica = grid.role.replica
    params, state = ctx.params, ctx.opt_state
    source = GradientSource(ctx)
    T = source.threads
    updates = -(-ctx.remaining_steps // (n_rep * T))
    batches = Prefetcher(Batches(ctx.train_x, ctx.train_y, source.batch,
                                 ctx.batch_seed(replica)), cfg.prefetch)
    buf = np.zeros(model.n_params + 1, dtype=np.float32)
    step = ctx.start_step
    m = ctx.metrics
    # Bytes each rank sends per update in a ring allreduce, 2 (R-1)/R of the buffer; summed over
    # the R ranks and divided by the R mini-batches of an update, the same figure per step.
    bytes_per_update = 2 * buf.nbytes * (n_rep - 1) / n_rep / T
    t0 = time.perf_counter()
    last_t, last_step = t0, step
    loss_win, n_win = 0.0, 0

    def report():
        nonlocal last_t, last_step, loss_win, n_win
        now = time.perf_counter()
        m.record("progress", step=step, epoch=round(ctx.epochs(step), 3),
                 examples_per_s=round(rate((step - last_step) * cfg.batch_size, now - last_t), 1),
                 loss=loss_win / max(1, n_win), staleness=0,
                 bytes_per_step=round(bytes_per_update),
                 **model_parallel_figures(ctx, (step - ctx.start_step) // n_rep, now - t0))
        last_t, last_step, loss_win, n_win = now, step, 0.0, 0

    for _ in range(updates):
        x, y = next(batches)
        loss = sync_step(comm, source, ctx.optimizer, params, state, x, y, buf, cfg.timeout)
        step += n_rep * T
        loss_win += loss
        n_win += 1
        if m.due():
            report()
        evaluating = crossed(step, n_rep * T, cfg.eval_every)
        saving = crossed(step, n_rep * T, cfg.checkpoint_every)
        if (evaluating or saving) and replica == 0:  # every replica holds the same weights
            full, full_state = gather_state(ctx, params, state if saving else {})
            if grid.is_chief and evaluating:
                test_loss, test_acc = evaluate(ctx, full)
                m.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                         test_accuracy=test_acc, test_loss=test_loss)
            if grid.is_chief and saving:
                path = save_checkpoint(ctx, full, full_state, step, {"train_loss": loss})
                m.record("checkpoint", echo=False, step=step, path=str(path))
    if n_win:
        report()  # the last window, so every run's metrics hold at least one progress record
    train_s = time.perf_counter() - t0
    batches.close()
    result = {"step": step, "train_s": train_s,
              "examples_per_s": rate((step - ctx.start_step) * cfg.batch_size, train_s),
              "bytes_per_step": bytes_per_update}
    result.update(model_parallel_figures(ctx, updates * T, train_s))
    if replica == 0:
        full, full_state = gather_state(ctx, params, state)
        if grid.is_chief:
            test_loss, test_acc = evaluate(ctx, full)
            path = save_checkpoint(ctx, full, full_state, step,
                                   {"test_accuracy": test_acc, "test_loss": test_loss})
            result.update(test_accuracy=test_acc, test_loss=test_loss, checkpoint=str(path))
    return result
