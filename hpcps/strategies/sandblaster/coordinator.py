"""Sandblaster's coordinator: L-BFGS through commands to the shards, portions to replicas."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np


from hpcps.runtime import faults
from hpcps.blocks import block_range
from hpcps.mpi.comm import PeerTimeout, Poller, Transport, source_of, status, wait_all
from hpcps.errors import NonFiniteError
from hpcps.runtime.metrics import DivergenceWatch
from hpcps.model.optim import LBFGS
from hpcps.strategies.sandblaster import Op, Task
from hpcps.strategies.sandblaster import Tag as SandblasterTag
from hpcps.strategies.sandblaster.vector_shard import CMD_SLOTS
from hpcps.strategies.sandblaster.schedule import PortionScheduler
from hpcps.strategies.context import (TEST, VAL, Context, check_test_loss, rate,
                                      split_figures, warn_divergence)
from hpcps.strategies.sandblaster.common import (RESULT_SLOTS, TASK_SLOTS, batch_order,
                                                 vector_names)
from hpcps.strategies.loop import run_position

# --------------------------------------------------------------------------------
class ShardSpace:
    """The named-vector space of :class:`LBFGS`, each operation a command to every shard."""

    def __init__(self, ctx: Context, names, runner: "BatchRunner"):
        self.net = Transport(ctx.grid.world)
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
        reqs = [self.net.post_recv(self._replies[i], r, SandblasterTag.REPLY)
                for i, r in enumerate(self.servers)]
        self._cmd[:] = (int(op), a, b, alpha, step, 0.0)
        for r in self.servers:
            self.net.send_eager(self._cmd, r, SandblasterTag.CMD)
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
        self.net = Transport(ctx.grid.world)
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
        self.net.send_eager(self._task, r, SandblasterTag.TASK)
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
        st = status()
        poll = Poller()
        while not sched.finished:
            if not self.net.probe(st, SandblasterTag.RESULT):
                if self._check_lost(sched, space):
                    for q in list(self.live):  # the lost replica's portions are free again
                        dispatch(q)
                poll.pause()
                continue
            poll.reset()
            r = source_of(st)
            self.net.take(self._result, r, SandblasterTag.RESULT)
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

    def evaluate_test(self, split: str = TEST) -> tuple[float, float]:
        """Ask replica 0 for the loss and accuracy at the current x on ``split`` (the test
        set, or the validation split)."""
        r0 = self.replicas[0]
        if r0 not in self.live:
            return math.nan, math.nan
        while self.state[r0] != "idle":  # a late backup copy still running: take its result
            self._receive_from(r0)
            self.state[r0] = "idle"
            self.accept[r0] = 0
        self._send(r0, Task.EVALUATE, portion=int(split == VAL), vec=0)
        self._receive_from(r0)
        return float(self._result[3]), float(self._result[4])

    def _receive_from(self, r: int) -> None:
        req = self.net.post_recv(self._result, r, SandblasterTag.RESULT)
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
    stopped = False
    while ctx.start_step + space.evaluations < ctx.total_steps:
        if ctx.stop_requested():  # SIGTERM/SIGUSR1 (hpcps.runtime.stop): checkpoint below, then end
            _note_stop(ctx, ctx.start_step + space.evaluations)
            stopped = True
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
        if next_eval and step >= next_eval:  # the validation split when there is one
            split = ctx.eval_split
            loss, acc = _tested(runner, step, split)
            m.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                     **split_figures(split, loss, acc))
            next_eval = _next(step, cfg.eval_every)
        if next_ckpt and step >= next_ckpt:
            _checkpoint(ctx, space, opt, Op.CHECKPOINT, step, {"train_loss": info["f"]})
            next_ckpt = _next(step, cfg.checkpoint_every)
    train_s = time.perf_counter() - t0
    step = ctx.start_step + space.evaluations
    test_loss, test_acc = _tested(runner, step)
    final = {"test_accuracy": test_acc, "test_loss": test_loss}
    if ctx.val_source is not None:
        val_loss, val_acc = _tested(runner, step, VAL)
        final.update(val_accuracy=val_acc, val_loss=val_loss)
    _checkpoint(ctx, space, opt, Op.FINISH, step, {"train_loss": opt.f, **final})
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
    # for hpcps.runtime.faults.finish: whom it lost, and how long a live replica may still take to
    # report (one busy with a portion when STOP came may be silent until --replica-timeout)
    lost = {"lost_ranks": list(runner.stats["lost_replicas"]),
            "ending_grace_s": max(faults.ending_grace(cfg.heartbeat_timeout),
                                  runner.replica_timeout)} \
        if cfg.heartbeat_timeout is not None else {}
    return {"step": step, "train_s": train_s, **final, **lost, "stopped_early": stopped,
            "checkpoint": str(ctx.run_dir / "checkpoint.h5"),
            "examples_per_s": rate(batch_n * space.evaluations, train_s), "figures": figures}


def _note_stop(ctx: Context, step: int) -> None:
    flag = ctx.stop.flag if ctx.stop is not None else ctx.stop_flag
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


def _tested(runner: BatchRunner, step: int, split: str = TEST) -> tuple[float, float]:
    """Loss and accuracy at x on ``split``; a non-finite loss stops the job (NaN from a lost
    replica 0 only means nobody could evaluate)."""
    loss, acc = runner.evaluate_test(split)
    if runner.replicas[0] in runner.live:
        check_test_loss(loss, step, split)
    return loss, acc


def _next(step: int, every: int) -> int:
    return (step // every + 1) * every if every else 0


def _checkpoint(ctx, space: ShardSpace, opt: LBFGS, op: Op, step: int, metrics: dict) -> None:
    """Shard 0 gathers the vectors and writes the checkpoint with the L-BFGS scalars."""
    Transport(ctx.grid.world).send_obj({"lbfgs": opt.state(), "metrics": metrics},
                                       ctx.grid.layout.server_rank(0), SandblasterTag.STATE)
    space.op(op, step=step)
