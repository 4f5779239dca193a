"""A downpour replica: fetch every ``n_fetch`` steps, push every ``n_push``, never wait for
another replica (the method: :mod:`hpcps.strategies.downpour`)."""
from __future__ import annotations

import signal
import time

import numpy as np

from hpcps.compress import codec as compress
from hpcps.compress.bf16 import Wire

from hpcps.ps.chunks import ChunkPlan
from hpcps.mpi.comm import Transport, dup_comm, wait_all
from hpcps.mpi.protocol import H, Message, Tag
from hpcps.ps import activations, replicated, spares
from hpcps.ps.client import Client
from hpcps.model.spec import is_embedding_spec
from hpcps.strategies.embedding import EmbeddingRows
from hpcps.ps.epochs import EpochClock
from hpcps.ps.liveness import HEARTBEATS_PER_TIMEOUT, Dropped, HeartbeatThread
from hpcps.runtime.stop import SignalFlag
from hpcps.strategies.context import (
    Context,
    finish_on_chief,
    steps_for_replica,
)
from hpcps.strategies.downpour import DOWNPOUR_TAU, momentum_corrected
from hpcps.strategies.downpour import Tag as DownpourTag
from hpcps.strategies.downpour.plan import (TAU_BYTES, clock_offsets, epochs_of, final_message,
                                           partition_plan, warmup_steps)
from hpcps.strategies.loop import ReplicaLoop
from hpcps.compress.threshold import (
    ResidualWatch,
    Threshold,
    Velocity,
    clip_norm,
)

class PackedPusher:
    """Strom-compressed pushes: the residual stays on the replica, each shard gets a message.

    The accumulated gradient, permuted to shard order (each shard's chunks contiguous,
    :meth:`hpcps.ps.chunks.ChunkPlan.to_shard_order`), is added to the residual, kept in that
    order; elements past +-tau become 1-bit words (``hpcps.compress.codec.threshold``), which are
    cut at the shard boundaries (words are sorted by index), re-based to each shard's local
    vector and coded. Each body starts with the tau it was cut at (float32): with ``--tau
    auto`` every replica's tau is its own and changes from push to push
    (:class:`hpcps.compress.threshold.Threshold`).

    With momentum (``--optimizer momentum``) the replica keeps the velocity and pushes its
    thresholded velocity (Deep Gradient Compression's momentum correction,
    :class:`hpcps.compress.threshold.Velocity`); the shards then take plain SGD steps.
    """

    def __init__(self, plan: ChunkPlan, thr: Threshold, golomb: bool,
                 momentum: float | None = None):
        n = plan.n
        self.plan = plan
        self.residual = np.zeros(n, dtype=np.float32)
        self.ordered = np.empty(n, dtype=np.float32)
        self.out = np.empty(n, dtype=np.uint32)
        self.thr = thr
        self.golomb = golomb
        self.velocity = Velocity(n, momentum) if momentum is not None else None
        self.ranges = list(plan.ranges)
        self.bounds = np.array([lo << 1 for lo, _ in self.ranges] + [n << 1], dtype=np.uint64)
        self.words_sent = 0
        self.watch = ResidualWatch(adaptive=self.thr.density is not None)

    def bodies(self, grad: np.ndarray) -> list[np.ndarray]:
        ordered = self.plan.to_shard_order(grad, self.ordered)
        if self.velocity is not None:
            self.velocity.accumulate(ordered)
        tau = np.float32(self.thr.tau)
        words = compress.threshold(self.residual, ordered, float(tau), out=self.out)
        if self.velocity is not None:
            self.velocity.mask(words)
        self.thr.after_pass(self.residual, len(words))
        self.words_sent += len(words)
        cuts = np.searchsorted(words, self.bounds)
        head = np.frombuffer(np.array([tau], dtype="<f4").tobytes(), dtype=np.uint8)
        return [np.concatenate([head, compress.encode(words[cuts[s]:cuts[s + 1]]
                                                      - np.uint32(lo << 1), self.golomb)])
                for s, (lo, _) in enumerate(self.ranges)]


def epoch_clock(ctx: Context, shares: list[int]) -> EpochClock:
    """--epoch-quorum: this replica's clock of the epochs (its partitions agree on it over a
    copy of the replica communicator)."""
    grid, cfg = ctx.grid, ctx.cfg
    agree = dup_comm(grid.replica_comm, 1, cfg.timeout, "the other partitions of this replica "
                     "to set up the epoch clock")[0] if grid.layout.partitions > 1 else None
    return EpochClock(grid.world, grid.layout.server_rank(0), shares, grid.role.replica,
                      cfg.timeout, announce=grid.role.partition == 0, agree=agree)


