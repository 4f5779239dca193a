"""One training job under MPI: config -> checks every rank agrees on -> grid of ranks -> this
rank's role in the strategy -> summary. Started by :mod:`hpcps.train` (the command), which
answers ``--help`` and ``--version`` and refuses bad options and layouts before MPI is loaded.

Start-up checks (options, layout, dataset, checkpoint, run directory, whether the data fit
each rank's memory budget or stream: :mod:`hpcps.strategies.feed`) run on every rank and
end in one collective vote: if any rank refused its input, the lowest such rank prints the
reason once and every rank exits with the same code (2 config and run directory, 3 data, 4
checkpoint), never a hang. Once training runs, a rank that fails prints its rank, host and
reason and aborts the whole job; a NaN or infinity in training ends it with code 7 (the exit
codes are listed in :mod:`hpcps.errors` and ``docs/errors.md``).

SIGTERM and SIGUSR1 (preemption, a time limit: ``docs/slurm.md``) stop training on every rank
at the next safe point (:mod:`hpcps.runtime.stop`); the final checkpoint then holds the step
reached and the job exits with code 75, "checkpointed, resubmit me": ``--resume auto``
continues from the run directory's newest valid checkpoint, or starts fresh when there is none.

Under Slurm (``jobs/*.sbatch``), ``srun`` (with the site's PMI) and ``mpiexec`` start the same
job; the default run directory is ``runs/slurm-<job id>`` (:mod:`hpcps.runtime.slurm`).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from hpcps import config, trace
from hpcps.compress.bf16 import Wire
from hpcps.io import checkpoint, data, runlog, tables
from hpcps.model import convnet
from hpcps.model.spec import is_embedding_spec
from hpcps.io.tables import TABLES_DIR, table_files
from hpcps.runtime import faults, keeper, memory, slurm, timeline
from hpcps.mpi import joins
from hpcps.mpi.comm import (PeerTimeout, ReplicaExchange, allgather_obj, barrier, bcast_obj,
                             dedicate, dup_comm, gather_obj, host, usable_cores)
from hpcps.options import parse_augment
from hpcps.errors import (INTERRUPTED_EXIT, PREEMPTED_EXIT, CheckpointError, CollectiveLost,
                          ConfigError, HpcpsError, NonFiniteError, interrupted)
from hpcps.runtime.metrics import Metrics
from hpcps.ps.liveness import Dismissed
from hpcps.model.mlp import InitialWeights, SingleExchange
from hpcps.runtime.stacks import StackDumper
from hpcps.runtime.stop import SignalFlag, StopVote
from hpcps.strategies.registry import strategies
from hpcps.blocks import block_range
from hpcps.io.data import RowSource
from hpcps.io.data.augment import check_image_shape
from hpcps.strategies.feed import Feed
from hpcps.strategies.feed import plan as feed_plan
from hpcps.strategies.context import (VAL_FILE, VAL_HELD_OUT, Context, explain_nonfinite,
                                      make_optimizer, state_from_checkpoint, train_shard,
                                      without)
from hpcps.mpi.topology import Layout, abort, build_grid, check_thread_support, world_comm


def _agree(world, fn, *args):
    """Run ``fn`` on every rank; if any rank raised, all exit with the first failure's code."""
    value, code, text = None, 0, ""
    try:
        value = fn(*args)
    except HpcpsError as exc:
        code, text = exc.exit_code, str(exc)
    except MemoryError as exc:  # the options ask for more than the node has (exit 2)
        code, text = ConfigError.exit_code, (
            f"out of memory while setting up the run ({exc or 'MemoryError'}): the model, "
            "or the data a rank holds, does not fit on its node; use a smaller model, "
            "more ranks to share it (--partitions, --servers), or a smaller --data-memory")
    except Exception:  # a bug, not bad input: show where
        code, text = 1, traceback.format_exc()
    codes = allgather_obj(world, code)
    if any(codes):
        first = next(i for i, c in enumerate(codes) if c)
        if world.Get_rank() == first:
            where = "" if all(codes) else f" (rank {first})"
            print(f"hpcps: error{where}: {text}", file=sys.stderr, flush=True)
        raise SystemExit(codes[first])
    return value


def _ensure_dataset(cfg: config.Config, rank: int) -> None:
    """Prepare a built-in dataset on first use (rank 0 only; the others wait in the vote)."""
    path = Path(cfg.data)
    if rank != 0 or path.exists():
        return
    for name, default in data.DEFAULT_DATA.items():
        if path.resolve() == Path(default).resolve():
            print(f"[hpcps] {path} not found: preparing the {name} dataset first", flush=True)
            data.prepare(name, path, log=lambda s: print(f"[hpcps] {s}", flush=True))
            return


