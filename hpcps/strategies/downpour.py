"""Downpour SGD (Dean et al. 2012, section 4.1): asynchronous replicas, sharded parameter server.

The flat parameter vector is cut into S contiguous chunks, one per server shard; each shard
applies the optimizer (Adagrad by default, as in the paper) to its chunk as gradients arrive.
Each replica trains on its own shard of the training data and, independently of every other
replica:

* every ``n_fetch`` steps fetches the current parameters from all shards;
* computes the gradient of one mini-batch on its (possibly stale) copy;
* every ``n_push`` steps pushes the gradient accumulated since the last push to the shards.

No replica ever waits for another; a shard applies pushes in whatever order they arrive, so a
replica's gradient may be computed from parameters a few updates old (the staleness reported).
Warm start: for the first ``warmup_steps`` only replica 0 trains, then it releases the others.

At the end every replica sends DONE; the shards gather the final state on shard 0, which sends
it to the chief (world rank 0) for the final evaluation and checkpoint. Periodic checkpoints are
written by shard 0 while training goes on.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from hpcps import compress
from hpcps.data import Batches, Prefetcher
from hpcps.protocol import H, Message, Tag
from hpcps.ps import activations
from hpcps.ps.client import Client
from hpcps.ps.server import ShardServer
from hpcps.ps.waiting import wait_all
from hpcps.strategies.common import (Context, GradientSource, evaluate,
                                     model_parallel_figures, rate, save_checkpoint,
                                     steps_for_replica)
from hpcps.topology import shard_range


def part_sizes(ctx: Context) -> list[int]:
    """Length of each partition's slice of the parameters (one entry when P = 1)."""
    return list(getattr(ctx.model, "part_sizes", [ctx.model.n_params]))


def shards_of_partition(ctx: Context, part: int) -> list[tuple[int, int, int]]:
    """(shard, lo, hi) for each shard holding partition ``part``'s slice, lo/hi within it.

    Each partition has its own S/P shards (so a partition talks only to the shards that
    hold its parameters), and splits its slice among them in contiguous chunks.
    """
    per = ctx.grid.layout.servers // ctx.grid.layout.partitions
    if ctx.cfg.push == "activations":  # whole rows per shard (P = 1)
        return [(j, lo, hi) for j, (lo, hi) in
                enumerate(activations.row_aligned_ranges(ctx.model, per))]
    size = part_sizes(ctx)[part]
    return [(part * per + j, *shard_range(size, per, j)) for j in range(per)]


def global_ranges(ctx: Context) -> list[tuple[int, int]]:
    """Every shard's chunk of the global vector (partition slices one after the other), in
    shard order; consecutive, so gathering them in order rebuilds the global vector."""
    sizes = part_sizes(ctx)
    base = np.cumsum([0] + sizes)
    out = []
    for part in range(len(sizes)):
        out += [(int(base[part]) + lo, int(base[part]) + hi)
                for _, lo, hi in shards_of_partition(ctx, part)]
    return out


class PackedPusher:
    """Strom-compressed pushes: the residual stays on the replica, each shard gets a message.

    The accumulated gradient is added to the residual; elements past +-tau become 1-bit
    words (``hpcps.compress.threshold``), which are cut at the shard boundaries (words are
    sorted by index), re-based to each shard's slice and coded.
    """

    def __init__(self, n: int, ranges, tau: float, golomb: bool):
        self.residual = np.zeros(n, dtype=np.float32)
        self.out = np.empty(n, dtype=np.uint32)
        self.tau = tau
        self.golomb = golomb
        self.ranges = list(ranges)
        self.bounds = np.array([lo << 1 for lo, _ in ranges] + [n << 1], dtype=np.uint64)
        self.words_sent = 0

    def bodies(self, grad: np.ndarray) -> list[np.ndarray]:
        words = compress.threshold(self.residual, grad, self.tau, out=self.out)
        self.words_sent += len(words)
        cuts = np.searchsorted(words, self.bounds)
        return [compress.encode(words[cuts[s]:cuts[s + 1]] - np.uint32(lo << 1), self.golomb)
                for s, (lo, _) in enumerate(self.ranges)]