def packed_pusher(ctx: Context, plan: ChunkPlan) -> PackedPusher | None:
    """--compress threshold: the residual and the messages to each shard (else None)."""
    cfg = ctx.cfg
    if cfg.compress != "threshold":
        return None
    return PackedPusher(plan, Threshold.from_config(cfg, ctx.model.n_params, DOWNPOUR_TAU),
                        cfg.golomb == "on", cfg.momentum if momentum_corrected(cfg) else None)


def shard_client(ctx: Context, plan: ChunkPlan, ranks: list[int], packed: list[int] | None):
    """A replica's fetches and pushes: to one copy of each chunk, or (--ps-copies) to the
    primary of each chunk set, re-routed when it fails over."""
    cfg, r = ctx.cfg, ctx.grid.role.replica
    if cfg.ps_copies > 1:  # the spares' ranks too: one may become a shard
        table = ranks + ctx.grid.layout.shard_table[len(ranks):]
        return replicated.ReplicatedClient(ctx.grid.world, table, plan, r, cfg.timeout,
                                           cfg.ps_copies, packed_bytes=packed,
                                           n_sets=len(ranks), wire=Wire.named(cfg.wire_dtype))
    return Client(ctx.grid.world, ranks, plan, r, cfg.timeout, packed_bytes=packed,
                  wire=Wire.named(cfg.wire_dtype))