def _check_table_capacity(cfg: config.Config, fields) -> None:
    """Refuse a ``--table-capacity`` below what one pull can need at once. A shard serves
    one replica's pull (its T = ``--threads`` mini-batches of an iteration) at once and never
    evicts a row of it, so each table's rows of the pull must fit together: for field f, up
    to min(batch_size x T x width_f, vocab_f) distinct ids, all of them on one shard in the
    worst case."""
    cap = cfg.table_capacity
    if cap is None:
        return
    rows = cfg.batch_size * cfg.threads  # examples one pull serves
    needs = [(min(rows * f.width, f.vocab), t, f) for t, f in enumerate(fields)]
    need, t, f = max(needs, key=lambda x: x[0])
    if cap < need:
        batch = (f"--batch-size {cfg.batch_size} x --threads {cfg.threads}" if cfg.threads > 1
                 else f"--batch-size {cfg.batch_size}")
        raise ConfigError(f"--table-capacity {cap} is below the rows one batch can touch in "
                          f"one table, all on one shard in the worst case: table {t} (field "
                          f"{f.name!r}, {f.width} id(s) per example, vocabulary {f.vocab}) "
                          f"up to min({batch} x {f.width}, {f.vocab}) = {need}; give "
                          f"--table-capacity {need} or more, or a smaller --batch-size"
                          + (" or fewer --threads" if cfg.threads > 1 else ""))


def _check_dataset(cfg: config.Config) -> data.DatasetInfo:
    if is_embedding_spec(cfg.model):  # categorical ids, not dense features
        info = data.open_categorical(cfg.data)
        convnet.build(cfg, info)  # refuses non-binary labels
        _check_table_capacity(cfg, info.fields)
        return info
    info = data.open_dataset(cfg.data)
    aug = parse_augment(getattr(cfg, "augment", None))
    if aug is not None:
        check_image_shape(aug, info.image_shape, cfg.data)
    if cfg.model is not None:
        convnet.build(cfg, info)  # refuses a flat dataset, a spec that does not fit
        return info
    if cfg.layers[0] != info.n_features or cfg.layers[-1] != info.n_classes:
        raise ConfigError(
            f"--layers {','.join(map(str, cfg.layers))} does not fit dataset {cfg.data} "
            f"({info.n_features} features, {info.n_classes} classes): the first width must be "
            f"{info.n_features} and the last {info.n_classes}")
    return info


def _load_resume(cfg: config.Config, info: data.DatasetInfo):
    if not cfg.resume:
        return None, []
    ckpt = checkpoint.load(cfg.resume)
    checkpoint.check_finite(ckpt)
    if cfg.spec.check_resume is not None:
        cfg.spec.check_resume(cfg, ckpt)
    saved = ckpt.config.get("model")
    if (saved and convnet.resolve(saved)) != (cfg.model and convnet.resolve(cfg.model)):
        raise CheckpointError(f"checkpoint {cfg.resume} holds model {saved or 'an MLP'} but "
                              f"this run asks for {cfg.model or 'an MLP (--layers)'}")
    if ckpt.optimizer not in cfg.spec.optimizers:  # no --optimizer of this strategy fits
        embedding = is_embedding_spec(cfg.model)  # those that train this kind of model
        takers = [name for name, spec in strategies().items()
                  if ckpt.optimizer in spec.optimizers
                  and (spec.embeddings if embedding else spec.dense_models)]
        raise CheckpointError(
            f"checkpoint {cfg.resume} was written by optimizer {ckpt.optimizer!r}, which "
            f"--strategy {cfg.strategy} does not run (it runs {' or '.join(cfg.spec.optimizers)})"
            f", and an optimizer's state does not carry over to another: resume it with "
            f"--strategy {' or '.join(takers) or '(none)'}, or start a new run")
    model = convnet.build(cfg, info)
    if is_embedding_spec(cfg.model):  # its rows: the table files beside it, of its step
        files = table_files(Path(cfg.resume).parent / TABLES_DIR, ckpt.step, model.n_tables,
                            model.dim)
        _, rows_by = tables.count(files, 0)
        if rows_by and rows_by != cfg.row_optimizer:  # as the dense layers' optimizer: refused
            raise CheckpointError(
                f"checkpoint {cfg.resume}'s embedding rows were trained with --row-optimizer "
                f"{rows_by} but this run asks for {cfg.row_optimizer}: the rows' optimizer "
                f"state would not carry over; resume with --row-optimizer {rows_by}, or start "
                "a new run")
    warnings = checkpoint.check_compatible(ckpt, model.sizes,
                                           optimizer=cfg.optimizer,
                                           dataset=info.to_dict())
    split = _split_warning(cfg, ckpt, info)
    if split is not None:
        warnings.append(split)
    return ckpt, warnings


def _split_warning(cfg: config.Config, ckpt, info) -> str | None:
    """What to say when this resumed run holds out of /train, for validation, rows the
    checkpoint's run trained on (another --validation-fraction or --seed draws other rows);
    None when it holds none out (no fraction, or the file's own /val), the sets differ, or
    every held-out row was held out before."""
    if cfg.validation_fraction <= 0 or int(ckpt.dataset.get("n_train", -1)) != info.n_train:
        return None
    if not is_embedding_spec(cfg.model) and data.val_rows(cfg.data):
        return None  # the file's /val, not rows of /train
    was = float(ckpt.config.get("validation_fraction") or 0.0)
    seed = int(ckpt.config.get("seed") or 0)
    if (was, seed) == (cfg.validation_fraction, cfg.seed):
        return None
    now = data.holdout_rows(info.n_train, cfg.validation_fraction, cfg.seed)
    trained = int(np.setdiff1d(now, data.holdout_rows(info.n_train, was, seed)).size)
    if not trained:
        return None
    return (f"this run holds out --validation-fraction {cfg.validation_fraction:g} of /train "
            f"with --seed {cfg.seed}, the checkpoint's run {was:g} with --seed {seed}: "
            f"{trained} of the rows this run validates on were trained on before, so its "
            f"validation figures are optimistic (resume with --validation-fraction {was:g} "
            f"--seed {seed} to keep the split)")


