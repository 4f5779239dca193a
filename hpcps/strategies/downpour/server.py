"""Downpour's server shards: the gradient shard with its policy and push decoders, one copy
of each chunk or (``--ps-copies``) a copy of several chunk sets."""
from __future__ import annotations



import numpy as np

from hpcps.compress import codec as compress
from hpcps.compress.bf16 import Wire

from hpcps.mpi.comm import Transport, gather_to_root, wait_all
from hpcps.model import optim
from hpcps.mpi.protocol import HEADER_BYTES, H, Tag
from hpcps.ps import activations, persist, replicated, spares
from hpcps.ps.consistency import SoftSync, StaleSynchronous
from hpcps.ps.epochs import EpochKeeper
from hpcps.ps.gradient_shard import GradientShard
from hpcps.ps.liveness import Liveness
from hpcps.ps.rows import RowShard
from hpcps.strategies.embedding import row_shard, write_rows
from hpcps.ps.serve import serve
from hpcps.model.spec import is_embedding_spec
from hpcps.strategies.downpour import Tag as DownpourTag
from hpcps.strategies.downpour import momentum_corrected, softsync_group
from hpcps.strategies.downpour.plan import (TAU_BYTES, clock_offsets, epochs_of, final_message,
                                           partition_plan, shard_locals)
from hpcps.strategies.context import (
    Context,
    save_checkpoint,
)

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


def shard_policy(ctx: Context, n: int):
    """What a push and a fetch do on this shard (None: apply and answer at once)."""
    cfg = ctx.cfg
    if cfg.staleness_bound is not None:
        return StaleSynchronous(cfg.staleness_bound, ctx.grid.layout.replicas,
                                clock_offsets(ctx))
    if cfg.softsync is not None or cfg.staleness_lr == "on":
        return SoftSync(n, softsync_group(cfg, ctx.grid.layout.replicas),
                        cfg.staleness_lr == "on")
    return None


def shard_activation_handler(ctx: Context, lo: int, hi: int, params, state):
    """For a shard: apply pushed layer inputs and errors to its rows (Project Adam)."""
    chunk = activations.pieces(ctx.model, lo, hi)
    bound = activations.max_message_bytes(ctx.model, chunk, ctx.cfg.batch_size * ctx.cfg.n_push)
    wire = Wire.named(ctx.cfg.wire_dtype)  # the bound counts 4 bytes a value: either fits

    def handle(header, body):
        activations.apply(ctx.model, chunk, int(header[H.EXAMPLES]), wire.from_bytes(body),
                          params, state, ctx.optimizer)
        return None  # applied here, tile by tile

    return bound, Tag.PUSH_ACTIVATIONS, handle


