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

from hpcps.errors import ConfigError
from hpcps.model.spec import is_embedding_spec
from hpcps.options import (CHUNK_BYTES, COMPRESSION, DEFAULT_CHUNK_BYTES, EMBEDDING_DEFAULTS,
                           EMBEDDING_EPOCHS, EMBEDDING_OPTIONS, GOLOMB, HEARTBEAT_TIMEOUT,
                           LOOP_OPTIONS, TAU, WARMUP_STEPS, Option, check_compression,
                           check_embedding_options, check_fault_options, check_loop_options,
                           describe_rows, describe_tau, parse_augment, varies, WIRE_DTYPE)
from hpcps.strategies.downpour.summary import summary_lines
from hpcps.strategies.registry import SERVERS, Strategy, message_tags

def momentum_corrected(cfg) -> bool:
    """Compressed pushes with momentum: the replicas keep the velocity, the shards run SGD."""
    return cfg.compress == "threshold" and cfg.optimizer == "momentum"


# --------------------------------------------------------------------------------
# WARMUP_DONE: replica 0 -> the others, the warm start is over; FINAL: server shard 0 -> world
# rank 0, the final parameters, for evaluation
Tag = message_tags("downpour", "WARMUP_DONE", "FINAL")
PS_HEARTBEAT_TIMEOUT = 10.0  # --heartbeat-timeout's default with --ps-copies > 1 (seconds)
DOWNPOUR_TAU = 0.01  # default threshold of compressed pushes (gradient units, not weight units)


def _defaults(cfg) -> dict:
    d = {"servers": cfg.partitions,  # one shard per partition
         "lr": 0.01, "n_fetch": 1, "n_push": 1, "warmup_steps": 200, "compress": "none",
         "batch_size": 32, "prefetch": 2, "push": "gradients", "ps_copies": 1, "spares": 0,
         "joins": 0}
    if (cfg.ps_copies or 1) > 1 or (cfg.spares or 0) > 0 or (cfg.joins or 0) > 0:
        d["heartbeat_timeout"] = PS_HEARTBEAT_TIMEOUT  # deaths are found by heartbeats
    if cfg.push != "activations":  # activation pushes hold whole rows per shard, not chunks
        d["chunk_bytes"] = DEFAULT_CHUNK_BYTES
    if cfg.compress == "threshold":
        d.update(tau=DOWNPOUR_TAU, golomb="on")
    if is_embedding_spec(cfg.model):
        d.update(EMBEDDING_DEFAULTS)
        if cfg.steps is None:
            d["epochs"] = EMBEDDING_EPOCHS
    return d


def _validate_embeddings(cfg) -> None:
    """An embedding model's rows go through their own messages (:mod:`hpcps.ps.rows`): what
    acts on the dense vector's messages or on whole replicas does not reach them."""
    check_embedding_options(cfg, is_embedding_spec(cfg.model), {
        "--compress threshold": cfg.compress == "threshold",
        "--push activations": cfg.push == "activations",
        "--partitions > 1": cfg.partitions > 1,
        "--ps-copies > 1": (cfg.ps_copies or 1) > 1, "--spares": (cfg.spares or 0) > 0,
        "--joins": (cfg.joins or 0) > 0,
        "--persist-every": cfg.persist_every is not None,
        "--epoch-quorum": cfg.epoch_quorum is not None,
        "--heartbeat-timeout": cfg.heartbeat_timeout is not None,
        "--softsync": cfg.softsync is not None, "--staleness-lr": cfg.staleness_lr == "on",
        "--weight-decay": bool(cfg.weight_decay), "--dropout": bool(cfg.dropout),
        "--augment": parse_augment(cfg.augment) is not None,
        "--lr-schedule cosine": varies(cfg.lr_schedule)})


def _validate(cfg) -> None:
    _validate_embeddings(cfg)
    check_loop_options(cfg)
    check_fault_options(cfg)
    if cfg.ps_copies is not None and cfg.ps_copies > 1:
        _validate_copies(cfg)
    if cfg.spares:
        _validate_spares(cfg, "--spares")
    if cfg.joins:
        _validate_spares(cfg, "--joins")
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
    if cfg.push == "activations" and varies(cfg.lr_schedule):
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
        check_compression(cfg, DOWNPOUR_TAU)
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
    """What replicated shards (--ps-copies > 1) go with. Every copy of a set applies the
    set's pushes in its primary's order through the same deterministic policy, so what a
    policy decides from the pushes alone (softsync's groups, --staleness-lr's rates, SSP's
    clocks, which the primary holds fetches by) is replicated with them; what lives elsewhere
    is refused, saying what would have to be replicated."""
    copies, servers = cfg.ps_copies, cfg.servers or cfg.partitions
    if cfg.partitions > 1:
        raise ConfigError("--ps-copies > 1 with --partitions > 1: replicated shards let the "
                          "run go on without a dead rank, and the partitions of a replica "
                          "cannot go on without one of theirs (they exchange activations "
                          "every step, and no copy of a replica's partition exists to take "
                          "over); use --partitions 1")
    if copies > servers:
        raise ConfigError(f"--ps-copies {copies} puts each chunk set on {copies} distinct "
                          f"server shards: use --servers {copies} or more (got {servers})")
    why = {
        "--push activations": "a shard computes each update from pushed layer inputs and "
        "errors over whole rows, not hashed chunk sets; copies would need the rows' plan "
        "replicated and the activation messages forwarded and decoded on every copy",
        "--epoch-quorum": "the keeper of the epochs' ends lives on server shard 0 alone; its "
        "counts of finished replicas would have to be replicated and taken over with shard 0",
        "--persist-every": "each shard writes its own chunks' file and shard 0 the manifest "
        "over them; a set's file would have to be written by whichever copy is its primary, "
        "and the manifest re-pointed when a primary changes"}
    for name, given in (("--push activations", cfg.push == "activations"),
                        ("--epoch-quorum", cfg.epoch_quorum is not None),
                        ("--persist-every", cfg.persist_every is not None)):
        if given:
            raise ConfigError(f"--ps-copies > 1 with {name}: {why[name]}; drop one of the two")