def _resolve_auto(cfg: config.Config, run_dir: Path) -> tuple[config.Config, list[str]]:
    """``--resume auto``: the run directory's newest valid checkpoint, or a fresh start.
    Returns the config with ``resume`` set to that file (or None) and notes for the log."""
    if cfg.resume != config.RESUME_AUTO:
        return cfg, []
    ckpt, skipped = checkpoint.latest(run_dir)
    if ckpt is None:
        return dataclasses.replace(cfg, resume=None), \
            [f"--resume auto: no checkpoint in {run_dir}, starting fresh"]
    return dataclasses.replace(cfg, resume=str(ckpt.path)), skipped


def fresh_stamp(cfg: config.Config, slurm_job: str | None) -> str:
    """The time stamp naming a new default run directory (``runs/<strategy>-<stamp>``; rank
    0 decides). Made unique: when another run of the strategy started in the same second (a
    loop of launches), its directory exists and this one takes ``<stamp>-2``, ``-3``, ...,
    claimed by creating it, so that two launches racing cannot both take one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if cfg.run_dir or cfg.resume or slurm_job:
        return stamp  # not a default of its own: the stamp names nothing
    for k in range(1, 1000):
        name = stamp if k == 1 else f"{stamp}-{k}"
        try:
            config.default_run_dir(cfg, name).mkdir(parents=True, exist_ok=False)
            return name
        except FileExistsError:
            continue
        except OSError:
            break  # check_run_dir says what is wrong with the directory
    return stamp


def check_run_dir(run_dir: Path, given: bool) -> None:
    """Create the run directory if needed and make sure this rank can write into it, so that
    a run never trains for hours and then fails to write its metrics or checkpoint.

    ``given``: the path came from ``--run-dir`` (else from ``--resume`` or the default).
    Raises ConfigError with the path and the system's reason.
    """
    what = "--run-dir" if given else "run directory"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{what} {run_dir} is a file, not a directory: give a directory for "
                          "metrics.jsonl and checkpoint.h5")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what} {run_dir} cannot be created: {exc.strerror or exc}; give "
                          "--run-dir a directory you can write to") from None
    probe = run_dir / f".hpcps-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{what} {run_dir} is not writable: {exc.strerror or exc}; give "
                          "--run-dir a directory you can write to") from None


def _setup(cfg: config.Config, world, layout: Layout, info, ckpt, run_dir: Path,
           stream: Feed, grid=None) -> Context:
    """This rank's context; ``grid``: a rank that joined the running job brings its own."""
    full = convnet.build(cfg, info)
    P = layout.partitions
    if P > 1:  # refuse a layer narrower than P on every rank before any communication
        convnet.build_partition(cfg, full, P, 0)
    check_thread_support(cfg.threads, P)
    grid = build_grid(world, layout) if grid is None else grid
    opt = make_optimizer(cfg)
    role = grid.role
    if role.is_replica and isinstance(full, convnet.ConvNet):  # its own dropout masks
        full.seed_dropout(convnet.dropout_key(cfg.seed, role.replica,
                                              ckpt.step if ckpt is not None else 0))
    model = full
    if P > 1:
        exchange = ReplicaExchange(grid.replica_comm, cfg.timeout,
                                   Wire.named(cfg.wire_dtype)) if role.is_replica \
            else SingleExchange
        model = convnet.build_partition(cfg, full, P, role.partition if role.is_replica
                                        else 0, exchange)
    whole = ckpt is not None  # params hold the whole model: cut to this rank's part below
    if ckpt is None:  # each rank draws only what it holds: memory falls as 1/P and 1/S
        if role.may_die:  # a replica, or a spare that may become one
            params = model.init_params(cfg.seed)
        elif cfg.model is not None:  # a conv model (small): drawn whole, cut below
            params, whole = full.init_params(cfg.seed), True
        else:  # an MLP's servers slice it
            params = InitialWeights(cfg.layers, cfg.activation, P, cfg.seed)
        state, start = opt.init_state(len(params)), 0  # zeros: pages untouched cost nothing
    else:
        params, state = state_from_checkpoint(full, ckpt, opt.state_keys)
        start = ckpt.step
    if whole and P > 1:
        if role.is_replica:  # this partition's slice
            cut = model.local_from_full
        else:  # servers: every partition's slice, one after the other (the global vector)
            def cut(named):
                return np.concatenate([model.local_from_full(named, q) for q in range(P)])
        params = cut(full.views(params))
        state = {k: cut(full.views(v)) for k, v in state.items()}
    # the coordinator, where there is one, sees the whole run: it logs; otherwise rank 0
    reporter = layout.server_rank(layout.servers) if layout.coordinator else 0
    metrics = Metrics(run_dir if grid.rank == reporter else None, cfg.progress_every)
    # the validation split: the file's /val, else the rows --validation-fraction holds out of
    # /train (the same on every rank), else none (evaluations on the test set)
    held = np.empty(0, dtype=np.int64)
    categorical = is_embedding_spec(cfg.model)
    val_source, val_rows = None, 0 if categorical else data.val_rows(cfg.data)  # no /val
    if val_rows:
        val_source = VAL_FILE
    elif cfg.validation_fraction > 0:
        held = data.holdout_rows(info.n_train, cfg.validation_fraction, cfg.seed)
        val_source, val_rows = VAL_HELD_OUT, len(held)
    ctx = Context(cfg=cfg, grid=grid, model=model, full_model=full, optimizer=opt,
                  dataset=info, params=params, opt_state=state, start_step=start,
                  total_steps=cfg.total_steps(info.n_train - len(held)), run_dir=run_dir,
                  metrics=metrics, reporter=reporter,
                  resumed=ckpt.metrics if ckpt is not None else None,
                  val_source=val_source, val_rows=val_rows, held_out=len(held), feed=stream)
    if categorical:  # ids (and dense features) per row, checked as they are read
        rows_of, width = data.CategoricalRows.of(info), info.row_width
        if grid.role.is_replica and stream.train:
            lo, hi = block_range(info.n_train, layout.replicas, grid.role.replica)
            ctx.train_stream = RowSource(cfg.data, "train", width, lo, hi, held,
                                         layout=rows_of)
        elif grid.role.is_replica:
            block = data.load_block(cfg.data, "train", grid.role.replica,
                                    layout.replicas).without(held)
            ctx.train_x, ctx.train_y = block.features, block.y
        if grid.role.is_replica and (ctx.train_rows or 0) < cfg.batch_size:
            raise ConfigError(f"replica {grid.role.replica} holds {ctx.train_rows or 0} "
                              f"training rows, fewer than --batch-size {cfg.batch_size}")
        if grid.is_chief and stream.evaluation:  # scored in chunks
            ctx.test_stream = RowSource(cfg.data, "test", width, 0, info.n_test, layout=rows_of)
            if len(held):
                ctx.val_stream = RowSource(cfg.data, "train", width, rows=held, layout=rows_of)
        elif grid.is_chief:
            block = data.load_block(cfg.data, "test")
            ctx.test_x, ctx.test_y = block.features, block.y
            if len(held):
                block = data.load_categorical_rows(cfg.data, "train", held)
                ctx.val_x, ctx.val_y = block.features, block.y
    elif grid.role.is_replica and cfg.spec.replica_data == "whole":
        # any replica may be handed any portion: each holds the whole training set (in
        # memory: feed.plan refused a set that does not fit)
        ctx.train_x, ctx.train_y = without(data.load_split(cfg.data, "train"), 0, held)
    elif grid.role.is_replica:
        # every partition of a replica reads the same shard and draws the same batches
        for name, value in train_shard(cfg, info, grid.role.replica, layout.replicas, held,
                                       stream).items():
            setattr(ctx, name, value)
    if grid.is_chief and not categorical and stream.evaluation:  # scored in chunks
        D = info.n_features
        ctx.test_stream = RowSource(cfg.data, "test", D, 0, info.n_test)
        if ctx.val_source == VAL_FILE:
            ctx.val_stream = RowSource(cfg.data, "val", D, 0, val_rows)
        elif ctx.val_source == VAL_HELD_OUT:
            ctx.val_stream = RowSource(cfg.data, "train", D, rows=held)
    elif grid.is_chief and not categorical:
        ctx.test_x, ctx.test_y = data.load_split(cfg.data, "test")
        if ctx.val_source == VAL_FILE:
            ctx.val_x, ctx.val_y = data.load_split(cfg.data, "val")
        elif ctx.val_source == VAL_HELD_OUT:
            ctx.val_x, ctx.val_y = data.load_rows(cfg.data, "train", held)
    return ctx


