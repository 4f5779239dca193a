"""Sandblaster L-BFGS (Dean et al. 2012, section 4.2): batch optimization through the shards.

Roles: S server shards, R replicas and one coordinator (the last rank).

* The **coordinator** runs L-BFGS (:class:`hpcps.optim.LBFGS`: two-loop recursion, history of
  m pairs, strong-Wolfe line search) without ever holding a parameter vector. Every vector
  operation (copy, axpy, scale, dot) is a command of a few bytes to every shard, answered with
  at most one scalar; parameters, gradient, direction and the (s, y) history live on the
  shards, each keeping its slice (:mod:`hpcps.ps.vectors`).
* Each **evaluation** of the objective (one batch: ``--batch-size`` examples, by default the
  whole training set) is cut into ``--portions`` small portions. The coordinator hands a
  portion to whichever replica is free (:class:`hpcps.schedule.PortionScheduler`): faster
  replicas do more; consecutive portions go to the same replica where possible; near the end
  outstanding portions are given again to idle replicas and the first result wins (backup
  tasks). A replica fetches the parameters once per batch and pushes the gradient it
  accumulated over accepted portions every ``--flush-every`` portions; its pushes count only
  once the coordinator commits them, so a replica that stops answering (``--replica-timeout``)
  loses nothing: its uncommitted portions are handed to the others.
* Replica 0 also evaluates test accuracy when asked; the coordinator logs and writes the
  summary. Checkpoints (written by shard 0) hold the L-BFGS history, so a resumed run takes
  the same next step.

A step, for ``--steps`` and the progress line, is one evaluation of a batch.

Numerical health: the coordinator checks the loss at the current point (a scalar) and
``g . g``, one DOT command to the shards, after every iteration, and stops the job on NaN or
infinity (the line search itself never accepts a non-finite trial point, so without the
check a NaN gradient would only reset the history at every iteration); shard 0's checkpoints
go through the writer that refuses non-finite state. A rising loss over mini-batches is
watched as in the SGD strategies, per iteration.

A replica computes each portion's gradient with the compiled engine
(:meth:`hpcps.hogwild.HogwildEngine.gradient_sum`, which falls back to NumPy where the engine
is not built), with ``--threads T`` in T threads: the portion is split in T parts,
each thread sums its part's gradients into its own buffer, and the sums are added in thread
order. There are no Hogwild updates here — L-BFGS needs the exact gradient at the
point it chose — so the result is deterministic for a given T, and equal to the one-thread
gradient to rounding.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
from mpi4py import MPI

from hpcps import faults, trace
from hpcps.blocks import block_range
from hpcps.chunks import DEFAULT_CHUNK_BYTES, ChunkPlan, chunk_elements
from hpcps.comm import PeerTimeout, Poller, gather_to_root, wait_all
from hpcps.errors import CheckpointError, ConfigError, NonFiniteError
from hpcps.metrics import DivergenceWatch
from hpcps.optim import LBFGS
from hpcps.options import (CHUNK_BYTES, HEARTBEAT_TIMEOUT, INJECT_SLOW, Option,
                           parse_inject_slow)
from hpcps.protocol import H, Message, Op, Tag, Task
from hpcps.ps.lbfgs_shard import CMD_SLOTS, VectorShard
from hpcps.schedule import PortionScheduler
from hpcps.strategies.context import (Context, check_test_loss, rate, save_checkpoint,
                                      warn_divergence)
from hpcps.strategies.loop import run_position
from hpcps.strategies.registry import SERVERS, Strategy

TASK_SLOTS = 8     # kind, evaluation, portion, lo, hi, accept previous, vector id, data batch
RESULT_SLOTS = 6   # kind, batch, portion, loss sum (or test loss), examples (or accuracy), spare
PORTION_CHUNK = 256  # rows per engine step when a replica sums a portion's gradient


def vector_names(ctx: Context) -> list[str]:
    return LBFGS.vector_names(ctx.cfg.lbfgs_history)


def shard_plan(ctx: Context) -> ChunkPlan:
    """Which shard holds which ``--chunk-bytes`` chunk of the parameters (:mod:`hpcps.chunks`)."""
    n, S = ctx.full_model.n_params, ctx.grid.layout.servers
    return ChunkPlan(n, chunk_elements(ctx.cfg.chunk_bytes, n, S), S)


def batch_order(ctx: Context, batch: int) -> np.ndarray:
    """Rows of the training set in batch ``batch`` (the same on every rank: a function of the
    seed). The whole set when the batch is the whole set; otherwise consecutive windows of a
    per-epoch permutation."""
    n = ctx.dataset.n_train
    size = ctx.cfg.batch(n)
    if size >= n:
        return np.arange(n)
    per_epoch = n // size
    epoch, k = divmod(batch, per_epoch)
    perm = np.random.default_rng(ctx.cfg.seed * 7919 + epoch).permutation(n)
    return perm[k * size:(k + 1) * size]


# -- coordinator --------------------------------------------------------------------------------
class ShardSpace:
    """The named-vector space of :class:`LBFGS`, each operation a command to every shard."""

    def __init__(self, ctx: Context, names, runner: "BatchRunner"):
        self.comm = ctx.grid.world
        self.servers = ctx.grid.layout.server_ranks
        self.ids = {name: i for i, name in enumerate(names)}
        self.timeout = ctx.cfg.timeout
        self.runner = runner
        self._cmd = np.zeros(CMD_SLOTS, dtype=np.float64)
        self._replies = np.zeros((len(self.servers), 1), dtype=np.float64)
        self.commands = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.evaluations = 0

    def op(self, op: Op, a: int = 0, b: int = 0, alpha: float = 0.0, step: int = 0) -> float:
        reqs = [self.comm.Irecv(self._replies[i], source=r, tag=Tag.SB_REPLY)
                for i, r in enumerate(self.servers)]
        self._cmd[:] = (int(op), a, b, alpha, step, 0.0)
        for r in self.servers:
            self.comm.Send(self._cmd, dest=r, tag=Tag.SB_CMD)
        wait_all(reqs, self.timeout, f"server shards {self.servers} to answer {op.name}")
        self.commands += 1
        self.bytes_sent += self._cmd.nbytes * len(self.servers)
        self.bytes_received += self._replies.nbytes
        return float(self._replies.sum())

    def copy(self, dst, src):
        self.op(Op.COPY, self.ids[dst], self.ids[src])

    def axpy(self, dst, alpha, src):
        self.op(Op.AXPY, self.ids[dst], self.ids[src], alpha)

    def scale(self, dst, alpha):
        self.op(Op.SCALE, self.ids[dst], 0, alpha)

    def dot(self, a, b) -> float:
        return self.op(Op.DOT, self.ids[a], self.ids[b])

    def evaluate(self, x, g) -> float:
        self.evaluations += 1
        gid = self.ids[g]
        self.op(Op.RESET_ACC, gid)
        loss_sum, examples = self.runner.run_batch(self.ids[x], self)
        self.scale(g, 1.0 / examples)  # the mean gradient over the batch
        return loss_sum / examples


class BatchRunner:
    """Hands out the portions of one batch to the replicas and collects their results."""

    def __init__(self, ctx: Context):
        cfg = ctx.cfg
        self.ctx = ctx
        self.comm = ctx.grid.world
        self.replicas = [ctx.grid.layout.replica_rank(r) for r in range(ctx.grid.layout.replicas)]
        self.live = list(self.replicas)
        self.portions = cfg.portions
        self.flush_every = cfg.flush_every
        self.replica_timeout = cfg.replica_timeout
        self.evaluation = ctx.start_step  # which evaluation: replicas fetch x when it changes
        self.data_batch = 0                # which batch of the training set (batch_order)
        self.state = {r: "idle" for r in self.replicas}   # idle | portion | flush
        self.sent_at = {r: 0.0 for r in self.replicas}
        self.accept = {r: 0 for r in self.replicas}
        self._task = np.zeros(TASK_SLOTS, dtype=np.int64)
        self._result = np.zeros(RESULT_SLOTS, dtype=np.float64)
        self.stats = {"reissued": 0, "duplicates": 0, "requeued": 0, "lost_replicas": [],
                      "batch_s": []}

    def _send(self, r: int, kind: Task, batch=0, portion=0, lo=0, hi=0, vec=0) -> None:
        self._task[:] = (int(kind), batch, portion, lo, hi, self.accept[r], vec, self.data_batch)
        self.accept[r] = 0
        self.comm.Send(self._task, dest=r, tag=Tag.SB_TASK)
        self.sent_at[r] = time.monotonic()

    def run_batch(self, vec: int, space: ShardSpace) -> tuple[float, int]:
        """Gradient of training batch ``self.data_batch`` at vector ``vec``, accumulated on
        the shards. Returns (sum of the per-example losses, number of examples)."""
        t0 = time.perf_counter()
        order_len = len(batch_order(self.ctx, self.data_batch))
        cuts = [block_range(order_len, self.portions, p)[0] for p in range(self.portions)]
        cuts.append(order_len)
        sched = PortionScheduler(self.portions, self.live)
        losses = np.zeros(self.portions)
        self.evaluation += 1
        batch = self.evaluation

        def dispatch(r: int) -> None:
            if self.state[r] != "idle" or r not in self.live:
                return
            if len(sched.pending_flush(r)) >= self.flush_every:
                self.state[r] = "flush"
                self._send(r, Task.FLUSH, batch, vec=vec)
                return
            p = sched.next_for(r, time.monotonic())
            if p is None:
                if sched.pending_flush(r):
                    self.state[r] = "flush"
                    self._send(r, Task.FLUSH, batch, vec=vec)
                return
            self.state[r] = "portion"
            self._send(r, Task.PORTION, batch, p, cuts[p], cuts[p + 1], vec)

        for r in list(self.live):
            dispatch(r)
        st = MPI.Status()
        poll = Poller()
        while not sched.finished:
            if not self.comm.Iprobe(MPI.ANY_SOURCE, Tag.SB_RESULT, st):
                if self._check_lost(sched, space):
                    for q in list(self.live):  # the lost replica's portions are free again
                        dispatch(q)
                poll.pause()
                continue
            poll.reset()
            r = st.Get_source()
            self.comm.Recv(self._result, source=r, tag=Tag.SB_RESULT)
            kind, rb, p = int(self._result[0]), int(self._result[1]), int(self._result[2])
            if r not in self.live:
                continue  # declared lost: whatever it says now is ignored
            was = self.state[r]
            self.state[r] = "idle"
            if rb != batch:      # a backup copy of the previous batch, finished late
                self.accept[r] = 0
            elif kind == Task.PORTION and was == "portion":
                if sched.completed(r, p, time.monotonic()):
                    losses[p] = self._result[3]
                    self.accept[r] = 1
                else:
                    self.stats["duplicates"] += 1
            elif kind == Task.FLUSH and was == "flush":
                sched.flushed(r)
                space.op(Op.COMMIT, r)
            for q in list(self.live):
                dispatch(q)
        self.stats["reissued"] += sched.stats["reissued"]
        self.stats["requeued"] += sched.stats["requeued"]
        self.stats["batch_s"].append(time.perf_counter() - t0)
        return float(losses.sum()), order_len

    def _check_lost(self, sched: PortionScheduler, space: ShardSpace) -> bool:
        """Declare lost every busy replica silent for longer than --replica-timeout."""
        now = time.monotonic()
        lost = False
        for r in list(self.live):
            if self.state[r] != "idle" and now - self.sent_at[r] > self.replica_timeout:
                self.live.remove(r)
                sched.lost(r)
                space.op(Op.BAN, r)  # the shards drop whatever it pushed and ignore it
                self.stats["lost_replicas"].append(r)
                self.ctx.metrics.message(
                    f"replica rank {r} did not answer for {self.replica_timeout:g} s: its "
                    "portions go to the other replicas")
                if not self.live:
                    raise PeerTimeout("every replica stopped answering; sandblaster cannot go on")
                lost = True
        return lost

    def evaluate_test(self) -> tuple[float, float]:
        """Ask replica 0 for the test loss and accuracy at the current x."""
        r0 = self.replicas[0]
        if r0 not in self.live:
            return math.nan, math.nan
        while self.state[r0] != "idle":  # a late backup copy still running: take its result
            self._receive_from(r0)
            self.state[r0] = "idle"
            self.accept[r0] = 0
        self._send(r0, Task.EVALUATE, vec=0)
        self._receive_from(r0)
        return float(self._result[3]), float(self._result[4])

    def _receive_from(self, r: int) -> None:
        req = self.comm.Irecv(self._result, source=r, tag=Tag.SB_RESULT)
        wait_all([req], self.ctx.cfg.timeout, f"replica rank {r} to answer")

    def stop(self) -> None:
        for r in self.replicas:  # lost ones too: they wait for this to end
            self.accept[r] = 0
            self._send(r, Task.STOP)


def run_coordinator(ctx: Context) -> dict:
    cfg, m = ctx.cfg, ctx.metrics
    names = vector_names(ctx)
    runner = BatchRunner(ctx)
    space = ShardSpace(ctx, names, runner)
    opt = LBFGS(space, cfg.lbfgs_history)
    if ctx.resumed and ctx.resumed.get("lbfgs"):
        opt.load_state(ctx.resumed["lbfgs"])
    batch_n = cfg.batch(ctx.dataset.n_train)
    whole = batch_n >= ctx.dataset.n_train
    t0 = time.perf_counter()
    losses = []
    runner.data_batch = opt.iterations
    fresh = opt.f is None
    # each iteration's loss is of a whole batch: little noise, so a short window
    watch = DivergenceWatch(span=1, window=5)
    if fresh:
        losses.append(opt.start())
        step = ctx.start_step + space.evaluations
        m.record("progress", step=step, iteration=0, loss=opt.f,
                 **run_position(ctx, step, time.perf_counter() - t0))
        _check_health(space, opt.f, ctx.start_step + space.evaluations)
    next_eval = _next(ctx.start_step, cfg.eval_every)
    next_ckpt = _next(ctx.start_step, cfg.checkpoint_every)
    while ctx.start_step + space.evaluations < ctx.total_steps:
        if ctx.stop_requested():  # SIGTERM/SIGUSR1 (hpcps.stop): checkpoint below, then end
            _note_stop(ctx, ctx.start_step + space.evaluations)
            break
        if not whole and not fresh:  # next batch: the objective changed, and its gradient at x
            runner.data_batch += 1
            opt.start()
        fresh = False
        before = (space.evaluations, space.commands, space.bytes_sent)
        info = opt.step()
        step = ctx.start_step + space.evaluations
        losses.append(info["f"])
        evals = space.evaluations - before[0]
        batch_s = runner.stats["batch_s"][-evals:]
        m.record("progress", step=step, epoch=round(ctx.epochs(step), 3),
                 **run_position(ctx, step, time.perf_counter() - t0),
                 iteration=opt.iterations, loss=info["f"], step_length=info["t"],
                 evaluations=evals, batch_s=round(statistics.median(batch_s), 4),
                 examples_per_s=round(rate(batch_n * evals, sum(batch_s)), 1),
                 commands=space.commands - before[1],
                 coordinator_bytes=space.bytes_sent - before[2],
                 reissued=runner.stats["reissued"], duplicates=runner.stats["duplicates"],
                 lost_replicas=len(runner.stats["lost_replicas"]))
        _check_health(space, info["f"], step)
        fired = watch.update(step, info["f"])
        if fired is not None:
            warn_divergence(ctx, watch, fired, step)
        if not info["accepted"]:
            m.message("line search found no acceptable step: history reset")
        if next_eval and step >= next_eval:
            test_loss, test_acc = _tested(runner, step)
            m.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                     test_accuracy=test_acc, test_loss=test_loss)
            next_eval = _next(step, cfg.eval_every)
        if next_ckpt and step >= next_ckpt:
            _checkpoint(ctx, space, opt, Op.CHECKPOINT, step, {"train_loss": info["f"]})
            next_ckpt = _next(step, cfg.checkpoint_every)
    train_s = time.perf_counter() - t0
    step = ctx.start_step + space.evaluations
    test_loss, test_acc = _tested(runner, step)
    _checkpoint(ctx, space, opt, Op.FINISH, step,
                {"train_loss": opt.f, "test_accuracy": test_acc, "test_loss": test_loss})
    runner.stop()
    monotone = all(b <= a for a, b in zip(losses, losses[1:])) if whole else None
    figures = {
        "iterations": opt.iterations, "final_train_loss": opt.f, "loss_monotone": monotone,
        "median_batch_s": statistics.median(runner.stats["batch_s"] or [math.nan]),
        "coordinator_bytes_per_iteration": space.bytes_sent / max(1, opt.iterations),
        # per step (one batch evaluation): the coordinator's commands and replies here; the
        # replicas' fetches and pushes are added from their results (_summarize)
        "bytes_per_step": (space.bytes_sent + space.bytes_received) / max(1, space.evaluations),
        "evaluations": space.evaluations,
        "commands_per_iteration": space.commands / max(1, opt.iterations),
        "portions_reissued": runner.stats["reissued"],
        "duplicates_discarded": runner.stats["duplicates"],
        "portions_requeued": runner.stats["requeued"],
        "lost_replicas": runner.stats["lost_replicas"]}
    # for hpcps.faults.finish: whom it lost, and how long a live replica may still take to
    # report (one busy with a portion when STOP came may be silent until --replica-timeout)
    lost = {"lost_ranks": list(runner.stats["lost_replicas"]),
            "ending_grace_s": max(faults.ending_grace(cfg.heartbeat_timeout),
                                  runner.replica_timeout)} \
        if cfg.heartbeat_timeout is not None else {}
    return {"step": step, "train_s": train_s, "test_accuracy": test_acc, "test_loss": test_loss,
            **lost, "checkpoint": str(ctx.run_dir / "checkpoint.h5"),
            "examples_per_s": rate(batch_n * space.evaluations, train_s), "figures": figures}


def _note_stop(ctx: Context, step: int) -> None:
    flag = ctx.stop.flag
    why = f"{flag.name} received" if flag.raised else "a stop signal reached another rank"
    ctx.metrics.record("stop", echo=False, step=step, signal=flag.name or None, reason=why)
    ctx.metrics.message(f"stopping early at step {step}: {why}; writing the checkpoint (exit "
                        "code 75: resume with --resume auto)")


def _check_health(space: ShardSpace, f: float, step: int) -> None:
    """Stop the job if the loss or the gradient at the current point is not finite."""
    if not math.isfinite(f):
        raise NonFiniteError(step, f"found the training loss at the current point to be {f}")
    gg = space.dot("g", "g")  # float64 sums of float32 squares: finite iff every element is
    if not math.isfinite(gg):
        raise NonFiniteError(step, "found NaN or infinity in the gradient at the current point "
                             f"(g . g = {gg})")


def _tested(runner: BatchRunner, step: int) -> tuple[float, float]:
    """Test loss and accuracy at x; a non-finite loss stops the job (NaN from a lost
    replica 0 only means nobody could evaluate)."""
    test_loss, test_acc = runner.evaluate_test()
    if runner.replicas[0] in runner.live:
        check_test_loss(test_loss, step)
    return test_loss, test_acc


def _next(step: int, every: int) -> int:
    return (step // every + 1) * every if every else 0


def _checkpoint(ctx, space: ShardSpace, opt: LBFGS, op: Op, step: int, metrics: dict) -> None:
    """Shard 0 gathers the vectors and writes the checkpoint with the L-BFGS scalars."""
    ctx.grid.world.send({"lbfgs": opt.state(), "metrics": metrics},
                        dest=ctx.grid.layout.server_rank(0), tag=Tag.SB_STATE)
    space.op(op, step=step)


# -- replicas -----------------------------------------------------------------------------------
def run_replica(ctx: Context) -> dict:
    cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
    world, layout = grid.world, grid.layout
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
    from hpcps import conv_hogwild
    from hpcps.conv_hogwild import engine_for
    engine = engine_for(ctx.full_model, cfg.activation, threads=cfg.threads,
                        batch=PORTION_CHUNK)   # see the module docstring
    fetch = [Message(size) for size in plan.sizes]
    push = [Message(size) for size in plan.sizes]
    ask, ack = Message(0), Message(0)
    current, order, order_of = None, None, None
    done_portions = 0
    compute_s = 0.0
    moved = 0  # bytes of parameters fetched and gradients pushed, with their requests
    fetch_bytes = ask.buf.nbytes * plan.n_shards + sum(f.buf.nbytes for f in fetch)
    while True:
        wait_all([world.Irecv(task, source=coord, tag=Tag.SB_TASK)], cfg.timeout,
                 f"the coordinator (rank {coord}) to send work")
        kind, batch, portion, lo, hi, accept, vec, data_batch = (int(v) for v in task)
        ctx.stop_tick()  # the coordinator decides; a replica only passes a signal on
        if accept and have_pg:
            acc += pg
        have_pg = False
        if kind == Task.STOP:
            break
        if kind == Task.EVALUATE:
            _fetch(world, layout, plan, fetch, ask, vec, x, cfg.timeout)
            moved += fetch_bytes
            loss, accuracy = conv_hogwild.evaluate(model, x, ctx.test_x, ctx.test_y)
            result[:] = (int(Task.EVALUATE), batch, 0, loss, accuracy, 0)
            world.Send(result, dest=coord, tag=Tag.SB_RESULT)
            continue
        if batch != current:  # parameters are fetched once per evaluation of a batch
            _fetch(world, layout, plan, fetch, ask, vec, x, cfg.timeout)
            moved += fetch_bytes
            acc[:] = 0.0
            current = batch
        if data_batch != order_of:
            order, order_of = batch_order(ctx, data_batch), data_batch
        if kind == Task.PORTION:
            if math.isinf(slow) and done_portions > 0:
                _stall(world, coord, task, cfg.timeout)  # stops answering, as a dead machine
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
            world.Send(result, dest=coord, tag=Tag.SB_RESULT)
        elif kind == Task.FLUSH:
            for s in range(plan.n_shards):
                msg = push[s]
                msg.header[H.VECTOR] = vec
                plan.take(s, acc, out=msg.payload)
                req = world.Irecv(ack.buf, source=layout.server_rank(s), tag=Tag.SB_PUSH_ACK)
                world.Send(msg.buf, dest=layout.server_rank(s), tag=Tag.SB_PUSH)
                wait_all([req], cfg.timeout, f"server shard {s} to take a gradient push")
                moved += msg.buf.nbytes + ack.buf.nbytes
            acc[:] = 0.0
            result[:] = (int(Task.FLUSH), batch, 0, 0, 0, 0)
            world.Send(result, dest=coord, tag=Tag.SB_RESULT)
    return {"replica_portions": done_portions, "compute_s": compute_s, "bytes_moved": moved}


def _fetch(world, layout, plan, msgs, ask, vec, out, timeout) -> None:
    reqs = [world.Irecv(msgs[s].buf, source=layout.server_rank(s), tag=Tag.PARAMS)
            for s in range(plan.n_shards)]
    ask.header[H.VECTOR] = vec
    for s in range(plan.n_shards):
        world.Send(ask.buf, dest=layout.server_rank(s), tag=Tag.FETCH)
    wait_all(reqs, timeout, "the server shards to send the parameters")
    for s in range(plan.n_shards):
        plan.put(s, msgs[s].payload, out)


def _stall(world, coord, task, timeout) -> None:
    """--inject-slow RANK:stall: answer nothing more, only wait for the coordinator's STOP."""
    poll = Poller()
    deadline = time.monotonic() + timeout
    while True:
        if world.Iprobe(coord, Tag.SB_TASK):
            world.Recv(task, source=coord, tag=Tag.SB_TASK)
            if int(task[0]) == Task.STOP:
                return
        elif time.monotonic() > deadline:
            raise PeerTimeout(f"stalled replica waited {timeout:.0f} s for the end of the job")
        poll.pause()