def shard_expander(n_local: int, tau: float):
    """For a shard: turn a received message into a dense gradient of its slice (zeros except
    +-tau at the message's indices), reusing one buffer."""
    dense = np.zeros(n_local, dtype=np.float32)
    touched = np.empty(0, dtype=np.intp)

    def expand(body: np.ndarray) -> np.ndarray:
        nonlocal touched
        dense[touched] = 0.0
        words = compress.decode(body, n_local)
        compress.apply(dense, words, tau)
        touched = (words >> 1).astype(np.intp)
        return dense

    return compress.max_message_bytes(n_local), Tag.PUSH_COMPRESSED, lambda h, body: expand(body)


def shard_activation_handler(ctx: Context, lo: int, hi: int, params, state):
    """For a shard: apply pushed layer inputs and errors to its rows (Project Adam)."""
    chunk = activations.pieces(ctx.model, lo, hi)
    bound = activations.max_message_bytes(ctx.model, chunk, ctx.cfg.batch_size * ctx.cfg.n_push)

    def handle(header, body):
        activations.apply(ctx.model, chunk, int(header[H.EXAMPLES]), body.view(np.float32),
                          params, state, ctx.optimizer)
        return None  # applied here, tile by tile

    return bound, Tag.PUSH_ACTIVATIONS, handle


def run(ctx: Context) -> dict:
    if ctx.grid.role.is_server:
        return run_server(ctx)
    return run_replica(ctx)