def _data_budget(cfg: config.Config, ranks_on_node: int) -> tuple[int, str]:
    """This rank's data budget in bytes and how it was set."""
    if cfg.data_memory is not None:
        return int(cfg.data_memory * memory.MIB), f"--data-memory {cfg.data_memory:g}"
    return memory.system_data_budget(ranks_on_node)


def _plan_feed(cfg: config.Config, info, layout: Layout, budgets: list) -> Feed:
    """Whether data stream (:mod:`hpcps.strategies.feed`), from every rank's budget."""
    categorical = is_embedding_spec(cfg.model)
    n_features = getattr(info, "n_features", None) or info.row_width
    val = 0 if categorical else data.val_rows(cfg.data)  # a categorical file has no /val
    if not val and cfg.validation_fraction > 0:
        val = len(data.holdout_rows(info.n_train, cfg.validation_fraction, cfg.seed))
    lowest = min(range(len(budgets)), key=lambda r: budgets[r][0])
    why = budgets[lowest][1] + (f" on rank {lowest}" if len(budgets) > 1 else "")
    return feed_plan(cfg, layout, info.n_train, info.n_test, n_features, val,
                     [b for b, _ in budgets], why)


def _validation_note(ctx: Context) -> str:
    """What the periodic evaluations score, for the start line."""
    cfg = ctx.cfg
    if ctx.val_source == VAL_FILE:
        ignored = (f" (--validation-fraction {cfg.validation_fraction:g} not used: the file "
                   "has /val)" if cfg.validation_fraction > 0 else "")
        where = f"the validation split /val of {cfg.data} ({ctx.val_rows} rows){ignored}"
    elif ctx.val_source == VAL_HELD_OUT:
        where = (f"the validation split: {ctx.val_rows} rows (--validation-fraction "
                 f"{cfg.validation_fraction:g}) held out of /train, not trained on")
    else:
        return ("evaluations on the test set (no validation split: the file has no /val and "
                "--validation-fraction is 0)")
    return f"evaluations on {where}, the test set scored once at the end"


