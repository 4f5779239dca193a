"""The loop every SGD replica rank runs; each strategy supplies how a step combines its work.

sync, downpour and deadreckon replicas differ only in what happens around one mini-batch's
gradient (allreduce it; push it to the shards; threshold it and send it to the peers). The rest
is here, once: drawing batches (from memory or streamed from the file: ``Context.train_batches``)
with background prefetch, Hogwild threads (T mini-batches per iteration), the progress record,
evaluation and periodic checkpoints on replica 0, and the final figures. A strategy subclasses
:class:`ReplicaLoop` and fills in the hooks.

Numerical health, checked here for every strategy built on the loop: the training loss, a
scalar, every step (a non-finite one stops the job: :class:`~hpcps.errors.NonFiniteError`);
the parameters at each progress record and each periodic evaluation or checkpoint (one pass
over the vector, a few times a minute); and the chief feeds its loss to a
:class:`~hpcps.runtime.metrics.DivergenceWatch`, which warns once when the loss climbs and stays
high.
A non-finite gradient or update shows in the next step's loss, so a diverged run stops within
a step or two, before any checkpoint is written from it (and the writer refuses one besides).

Stopping early (SIGTERM or SIGUSR1, :mod:`hpcps.runtime.stop`): after each iteration, once its
evaluation and checkpoint are done, the loop asks whether to stop. Lockstep strategies
(``lockstep = True``: every replica runs the same iterations, sync and averaging) ask the
world-wide vote at the same iteration on every rank; the others poll it at their own pace,
and with P > 1 the partitions of a replica (which exchange activations every step) agree
among themselves in lockstep on what each polled, so they leave after the same iteration. A
stopped loop ends as a finished one does (``after_loop``, ``finish``): the final checkpoint
holds the step reached, and ``train.py`` exits with code 75.

Schedules are counted in this replica's own mini-batches, so that every partition of a
replica (they run the same steps) evaluates and checkpoints at the same iteration and can
gather the model together: replica 0 evaluates every ``ceil(eval_every / R)`` of its
mini-batches, about every ``eval_every`` global steps, on the validation split when the run has
one (``Context.eval_split``), else on the test set.
"""
from __future__ import annotations

import dataclasses
import math
import time
from abc import ABC, abstractmethod

import numpy as np

from hpcps import trace

from hpcps.io import checkpoint

from hpcps.model import optim
from hpcps.io.data import Prefetcher
from hpcps.errors import CollectiveLost, NonFiniteError
from hpcps.runtime.metrics import DivergenceWatch
from hpcps.options import (parse_inject_slow)
from hpcps.runtime.stacks import collect_wait
from hpcps.runtime.stop import StopVote
from hpcps.mpi.comm import (PeerFailed, PeerTimeout, bcast, can_shrink, dup_comm,
                             lost_members, peer_failed, shrink)
from hpcps.strategies.context import (Context, crossed, gather_state, model_parallel_figures,
                                      checkpoint_path, periodic_evaluation, rate,
                                      save_checkpoint,
                                      warn_divergence)
from hpcps.strategies.gradients import GradientSource
from hpcps.strategies.lr_rule import lr_multiplier


def stall(timeout: float) -> None:
    """--inject-slow RANK:stall: stop after the first iteration, as a machine that hangs.

    The ranks that wait for this one time out after ``timeout`` seconds and end the job (each
    rank's stack lands in the run directory, :mod:`hpcps.stacks`); if none waits for it, it
    ends the job itself once the others had time to."""
    limit = 2 * timeout + collect_wait(timeout) + 10
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.2)
    raise PeerTimeout(f"stalled on purpose (--inject-slow ...:stall) and no rank ended the job "
                      f"within {limit:.0f} s")