def _validate_spares(cfg, option: str) -> None:
    """What spare replicas (--spares K) and ranks that join (--joins J) go with: either joins
    as a new replica mid-run, so what fixes each replica's part of the run at start is
    refused."""
    why = {
        "--staleness-bound": "the shards hold every replica to the slowest one's clock, and a "
        "spare that joins mid-run has no clock of its own to start from; use --softsync or "
        "plain downpour with --spares",
        "--epoch-quorum": "each replica's share of every epoch is planned at start from the "
        "replica count; a spare would need the dead replica's remaining shares handed over",
        "--partitions > 1": "a spare would have to replace one partition of a replica in the "
        "middle of its activation exchange; spares replace whole replicas (--partitions 1)"}
    for name, given in (("--staleness-bound", cfg.staleness_bound is not None),
                        ("--epoch-quorum", cfg.epoch_quorum is not None),
                        ("--partitions > 1", cfg.partitions > 1)):
        if given:
            raise ConfigError(f"{option} with {name}: {why[name]}")


def softsync_group(cfg, replicas: int) -> int:
    """Pushes a shard combines into one update: ``--softsync``, or with ``--staleness-lr on``
    alone half the replicas (Zhang et al. combine groups of a fraction of the learners; the
    staleness-divided rate alone fell short: 96.7% on MNIST at R = 8 against 97.5-97.7% in
    groups of 4, docs/consistency.md), else 1 (each push at once)."""
    if cfg.softsync is not None:
        return int(cfg.softsync)
    return max(1, replicas // 2) if cfg.staleness_lr == "on" else 1


def _describe(cfg, n_train: int, replicas: int = 1) -> str:
    how = f"{cfg.optimizer} lr={cfg.lr} on the shards, batch {cfg.batch_size}/replica"
    if cfg.staleness_lr == "on":
        group = softsync_group(cfg, replicas)
        how += (f", each update at lr/staleness over the mean of {group} push(es)"
                + (" (--softsync default with --staleness-lr: replicas/2)"
                   if cfg.softsync is None else ""))
    if cfg.compress == "threshold":
        how += f", pushes thresholded at {describe_tau(cfg)}"
        if momentum_corrected(cfg):
            how += " (momentum on the replicas, corrected; SGD on the shards)"
    if cfg.push == "activations":
        how += ", pushes of layer inputs and errors"
    if is_embedding_spec(cfg.model):
        how += "; " + describe_rows(cfg)
    return how


STRATEGY = Strategy(
    name="downpour",
    help="asynchronous replicas fetch parameters from and push gradients to a sharded "
         "parameter server that runs the optimizer (DistBelief's Downpour SGD; the default); "
         "S defaults to P, one shard per partition",
    roles={"replica": "hpcps.strategies.downpour.replica:run_replica",
           "server": "hpcps.strategies.downpour.server:run_server",
           "spare": "hpcps.strategies.downpour.spare:run_spare"},
    servers=SERVERS,
    # adam-mnist: 99.42-99.53% on MNIST in three 50-epoch runs on 4 ranks with its images moved
    # by a pixel (99.29-99.38% in five runs without: docs/conv.md)
    recipes={"adam-mnist": {"optimizer": "momentum", "lr": 0.01, "batch_size": 64,
                            "weight_decay": 1e-3, "dropout": 0.3, "lr_schedule": "cosine",
                            "augment": "shift:1", "epochs": 50.0}},
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
               "its staleness (a softsync group's mean staleness); --softsync then defaults "
               "to half the replicas (default off)",
               choices=("on", "off")),
        TAU, *COMPRESSION, GOLOMB, *LOOP_OPTIONS, CHUNK_BYTES, *EMBEDDING_OPTIONS,
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
        Option("spares", int, "spare ranks, the last K of the job, idle until a replica dies "
               "or leaves (SIGTERM to its rank) or, with --ps-copies, a shard dies: a spare "
               "then takes the replica's data shard and trains on as a new replica, or holds a "
               "copy of each of the dead shard's chunk sets; brings --heartbeat-timeout (10 s "
               "unless given). Rank 0 assigns them (default 0: none)", check="nonneg"),
        Option("joins", int, "ranks that may join the running job later, from a second "
               "launch (mpiexec -n K python -m hpcps.join RUN_DIR): each becomes a spare, or "
               "at once a replica training on data shard j mod R (the j-th to join); the "
               "chief and the shards listen on MPI ports published in RUN_DIR/join (MPICH; "
               "brings --heartbeat-timeout, 10 s unless given; default 0: none)",
               check="nonneg"),
        Option("ps_copies", int, "copies of every chunk set on distinct server shards "
               "(Project Adam: 3): the primary applies a push, forwards it to the "
               "secondaries and acknowledges it once they hold it; a secondary takes over a "
               "primary silent for --heartbeat-timeout (10 s unless given) and replicas "
               "re-route to it (default 1: one copy, a dead shard ends the job)",
               check="positive"),
        WIRE_DTYPE),
    defaults=_defaults,
    embeddings=True,
    validate=_validate,
    describe=_describe,
    summarize="hpcps.strategies.downpour.summary:summarize",
    summary_lines=summary_lines,
    tags=Tag,
    stops_alone=True,
    cost="hpcps.strategies.downpour.cost:COST",
)