def _describe(cfg, layout: Layout) -> str:
    reps = f"{layout.replicas} replica(s) x {layout.partitions} partition(s)"
    coord = ", 1 coordinator" if layout.coordinator else ""
    reps += f", {layout.spares} spare(s)" if layout.spares else ""
    shards = f"{layout.servers} server shard(s){coord}, " if layout.servers else ""
    return f"{cfg.strategy} on {layout.n_world} ranks: {shards}{reps}"


def _summary(ctx: Context, results: list[dict], wall_s: float, stopped: bool = False) -> None:
    """The summary record and lines: common figures, then the strategy's own."""
    m, cfg, spec = ctx.metrics, ctx.cfg, ctx.cfg.spec
    mine = results[ctx.reporter]
    step = mine.get("step", ctx.start_step)
    trained = step - ctx.start_step
    summarize = spec.summarizer()
    figures = dict(summarize(ctx, results) if summarize else mine.get("figures", {}))
    bytes_per_step = figures.pop("bytes_per_step", 0.0)
    staleness = figures.pop("mean_staleness", 0.0)
    rec = m.record("summary", echo=False, strategy=cfg.strategy, ranks=ctx.grid.layout.n_world,
                   servers=ctx.grid.layout.servers, replicas=ctx.grid.layout.replicas,
                   partitions=ctx.grid.layout.partitions, threads=cfg.threads,
                   step=step, epoch=round(ctx.epochs(step), 3), steps_trained=trained,
                   train_s=round(mine.get("train_s", 0.0), 3), wall_s=round(wall_s, 3),
                   examples_per_s=round(mine.get("examples_per_s", float("nan")), 1),
                   bytes_per_step=round(bytes_per_step), mean_staleness=round(staleness, 3),
                   test_accuracy=mine.get("test_accuracy"), test_loss=mine.get("test_loss"),
                   **({"test_auc": mine["test_auc"]} if "test_auc" in mine else {}),
                   **_split_figures(ctx, mine, results),
                   stopped_early=stopped, total_steps=ctx.total_steps,
                   checkpoint=mine.get("checkpoint"), **memory.by_role(results),
                   **_blas_in_use(results), **_first_layer_in_use(results),
                   **_step_times(results),
                   **(ctx.feed.record() if ctx.feed is not None else {}), **figures)
    m.message(f"finished {_describe(cfg, ctx.grid.layout)}")
    m.message(f"  {trained} steps this run (global step {step}, {rec['epoch']:.2f} epochs) in "
              f"{rec['train_s']:.1f} s: {rec['examples_per_s']:.0f} examples/s, "
              f"{rec['bytes_per_step']:.0f} bytes moved per step")
    for line in (spec.summary_lines(rec) if spec.summary_lines else []):
        m.message("  " + line)
    for s in rec.get("shrinks") or []:
        m.message(f"  rank(s) {s['lost_ranks']} died at step {s['step']}: MPI reported it "
                  f"(ULFM), the collectives shrank to {s['replicas']} replica(s) and went on")
    if rec.get("test_auc") is not None:  # a binary model: AUC and log loss
        m.message(f"  final test AUC: {rec['test_auc']:.4f} (test log loss "
                  f"{rec['test_loss']:.4f})")
    else:
        m.message(f"  final test accuracy: {100 * rec['test_accuracy']:.2f}% "
                  f"(test loss {rec['test_loss']:.4f})")
    if rec.get("val_auc") is not None:
        m.message(f"  final validation AUC: {rec['val_auc']:.4f} (validation log loss "
                  f"{rec['val_loss']:.4f}, {rec['val_rows']} rows; the periodic evaluations "
                  "scored this split)")
    elif rec.get("val_accuracy") is not None:
        m.message(f"  final validation accuracy: {100 * rec['val_accuracy']:.2f}% "
                  f"(validation loss {rec['val_loss']:.4f}, {rec['val_rows']} rows; the "
                  "periodic evaluations scored this split)")
    if ctx.feed is not None and (ctx.feed.train or ctx.feed.evaluation):
        m.message("  " + ctx.feed.describe())
    m.message(f"  checkpoint: {rec['checkpoint']}   metrics: {m.path}")
    if stopped:
        m.message(f"  stopped early at step {step} of {ctx.total_steps} on a signal: exit code "
                  f"{PREEMPTED_EXIT}; run again with --resume auto (same run directory) to "
                  "continue")
    if "step_s" in rec:
        m.message(f"  a replica's iteration: {1e3 * rec['step_s']:.2f} ms, of which its gradient "
                  f"pass {1e3 * rec['pass_s']:.2f} ms "
                  f"({100 * rec['pass_s'] / max(rec['step_s'], 1e-12):.0f}%, "
                  f"{1e3 * rec['pass_cpu_s']:.2f} ms of CPU time; the rest is "
                  "communication, the update and the loop's own work)")
        idle = 1.0 - rec["cpu_s"] / max(rec["step_s"], 1e-12)
        m.message(f"  its process's CPU time: {1e3 * rec['cpu_s']:.2f} ms an iteration "
                  + (f"(it waited {100 * idle:.0f}% of the iteration: for its peers, the "
                     "network, or a core shared with other ranks)" if idle >= 0.1
                     else "(busy throughout: computing, or MPI polling)"))
    m.message(f"  BLAS: {rec['blas']} ({rec['blas_reason']})")
    if "first_layer" in rec:
        way = rec["first_layer"]["way"]
        m.message(f"  first layer: {'BLAS' if way == 'blas' else way + ' zero-skipping kernels'}"
                  f" ({rec['first_layer']['why']})")
    m.message("  " + memory.describe(rec))