def per_replica(every: int, replicas: int) -> int:
    """A global-step period as a period of one replica's own mini-batches (0 stays 0)."""
    return max(1, -(-every // replicas)) if every else 0


class ReplicaLoop(ABC):
    """One replica rank's training: :meth:`run` calls the hooks below.

    Hooks
    -----
    step(x, y) -> loss : one iteration on ``x, y`` (T mini-batches with T threads); required.
    global_step() -> int : the run's global step as this rank knows it; required.
    before_step() : at the start of each iteration (fetch, apply what peers sent, ...).
    progress_fields() -> dict : the strategy's figures for a progress record.
    checkpoint_state() -> dict : optimizer state vectors saved with periodic checkpoints.
    checkpoint_metrics() -> dict : scalars saved with them (the chief's; read back from
        ``ctx.resumed`` on ``--resume``).
    after_loop() : after the last iteration (last push, drain messages, ...).
    before_checkpoint(step) : on the chief, before it writes a periodic checkpoint at
        ``step`` (state kept elsewhere, an embedding model's rows on the shards, is written
        first, so that a checkpoint.h5 never names a step whose rows are not on disk).
    finish(train_s) -> dict : the final figures (collective parts included); the chief's
        dict goes into the summary: ``step``, ``test_accuracy``, ``test_loss`` (and
        ``val_accuracy``, ``val_loss`` with a validation split), ``checkpoint``,
        ``examples_per_s`` and ``figures`` (the strategy's own).
    loss_source() -> str : whose loss :meth:`step` returns, for the message when it is not
        finite (default: this replica's own mini-batches).
    run_complete() -> bool : after an iteration: whether the run as a whole is done, so this
        replica leaves before its ``steps`` (default False: each replica runs its share).

    Attributes a subclass sets: ``params`` (the vector this rank computes with, evaluated
    and checkpointed from replica 0), ``saves_checkpoints`` (False when the server shards
    write the periodic checkpoints instead of replica 0).
    """

    saves_checkpoints = True
    lockstep = False  # every replica runs the same iterations and they stop at the same one

    def __init__(self, ctx: Context, steps: int):
        """``steps``: mini-batches this replica runs, rounded up to whole iterations of T."""
        cfg, grid = ctx.cfg, ctx.grid
        self.ctx = ctx
        self.cfg = cfg
        self.source = self.make_source(ctx)
        self.T = self.source.threads
        self.iterations = -(-steps // self.T)
        self.replica = grid.role.replica
        self.first = self.replica == 0
        self.params: np.ndarray = ctx.params
        R = grid.layout.replicas
        self.ckpt_local = per_replica(cfg.checkpoint_every, R) if self.saves_checkpoints else 0
        self.batches = Prefetcher(ctx.train_batches(self.source.batch,
                                                    ctx.batch_seed(self.replica)), cfg.prefetch)
        self.slow = 1.0         # --inject-slow: this rank's steps take this many times longer
        if cfg.inject_slow is not None:
            who, factor = parse_inject_slow(cfg.inject_slow)
            self.slow = factor if who == grid.rank else 1.0
        self.done = 0           # this replica's mini-batches so far
        self.last_loss = float("nan")
        self._loss_win = 0.0
        self._n_win = 0
        self._t0 = self._last_t = time.perf_counter()
        self._cpu0 = time.process_time()
        self._last_step = ctx.start_step
        self.watch = DivergenceWatch()
        self.stopped_early = False
        self.shrinks: list[dict] = []  # collectives shrunk after deaths (ULFM)
        self.replica_vote = None  # the partitions of this replica agreeing on a stop
        if ctx.stop is not None and not self.lockstep and ctx.partitioned:
            comm = dup_comm(grid.replica_comm, 1, cfg.timeout,
                            "the other partitions of this replica to set up the stop vote")[0]
            self.replica_vote = StopVote(comm, ctx.stop.flag, cfg.timeout)

    # -- hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One iteration on mini-batch ``(x, y)``; returns its training loss."""

    def make_source(self, ctx: Context):
        """Where the gradient of a mini-batch comes from (a :class:`GradientSource`, or a
        source with its ``threads``, ``batch``, ``pass_s``, ``pass_cpu_s`` and ``timed``)."""
        return GradientSource(ctx)

    def lr_factor(self) -> float:
        """--lr-schedule's multiplier of the learning rate at this replica's global step."""
        return optim.lr_factor(self.cfg.lr_schedule, self.global_step(), self.ctx.total_steps)

    @abstractmethod
    def global_step(self) -> int:
        """The run's global step (mini-batches of all replicas) as this replica sees it."""

    def before_step(self) -> None:
        return None

    def progress_fields(self) -> dict:
        return {}

    def checkpoint_state(self) -> dict:
        return {}

    def checkpoint_metrics(self) -> dict:
        return {}

    def after_loop(self) -> None:
        return None

    def before_checkpoint(self, step: int) -> None:
        """On the chief, before it writes a periodic checkpoint at global ``step``."""
        return None

    def finish(self, train_s: float) -> dict:
        return {}

    def loss_source(self) -> str:
        return "its own mini-batch" + ("es" if self.T > 1 else "")

    def run_complete(self) -> bool:
        return False

    def alone_steps(self) -> int:
        """Mini-batches this replica trains while the others wait (downpour's warm start on
        replica 0): each moves the global step by one, not by R (default 0)."""
        return 0

    def _global_estimate(self, done: int) -> int:
        """The global steps of this run after this replica's first ``done`` mini-batches,
        were every replica at its pace: the same on every partition of the replica (its
        own count, not the global step it last heard of), so they gather together."""
        alone = min(done, self.alone_steps())
        return alone + (done - alone) * self.ctx.grid.layout.replicas

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict:
        ctx = self.ctx
        m, chief = ctx.metrics, ctx.grid.is_chief
        self._t0 = self._last_t = time.perf_counter()
        self._cpu0 = time.process_time()
        self._last_step = self.global_step()
        try:
            it = 0
            while it < self.iterations:
                tr = trace.ACTIVE
                t_it = tr.now() if tr is not None else 0
                self.before_step()
                x, y = next(self.batches)
                t = time.perf_counter()
                try:
                    self.last_loss = loss = self.step(x, y)
                except Exception as exc:
                    if self.lockstep and lost_member(exc):  # go on without it, or end
                        it = self._member_lost(exc, it)
                        continue
                    raise
                if not math.isfinite(loss):
                    raise NonFiniteError(self.global_step(), f"computed a training loss of "
                                         f"{loss} on {self.loss_source()}")
                if math.isinf(self.slow):
                    stall(self.cfg.timeout)
                if self.slow > 1.0:
                    time.sleep((self.slow - 1.0) * (time.perf_counter() - t))
                self.done += self.T
                if tr is not None:
                    tr.span(trace.STEP, "step", t_it, {"loss": loss})
                self._loss_win += loss
                self._n_win += 1
                if chief:
                    step = self.global_step()
                    fired = self.watch.update(step, loss)
                    if fired is not None:
                        warn_divergence(ctx, self.watch, fired, step)
                    if m.due():
                        self.report()
                self._evaluate_and_save()
                if it + 1 < self.iterations and self.run_complete():
                    break
                try:
                    stop_now = it + 1 < self.iterations and self._stop_now(it + 1)
                except Exception as exc:
                    if not (self.lockstep and lost_member(exc)):
                        raise
                    it = self._member_lost(exc, it + 1)
                    continue
                if stop_now:
                    self._note_stop()
                    break
                it += 1
            loop_s = time.perf_counter() - self._t0  # the iterations, without the ending
            loop_cpu_s = time.process_time() - self._cpu0  # this process's CPU time in them
            if self.replica_vote is not None:
                self.replica_vote.finish()
            if chief and self._n_win:
                self.report()  # the last window: every run's metrics hold a progress record
            self.after_loop()
        finally:
            self.batches.close()
        train_s = time.perf_counter() - self._t0
        result = self.finish(train_s)
        figures = {**model_parallel_figures(ctx, self.done, train_s), **result.get("figures", {})}
        if self.shrinks:  # ranks that died and the collectives shrunk without them (ULFM)
            figures["shrinks"] = self.shrinks
        # this rank's seconds per iteration, of them its gradient passes, and the CPU time
        # its process used per iteration and in the passes (every thread; train.py's
        # summary averages them over the replicas' ranks)
        iterations = max(1, -(-self.done // self.T))
        return {"train_s": train_s, **result, "figures": figures,
                "stopped_early": self.stopped_early,
                "step_s": loop_s / iterations, "pass_s": self.source.pass_s / iterations,
                "pass_cpu_s": self.source.pass_cpu_s / iterations,
                "cpu_s": loop_cpu_s / iterations}

    def _stop_now(self, iteration: int) -> bool:
        """After ``iteration`` (1, 2, ...): whether this rank leaves the loop now."""
        stop = self.ctx.stop
        if stop is None:
            return self.stops_alone()
        if self.lockstep:
            return stop.agreed_at(iteration)
        if self.replica_vote is not None:
            return self.replica_vote.agreed_at(iteration, stop.poll())
        return stop.poll()

    def stops_alone(self) -> bool:
        """In a run without a stop vote (``ctx.stop_flag``, :attr:`Strategy.stops_alone`):
        whether this rank stops now; a strategy that can stop so says when."""
        return False

    def _member_lost(self, exc: Exception, next_it: int) -> int:
        """A lockstep collective failed before iteration ``next_it``: where MPI reported the
        death (ULFM) and the strategy can, the survivors shrink their communicators and go
        on (the iteration they go on from: :meth:`shrink`); otherwise this rank ends as
        :meth:`_collective_lost` says."""
        if not isinstance(exc, PeerTimeout):  # a call on a communicator another revoked
            exc = PeerFailed(f"a collective with the other replicas: {exc}")
        if isinstance(exc, PeerFailed) and can_shrink() and not self.ctx.partitioned:
            resumed = self.shrink(next_it)
            if resumed is not None:
                return resumed
        raise self._collective_lost(exc) from exc

    def shrink(self, next_it: int) -> int | None:
        """Go on without the dead ranks (a lockstep strategy that can says how); None if
        this one cannot."""
        return None

    def _collective_lost(self, exc: PeerTimeout) -> Exception:
        """A lockstep collective timed out or MPI reported a member dead (ULFM): what this rank
        raises.

        With P = 1 the chief holds the whole model as of the last iteration every replica
        completed (the failed collective changed nothing), writes it as the checkpoint and
        ends the job with exit code 75 (:class:`CollectiveLost`). The others wait before
        reporting, so the chief's abort ends them; if the chief is the rank that died, they
        end the job with 75 themselves, the last periodic checkpoint to resume from. Without
        any checkpoint to resume from, or with P > 1 (the model is spread over the replica's
        partitions, one of which may be the dead rank), the timeout stands (exit code 5)."""
        ctx, step = self.ctx, self.global_step()
        path = checkpoint_path(ctx)
        if ctx.grid.is_chief and not ctx.partitioned:
            self.before_checkpoint(step)
            saved = save_checkpoint(ctx, self.params, self.checkpoint_state(), step,
                                    {"train_loss": self.last_loss, **self.checkpoint_metrics()})
            ctx.metrics.record("stop", echo=False, step=step, signal=None,
                               reason=f"a collective failed: {exc}")
            return CollectiveLost(f"{exc}; without ULFM a collective cannot go on without a "
                                  f"member: checkpoint written at step {step} ({saved}); "
                                  "exit code 75: resume with --resume auto on the ranks that "
                                  "are left")
        if ctx.partitioned:
            return exc
        last = f"the last one, {path}" if path.exists() else "none: the run starts again"
        return CollectiveLost(f"{exc}; the chief (rank 0) writes the checkpoint to resume "
                              f"from (if it is the rank lost, {last}): exit code 75, resume "
                              "with --resume auto on the ranks that are left",
                              defer_s=max(10.0, min(60.0, self.cfg.timeout)))

    def _note_stop(self) -> None:
        self.stopped_early = True
        if not self.ctx.grid.is_chief:
            return
        step = self.global_step()
        flag = self.ctx.stop.flag if self.ctx.stop is not None else self.ctx.stop_flag
        mine = flag is not None and flag.raised
        why = f"{flag.name} received" if mine else "a stop signal reached another rank"
        self.ctx.metrics.record("stop", echo=False, step=step,
                                signal=flag.name if mine else None, reason=why)
        self.ctx.metrics.message(f"stopping early at step {step}: {why}; writing the "
                                 "checkpoint (exit code 75: resume with --resume auto)")

    def check_params(self, params: np.ndarray, step: int, where: str) -> None:
        """Stop the job if ``params`` (this rank's vector, or the gathered whole model) holds
        a NaN or infinity. One pass over the vector: call it at progress and checkpoint
        time, not every step."""
        bad = checkpoint.nonfinite({"parameters": params})
        if bad is not None:
            raise NonFiniteError(step, f"found {bad[0]} NaN or infinite value(s) in {where}")

    def report(self) -> None:
        """One progress record: global step, rate, mean loss since the last, the strategy's."""
        step, now = self.global_step(), time.perf_counter()
        self.check_params(self.params, step, "its parameters")
        rec = {"step": step, "epoch": round(self.ctx.epochs(step), 3),
               "examples_per_s": round(rate((step - self._last_step) * self.cfg.batch_size,
                                            now - self._last_t), 1),
               "loss": self._loss_win / max(1, self._n_win)}
        rec.update(run_position(self.ctx, step, now - self._t0))
        rec.update(self.progress_fields())
        rec.update(model_parallel_figures(self.ctx, self.done, now - self._t0))
        self.ctx.metrics.record("progress", **rec)
        self._last_t, self._last_step = now, step
        self._loss_win, self._n_win = 0.0, 0

    def _evaluate_and_save(self) -> None:
        """Replica 0's periodic evaluation and checkpoint (all its partitions gather)."""
        if not self.first:
            return
        now = self._global_estimate(self.done)
        evaluating = crossed(now, now - self._global_estimate(self.done - self.T),
                             self.cfg.eval_every)
        saving = crossed(self.done, self.T, self.ckpt_local)
        if not (evaluating or saving):
            return
        ctx = self.ctx
        full, state = gather_state(ctx, self.params, self.checkpoint_state() if saving else {})
        if not ctx.grid.is_chief:
            return
        step = self.global_step()
        self.check_params(full, step, "the model gathered for evaluation or a checkpoint")
        if evaluating:  # on the validation split when there is one, else the test set
            ctx.metrics.record("eval", step=step, epoch=round(ctx.epochs(step), 3),
                               **periodic_evaluation(ctx, full, step))
        if saving:
            self.before_checkpoint(step)
            path = save_checkpoint(ctx, full, state, step, {"train_loss": self.last_loss,
                                                            **self.checkpoint_metrics()})
            ctx.metrics.record("checkpoint", echo=False, step=step, path=str(path))


def run_position(ctx, step: int, elapsed: float) -> dict:
    """How far along the run is at global ``step``: percent of the run's steps done, and the
    seconds left at the rate of this run so far (None before the first step of this run)."""
    total, start = ctx.total_steps, ctx.start_step
    done = min(1.0, step / total) if total > 0 else 1.0
    ran = step - start
    eta = round(elapsed * max(0, total - step) / ran, 1) if ran > 0 else None
    return {"done_pct": round(100.0 * done, 1), "eta_s": eta}


def lost_member(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer of a collective is gone: a wait that timed out or that MPI
    failed (:class:`PeerTimeout`), or a call MPI refused on a communicator another survivor
    revoked (ULFM)."""
    return isinstance(exc, PeerTimeout) or peer_failed(exc)


class AllReplicasLoop(ReplicaLoop):
    """A replica loop whose update takes one mini-batch (T with threads) from each of the R
    replicas of the partition communicator (sync, averaging): the global step advances by R
    per iteration, and the rate follows ``--lr-rule`` (:mod:`hpcps.strategies.lr_rule`: R
    replicas x T threads, after the warm-up). A subclass sets ``self.R`` before calling
    ``__init__``."""

    R: int
    _base_steps = 0  # global steps before the last shrink (ULFM), this run's
    _done_base = 0   # this replica's mini-batches then
    _world_ranks: list[int] | None = None  # the job's world ranks of the shrunk world's ranks

    def lr_factor(self) -> float:
        """The schedule's multiplier times the linear rule's."""
        return super().lr_factor() * lr_multiplier(self.cfg.lr_rule, self.R, self.T,
                                                   self.global_step(), self.cfg.lr_warmup_steps)

    def global_step(self) -> int:
        return self.ctx.start_step + self._base_steps + (self.done - self._done_base) * self.R

    def shared_state(self) -> list[np.ndarray]:
        """What every replica must hold alike to go on after a shrink (the chief's is sent)."""
        return [self.params, *self.checkpoint_state().values()]

    def rebuild(self) -> None:
        """Rebuild what depends on ``self.comm`` and ``self.R`` (after a shrink)."""

    def shrink(self, next_it: int) -> int | None:
        """A rank died and MPI said so (ULFM): shrink the replicas', the world's and the stop
        vote's communicators to the survivors, take the chief's iteration, parameters and
        state (a survivor may have completed the failed collective while another did not),
        and go on with R - 1 replicas, the dead one's data shard no longer trained. None if
        the chief died: it holds the state the others would go on from, so the run ends as
        without ULFM. Collective over the survivors."""
        ctx, grid = self.ctx, self.ctx.grid
        stop = ctx.stop
        comms = [self.comm, grid.world] + ([stop.comm] if stop is not None else [])
        new = shrink(comms)
        ranks = self._world_ranks or list(range(grid.world.Get_size()))
        gone = lost_members(grid.world, new[1])
        if 0 in gone:
            return None
        self._world_ranks = [r for i, r in enumerate(ranks) if i not in gone]
        if stop is not None:
            stop.replace(new[2])
        ctx.grid = dataclasses.replace(grid, world=new[1], partition_comm=new[0])
        head = np.array([next_it, self.done, self._base_steps, self._done_base, self.R],
                        np.int64)
        what = "the chief's state, after a rank died (the shrunk communicator)"
        for arr in [head, *self.shared_state()]:
            bcast(new[0], arr, 0, self.cfg.timeout, what)
        next_it, done, base, done_base, r_before = (int(v) for v in head)
        self._base_steps = base + (done - done_base) * r_before
        self.done = self._done_base = done
        self.comm, self.R = new[0], new[0].Get_size()
        self.rebuild()
        step = self.global_step()
        self.iterations = next_it + -(-max(0, ctx.total_steps - step) // (self.R * self.T))
        lost = [ranks[i] for i in gone]
        self.shrinks.append({"lost_ranks": lost, "step": step, "replicas": self.R,
                             "at": time.time()})
        if grid.is_chief:
            ctx.metrics.message(f"rank(s) {lost} died: MPI reported it (ULFM), the collectives "
                                f"shrank to the {self.R} replica(s) left, which go on from "
                                f"step {step} (the dead ranks' data shards are no longer "
                                "trained)")
            ctx.metrics.record("shrink", echo=False, **self.shrinks[-1])
        return next_it