# -- server shards ------------------------------------------------------------------------------
def run_shard(ctx: Context) -> dict:
    cfg, grid = ctx.cfg, ctx.grid
    s = grid.role.shard
    plan = shard_plan(ctx)
    names = vector_names(ctx)
    ids = {name: i for i, name in enumerate(names)}
    coord = grid.layout.n_world - 1
    saved = ["x", "g"] + [f"{k}{i}" for k in "sy" for i in range(cfg.lbfgs_history)]

    def on_gather(op: int, step: int) -> None:
        whole = {name: gather_to_root(grid.server_comm, shard.vec[ids[name]], plan.sizes,
                                      cfg.timeout,
                                      "the other server shards to join a checkpoint gather")
                 for name in saved}
        if s != 0:
            return
        whole = {name: plan.from_shard_order(v) for name, v in whole.items()}
        extra = shard.note  # sent by the coordinator just before this command
        metrics = dict(extra["metrics"], lbfgs=extra["lbfgs"])
        state = {name: whole[name] for name in saved[1:]}
        path = save_checkpoint(ctx, whole["x"], state, step, metrics)
        if op == Op.CHECKPOINT:
            print(f"[hpcps] server shard 0 wrote checkpoint {path} at step {step}", flush=True)

    shard = VectorShard(grid.world, plan.sizes[s], len(names), coord, cfg.timeout, on_gather,
                        ctx.stop_tick, may_lose=cfg.heartbeat_timeout)
    plan.take(s, ctx.params, out=shard.vec[ids["x"]])
    for name, full in ctx.opt_state.items():  # resumed: gradient and history
        plan.take(s, full, out=shard.vec[ids[name]])
    shard.serve()
    return {"shard": s, "commands": shard.commands, "broken_transfers": shard.broken}