# ----------------------------------------------------------------------------------
class DownpourReplica(ReplicaLoop):
    """Fetch every ``n_fetch`` steps, push every ``n_push``; never wait for another replica.

    Replica 0 trains alone for the warm start, then partition p of replica 0 releases
    partition p of every other replica (each partition rank waits only for its own
    counterpart, so every partition of every replica is released).
    """

    saves_checkpoints = False  # shard 0 writes them from the shards' state

    def __init__(self, ctx: Context):
        cfg, model, grid = ctx.cfg, ctx.model, ctx.grid
        layout = grid.layout
        r, R = grid.role.replica, layout.replicas
        self.warmup = warmup_steps(ctx)
        # replicas may die: every replica runs until the shards have applied the run's steps,
        # so the survivors take over a lost replica's share (with --epoch-quorum: its share
        # of each epoch, which ends without it)
        self.may_lose = cfg.heartbeat_timeout is not None
        shares = [s[r] for _, s in epochs_of(ctx)] if cfg.epoch_quorum is not None else None
        super().__init__(ctx, sum(shares) if shares is not None else
                         ctx.remaining_steps if self.may_lose else
                         steps_for_replica(ctx.remaining_steps, R, r, self.warmup))
        self.layout = layout
        part = grid.role.partition
        self.epochs = None
        if shares is not None:
            # each epoch's share is run in whole iterations of T mini-batches
            self.iterations = sum(-(-k // self.T) for k in shares)
            self.epochs = epoch_clock(ctx, shares)
        self.advance_due = False  # an iteration ran whose end the epoch clock has not seen
        plan = partition_plan(ctx, part)
        ranks = [layout.server_rank(part * plan.n_shards + j) for j in range(plan.n_shards)]
        self.pusher = packed_pusher(ctx, plan)
        self.grad_clip = (cfg.grad_clip or 0.0) / np.sqrt(R)
        self.activations = cfg.push == "activations"
        # a conv model's conv layers go dense with activation pushes: their summed gradient
        self.dense_layers = self.activations and None in activations.layer_dims(model)
        if self.activations:
            self.chunks = [activations.pieces(model, lo, hi) for lo, hi in plan.ranges]
        self.client = shard_client(ctx, plan, ranks, self.packed_bounds(plan)
                                   if self.pusher is not None or self.activations else None)
        self.rows_in, self.rows_err = [], []  # activation pushes: since the last push
        self.params = np.empty(model.n_params, dtype=np.float32)
        self.grad = np.empty(model.n_params, dtype=np.float32)
        self.acc = np.zeros(model.n_params, dtype=np.float32)
        self.acc_steps, self.loss_sum = 0, 0.0
        self.fetch_every = max(1, cfg.n_fetch // self.T)
        self.info = {"step": ctx.start_step}
        self.flag = Message(0)
        self.release_reqs = []
        self.released = r != 0 or R == 1 or self.warmup == 0
        # stale-synchronous parallel: this replica's clock as the shards count it (steps
        # pushed, from the warm-start offset), and its largest lead over the slowest replica
        self.clock = clock_offsets(ctx)[r]
        self.max_lead = 0
        self.heartbeat = HeartbeatThread(grid.world, ranks, r, cfg.heartbeat_timeout /
                                         HEARTBEATS_PER_TIMEOUT) \
            if cfg.heartbeat_timeout is not None else None
        if cfg.ps_copies > 1:  # it stops beating a shard found dead
            self.client.heartbeat = self.heartbeat
        # --spares: the chief hands a dead or departed replica's data shard to a spare
        self.pool = spares.SparePool(
            grid.world, layout, self._replaced, cfg.ps_copies, timeout=cfg.timeout,
            welcome={"cfg": cfg, "feed": ctx.feed, "start_step": ctx.start_step,
                     "run_dir": str(ctx.run_dir)},
            view=getattr(self.client, "view", None)) \
            if grid.is_chief and (layout.spares or layout.joins) else None
        if self.pool is not None and hasattr(self.client, "while_waiting"):
            self.client.while_waiting = self.pool.poll
        self.leave: SignalFlag | None = None  # SIGTERM: leave the run cleanly (not the chief)
        self.left = False

    def _replaced(self, text: str, record: dict, kind: str = "replacement") -> None:
        self.ctx.metrics.message(text)
        self.ctx.metrics.record(kind, echo=False, **record)

    def packed_bounds(self, plan: ChunkPlan) -> list[int]:
        """The largest message each shard may receive from this replica, for packed pushes
        (compressed gradients, or layer inputs and errors)."""
        if self.activations:
            k_max = self.cfg.batch_size * self.cfg.n_push
            return [activations.max_message_bytes(self.ctx.model, c, k_max)
                    for c in self.chunks]
        return [TAU_BYTES + compress.max_message_bytes(size) for size in plan.sizes]

    def run(self) -> dict:
        if self.may_lose and not self.ctx.grid.is_chief:
            # the run goes on without this replica: SIGTERM makes it push what it has and
            # leave at the end of its iteration, as if it had finished
            self.leave = SignalFlag().install((signal.SIGTERM,))
        if self.heartbeat is not None:
            self.heartbeat.start()
        try:
            if self.replica != 0 and self.warmup > 0:
                self._wait_for_release()
            elif not self.released:
                self.ctx.metrics.message(f"warm start: replica 0 trains alone for "
                                         f"{self.warmup} steps")
            return super().run()
        except Dropped as exc:  # the shards took it for dead: its pushes are discarded
            print(f"[hpcps] replica {self.replica} (rank {self.ctx.grid.rank}) leaves: {exc}",
                  flush=True)
            return {**self.finish(0.0), "left": True, "dropped": True}
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _wait_for_release(self) -> None:
        self.ctx.metrics.message(f"replica {self.replica} waits for replica 0's warm start")
        leader = self.layout.replica_rank(0, self.ctx.grid.role.partition)
        req = Transport(self.ctx.grid.world).post_recv(self.flag.buf, leader,
                                                      DownpourTag.WARMUP_DONE)
        wait_all([req], self.cfg.timeout, f"replica 0 (rank {leader}) to finish its "
                 f"{self.warmup}-step warm start")

    def _release(self) -> None:
        part = self.ctx.grid.role.partition
        for other in range(1, self.layout.replicas):
            dest = self.layout.replica_rank(other, part)
            self.release_reqs.append(Transport(self.ctx.grid.world).send_nowait(
                self.flag.buf, dest, DownpourTag.WARMUP_DONE))
        self.released = True

    def _push(self) -> None:
        model, client = self.ctx.model, self.client
        if self.activations:
            layers = range(len(self.rows_in[0]))
            ins = [None if self.rows_in[0][i] is None else
                   np.concatenate([a[i] for a in self.rows_in]) for i in layers]
            errs = [None if self.rows_err[0][i] is None else
                    np.concatenate([e[i] for e in self.rows_err]) for i in layers]
            k = len(next(e for e in errs if e is not None))  # rows since the last push
            modes = activations.activation_layers(model, k)
            dense = model.views(self.acc)  # a conv model's conv layers: summed gradients
            wire = Wire.named(self.cfg.wire_dtype)
            client.push_packed([wire.to_bytes(activations.pack(model, c, modes, ins, errs, dense))
                                for c in self.chunks],
                               self.acc_steps, self.loss_sum, tag=Tag.PUSH_ACTIVATIONS, rows=k)
            self.rows_in.clear()
            self.rows_err.clear()
        elif self.pusher is None:
            client.push(self.acc, self.acc_steps, self.loss_sum)
        else:
            client.push_packed(self.pusher.bodies(self.acc), self.acc_steps, self.loss_sum)
        self.clock += self.acc_steps
        self.acc[:] = 0.0
        self.acc_steps, self.loss_sum = 0, 0.0

    # -- hooks ---------------------------------------------------------------------------------
    def before_step(self) -> None:
        if self.pool is not None:
            self.pool.poll()
        if (self.done // self.T) % self.fetch_every == 0:
            self.info = self.client.fetch(self.params)
            if self.cfg.staleness_bound is not None:
                self.max_lead = max(self.max_lead, self.clock - int(self.info["clock"]))

    def step(self, x, y) -> float:
        T = self.T
        if self.activations:  # keep what the gradient is made of, not the gradient
            with self.source.timed(len(x)):
                loss, ins, errs = activations.parts(self.ctx.model, self.params, x, y,
                                                    self.grad)
            self.rows_in.append(ins)
            self.rows_err.append(errs)
            if self.dense_layers:
                self.acc += self.grad
        else:
            loss = self.gradient(x, y)
            if self.grad_clip > 0:
                clip_norm(self.grad, self.grad_clip)
            if T > 1:
                self.grad *= np.float32(T)  # the sum over the T mini-batches, as n_push sums
            self.acc += self.grad
        self.acc_steps += T
        self.loss_sum += loss * T
        self.advance_due = self.epochs is not None
        if self.acc_steps >= self.cfg.n_push:
            self._push()
        if not self.released and self.done + T >= self.warmup:
            self._release()
            self.ctx.metrics.message("warm start done: all replicas train now")
        return loss

    def gradient(self, x, y) -> float:
        """One iteration's gradient into ``self.grad``; returns its loss."""
        return self.source(self.params, x, y, self.grad)

    def global_step(self) -> int:
        return self.info["step"]

    def stops_alone(self) -> bool:
        """Rank 0 of a run whose ranks may die stops on its signal (``ctx.stop_flag``); its
        DONE tells the shards, whose replies then tell the other replicas
        (:meth:`run_complete`)."""
        return self.ctx.grid.is_chief and self.ctx.stop_requested()

    def run_complete(self) -> bool:
        if self.info.get("stopping"):  # rank 0 stopped the run early
            self.ctx.metrics.message(f"replica {self.replica} ends: rank 0 stopped the run at "
                                     f"global step {self.info['step']}")
            return True
        if self.leave is not None and self.leave.raised:
            self.left = True
            self.ctx.metrics.message(f"replica {self.replica} leaves on SIGTERM at global "
                                     f"step {self.info['step']}")
            return True
        if self.epochs is not None:
            self.advance_due = False
            return self.epochs.advance(self.T)
        return self.may_lose and self.info["step"] + self.acc_steps >= self.ctx.total_steps

    def progress_fields(self) -> dict:
        c, done = self.client, max(1, self.done)
        out = {"loss": self.info.get("loss", float("nan")),
               "staleness": round(self.info.get("staleness", 0.0), 2),
               "max_staleness": self.info.get("max_staleness", 0.0),
               "bytes_per_step": round((c.bytes_sent + c.bytes_received) / done),
               "bytes_sent_per_step": round(c.bytes_sent / done)}
        if self.pusher:
            out["updates_per_step"] = round(self.pusher.words_sent / done, 1)
            out.update(self.pusher.thr.fields(self.pusher.residual))
            warning = self.pusher.watch.update(out["residual_norm"], out["tau"])
            if warning:
                self.ctx.metrics.message(warning)
        if self.cfg.staleness_bound is not None:
            out["clock_lead_max"] = self.max_lead
        if self.cfg.persist_every is not None:  # on every shard's disk, as the last fetch said
            out["unpersisted_steps"] = self.info.get("unpersisted", 0)
            out["persisted_step"] = self.info["step"] - out["unpersisted_steps"]
        return out

    def after_loop(self) -> None:
        if self.acc_steps:
            self._push()
        if not self.released:
            self._release()
        if self.advance_due and not self.stopped_early:  # the last iteration's epoch end
            self.epochs.advance(self.T)
        wait_all(self.release_reqs, self.cfg.timeout,
                 "other replicas to take the warm-start release")
        # every push committed, DONE sent: nobody waits for this one (rank 0's, when it
        # stopped early, makes the shards tell the others to end)
        self.client.done(stop=self.stopped_early and self.ctx.grid.is_chief)
        if self.left:
            spares.report_left(Transport(self.ctx.grid.world), self.replica)
        if self.pool is not None:
            self.pool.release()
        if self.epochs is not None:
            self.epochs.drain()

    def alone_steps(self) -> int:
        return self.warmup if self.replica == 0 and self.layout.replicas > 1 else 0

    def finish(self, train_s: float) -> dict:
        c = self.client
        out = {"replica_steps": self.done, "clock_lead_max": self.max_lead,
               "bytes_sent": c.bytes_sent,
               "bytes_received": c.bytes_received,
               "words_sent": self.pusher.words_sent if self.pusher else None,
               "final_tau": self.pusher.thr.tau if self.pusher else None,
               "residual_warning": self.pusher.watch.fired if self.pusher else None}
        if self.epochs is not None:
            out.update(epoch_left=self.epochs.left, epoch_wait_s=self.epochs.waited_s)
        if self.cfg.ps_copies > 1:
            out.update(c.figures())
        if self.left:
            out["left"] = True
        if self.pool is not None:
            out.update(self.pool.figures())
        if self.ctx.grid.is_chief:
            out.update(_finish_chief(self.ctx, self._t0, self.pool))
        return out


class EmbeddingReplica(EmbeddingRows, DownpourReplica):
    """A replica of an embedding model (:mod:`hpcps.model.ctr`): the dense layers as any
    model's, the batch's embedding rows pulled and pushed by id every step. The chief scores
    the model with the shards' rows, which they serve until it releases them after the final
    evaluation."""

    def after_loop(self) -> None:
        self.drain_rows()
        super().after_loop()  # the dense pushes, then DONE

    def finish(self, train_s: float) -> dict:
        out = super().finish(train_s)
        self.release_rows()
        r = self.rows
        return {**out, "bytes_sent": out["bytes_sent"] + r.bytes_sent,
                "bytes_received": out["bytes_received"] + r.bytes_received,
                "rows_pulled": r.rows_pulled}


def run_replica(ctx: Context) -> dict:
    if is_embedding_spec(ctx.cfg.model):
        return EmbeddingReplica(ctx).run()
    return DownpourReplica(ctx).run()


def _finish_chief(ctx: Context, t0: float, spares_of_chief=None) -> dict:
    """Receive the final state from shard 0, evaluate it, write the final checkpoint.

    Shard 0 sends it once every replica is done, so the training time runs from ``t0`` (the
    start of the chief's loop) to its arrival: replica 0's own loop may end long before a slow
    replica's, and its rate would then overstate the job's."""
    layout = ctx.grid.layout
    if ctx.cfg.ps_copies > 1:  # each set from its primary at the end
        cfg = ctx.cfg
        pool = spares_of_chief  # the spares that became shards are told to leave too
        params, state, step, applied, by_replica = replicated.receive_final(
            ctx.grid.world, partition_plan(ctx, 0), list(ctx.optimizer.state_keys),
            pool.shard_ranks if pool is not None else layout.server_ranks,
            cfg.heartbeat_timeout, cfg.timeout, layout.trainers)
        train_s = time.perf_counter() - t0
        out = finish_on_chief(ctx, params, state, step, train_s)
        return {**out, "train_s": train_s, "ps_applied": applied,
                "ps_applied_by_replica": by_replica}
    msg = final_message(ctx)
    req = Transport(ctx.grid.world).post_recv(msg.buf, layout.server_rank(0), DownpourTag.FINAL)
    wait_all([req], ctx.cfg.timeout, f"the final parameters from server shard 0 "
             f"(rank {layout.server_rank(0)})")
    n = ctx.full_model.n_params
    train_s = time.perf_counter() - t0
    state = {k: msg.payload[(i + 1) * n:(i + 2) * n]
             for i, k in enumerate(ctx.optimizer.state_keys)}
    out = finish_on_chief(ctx, msg.payload[:n], state, int(msg.header[H.STEPS]), train_s)
    return {**out, "train_s": train_s}
