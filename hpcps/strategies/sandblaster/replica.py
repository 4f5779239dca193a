"""A sandblaster replica: the portions it is handed, summed into gradients it pushes."""
from __future__ import annotations

import math
import time

import numpy as np

from hpcps import trace

from hpcps.compress.bf16 import Wire
from hpcps.mpi.comm import PeerTimeout, Poller, Transport, reply_spin_s, status, wait_all
from hpcps.options import parse_inject_slow
from hpcps.mpi.protocol import H, Message, Tag
from hpcps.strategies.sandblaster import Tag as SandblasterTag
from hpcps.strategies.sandblaster import Task
from hpcps.strategies.context import Context
from hpcps.strategies.sandblaster.common import (PORTION_CHUNK, RESULT_SLOTS, TASK_SLOTS,
                                                 batch_order, shard_plan)

# -- replicas -----------------------------------------------------------------------------------
def run_replica(ctx: Context) -> dict:
    cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
    net, layout = Transport(grid.world), grid.layout
    coord = layout.n_world - 1
    plan = shard_plan(ctx)
    n = model.n_params
    x = np.empty(n, dtype=np.float32)
    acc = np.zeros(n, dtype=np.float32)
    pg = np.zeros(n, dtype=np.float32)
    have_pg = False
    slow = 1.0
    if cfg.inject_slow:
        who, factor = parse_inject_slow(cfg.inject_slow)
        slow = factor if who == grid.rank else 1.0
    task = np.zeros(TASK_SLOTS, dtype=np.int64)
    result = np.zeros(RESULT_SLOTS, dtype=np.float64)
    from hpcps.engine.conv_hogwild import engine_for
    engine = engine_for(ctx.full_model, cfg.activation, threads=cfg.threads,
                        batch=PORTION_CHUNK)   # see the module docstring
    wire = Wire.named(cfg.wire_dtype)
    fetch = [Message(size, wire) for size in plan.sizes]
    push = [Message(size, wire) for size in plan.sizes]
    ask, ack = Message(0), Message(0)
    current, order, order_of = None, None, None
    done_portions = 0
    compute_s = 0.0
    moved = 0  # bytes of parameters fetched and gradients pushed, with their requests
    fetch_bytes = ask.buf.nbytes * plan.n_shards + sum(f.buf.nbytes for f in fetch)
    while True:
        wait_all([net.post_recv(task, coord, SandblasterTag.TASK)], cfg.timeout,
                 f"the coordinator (rank {coord}) to send work")
        kind, batch, portion, lo, hi, accept, vec, data_batch = (int(v) for v in task)
        ctx.stop_tick()  # the coordinator decides; a replica only passes a signal on
        if accept and have_pg:
            acc += pg
        have_pg = False
        if kind == Task.STOP:
            break
        if kind == Task.EVALUATE:
            _fetch(net, layout, plan, fetch, ask, vec, x, cfg.timeout)
            moved += fetch_bytes
            loss, accuracy = ctx.score(model, x, "val" if portion == 1 else "test")
            result[:] = (int(Task.EVALUATE), batch, 0, loss, accuracy, 0)
            net.send(result, coord, SandblasterTag.RESULT)
            continue
        if batch != current:  # parameters are fetched once per evaluation of a batch
            _fetch(net, layout, plan, fetch, ask, vec, x, cfg.timeout)
            moved += fetch_bytes
            acc[:] = 0.0
            current = batch
        if data_batch != order_of:
            order, order_of = batch_order(ctx, data_batch), data_batch
        if kind == Task.PORTION:
            if math.isinf(slow) and done_portions > 0:
                _stall(net, coord, task, cfg.timeout)  # stops answering, as a dead machine
                break
            t = time.perf_counter()
            tr = trace.ACTIVE
            t0 = tr.now() if tr is not None else 0
            rows = order[lo:hi]
            # sums, not means, so portions of any size add up exactly
            loss_sum, _, _ = engine.gradient_sum(x, ctx.train_x, ctx.train_y, rows, pg)
            if tr is not None:
                tr.span(trace.COMPUTE, "portion gradient", t0,
                        {"examples": len(rows), "batch": batch, "portion": portion})
            loss = loss_sum / max(len(rows), 1)
            elapsed = time.perf_counter() - t
            compute_s += elapsed
            if 1.0 < slow < math.inf:
                time.sleep((slow - 1.0) * elapsed)
            have_pg = True
            done_portions += 1
            result[:] = (int(Task.PORTION), batch, portion, loss * len(rows), len(rows), 0)
            net.send(result, coord, SandblasterTag.RESULT)
        elif kind == Task.FLUSH:
            for s in range(plan.n_shards):
                msg = push[s]
                msg.header[H.VECTOR] = vec
                plan.take(s, acc, out=msg.payload)
                msg.pack()
                req = net.post_recv(ack.buf, layout.server_rank(s), SandblasterTag.PUSH_ACK)
                net.send(msg.buf, layout.server_rank(s), SandblasterTag.PUSH)
                wait_all([req], cfg.timeout, f"server shard {s} to take a gradient push")
                moved += msg.buf.nbytes + ack.buf.nbytes
            acc[:] = 0.0
            result[:] = (int(Task.FLUSH), batch, 0, 0, 0, 0)
            net.send(result, coord, SandblasterTag.RESULT)
    return {"replica_portions": done_portions, "compute_s": compute_s, "bytes_moved": moved}


def _fetch(net, layout, plan, msgs, ask, vec, out, timeout) -> None:
    reqs = [net.post_recv(msgs[s].buf, layout.server_rank(s), Tag.PARAMS)
            for s in range(plan.n_shards)]
    ask.header[H.VECTOR] = vec
    for s in range(plan.n_shards):
        net.send_eager(ask.buf, layout.server_rank(s), Tag.FETCH)
    wait_all(reqs, timeout, "the server shards to send the parameters", reply_spin_s())
    for s in range(plan.n_shards):
        msgs[s].unpack()
        plan.put(s, msgs[s].payload, out)


def _stall(net, coord, task, timeout) -> None:
    """--inject-slow RANK:stall: answer nothing more, only wait for the coordinator's STOP."""
    poll = Poller()
    deadline = time.monotonic() + timeout
    st = status()
    while True:
        if net.probe(st, SandblasterTag.TASK, coord):
            net.take(task, coord, SandblasterTag.TASK)
            if int(task[0]) == Task.STOP:
                return
        elif time.monotonic() > deadline:
            raise PeerTimeout(f"stalled replica waited {timeout:.0f} s for the end of the job")
        poll.pause()