def _train_rows(ctx: Context) -> int | None:
    """The training rows this rank trains on: a replica's (partition 0 of it, so that a
    replica counts once), None on the other ranks."""
    role = ctx.grid.role
    if not role.is_replica or (ctx.partitioned and role.partition):
        return None
    return ctx.train_rows


def _split_figures(ctx: Context, mine: dict, results: list[dict]) -> dict:
    """Which split each figure is on: ``eval_split`` (what the periodic evaluations scored),
    ``val_source`` (``file``, ``held-out`` or None), ``val_accuracy`` and ``val_loss`` (the
    final model on the validation split, when there is one; ``val_auc`` too for an embedding
    model), ``val_rows``, and
    ``train_rows``: the training rows the replicas held (each replica's shard once; with
    replicas that each hold the whole set, that set)."""
    rows = [r["train_rows"] for r in results if r.get("train_rows") is not None]
    whole = ctx.cfg.spec.replica_data == "whole"
    out = {"eval_split": ctx.eval_split, "val_source": ctx.val_source,
           "train_rows": (max(rows) if whole else sum(rows)) if rows else None}
    if ctx.val_source is not None:
        out.update(val_accuracy=mine.get("val_accuracy"), val_loss=mine.get("val_loss"),
                   val_rows=ctx.val_rows)
        if mine.get("val_auc") is not None:  # a binary (embedding) model
            out["val_auc"] = mine["val_auc"]
    return out


def _step_times(results: list[dict]) -> dict:
    """``step_s``: seconds of a replica's iteration, from its first to its last (without the
    run's ending); ``pass_s``: of them, its gradient passes; ``cpu_s`` and ``pass_cpu_s``:
    the CPU time its process used per iteration and in its passes (every thread, user and
    system). Means over the ranks that train (empty when none reported them: sandblaster,
    whose step is a pass over the data)."""
    timed = [r for r in results if "step_s" in r]
    if not timed:
        return {}
    return {k: round(sum(r[k] for r in timed) / len(timed), 7)
            for k in ("step_s", "pass_s", "pass_cpu_s", "cpu_s")}


def _blas_chosen() -> dict | None:
    """This rank's BLAS choice, if it ran a compiled kernel (see :func:`_blas_in_use`)."""
    from hpcps.kernels import HAVE_EXTENSION, blas
    return blas.chosen() if HAVE_EXTENSION else None


def _first_layer_chosen() -> dict | None:
    """How this rank's compiled engine computes the first layer, if it decided
    (:func:`hpcps.engine.hogwild.chosen`)."""
    from hpcps.engine import hogwild
    return hogwild.chosen() if hogwild.HAVE_EXTENSION else None


def _first_layer_in_use(results: list[dict]) -> dict:
    """``first_layer``: the way the compiled engine computes the first layer (an instruction
    set of the zero-skipping kernels, or ``blas``) and why, on the lowest rank that has one
    (the chief's replica where it trains); nothing when no rank used the compiled MLP
    engine (conv models, no extension). Each rank times its own."""
    mine = next((r["first_layer"] for r in results if r.get("first_layer")), None)
    return {"first_layer": mine} if mine else {}


def _blas_in_use(results: list[dict]) -> dict:
    """``blas``: ``mkl`` or ``openblas``, the sgemm the compiled kernels call (``HPCPS_BLAS``),
    ``numpy`` when they are not built; ``blas_reason``: why. Each rank chooses its own when it
    first runs a kernel: the reporter's choice when it computed, else the first replica's
    (sandblaster's coordinator computes nothing)."""
    from hpcps.kernels import HAVE_EXTENSION, blas
    if not HAVE_EXTENSION:
        return {"blas": "numpy", "blas_reason": "no compiled kernels"}
    mine = blas.chosen()
    if mine is None:
        mine = next((r["blas_used"] for r in results
                     if r.get("role") == "replica" and r.get("blas_used")), None)
        if mine is not None:
            mine = {**mine, "blas_reason": f"a replica's choice: {mine['blas_reason']}"}
    return mine or blas.summary()