# -----------------------------------------------------------------------------
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

    rows = embedding_rows(ctx)  # an embedding model's rows held on this shard, else None

    def on_boundary(step: int) -> None:
        if rows is not None:
            write_rows(ctx, rows, step)
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
    layout = grid.layout
    liveness = Liveness.of_trainers(layout, cfg.heartbeat_timeout) \
        if cfg.heartbeat_timeout is not None else None  # replicas may die
    # momentum-corrected compressed pushes carry the velocity already: the shard steps SGD
    apply = optim.SGD(cfg.lr).apply if momentum_corrected(cfg) else ctx.optimizer.apply
    # --lr-schedule: the rate at the global step the shard has counted
    apply = optim.scheduled(apply, cfg.lr_schedule, lambda: server.step, ctx.total_steps)
    server = GradientShard(grid.world, params, state, apply,
                         n_replicas=layout.trainers, step=ctx.start_step,
                         timeout=cfg.timeout, on_boundary=on_boundary,
                         boundary_every=cfg.checkpoint_every,
                         policy=shard_policy(ctx, len(params)),
                         packed=shard_expander(len(params))
                         if cfg.compress == "threshold" else
                         shard_activation_handler(ctx, *plan.ranges[j], params, state)
                         if cfg.push == "activations" else None,
                         tick=ctx.stop_tick, liveness=liveness, epochs=keeper,
                         persist=persister,
                         wire=Wire.named(cfg.wire_dtype))
    with_spares(server, layout, liveness)
    stats = server.serve(rows.handlers() if rows is not None else None)
    if rows is not None:
        write_rows(ctx, rows, server.step)
    got = gather()
    if got is not None:
        msg = final_message(ctx)
        n = ctx.full_model.n_params
        msg.payload[:n] = got[0]
        for i, k in enumerate(keys):
            msg.payload[(i + 1) * n:(i + 2) * n] = got[1][k]
        msg.header[H.STEPS] = server.step
        req = Transport(grid.world).send_nowait(msg.buf, 0, DownpourTag.FINAL)
        wait_all([req], cfg.timeout, "the chief (rank 0) to take the final parameters")
    if rows is not None:  # the chief's final evaluation reads rows, then releases the shards
        serve(grid.world, {**rows.handlers(), Tag.ROWS_DONE: rows.on_release}, cfg.timeout,
              lambda: "world rank 0 to finish its final evaluation (ROWS_DONE)",
              ctx.stop_tick)
    return {**(rows.figures() if rows is not None else {}), "shard": s,
            "pushes": stats.pushes, "fetches": stats.fetches,
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


def with_spares(server, layout, liveness) -> None:
    """--spares, --joins: the spares' replica indices (the joined ranks' too) are not waited
    for until the chief assigns one,
    and each replica the shard loses is reported to the chief (:mod:`hpcps.ps.spares`)."""
    if not layout.spares and not layout.joins:
        return
    if isinstance(server, GradientShard) or server.me < layout.servers:
        server.idle(range(layout.replicas, layout.trainers))
    if isinstance(server, GradientShard):
        net, sent = Transport(server.comm), []

        def send(buf, dest: int, tag: int) -> None:  # not waited for; kept until the end
            sent.append((net.send_nowait(buf, dest, tag), buf))
    else:
        send = server._send
    server.on_lost = lambda r: spares.report_lost(send, r, layout.trainer_rank(r),
                                                  liveness.lost.get(r, 0.0))
    if not isinstance(server, GradientShard):
        server.on_shard_lost = lambda d, silent: spares.report_shard_lost(
            server._send, server.me, d, silent)


def embedding_rows(ctx: Context) -> RowShard | None:
    """This shard's rows of an embedding model's tables (None for other models)."""
    return row_shard(ctx) if is_embedding_spec(ctx.cfg.model) else None


def run_replicated_server(ctx: Context, me: int | None = None, heals=None) -> dict:
    """A shard of a run with ``--ps-copies C > 1``: a copy of each of C chunk sets
    (:mod:`hpcps.ps.replicated`). ``me``: a spare's shard index S + k, holding nothing until
    the primaries of the dead shard's sets send them; ``heals``: the chief's ASSIGN to it."""
    cfg, grid = ctx.cfg, ctx.grid
    layout = grid.layout
    spare = me is not None
    me = grid.role.shard if me is None else me
    S, R = layout.servers, layout.trainers
    plan = partition_plan(ctx, 0)
    keys = list(ctx.optimizer.state_keys)
    liveness = Liveness.of_trainers(layout, cfg.heartbeat_timeout)
    server = None
    sets: dict = {}

    def make_set(h: int) -> GradientShard:
        params = plan.take(h, ctx.params)
        state = {k: plan.take(h, v) for k, v in ctx.opt_state.items()}
        apply = optim.SGD(cfg.lr).apply if momentum_corrected(cfg) else ctx.optimizer.apply
        apply = optim.scheduled(apply, cfg.lr_schedule, lambda h=h: sets[h].step,
                                ctx.total_steps)
        return GradientShard(grid.world, params, state, apply, n_replicas=R,
                             step=ctx.start_step, timeout=cfg.timeout,
                             on_boundary=lambda b, h=h: server.boundary(h, b),
                             boundary_every=cfg.checkpoint_every,
                             policy=replicated.SetPolicy(h, shard_policy(ctx, len(params))),
                             packed=shard_expander(len(params))
                             if cfg.compress == "threshold" else None,
                             liveness=liveness,
                             wire=Wire.named(cfg.wire_dtype))

    if not spare:
        for h in replicated.sets_of(me, S, cfg.ps_copies):
            sets[h] = make_set(h)
    biggest = max(plan.sizes)
    inbox = (biggest, HEADER_BYTES + shard_expander(biggest)[0]
             if cfg.compress == "threshold" else 0)

    def save(step: int, parts: dict) -> None:
        params, state = replicated.assemble(plan, parts, keys)
        path = save_checkpoint(ctx, params, state, step)
        print(f"[hpcps] server shard {me} wrote checkpoint {path} at step {step}", flush=True)

    server = replicated.ReplicatedServer(grid.world, me, layout.shard_table,
                                         [layout.trainer_rank(r) for r in range(R)],
                                         cfg.ps_copies, sets, keys, cfg.heartbeat_timeout,
                                         cfg.timeout, save=save, n_sets=S, make_set=make_set,
                                         liveness=liveness, inbox=inbox,
                                         wire=Wire.named(cfg.wire_dtype))
    if spare:
        server.learn_heals(heals["heals"], heals["dead"])
        server.done.update(r for r in range(layout.replicas, R)  # not yet joined
                           if r not in heals.get("joined", ()))
    with_spares(server, layout, liveness)
    server.serve()
    stats = [cs.stats for cs in sets.values()]
    # softsync's figures from the sets this shard ended as primary of (a secondary's repeat them)
    combining = [sets[h].policy.inner for h in sets if server.role[h] == "primary"
                 and isinstance(sets[h].policy.inner, SoftSync)]
    bounded = [sets[h].policy.inner for h in sets if server.role[h] == "primary"
               and isinstance(sets[h].policy.inner, StaleSynchronous)]
    pushes = max(1, sum(s.pushes for s in stats))
    return {"shard": me, "pushes": sum(s.pushes for s in stats),
            "fetches": sum(s.fetches for s in stats),
            "bytes_in": sum(s.bytes_in for s in stats),
            "bytes_out": sum(s.bytes_out for s in stats),
            "mean_staleness": sum(s.staleness_sum for s in stats) / pushes,
            "max_staleness": max(s.staleness_max for s in stats),
            "staleness_hist": [sum(col) for col in zip(*(s.staleness_hist for s in stats))],
            "held_fetches": sum(s.held_fetches for s in stats),
            "held_s": sum(s.held_s for s in stats),
            "combined_updates": sum(p.updates for p in combining)
            if cfg.softsync is not None or cfg.staleness_lr == "on" else None,
            "combined_pushes": sum(p.combined for p in combining)
            if cfg.softsync is not None or cfg.staleness_lr == "on" else None,
            "clock_lead_max": max((p.max_lead for p in bounded), default=0)
            if cfg.staleness_bound is not None else None,
            "step": max(cs.step for cs in sets.values()),
            "lost_replicas": server.lost_replicas, "lost_after_s": server.lost_after_s,
            "epochs": None, "persist": None, **server.figures()}