# -- declaration --------------------------------------------------------------------------------
def _validate(cfg) -> None:
    if cfg.lr is not None:
        raise ConfigError("--lr does not apply to --strategy sandblaster: L-BFGS chooses each "
                          "step's length by its line search")
    if cfg.inject_slow is not None:
        parse_inject_slow(cfg.inject_slow)
    faults.check_options(cfg)


def _check_resume(cfg, ckpt) -> None:
    lbfgs = ckpt.metrics.get("lbfgs")
    if lbfgs and lbfgs.get("m") != cfg.lbfgs_history:
        raise CheckpointError(f"checkpoint {cfg.resume} holds an L-BFGS history of "
                              f"{lbfgs.get('m')} pairs; resume with --lbfgs-history "
                              f"{lbfgs.get('m')}")


def _describe(cfg, n_train: int) -> str:
    return (f"L-BFGS m={cfg.lbfgs_history}, batch {cfg.batch(n_train)} examples in "
            f"{cfg.portions} portions")


def _summary_lines(f: dict) -> list[str]:
    return [f"{f['iterations']} L-BFGS iterations, training loss {f['final_train_loss']:.4f}, "
            f"{f['median_batch_s']:.2f} s per batch, {f['coordinator_bytes_per_iteration']:.0f} "
            f"bytes of commands per iteration; {f['portions_reissued']} portions re-issued as "
            f"backups, {f['duplicates_discarded']} late duplicates discarded, "
            f"{len(f['lost_replicas'])} replica(s) lost"]