def guarded(world, role: str, fn, *args, stacks: StackDumper | None = None,
            timeout: float = 0.0):
    """Run ``fn``; if it raises on this rank, print rank, host and reason, and abort the job.

    Once training runs, the other ranks may be blocked waiting on this one: only an abort
    ends them promptly (mpiexec then exits non-zero), so no failure becomes a hang. A wait
    that timed out first gathers every rank's stack (``stacks``, :mod:`hpcps.stacks`) and
    says where each rank was.
    """
    try:
        return fn(*args)
    except Dismissed as exc:  # the others went on without this rank: it leaves, they do not end
        print(f"hpcps: rank {world.Get_rank()} of {world.Get_size()} on {host()} ({role}): "
              f"{exc}", file=sys.stderr, flush=True)
        faults.leave(0)
    except KeyboardInterrupt:
        interrupted(world.Get_rank())
        if stacks is not None:
            stacks.announce_end(INTERRUPTED_EXIT)
        abort(INTERRUPTED_EXIT)
    except BaseException as exc:
        code = exc.exit_code if isinstance(exc, HpcpsError) else 1
        detail = str(exc) if isinstance(exc, HpcpsError) else traceback.format_exc()
        defer_s = float(getattr(exc, "defer_s", 0.0)) if isinstance(exc, HpcpsError) else 0.0
        if isinstance(exc, (PeerTimeout, CollectiveLost)) and stacks is not None:
            # a lost collective: the stacks show the wait that timed out, where it was
            waited = exc.__cause__ if isinstance(exc.__cause__, PeerTimeout) else exc
            more, defer_s = stacks.explain(waited, timeout)
            detail += more
        if defer_s > 0:
            time.sleep(defer_s)  # the reporting rank's abort usually ends us first
        print(f"hpcps: rank {world.Get_rank()} of {world.Get_size()} on {host()} ({role}) "
              f"failed: {detail}", file=sys.stderr, flush=True)
        if stacks is not None:
            stacks.announce_end(code)
        abort(code)


