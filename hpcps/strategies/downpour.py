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

import math
import time

import numpy as np

from hpcps import compress, faults
from hpcps.chunks import DEFAULT_CHUNK_BYTES, ChunkPlan, chunk_elements
from hpcps.comm import dup_comm, gather_to_root, wait_all
from hpcps.errors import ConfigError
from hpcps import optim
from hpcps.options import (
    CHUNK_BYTES,
    COMPRESSION,
    GOLOMB,
    HEARTBEAT_TIMEOUT,
    TAU,
    WARMUP_STEPS,
    Option,
)
from hpcps.protocol import H, Message, Tag
from hpcps.ps import activations, persist, replicated
from hpcps.ps.client import Client
from hpcps.ps.consistency import SoftSync, StaleSynchronous
from hpcps.ps.epochs import EpochClock, EpochKeeper, epoch_plan
from hpcps.ps.gradient_shard import GradientShard
from hpcps.ps.liveness import HEARTBEATS_PER_TIMEOUT, HeartbeatThread, Liveness
from hpcps.strategies.context import (
    Context,
    finish_on_chief,
    save_checkpoint,
    steps_for_replica,
)
from hpcps.strategies.loop import LOOP_OPTIONS, ReplicaLoop, check_options
from hpcps.strategies.registry import SERVERS, Strategy
from hpcps.threshold import (
    ResidualWatch,
    Threshold,
    Velocity,
    check_config,
    clip_norm,
    describe_tau,
)

MANIFEST = persist.MANIFEST_NAME
TAU_BYTES = 4  # float32 tau in front of each compressed push: what each word stands for


def part_sizes(ctx: Context) -> list[int]:
    """Length of each partition's slice of the parameters (one entry when P = 1)."""
    return list(getattr(ctx.model, "part_sizes", [ctx.model.n_params]))


def shard_policy(ctx: Context, n: int):
    """What a push and a fetch do on this shard (None: apply and answer at once)."""
    cfg = ctx.cfg
    if cfg.staleness_bound is not None:
        return StaleSynchronous(cfg.staleness_bound, ctx.grid.layout.replicas,
                                clock_offsets(ctx))
    if cfg.softsync is not None or cfg.staleness_lr == "on":
        return SoftSync(n, cfg.softsync or 1, cfg.staleness_lr == "on")
    return None


def clock_offsets(ctx: Context) -> list[int]:
    """Each replica's clock at start under a staleness bound: the replicas that join after
    replica 0's warm start begin with its warm-start steps (they start from its parameters)."""
    warmup = ctx.cfg.warmup_steps if ctx.start_step == 0 else 0
    return [0] + [warmup] * (ctx.grid.layout.replicas - 1)


def warmup_steps(ctx: Context) -> int:
    """Replica 0's warm-start steps in this run (none when resuming)."""
    return ctx.cfg.warmup_steps if ctx.start_step == 0 else 0


def epochs_of(ctx: Context) -> list[tuple[int, list[int]]]:
    """--epoch-quorum: the run's epochs and each replica's share of them
    (:func:`hpcps.ps.epochs.epoch_plan`; every rank computes the same)."""
    n = ctx.dataset.n_train
    return epoch_plan(ctx.start_step, ctx.total_steps, n / ctx.cfg.batch(n),
                      ctx.grid.layout.replicas, warmup_steps(ctx))


def partition_plan(ctx: Context, part: int) -> ChunkPlan:
    """Which of partition ``part``'s own S/P shards holds which chunk of its slice.

    Each partition has its own S/P shards (so a partition talks only to the shards that hold
    its parameters); its slice is cut into ``--chunk-bytes`` chunks hashed to them
    (:mod:`hpcps.chunks`). Activation pushes keep one contiguous run of whole rows per shard.
    """
    per = ctx.grid.layout.servers // ctx.grid.layout.partitions
    if ctx.cfg.push == "activations":  # whole rows per shard (P = 1)
        return ChunkPlan.contiguous(activations.row_aligned_ranges(ctx.model, per))
    n = part_sizes(ctx)[part]
    return ChunkPlan(n, chunk_elements(ctx.cfg.chunk_bytes, n, per), per)


def shard_locals(ctx: Context) -> list[tuple[int, int, ChunkPlan, int]]:
    """For every shard in order: (partition, offset of the partition's slice in the global
    vector, the partition's plan, the shard's index among the partition's shards)."""
    sizes = part_sizes(ctx)
    base = np.cumsum([0] + sizes)
    out = []
    for part in range(len(sizes)):
        plan = partition_plan(ctx, part)
        out += [(part, int(base[part]), plan, j) for j in range(plan.n_shards)]
    return out