# -- replicas ----------------------------------------------------------------------------------
def run_replica(ctx: Context) -> dict:
    cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
    layout = grid.layout
    r, R = grid.role.replica, layout.replicas
    warmup = cfg.warmup_steps if ctx.start_step == 0 else 0
    my_steps = steps_for_replica(ctx.remaining_steps, R, r, warmup)
    packed = cfg.compress == "threshold" or cfg.push == "activations"
    mine = shards_of_partition(ctx, grid.role.partition)
    ranks = [layout.server_rank(shard) for shard, _, _ in mine]
    ranges = [(lo, hi) for _, lo, hi in mine]
    pusher = PackedPusher(model.n_params, ranges, cfg.tau, cfg.golomb == "on") \
        if cfg.compress == "threshold" else None
    if cfg.push == "activations":
        chunks = [activations.pieces(model, lo, hi) for lo, hi in ranges]
        k_max = cfg.batch_size * cfg.n_push
        bounds = [activations.max_message_bytes(model, c, k_max) for c in chunks]
    else:
        bounds = [compress.max_message_bytes(hi - lo) for lo, hi in ranges]
    client = Client(grid.world, ranks, ranges, r, cfg.timeout,
                    packed_bytes=bounds if packed else None)
    rows_in, rows_err = [], []  # activation push: layer inputs and errors since the last push

    def push(grad: np.ndarray, steps: int, loss_sum: float) -> None:
        if cfg.push == "activations":
            ins = [np.concatenate([a[l] for a in rows_in]) for l in range(model.n_layers)]
            errs = [np.concatenate([e[l] for e in rows_err]) for l in range(model.n_layers)]
            k = len(ins[0])
            modes = activations.activation_layers(model, k)
            client.push_packed([activations.pack(model, c, modes, ins, errs).view(np.uint8)
                                for c in chunks], steps, loss_sum,
                               tag=Tag.PUSH_ACTIVATIONS, rows=k)
            rows_in.clear()
            rows_err.clear()
        elif pusher is None:
            client.push(grad, steps, loss_sum)
        else:
            client.push_packed(pusher.bodies(grad), steps, loss_sum)

    source = GradientSource(ctx)
    T = source.threads  # mini-batches per iteration (Hogwild threads)
    batches = Prefetcher(Batches(ctx.train_x, ctx.train_y, source.batch, ctx.batch_seed(r)),
                         cfg.prefetch)
    params = np.empty(model.n_params, dtype=np.float32)
    grad = np.empty(model.n_params, dtype=np.float32)
    acc = np.zeros(model.n_params, dtype=np.float32)
    acc_steps, loss_sum = 0, 0.0
    m = ctx.metrics
    flag = Message(0)

    warmup_reqs = []
    released = r != 0 or R == 1 or warmup == 0
    if r != 0 and warmup > 0:
        m.message(f"replica {r} waits for replica 0's warm start")
        # partition p of replica 0 releases partition p of every other replica
        leader = layout.replica_rank(0, grid.role.partition)
        req = grid.world.Irecv(flag.buf, source=leader, tag=Tag.WARMUP_DONE)
        wait_all([req], cfg.timeout, f"replica 0 (rank {leader}) to finish "
                 f"its {warmup}-step warm start")
    elif r == 0 and warmup > 0 and R > 1:
        m.message(f"warm start: replica 0 trains alone for {warmup} steps")

    def release():
        for other in range(1, R):
            dest = layout.replica_rank(other, grid.role.partition)
            warmup_reqs.append(grid.world.Isend(flag.buf, dest=dest, tag=Tag.WARMUP_DONE))

    t0 = time.perf_counter()
    last_t, last_step = t0, ctx.start_step
    # replica 0 evaluates every eval_every/R of its own steps: a schedule every partition of
    # the replica computes alike, so they can gather the model together
    eval_local = max(1, -(-cfg.eval_every // R)) if cfg.eval_every else 0
    info = {"step": ctx.start_step}

    def report(done_steps: int) -> None:
        nonlocal last_t, last_step
        step, now = info["step"], time.perf_counter()
        m.record("progress", step=step, epoch=round(ctx.epochs(step), 3),
                 examples_per_s=round(rate((step - last_step) * cfg.batch_size, now - last_t), 1),
                 loss=info.get("loss", float("nan")),
                 staleness=round(info.get("staleness", 0.0), 2),
                 max_staleness=info.get("max_staleness", 0.0),
                 bytes_per_step=round((client.bytes_sent + client.bytes_received)
                                      / max(1, done_steps)),
                 bytes_sent_per_step=round(client.bytes_sent / max(1, done_steps)),
                 **({"updates_per_step": round(pusher.words_sent / max(1, done_steps), 1)}
                    if pusher else {}),
                 **model_parallel_figures(ctx, done_steps, now - t0))
        last_t, last_step = now, step

    fetch_every = max(1, cfg.n_fetch // T)
    eval_iters = max(1, eval_local // T) if eval_local else 0
    iterations = -(-my_steps // T)
    for it in range(iterations):
        done = (it + 1) * T  # this replica's mini-batches so far
        if it % fetch_every == 0:
            info = client.fetch(params)
        x, y = next(batches)
        if cfg.push == "activations":  # keep what the gradient is made of, not the gradient
            loss, ins, errs = model.loss_and_parts(params, x, y)
            rows_in.append(ins)
            rows_err.append(errs)
        else:
            loss = source(params, x, y, grad)
        if T > 1:
            grad *= np.float32(T)  # the sum over the T mini-batches, as n_push sums steps
        if cfg.push != "activations":
            acc += grad
        acc_steps += T
        loss_sum += loss * T
        if acc_steps >= cfg.n_push:
            push(acc, acc_steps, loss_sum)
            acc[:] = 0.0
            acc_steps, loss_sum = 0, 0.0
        if not released and done >= warmup:
            release()
            released = True
            m.message("warm start done: all replicas train now")
        if grid.is_chief and m.due():
            report(done)
        if r == 0 and eval_iters and (it + 1) % eval_iters == 0:
            full = ctx.gather_full(params)
            if grid.is_chief:
                test_loss, test_acc = evaluate(ctx, full)
                step = info["step"]
                m.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                         test_accuracy=test_acc, test_loss=test_loss)
    if acc_steps:
        push(acc, acc_steps, loss_sum)
    my_steps = iterations * T  # rounded up to whole iterations
    if grid.is_chief and my_steps:
        report(my_steps)  # the last window, so every run's metrics hold a progress record
    if not released:
        release()
    wait_all(warmup_reqs, cfg.timeout, "other replicas to take the warm-start release")
    client.done()
    train_s = time.perf_counter() - t0
    batches.close()
    result = {"replica_steps": my_steps, "train_s": train_s,
              "bytes_sent": client.bytes_sent, "bytes_received": client.bytes_received,
              "words_sent": pusher.words_sent if pusher else None,
              **model_parallel_figures(ctx, my_steps, train_s)}
    if grid.is_chief:
        result.update(_finish_chief(ctx, train_s))
    return result


def _final_message(ctx: Context) -> Message:
    """Buffer for the final whole-model state: parameters, then each optimizer state vector."""
    n = ctx.full_model.n_params
    return Message(n * (1 + len(ctx.optimizer.state_keys)))


def _finish_chief(ctx: Context, train_s: float) -> dict:
    """Receive the final state from shard 0, evaluate it, write the final checkpoint."""
    layout = ctx.grid.layout
    msg = _final_message(ctx)
    req = ctx.grid.world.Irecv(msg.buf, source=layout.server_rank(0), tag=Tag.FINAL)
    wait_all([req], ctx.cfg.timeout, f"the final parameters from server shard 0 "
             f"(rank {layout.server_rank(0)})")
    n = ctx.full_model.n_params
    params = msg.payload[:n]
    state = {k: msg.payload[(i + 1) * n:(i + 2) * n]
             for i, k in enumerate(ctx.optimizer.state_keys)}
    step = int(msg.header[H.STEPS])
    test_loss, test_acc = evaluate(ctx, params)
    path = save_checkpoint(ctx, params, state, step,
                           {"test_accuracy": test_acc, "test_loss": test_loss})
    return {"step": step, "test_accuracy": test_acc, "test_loss": test_loss,
            "checkpoint": str(path),
            "examples_per_s": rate((step - ctx.start_step) * ctx.cfg.batch_size, train_s)}


# -- server shards -----------------------------------------------------------------------------
def run_server(ctx: Context) -> dict:
    cfg, grid = ctx.cfg, ctx.grid
    s = grid.role.shard
    ranges = global_ranges(ctx)
    lo, hi = ranges[s]
    params = ctx.params[lo:hi].copy()
    state = {k: v[lo:hi].copy() for k, v in ctx.opt_state.items()}
    keys = list(ctx.optimizer.state_keys)

    def gather() -> tuple[np.ndarray, dict] | None:
        """The whole model (MLP layout) and optimizer state on shard 0, from every shard's
        chunk; None on the other shards. Collective over the server communicator."""
        comm = grid.server_comm
        counts = [h - l for l, h in ranges]
        displs = [l for l, _ in ranges]
        n_global = ranges[-1][1]
        gathered = []
        for local in [params] + [state[k] for k in keys]:
            whole = np.empty(n_global, np.float32) if s == 0 else None
            recv = [whole, counts, displs, MPI.FLOAT] if s == 0 else None
            wait_all([comm.Igatherv(local, recv, root=0)], cfg.timeout,
                     "the other server shards to join a gather of the model")
            gathered.append(whole)
        if s != 0:
            return None
        full = [ctx.global_to_full(v) for v in gathered]
        return full[0], dict(zip(keys, full[1:]))

    def on_boundary(step: int) -> None:
        got = gather()
        if got is not None:
            path = save_checkpoint(ctx, got[0], got[1], step)
            print(f"[hpcps] server shard 0 wrote checkpoint {path} at step {step}", flush=True)

    server = ShardServer(grid.world, params, state, ctx.optimizer.apply,
                         n_replicas=grid.layout.replicas, step=ctx.start_step,
                         timeout=cfg.timeout, on_boundary=on_boundary,
                         boundary_every=cfg.checkpoint_every,
                         packed=shard_expander(hi - lo, cfg.tau)
                         if cfg.compress == "threshold" else
                         shard_activation_handler(ctx, lo, hi, params, state)
                         if cfg.push == "activations" else None)
    stats = server.serve()
    got = gather()
    if got is not None:
        msg = _final_message(ctx)
        n = ctx.full_model.n_params
        msg.payload[:n] = got[0]
        for i, k in enumerate(keys):
            msg.payload[(i + 1) * n:(i + 2) * n] = got[1][k]
        msg.header[H.STEPS] = server.step
        req = grid.world.Isend(msg.buf, dest=0, tag=Tag.FINAL)
        wait_all([req], cfg.timeout, "the chief (rank 0) to take the final parameters")
    return {"shard": s, "pushes": stats.pushes, "fetches": stats.fetches,
            "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
            "mean_staleness": stats.staleness_sum / max(1, stats.pushes),
            "max_staleness": stats.staleness_max, "step": server.step}