def _summarize(ctx: Context, results: list[dict]) -> dict:
    """The coordinator's figures, with ``bytes_per_step`` counting every byte a step (one
    batch evaluation) moves: the coordinator's commands and the replicas' parameter fetches
    and gradient pushes (``replica_bytes_per_step``)."""
    figures = dict(results[ctx.reporter].get("figures", {}))
    evaluations = max(1, figures.pop("evaluations", 1))
    replicas = sum(r.get("bytes_moved", 0) for r in results if r.get("role") == "replica")
    figures["replica_bytes_per_step"] = replicas / evaluations
    figures["bytes_per_step"] = figures.get("bytes_per_step", 0.0) + replicas / evaluations
    if ctx.cfg.heartbeat_timeout is not None:  # named as downpour names them
        figures["lost_ranks"] = sorted(figures["lost_replicas"])
    return figures


STRATEGY = Strategy(
    name="sandblaster",
    help="batch L-BFGS run by a coordinator through vector commands to the server shards; "
         "replicas compute portions of each batch, backup copies of the last ones "
         "(DistBelief's Sandblaster)",
    roles={"replica": run_replica, "server": run_shard, "coordinator": run_coordinator},
    servers=SERVERS,
    coordinator=True,
    options=(
        Option("lbfgs_history", int, "(s, y) pairs L-BFGS keeps (default 10)",
               check="positive"),
        Option("portions", int, "portions each batch is cut into and handed to free replicas "
               "(default 64)", check="positive"),
        Option("flush_every", int, "a replica pushes its accumulated gradient every this many "
               "portions (default 4)", check="positive"),
        INJECT_SLOW, HEARTBEAT_TIMEOUT,
        Option("replica_timeout", float, "seconds without an answer before a replica's "
               "portions go to the others (default 60)", check="positive"),
        CHUNK_BYTES,
    ),
    defaults={"servers": 1, "batch_size": 0, "lbfgs_history": 10, "portions": 64,
              "flush_every": 4, "replica_timeout": 60.0, "chunk_bytes": DEFAULT_CHUNK_BYTES},
    optimizers=("lbfgs",),
    summarize=_summarize,
    model_parallel=False,
    whole_batch=True,
    epochs=40.0,  # a step is one evaluation of a whole batch (by default the whole set)
    replica_data="whole",  # any replica may be handed any portion
    validate=_validate,
    check_resume=_check_resume,
    describe=_describe,
    summary_lines=_summary_lines,
)