class PackedPusher:
    """Strom-compressed pushes: the residual stays on the replica, each shard gets a message.

    The accumulated gradient, permuted to shard order (each shard's chunks contiguous,
    :meth:`hpcps.chunks.ChunkPlan.to_shard_order`), is added to the residual, kept in that
    order; elements past +-tau become 1-bit words (``hpcps.compress.threshold``), which are
    cut at the shard boundaries (words are sorted by index), re-based to each shard's local
    vector and coded. Each body starts with the tau it was cut at (float32): with ``--tau
    auto`` every replica's tau is its own and changes from push to push
    (:class:`hpcps.threshold.Threshold`).

    With momentum (``--optimizer momentum``) the replica keeps the velocity and pushes its
    thresholded velocity (Deep Gradient Compression's momentum correction,
    :class:`hpcps.threshold.Velocity`); the shards then take plain SGD steps.
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
        self.watch = ResidualWatch()

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


def shard_expander(n_local: int):
    """For a shard: turn a received message into a dense gradient of its slice (zeros except
    +-tau at the message's indices, tau as the message carries it), reusing one buffer."""
    dense = np.zeros(n_local, dtype=np.float32)
    touched = np.empty(0, dtype=np.intp)

    def expand(body: np.ndarray) -> np.ndarray:
        nonlocal touched
        dense[touched] = 0.0
        touched = np.empty(0, dtype=np.intp)
        if len(body) < TAU_BYTES:
            raise compress.CodecError(f"compressed push of {len(body)} bytes: too short to "
                                      "hold its tau")
        tau = float(np.frombuffer(body[:TAU_BYTES].tobytes(), dtype="<f4")[0])
        if not (np.isfinite(tau) and tau > 0):
            raise compress.CodecError(f"compressed push carries tau = {tau}; it must be "
                                      "positive and finite")
        words = compress.decode(body[TAU_BYTES:], n_local)
        compress.apply(dense, words, tau)
        touched = (words >> 1).astype(np.intp)
        return dense

    return (TAU_BYTES + compress.max_message_bytes(n_local), Tag.PUSH_COMPRESSED,
            lambda h, body: expand(body))


def momentum_corrected(cfg) -> bool:
    """Compressed pushes with momentum: the replicas keep the velocity, the shards run SGD."""
    return cfg.compress == "threshold" and cfg.optimizer == "momentum"


def shard_activation_handler(ctx: Context, lo: int, hi: int, params, state):
    """For a shard: apply pushed layer inputs and errors to its rows (Project Adam)."""
    chunk = activations.pieces(ctx.model, lo, hi)
    bound = activations.max_message_bytes(ctx.model, chunk, ctx.cfg.batch_size * ctx.cfg.n_push)

    def handle(header, body):
        activations.apply(ctx.model, chunk, int(header[H.EXAMPLES]), body.view(np.float32),
                          params, state, ctx.optimizer)
        return None  # applied here, tile by tile

    return bound, Tag.PUSH_ACTIVATIONS, handle


# -- replicas ----------------------------------------------------------------------------------
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
            agree = dup_comm(grid.replica_comm, 1, cfg.timeout, "the other partitions of "
                             "this replica to set up the epoch clock")[0] \
                if layout.partitions > 1 else None
            self.epochs = EpochClock(grid.world, layout.server_rank(0), shares, r,
                                     cfg.timeout, announce=part == 0, agree=agree)
        self.advance_due = False  # an iteration ran whose end the epoch clock has not seen
        plan = partition_plan(ctx, part)
        ranks = [layout.server_rank(part * plan.n_shards + j) for j in range(plan.n_shards)]
        self.pusher = PackedPusher(
            plan, Threshold.from_config(cfg, model.n_params, DOWNPOUR_TAU),
            cfg.golomb == "on", cfg.momentum if momentum_corrected(cfg) else None) \
            if cfg.compress == "threshold" else None
        self.grad_clip = (cfg.grad_clip or 0.0) / np.sqrt(R)
        self.activations = cfg.push == "activations"
        # a conv model's conv layers go dense with activation pushes: their summed gradient
        self.dense_layers = self.activations and None in activations.layer_dims(model)
        if self.activations:
            self.chunks = [activations.pieces(model, lo, hi) for lo, hi in plan.ranges]
            k_max = cfg.batch_size * cfg.n_push
            bounds = [activations.max_message_bytes(model, c, k_max) for c in self.chunks]
        else:
            bounds = [TAU_BYTES + compress.max_message_bytes(size) for size in plan.sizes]
        packed = self.pusher is not None or self.activations
        if cfg.ps_copies > 1:
            self.client = replicated.ReplicatedClient(grid.world, ranks, plan, r, cfg.timeout,
                                                      cfg.ps_copies,
                                                      packed_bytes=bounds if packed else None)
        else:
            self.client = Client(grid.world, ranks, plan, r, cfg.timeout,
                                 packed_bytes=bounds if packed else None)
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

    def run(self) -> dict:
        if self.heartbeat is not None:
            self.heartbeat.start()
        try:
            if self.replica != 0 and self.warmup > 0:
                self._wait_for_release()
            elif not self.released:
                self.ctx.metrics.message(f"warm start: replica 0 trains alone for "
                                         f"{self.warmup} steps")
            return super().run()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _wait_for_release(self) -> None:
        self.ctx.metrics.message(f"replica {self.replica} waits for replica 0's warm start")
        leader = self.layout.replica_rank(0, self.ctx.grid.role.partition)
        req = self.ctx.grid.world.Irecv(self.flag.buf, source=leader, tag=Tag.WARMUP_DONE)
        wait_all([req], self.cfg.timeout, f"replica 0 (rank {leader}) to finish its "
                 f"{self.warmup}-step warm start")

    def _release(self) -> None:
        part = self.ctx.grid.role.partition
        for other in range(1, self.layout.replicas):
            dest = self.layout.replica_rank(other, part)
            self.release_reqs.append(self.ctx.grid.world.Isend(self.flag.buf, dest=dest,
                                                               tag=Tag.WARMUP_DONE))
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
            client.push_packed([activations.pack(model, c, modes, ins, errs, dense)
                                .view(np.uint8) for c in self.chunks],
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
            loss = self.source(self.params, x, y, self.grad)
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

    def global_step(self) -> int:
        return self.info["step"]

    def run_complete(self) -> bool:
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
        self.client.done()
        if self.epochs is not None:
            self.epochs.drain()

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
        if self.ctx.grid.is_chief:
            out.update(_finish_chief(self.ctx, self._t0))
        return out


def run_replica(ctx: Context) -> dict:
    return DownpourReplica(ctx).run()


def _final_message(ctx: Context) -> Message:
    """Buffer for the final whole-model state: parameters, then each optimizer state vector."""
    n = ctx.full_model.n_params
    return Message(n * (1 + len(ctx.optimizer.state_keys)))


def _finish_chief(ctx: Context, t0: float) -> dict:
    """Receive the final state from shard 0, evaluate it, write the final checkpoint.

    Shard 0 sends it once every replica is done, so the training time runs from ``t0`` (the
    start of the chief's loop) to its arrival: replica 0's own loop may end long before a slow
    replica's, and its rate would then overstate the job's."""
    layout = ctx.grid.layout
    if ctx.cfg.ps_copies > 1:  # each set from its primary at the end
        cfg = ctx.cfg
        params, state, step, applied = replicated.receive_final(
            ctx.grid.world, partition_plan(ctx, 0), list(ctx.optimizer.state_keys),
            layout.server_ranks, cfg.heartbeat_timeout, cfg.timeout)
        train_s = time.perf_counter() - t0
        out = finish_on_chief(ctx, params, state, step, train_s)
        return {**out, "train_s": train_s, "ps_applied": applied}
    msg = _final_message(ctx)
    req = ctx.grid.world.Irecv(msg.buf, source=layout.server_rank(0), tag=Tag.FINAL)
    wait_all([req], ctx.cfg.timeout, f"the final parameters from server shard 0 "
             f"(rank {layout.server_rank(0)})")
    n = ctx.full_model.n_params
    train_s = time.perf_counter() - t0
    state = {k: msg.payload[(i + 1) * n:(i + 2) * n]
             for i, k in enumerate(ctx.optimizer.state_keys)}
    out = finish_on_chief(ctx, msg.payload[:n], state, int(msg.header[H.STEPS]), train_s)
    return {**out, "train_s": train_s}


# -- server shards -----------------------------------------------------------------------------
def run_server(ctx: Context) -> dict:
    if ctx.cfg.ps_copies > 1:
        return run_replicated_server(ctx)
    cfg, grid = ctx.cfg, ctx.grid
    s = grid.role.shard
    shards = shard_locals(ctx)
    part, base, plan, j = shards[s]
    size = plan.n

    def mine(vec: np.ndarray) -> np.ndarray:
        return plan.take(j, vec[base:base + size])

    params = mine(ctx.params)
    state = {k: mine(v) for k, v in ctx.opt_state.items()}
    keys = list(ctx.optimizer.state_keys)

    def unshuffle(vec: np.ndarray) -> np.ndarray:
        """The global vector from the shards' local vectors one after the other: each
        partition's segment is in its plan's shard order."""
        out = np.empty_like(vec)
        for q, b, p, k in shards:
            if k == 0:
                p.from_shard_order(vec[b:b + p.n], out[b:b + p.n])
        return out

    def gather() -> tuple[np.ndarray, dict] | None:
        """The whole model (MLP layout) and optimizer state on shard 0, from every shard's
        chunks; None on the other shards. Collective over the server communicator."""
        counts = [p.sizes[k] for _, _, p, k in shards]
        gathered = [gather_to_root(grid.server_comm, local, counts, cfg.timeout,
                                   "the other server shards to join a gather of the model")
                    for local in [params] + [state[k] for k in keys]]
        if s != 0:
            return None
        full = [ctx.global_to_full(unshuffle(v)) for v in gathered]
        return full[0], dict(zip(keys, full[1:]))

    def on_boundary(step: int) -> None:
        got = gather()
        if got is not None:
            path = save_checkpoint(ctx, got[0], got[1], step)
            print(f"[hpcps] server shard 0 wrote checkpoint {path} at step {step}", flush=True)

    keeper = None
    if cfg.epoch_quorum is not None and s == 0:
        layout = grid.layout
        keeper = EpochKeeper(grid.world, epochs_of(ctx), cfg.epoch_quorum,
                             [[layout.replica_rank(r, p) for p in range(layout.partitions)]
                              for r in range(layout.replicas)])
    persister = persist.start(ctx, s, shards, params, state, cfg.persist_every,
                              ctx.start_step) if cfg.persist_every is not None else None
    liveness, replica_of = None, None
    if cfg.heartbeat_timeout is not None:  # replicas may die (P = 1: replica r is rank r)
        layout = grid.layout
        liveness = Liveness(layout.replicas, cfg.heartbeat_timeout)
        replica_of = {layout.replica_rank(r): r for r in range(layout.replicas)}
    # momentum-corrected compressed pushes carry the velocity already: the shard steps SGD
    apply = optim.SGD(cfg.lr).apply if momentum_corrected(cfg) else ctx.optimizer.apply
    # --lr-schedule: the rate at the global step the shard has counted
    apply = optim.scheduled(apply, cfg.lr_schedule, lambda: server.step, ctx.total_steps)
    server = GradientShard(grid.world, params, state, apply,
                         n_replicas=grid.layout.replicas, step=ctx.start_step,
                         timeout=cfg.timeout, on_boundary=on_boundary,
                         boundary_every=cfg.checkpoint_every,
                         policy=shard_policy(ctx, len(params)),
                         packed=shard_expander(len(params))
                         if cfg.compress == "threshold" else
                         shard_activation_handler(ctx, *plan.ranges[j], params, state)
                         if cfg.push == "activations" else None,
                         tick=ctx.stop_tick, liveness=liveness, replica_of=replica_of,
                         fatal=(0,), epochs=keeper, persist=persister)
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
            "staleness_hist": stats.staleness_hist,
            "held_fetches": stats.held_fetches, "held_s": stats.held_s,
            "combined_updates": getattr(server.policy, "updates", None),
            "combined_pushes": getattr(server.policy, "combined", None),
            "clock_lead_max": server.policy.max_lead
            if isinstance(server.policy, StaleSynchronous) else None,
            "max_staleness": stats.staleness_max, "step": server.step,
            "lost_replicas": stats.lost_replicas, "lost_after_s": stats.lost_after_s,
            "discarded_pushes": stats.discarded_pushes,
            "epochs": keeper.figures() if keeper is not None else None,
            "persist": persister.figures() if persister is not None else None}


def run_replicated_server(ctx: Context) -> dict:
    """A shard of a run with ``--ps-copies C > 1``: a copy of each of C chunk sets
    (:mod:`hpcps.ps.replicated`)."""
    cfg, grid = ctx.cfg, ctx.grid
    layout = grid.layout
    me, S, R = grid.role.shard, layout.servers, layout.replicas
    plan = partition_plan(ctx, 0)
    keys = list(ctx.optimizer.state_keys)
    liveness = Liveness(R, cfg.heartbeat_timeout)
    replica_of = {layout.replica_rank(r): r for r in range(R)}
    server = None
    sets = {}
    for h in replicated.sets_of(me, S, cfg.ps_copies):
        params = plan.take(h, ctx.params)
        state = {k: plan.take(h, v) for k, v in ctx.opt_state.items()}
        apply = optim.SGD(cfg.lr).apply if momentum_corrected(cfg) else ctx.optimizer.apply
        apply = optim.scheduled(apply, cfg.lr_schedule, lambda h=h: sets[h].step,
                                ctx.total_steps)
        sets[h] = GradientShard(grid.world, params, state, apply, n_replicas=R,
                                step=ctx.start_step, timeout=cfg.timeout,
                                on_boundary=lambda b, h=h: server.boundary(h, b),
                                boundary_every=cfg.checkpoint_every,
                                policy=replicated.SetPolicy(h),
                                packed=shard_expander(len(params))
                                if cfg.compress == "threshold" else None,
                                liveness=liveness, replica_of=replica_of, fatal=(0,))

    def save(step: int, parts: dict) -> None:
        params, state = replicated.assemble(plan, parts, keys)
        path = save_checkpoint(ctx, params, state, step)
        print(f"[hpcps] server shard {me} wrote checkpoint {path} at step {step}", flush=True)

    server = replicated.ReplicatedServer(grid.world, me, layout.server_ranks,
                                         [layout.replica_rank(r) for r in range(R)],
                                         cfg.ps_copies, sets, keys, cfg.heartbeat_timeout,
                                         cfg.timeout, save=save)
    server.serve()
    stats = [cs.stats for cs in sets.values()]
    pushes = max(1, sum(s.pushes for s in stats))
    return {"shard": me, "pushes": sum(s.pushes for s in stats),
            "fetches": sum(s.fetches for s in stats),
            "bytes_in": sum(s.bytes_in for s in stats),
            "bytes_out": sum(s.bytes_out for s in stats),
            "mean_staleness": sum(s.staleness_sum for s in stats) / pushes,
            "max_staleness": max(s.staleness_max for s in stats),
            "staleness_hist": [sum(col) for col in zip(*(s.staleness_hist for s in stats))],
            "held_fetches": 0, "held_s": 0.0, "combined_updates": None,
            "combined_pushes": None, "clock_lead_max": None,
            "step": max(cs.step for cs in sets.values()),
            "lost_replicas": server.lost_replicas, "lost_after_s": server.lost_after_s,
            "epochs": None, "persist": None, **server.figures()}


# -- declaration --------------------------------------------------------------------------------
PS_HEARTBEAT_TIMEOUT = 10.0  # --heartbeat-timeout's default with --ps-copies > 1 (seconds)
DOWNPOUR_TAU = 0.01  # default threshold of compressed pushes (gradient units, not weight units)


def _defaults(cfg) -> dict:
    d = {"servers": cfg.partitions,  # one shard per partition
         "lr": 0.01, "n_fetch": 1, "n_push": 1, "warmup_steps": 200, "compress": "none",
         "batch_size": 32, "prefetch": 2, "push": "gradients", "ps_copies": 1}
    if (cfg.ps_copies or 1) > 1:  # replicated shards detect deaths by heartbeats
        d["heartbeat_timeout"] = PS_HEARTBEAT_TIMEOUT
    if cfg.push != "activations":  # activation pushes hold whole rows per shard, not chunks
        d["chunk_bytes"] = DEFAULT_CHUNK_BYTES
    if cfg.compress == "threshold":
        d.update(tau=DOWNPOUR_TAU, golomb="on")
    return d


def _validate(cfg) -> None:
    check_options(cfg)
    faults.check_options(cfg)
    if cfg.ps_copies is not None and cfg.ps_copies > 1:
        _validate_copies(cfg)
    if cfg.epoch_quorum is not None and cfg.epoch_quorum > 1:
        raise ConfigError(f"--epoch-quorum is the fraction of replicas an epoch waits for, "
                          f"at most 1 (Project Adam: 0.75); got {cfg.epoch_quorum}")
    if cfg.epoch_quorum is not None and cfg.staleness_bound is not None:
        raise ConfigError("--epoch-quorum lets an epoch end without its slowest replicas, "
                          "--staleness-bound holds every replica to the slowest: choose one")
    if cfg.push == "activations" and cfg.weight_decay:
        raise ConfigError("--weight-decay is added to the gradients a replica pushes; with "
                          "--push activations the shards compute the fully connected layers' "
                          "updates from activations and errors instead: use --push gradients")
    if cfg.push == "activations" and optim.varies(cfg.lr_schedule):
        raise ConfigError("--lr-schedule scales the updates the shards apply; --push "
                          "activations computes the fully connected layers' updates at the "
                          "fixed --lr in a fused kernel: use --push gradients")
    if cfg.push == "activations" and cfg.chunk_bytes is not None:
        raise ConfigError("--chunk-bytes does not apply to --push activations: a shard applies "
                          "pushed layer inputs and errors to whole rows, so each shard holds one "
                          "run of whole rows instead of hashed chunks")
    if cfg.push == "activations" and (cfg.compress == "threshold" or cfg.partitions > 1
                                      or cfg.threads > 1):
        raise ConfigError("--push activations goes with dense pushes of whole replicas: not "
                          "with --compress threshold, --partitions > 1 or --threads > 1")
    if cfg.compress != "threshold":
        for name in ("tau", "golomb") + tuple(o.name for o in COMPRESSION):
            if getattr(cfg, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} applies to downpour only with --compress threshold")
    else:
        check_config(cfg, DOWNPOUR_TAU)
        if cfg.optimizer == "momentum" and cfg.nesterov == "on":
            raise ConfigError("--compress threshold runs momentum on the replicas before "
                              "thresholding (Deep Gradient Compression's correction), without "
                              "Nesterov's variant: use --nesterov off")
    combining = cfg.softsync is not None or cfg.staleness_lr == "on"
    if combining and cfg.push == "activations":
        raise ConfigError("--softsync and --staleness-lr combine pushed gradients on the shard; "
                          "--push activations applies each push itself: use --push gradients")
    if combining and cfg.staleness_bound is not None:
        raise ConfigError("--staleness-bound holds fetches, --softsync and --staleness-lr "
                          "combine pushes: a shard runs one of the two, choose one")
    if cfg.staleness_bound is not None and cfg.n_fetch not in (None, 1):
        raise ConfigError("--staleness-bound holds a replica at its fetches, so it needs a "
                          f"fetch every step: use --n-fetch 1 (got {cfg.n_fetch})")
    if cfg.heartbeat_timeout is not None and cfg.partitions > 1:
        raise ConfigError("--heartbeat-timeout with --partitions > 1: the partitions of a "
                          "replica exchange activations at every step, so one that dies stalls "
                          "the others of its replica; replicas may die only with --partitions 1")
    if cfg.servers is not None and cfg.servers % cfg.partitions:
        raise ConfigError(f"--servers {cfg.servers} does not divide among --partitions "
                          f"{cfg.partitions}: each partition talks to its own server shards, so "
                          f"S must be a multiple of P (e.g. --servers {cfg.partitions})")


def _validate_copies(cfg) -> None:
    """What replicated shards (--ps-copies > 1) go with."""
    copies, servers = cfg.ps_copies, cfg.servers or cfg.partitions
    if cfg.partitions > 1:
        raise ConfigError("--ps-copies > 1 with --partitions > 1: replicated shards let the "
                          "run go on without a dead rank, and the partitions of a replica "
                          "cannot go on without one of theirs; use --partitions 1")
    if copies > servers:
        raise ConfigError(f"--ps-copies {copies} puts each chunk set on {copies} distinct "
                          f"server shards: use --servers {copies} or more (got {servers})")
    for name, given in (("--push activations", cfg.push == "activations"),
                        ("--softsync", cfg.softsync is not None),
                        ("--staleness-lr on", cfg.staleness_lr == "on"),
                        ("--staleness-bound", cfg.staleness_bound is not None),
                        ("--epoch-quorum", cfg.epoch_quorum is not None),
                        ("--persist-every", cfg.persist_every is not None)):
        if given:
            raise ConfigError(f"--ps-copies > 1 replicates each push as the primary applied "
                              f"it, one at a time; {name} is not replicated: drop one of the "
                              "two")


def _describe(cfg, n_train: int) -> str:
    how = f"{cfg.optimizer} lr={cfg.lr} on the shards, batch {cfg.batch_size}/replica"
    if cfg.compress == "threshold":
        how += f", pushes thresholded at {describe_tau(cfg)}"
        if momentum_corrected(cfg):
            how += " (momentum on the replicas, corrected; SGD on the shards)"
    if cfg.push == "activations":
        how += ", pushes of layer inputs and errors"
    return how


def _summarize(ctx: Context, results: list[dict]) -> dict:
    """Traffic of every replica and staleness seen by every shard, added up."""
    cfg = ctx.cfg
    reps = [r for r in results if "replica_steps" in r]
    shards = [r for r in results if "shard" in r]
    trained = max(1, results[ctx.reporter].get("step", ctx.start_step) - ctx.start_step)
    moved = sum(r["bytes_sent"] + r["bytes_received"] for r in reps)
    out = {"bytes_per_step": moved / trained,
           "mean_staleness": sum(s["mean_staleness"] for s in shards) / max(1, len(shards)),
           "max_staleness": max((s["max_staleness"] for s in shards), default=0.0),
           # pushes by staleness as the first shard that reported saw them: bins 0, 1, 2-3,
           # 4-7, ..., >= 256 (shard 0 unless it was lost)
           "staleness_hist": min(shards, key=lambda s: s["shard"])["staleness_hist"]}
    out.update(results[ctx.reporter].get("figures", {}))  # the chief's model-parallel figures
    if cfg.staleness_bound is not None:  # per shard, averaged over the shards
        out.update(staleness_bound=cfg.staleness_bound,
                   clock_lead_max=max(r["clock_lead_max"] for r in reps + shards),
                   ssp_held_fetches=sum(s["held_fetches"] for s in shards) / len(shards),
                   ssp_held_s=sum(s["held_s"] for s in shards) / len(shards))
    if shards and isinstance(shards[0].get("combined_updates"), int):
        updates = sum(s["combined_updates"] for s in shards)
        out.update(softsync=cfg.softsync or 1, staleness_lr=cfg.staleness_lr or "off",
                   pushes_per_update=sum(s["combined_pushes"] for s in shards) / max(1, updates))
    if cfg.epoch_quorum is not None:
        keeper = next(s["epochs"] for s in shards if s["shard"] == 0)
        out.update(epoch_quorum=cfg.epoch_quorum, **keeper,
                   epoch_left_steps=sum(r["epoch_left"] for r in reps),
                   epoch_wait_s=max((r["epoch_wait_s"] for r in reps), default=0.0))
    if cfg.persist_every is not None:
        kept = [s["persist"] for s in shards]
        out.update(persist_every_s=cfg.persist_every,
                   persist_flushes=sum(k["flushes"] for k in kept),
                   persist_skipped_rounds=sum(k["skipped_rounds"] for k in kept),
                   persist_bytes=sum(k["bytes_written"] for k in kept),
                   persist_write_s=max(k["write_s"] for k in kept),
                   persist_copy_s=max(k["copy_s"] for k in kept),
                   persist_max_window_steps=max(k["max_window_steps"] for k in kept),
                   persisted_step=min(k["persisted_step"] for k in kept))
    if cfg.ps_copies > 1:
        chief = results[ctx.reporter]
        takeovers = [t for s in shards for t in s["takeovers"]]
        out.update(ps_copies=cfg.ps_copies,
                   pushes_committed=sum(r["pushes_committed"] for r in reps),
                   ps_applied=chief.get("ps_applied"),
                   resent_pushes=sum(r["resent_pushes"] for r in reps),
                   replicated_pushes=sum(s["replicated_pushes"] for s in shards),
                   takeovers=[{**t, "served_after_s": None if t["first_served_at"] is None
                               else round(t["first_served_at"] - t["detected_at"]
                                          + t["silent_s"], 3)} for t in takeovers],
                   lost_shard_ranks=sorted({int(k) for s in shards
                                            for k in s["lost_shard_ranks"]}))
    if cfg.heartbeat_timeout is not None:
        layout = ctx.grid.layout
        lost = sorted({int(r) for s in shards for r in s["lost_replicas"]})
        why = {str(layout.replica_rank(r)): next(
            s["lost_replicas"][r] for s in shards if r in s["lost_replicas"]) for r in lost}
        # seconds between the last message from a lost replica and its drop, the longest over
        # the shards: how long the shards waited for a dead replica
        after = {str(layout.replica_rank(r)): max(
            s["lost_after_s"][r] for s in shards if r in s["lost_after_s"]) for r in lost}
        for rank, r in enumerate(results):  # died after its last push (hpcps.faults.finish)
            if r.get("lost") and "why" in r:
                why[str(rank)], after[str(rank)] = r["why"], r["after_s"]
        for s in shards:  # server shards lost (--ps-copies > 1)
            for rank, reason in s.get("lost_shard_ranks", {}).items():
                why.setdefault(str(rank), f"server shard {layout.role(int(rank)).shard}: "
                                          f"{reason}")
        out.update(lost_ranks=sorted(int(k) for k in why), lost_why=why,
                   lost_detected_s=after,
                   discarded_pushes=sum(s["discarded_pushes"] for s in shards))
    pushed = sum(r["bytes_sent"] for r in reps) / trained
    if cfg.push == "activations":
        out.update(push_bytes_per_step=round(pushed),
                   dense_push_bytes_per_step=4 * ctx.full_model.n_params)
    if cfg.compress == "threshold":
        words = sum(r["words_sent"] for r in reps)
        out.update(final_tau=reps[0]["final_tau"] if reps else None,
                   residual_warning=any(r["residual_warning"] for r in reps))
        out.update(push_bytes_per_step=round(pushed), updates_per_step=words / trained,
                   compression_ratio=4 * ctx.full_model.n_params / max(1.0, pushed),
                   bits_per_update=8 * pushed * trained / max(1, words))
    return out


def _summary_lines(f: dict) -> list[str]:
    lines = []
    if "compression_ratio" in f:
        lines.append(f"{f['updates_per_step']:.0f} updates per step, {f['bits_per_update']:.1f} "
                     f"bits per update, compression {f['compression_ratio']:.0f}x of the dense "
                     "gradient")
    if "dense_push_bytes_per_step" in f:
        lines.append(f"pushed {f['push_bytes_per_step']:.0f} bytes per step of layer inputs and "
                     f"errors instead of {f['dense_push_bytes_per_step']} of gradient")
    if f.get("lost_ranks"):
        kinds = "rank(s)" if f.get("lost_shard_ranks") else "replica rank(s)"
        lines.append(f"lost {kinds} {f['lost_ranks']} during the run ("
                     + "; ".join(f"rank {k}: {v}" for k, v in f["lost_why"].items())
                     + f"); {f['discarded_pushes']} late push(es) from them discarded; the "
                     "others finished the run")
    if "ps_copies" in f:
        applied = f["ps_applied"] or []
        line = (f"{f['ps_copies']} copies of every chunk set: {f['pushes_committed']} pushes "
                f"committed, applied to the sets {sorted(set(applied))} time(s)")
        for t in f["takeovers"]:
            line += (f"; set {t['set']} taken over by shard {t['by_shard']} from shard "
                     f"{t['from_shard']} (silent "
                     f"{t['silent_s']:.1f} s), serving again "
                     + (f"{t['served_after_s']:.1f} s after its last sign of life"
                        if t["served_after_s"] is not None else "never (no request came)"))
        if f["resent_pushes"]:
            line += f"; {f['resent_pushes']} uncommitted push(es) sent again to a new primary"
        lines.append(line)
    if "epoch_quorum" in f:
        counted = sorted(set(zip(f["epoch_finished"], f["epoch_counted"])))
        left = any(a < math.ceil(f["epoch_quorum"] * b - 1e-9) for a, b in counted)
        lines.append(f"epoch quorum {f['epoch_quorum']:g}: {f['epochs_ended']} of "
                     f"{f['epochs_planned']} epoch(s) ended, when "
                     + ", ".join(f"{a} of {b}" for a, b in counted)
                     + " replicas had run their share"
                     + (" (the others had left the run)" if left else "")
                     + "; stragglers left "
                     f"{f['epoch_left_steps']} mini-batch(es) of their shares to the next "
                     f"epoch; epochs took {', '.join(f'{t:.1f}' for t in f['epoch_s'])} s")
    if "persist_every_s" in f:
        lines.append(f"persisted every {f['persist_every_s']:g} s: {f['persist_flushes']} "
                     f"flush(es) of {f['persist_bytes'] / 2**20:.1f} MiB in all "
                     f"({f['persist_skipped_rounds']} round(s) skipped while the writer was "
                     f"busy); at most {f['persist_max_window_steps']} step(s) applied and not "
                     f"yet on disk; {MANIFEST} reads the shards' files at step "
                     f"{f['persisted_step']}")
    lines.append(f"staleness: mean {f['mean_staleness']:.2f}, max {f['max_staleness']:.0f} "
                 "shard updates between a replica's fetch and its push")
    if "softsync" in f:
        lines.append(f"softsync {f['softsync']}: {f['pushes_per_update']:.2f} pushes combined per "
                     f"shard update; staleness-scaled rates: {f['staleness_lr']}")
    if "staleness_bound" in f:
        lines.append(f"staleness bound {f['staleness_bound']}: largest lead over the slowest "
                     f"replica {f['clock_lead_max']} steps; {f['ssp_held_fetches']:.0f} fetches "
                     f"held per shard, {f['ssp_held_s']:.2f} s in all")
    return lines


STRATEGY = Strategy(
    name="downpour",
    help="asynchronous replicas fetch parameters from and push gradients to a sharded "
         "parameter server that runs the optimizer (DistBelief's Downpour SGD; the default); "
         "S defaults to P, one shard per partition",
    roles={"replica": run_replica, "server": run_server},
    servers=SERVERS,
    options=(
        Option("n_fetch", int, "fetch fresh parameters from the shards every n_fetch steps "
               "(default 1)", check="positive"),
        Option("n_push", int, "push the accumulated gradient every n_push steps (default 1)",
               check="positive"),
        WARMUP_STEPS,
        Option("compress", str, "'threshold' pushes Strom-compressed gradients (residual kept "
               "on the replica) instead of dense ones; default 'none'",
               choices=("none", "threshold")),
        Option("push", str, "'activations' sends, for fully connected layers where it is fewer "
               "numbers, the k rows of layer inputs and errors since the last push and lets the "
               "shard compute the update (Project Adam); default 'gradients'",
               choices=("gradients", "activations")),
        Option("staleness_bound", int, "stale-synchronous parallel: a replica may not start "
               "step c while the slowest live replica has not completed step c - s - 1 (0: "
               "bulk-synchronous; default: no bound, fully asynchronous)", check="nonneg"),
        Option("softsync", int, "soft synchronization: a shard applies the mean of every s "
               "pushes, from any replicas, as one update (default 1: each push at once)",
               check="positive"),
        Option("staleness_lr", str, "on: take each update at the rate lr/max(1, tau), tau "
               "its staleness (a softsync group's mean staleness) (default off)",
               choices=("on", "off")),
        TAU, *COMPRESSION, GOLOMB, *LOOP_OPTIONS, CHUNK_BYTES,
        Option("persist_every", float, "delayed persistence: every this many seconds each "
               "server shard writes the chunks updated since its last flush to its own HDF5 "
               "file from a background thread, and checkpoint-persisted.h5 reads them as "
               "virtual datasets (Project Adam; --resume takes it; default: none)",
               check="positive"),
        Option("epoch_quorum", float, "Project Adam's end of epoch: an epoch ends once this "
               "fraction of the replicas has run its share of it (0.75 in the paper); the "
               "others leave the rest of theirs and start the next epoch, whose examples they "
               "take up where they stopped. The replicas that finish first wait for the end "
               "(1: every replica finishes every epoch; default: no epoch barrier, each "
               "replica runs its share of the whole run)", check="positive"),
        HEARTBEAT_TIMEOUT,
        Option("ps_copies", int, "copies of every chunk set on distinct server shards "
               "(Project Adam: 3): the primary applies a push, forwards it to the "
               "secondaries and acknowledges it once they hold it; a secondary takes over a "
               "primary silent for --heartbeat-timeout (10 s unless given) and replicas "
               "re-route to it (default 1: one copy, a dead shard ends the job)",
               check="positive")),
    defaults=_defaults,
    validate=_validate,
    describe=_describe,
    summarize=_summarize,
    summary_lines=_summary_lines,
)