def main(argv: list[str] | None = None, early=()) -> int:
    """Run the job. ``early``: the signals :func:`hpcps.train.catch_early` caught before
    this rank's handlers were installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world = world_comm()
    rank, size = world.Get_rank(), world.Get_size()
    t_start = time.perf_counter()
    # from here on SIGTERM/SIGUSR1 ask for a stop, not death (and those that came earlier)
    flag = SignalFlag().install(early=early)
    if keeper.under_hydra():  # Hydra's SIGUSR1 ("a rank ended") may come while this rank ends,
        # after Python has given the signal its default action back: death, which the keeper
        # would report as a lost rank after an ordinary refusal
        atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)
    cfg = _agree(world, config.parse, argv)
    _agree(world, slurm.check_tasks, os.environ, size)
    layout = _agree(world, config.plan, cfg, size)
    _agree(world, _ensure_dataset, cfg, rank)
    info = _agree(world, _check_dataset, cfg)
    stamp, token = bcast_obj(world, (fresh_stamp(cfg, slurm.job_name(os.environ)),
                                     f"{host()}-{os.getpid()}-"
                                     f"{time.time():.6f}") if rank == 0 else None)
    run_dir = _agree(world, config.run_dir_for, cfg, stamp, slurm.job_name(os.environ))
    given = bool(cfg.run_dir)
    _agree(world, check_run_dir, run_dir, given)
    _agree(world, lambda: runlog.hold(run_dir) if rank == 0 else None)  # one job per directory
    # --joins: the chief and every rank that is or may become a shard listen for newcomers
    world = _agree(world, joins.routed, world, run_dir, layout.joins,
                   rank == 0 or rank in layout.shard_table, cfg.timeout)
    auto = cfg.resume == config.RESUME_AUTO
    cfg, notes = _agree(world, _resolve_auto, cfg, run_dir)
    ckpt, warnings = _agree(world, _load_resume, cfg, info)
    if rank == 0:
        for w in notes:
            print(f"[hpcps] {w}", flush=True)
        for w in warnings:
            print(f"[hpcps] warning: {w}", flush=True)
    vote_comm = dup_comm(world, 1, cfg.timeout, "every rank to set up the stop vote")[0]
    # how much data each rank may hold, and so what streams: the same decision on every rank
    where = allgather_obj(world, (host(), usable_cores()))
    on_node = [h for h, _ in where].count(host())
    dedicate(where, cfg.threads)  # with a core each, waits for replies spin first
    budgets = allgather_obj(world, _agree(world, _data_budget, cfg, on_node))
    stream = _agree(world, _plan_feed, cfg, info, layout, budgets)
    ctx = _agree(world, _setup, cfg, world, layout, info, ckpt, run_dir, stream)
    may_lose = cfg.heartbeat_timeout is not None  # replicas may die (hpcps.runtime.faults)
    verdict = None  # what the launcher does when a rank ends (faults.launcher_verdict)
    if may_lose:  # no world-wide stop vote with ranks that may die
        if cfg.spec.stops_alone:  # rank 0's SIGTERM stops the run by the strategy's messages
            flag.without_vote(hydra=keeper.under_hydra())
            ctx.stop_flag = flag
        else:  # signals act as usual
            flag.uninstall()
        _agree(world, faults.check_thread_level)
        verdict = faults.launcher_verdict(faults.ancestry(), os.environ)
        if rank == 0 and verdict:
            print(f"[hpcps] warning: {verdict}", flush=True)
    else:
        ctx.stop = StopVote(vote_comm, flag, cfg.timeout)
    m = ctx.metrics
    how = cfg.spec.how(cfg, ctx.n_train, layout.replicas)
    aug = parse_augment(getattr(cfg, "augment", None))
    if aug is not None:
        how += f", {aug.describe()}"
    m.message(_describe(cfg, layout) + f"; model {convnet.describe_model(ctx.full_model)} "
              f"({ctx.full_model.n_params} parameters), {how}, {ctx.total_steps} steps "
              f"({ctx.epochs(ctx.total_steps):.2f} epochs) of {info.name}; "
              f"{_validation_note(ctx)}; {stream.describe()}")
    note = config.recipe_note(cfg)
    if note is not None:
        m.message(f"{note}; options given on the command line win")
    if ckpt is not None:
        m.message(f"resumed from {cfg.resume}{' (--resume auto)' if auto else ''} at step "
                  f"{ckpt.step}")
        if ckpt.step >= ctx.total_steps:
            m.message(f"the checkpoint's step {ckpt.step} is at or past this run's length "
                      f"({ctx.total_steps} steps): nothing is left to train, the run evaluates "
                      "it and ends (ask for more with --steps or --epochs)")
    m.record("start", echo=False, config=cfg.to_dict(), dataset=info.to_dict(),
             start_step=ctx.start_step, total_steps=ctx.total_steps, ranks=size,
             resume_auto=auto, slurm=slurm.describe(os.environ), **stream.record())

    def train_and_report(tl: timeline.Timeline | None) -> int:
        try:
            result = cfg.spec.run(ctx)
        except NonFiniteError as exc:  # say where, what is left, and the usual causes
            raise explain_nonfinite(ctx, exc) from None
        result = {**result, "role": ctx.grid.role.kind, "peak_rss_bytes": memory.peak_rss_bytes(),
                  "blas_used": _blas_chosen(), "first_layer": _first_layer_chosen(),
                  "train_rows": _train_rows(ctx)}
        if may_lose:
            code = 0  # the reporter's: 75 when rank 0 stopped the run early (stops_alone)

            def summarize(results: list) -> None:
                nonlocal code
                mine = results[ctx.reporter]
                stopped = bool(mine.get("stopped_early")) and \
                    mine.get("step", ctx.start_step) < ctx.total_steps
                code = PREEMPTED_EXIT if stopped else 0
                _summary(ctx, results, time.perf_counter() - t_start, stopped)

            lost = faults.finish(world, ctx.reporter, result, ctx.grid.layout, cfg.timeout,
                                 summarize, grace=faults.ending_grace(cfg.heartbeat_timeout),
                                 leave_early=verdict is None)
            m.close()
            if lost:  # MPI_Finalize would wait for the dead ranks
                faults.leave(code)
            return code
        stopped = ctx.stop.finish()  # every rank leaves the vote after the same round
        live = ctx.grid.world  # the world, or its survivors after a death (ULFM's shrink)
        barrier(live, cfg.timeout, "every rank to finish training")
        if tl is not None:
            with trace.activated(None):
                path = timeline.finish(live, tl, ctx.grid.role, run_dir, cfg.timeout,
                                       {"strategy": cfg.strategy, "ranks": size})
            # written by rank 0, said by the reporter (sandblaster's is the coordinator)
            said = bcast_obj(live, None if path is None else str(path), root=0)
            if said is not None:
                m.message(f"trace: {said} (open it in https://ui.perfetto.dev or "
                          "chrome://tracing)")
        results = gather_obj(live, result, root=ctx.reporter)
        code = 0
        if live.Get_rank() == ctx.reporter:
            step = results[ctx.reporter].get("step", ctx.start_step)
            code = PREEMPTED_EXIT if stopped and step < ctx.total_steps else 0
            _summary(ctx, results, time.perf_counter() - t_start, code == PREEMPTED_EXIT)
        m.close()
        code = bcast_obj(live, code, root=ctx.reporter)
        if live is not world:  # MPI_Finalize would wait for the dead ranks
            faults.leave(code)
        return code

    tl = timeline.start(world, cfg.timeout) if cfg.trace else None
    stacks = StackDumper(run_dir, rank, size, ctx.grid.role.kind, token, host()).start()
    try:
        with trace.activated(tl.tracer if tl is not None else None):
            return guarded(world, ctx.grid.role.kind, train_and_report, tl, stacks=stacks,
                           timeout=cfg.timeout)
    finally:
        stacks.stop()
        joins.close(world)

