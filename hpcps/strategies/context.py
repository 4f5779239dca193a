"""What every strategy role is handed, and what they share around it: checkpoints, evaluation,
and what to say when training diverges.

:class:`Context` is built once by ``train.py`` and holds the config, the grid, the model, the
starting state (fresh or resumed) and the data this rank needs. A strategy's ``run(ctx)``
returns a dict of final figures for the summary.

Numerical health. Every checkpoint goes through :func:`save_checkpoint`, which refuses
parameters or optimizer state holding NaN or infinity (:class:`~hpcps.errors.NonFiniteError`,
exit code 7), so the last finite checkpoint is never overwritten by a diverged one. A rank
that sees a non-finite value during training raises ``NonFiniteError(step, what)``
(the parameter-server shard too, which knows no Context); ``train.py`` completes the message
with :func:`explain_nonfinite`: the rank's role, the checkpoint left in the run directory and
what usually causes it for the configuration in use (:func:`divergence_causes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import ConfigError, NonFiniteError
from hpcps.io import checkpoint, data, tables
from hpcps.io.data import DatasetInfo, RowSource
from hpcps.io.data.augment import Augmented
from hpcps.model import optim
from hpcps.model.mlp import MLP
from hpcps.model.spec import is_embedding_spec
from hpcps.mpi.comm import ReplicaExchange, gather_to_root
from hpcps.mpi.topology import Grid
from hpcps.options import RunConfig, parse_augment
from hpcps.runtime.metrics import Metrics
from hpcps.runtime.stop import SignalFlag, StopVote
from hpcps.strategies import feed
from hpcps.strategies.feed import Feed

CHECKPOINT_NAME = "checkpoint.h5"
TEST, VAL = "test", "val"  # the splits an evaluation scores (the ``split`` of eval records)
VAL_FILE, VAL_HELD_OUT = "file", "held-out"  # where the validation split comes from


@dataclass
class Context:
    """Everything one rank needs to run its part of a strategy.

    ``model`` is what this rank computes with: the whole :class:`MLP`, or with P > 1
    partitions its :class:`PartitionedMLP` slice (which exchanges activations inside the
    replica). ``full_model`` is always the whole MLP (checkpoints, evaluation).

    ``params`` and ``opt_state`` (fresh or from ``--resume``) are, on a replica, the vectors it
    computes with (its partition's slice); on a server, the *global* vector, every partition's
    slice one after the other, of which the shard keeps its own chunk. ``train_x/train_y``
    hold this replica's shard of the training set (every partition of a replica reads the same
    shard with the same seed, so they see the same batches without sending them);
    ``test_x/test_y`` are loaded on the chief only, and so are ``val_x/val_y``, the validation
    split (the file's /val, or the rows ``--validation-fraction`` holds out of /train), when
    ``val_source`` says there is one (every rank knows that). Data larger than the rank's
    memory budget stream instead (``feed``, :mod:`hpcps.strategies.feed`): the arrays are
    then None and ``train_stream``, ``test_stream``, ``val_stream`` name the rows; roles draw
    batches with :meth:`train_batches` and score with :func:`evaluate`, which serve both.
    """

    cfg: RunConfig
    grid: Grid
    model: object
    full_model: MLP
    optimizer: object
    dataset: DatasetInfo
    params: np.ndarray
    opt_state: dict[str, np.ndarray]
    start_step: int
    total_steps: int
    run_dir: Path
    metrics: Metrics
    train_x: np.ndarray | None = None
    train_y: np.ndarray | None = None
    test_x: np.ndarray | None = None
    test_y: np.ndarray | None = None
    val_x: np.ndarray | None = None    # the validation split, on the chief only
    val_y: np.ndarray | None = None
    # data that stream from the file instead (hpcps.strategies.feed): then the arrays above
    # are None and these name the rows
    feed: Feed | None = None
    train_stream: RowSource | None = None
    test_stream: RowSource | None = None
    val_stream: RowSource | None = None
    val_source: str | None = None      # where it comes from (VAL_FILE, VAL_HELD_OUT), None: none
    val_rows: int = 0                  # its rows (known on every rank)
    held_out: int = 0                  # of them, rows of /train (--validation-fraction)
    reporter: int = 0                  # the rank that logs and prints the summary
    resumed: dict | None = None        # the metrics saved in the --resume checkpoint
    stop: StopVote | None = None       # SIGTERM/SIGUSR1 agreed among the ranks (hpcps.runtime.stop)
    # a run without that vote (ranks may die) of a strategy that stops without one
    # (Strategy.stops_alone): this rank's SIGTERM (and SIGUSR1 outside Hydra), recorded;
    # None: SIGTERM ends the rank
    stop_flag: SignalFlag | None = None
    # (whole params, split) -> figures without prefix, {"loss": .., "auc": ..}: how the chief
    # scores a model whose evaluation needs more than its parameters (an embedding model's
    # rows live on the server shards); None: loss and accuracy of the forward pass
    evaluator: Callable[[np.ndarray, str], dict] | None = None

    def train_batches(self, batch: int, seed: int):
        """This replica's endless mini-batches of ``batch`` rows, drawn from ``seed``: from
        its block in memory, or streamed from the file; with ``--augment``, its images moved
        (:mod:`hpcps.io.data.augment`)."""
        batches = feed.batches(self.train_x, self.train_y, self.train_stream, self.feed, batch,
                               seed)
        aug = parse_augment(getattr(self.cfg, "augment", None))
        if aug is None:
            return batches
        # every partition of a replica draws the same batches from the same seed, and so the
        # same moves
        return Augmented(batches, aug, self.dataset.image_shape, seed)

    @property
    def train_rows(self) -> int | None:
        """Rows of this rank's training block (None: it holds none)."""
        if self.train_stream is not None:
            return len(self.train_stream)
        return None if self.train_x is None else len(self.train_x)

    def score(self, model, params: np.ndarray, split: str = TEST) -> tuple[float, float]:
        """(loss, accuracy) of ``model`` with ``params`` on this rank's ``split`` (``test``
        or ``val``), in memory or read in chunks."""
        if split == VAL:
            x, y, source = self.val_x, self.val_y, self.val_stream
        else:
            x, y, source = self.test_x, self.test_y, self.test_stream
        if x is None and source is None:
            raise ValueError(f"no {split} split loaded on this rank")
        return feed.score(model, params, x, y, source,
                          self.feed.eval_rows if self.feed is not None else feed.EVAL_ROWS)

    def stop_requested(self) -> bool:
        """At a safe point of a rank that runs at its own pace and decides for the run (a
        coordinator): poll the stop vote (never waits); True once this rank should stop. In
        a run without a vote (``stop_flag``, :attr:`Strategy.stops_alone`): True once this
        rank got the signal itself (see :mod:`hpcps.runtime.stop`)."""
        if self.stop is not None:
            return self.stop.poll()
        return self.stop_flag is not None and self.stop_flag.raised

    def stop_tick(self) -> None:
        """For serving loops: take part in the stop vote without acting on it (a shard
        ends when its replicas or its coordinator end)."""
        if self.stop is not None:
            self.stop.poll()

    @property
    def eval_split(self) -> str:
        """The split the periodic evaluations score: ``val`` when there is a validation
        split, else ``test`` (the final evaluation always scores the test set)."""
        return VAL if self.val_source is not None else TEST

    @property
    def remaining_steps(self) -> int:
        return max(0, self.total_steps - self.start_step)

    @property
    def n_train(self) -> int:
        """The training rows the replicas train on: /train less the rows held out for
        validation (epochs count passes over these)."""
        return self.dataset.n_train - self.held_out

    def epochs(self, step: int) -> float:
        return step * self.cfg.batch(self.n_train) / self.n_train

    def batch_seed(self, replica: int) -> int:
        """Data order differs per replica and per resume point, reproducibly from --seed."""
        return self.cfg.seed * 1_000_003 + replica * 7919 + self.start_step


    @property
    def partitioned(self) -> bool:
        return self.grid.layout.partitions > 1

    def global_to_full(self, vec: np.ndarray) -> np.ndarray:
        """Whole-model vector (MLP layout) from a global partition-major one."""
        if not self.partitioned:
            return vec
        sizes = self.model.part_sizes
        cuts = np.cumsum([0] + sizes)
        return self.model.full_from_parts([vec[cuts[q]:cuts[q + 1]] for q in range(len(sizes))])

    def gather_full(self, vec: np.ndarray) -> np.ndarray | None:
        """Collective over this replica's ranks: the whole-model vector on partition 0, None on
        the other partitions. With P = 1, just ``vec``."""
        if not self.partitioned:
            return vec
        out = gather_to_root(self.grid.replica_comm, vec, self.model.part_sizes,
                             self.cfg.timeout,
                             "the partitions of this replica to join a gather of the model")
        return self.global_to_full(out) if out is not None else None


def model_parallel_figures(ctx: Context, steps: int, seconds: float) -> dict:
    """Per-step figures of the exchange inside the replica (empty with P = 1)."""
    ex = getattr(ctx.model, "exchange", None)
    if not ctx.partitioned or not isinstance(ex, ReplicaExchange) or steps <= 0:
        return {}
    return {"replica_bytes_per_step": round(ex.bytes_sent / steps),
            "exchange_s_per_step": round(ex.wait_s / steps, 6),
            "compute_s_per_step": round(max(0.0, seconds - ex.wait_s) / steps, 6)}


def without(xy: tuple[np.ndarray, np.ndarray], lo: int,
            held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``lo ..`` of /train as loaded, less those ``held`` out for validation."""
    x, y = xy
    mine = held[(held >= lo) & (held < lo + len(x))] - lo
    if not len(mine):
        return x, y
    keep = np.ones(len(x), dtype=bool)
    keep[mine] = False
    return np.ascontiguousarray(x[keep]), np.ascontiguousarray(y[keep])


def train_shard(cfg: RunConfig, info: DatasetInfo, index: int, replicas: int,
                held: np.ndarray, stream: Feed | None = None) -> dict:
    """Data shard ``index`` of ``replicas`` of /train (a dense dataset), less the rows
    ``held`` out for validation, as the Context fields that hold it: ``train_x``,
    ``train_y`` read into memory, or, when ``stream`` says the training data stream,
    ``train_stream`` naming the rows. ConfigError if it cannot fill one step's
    mini-batches."""
    lo, hi = block_range(info.n_train, replicas, index)
    if stream is not None and stream.train:
        source = RowSource(cfg.data, "train", info.n_features, lo, hi, held)
        fields: dict = {"train_x": None, "train_y": None, "train_stream": source}
        rows = len(source)
    else:
        x, y = without(data.load_split(cfg.data, "train", index, replicas), lo, held)
        fields, rows = {"train_x": x, "train_y": y, "train_stream": None}, len(x)
    need = cfg.batch_size * cfg.threads  # a step draws one mini-batch per thread
    if rows < need:
        what = (f"one step's {need} (--batch-size {cfg.batch_size} x --threads "
                f"{cfg.threads})" if cfg.threads > 1 else f"--batch-size {cfg.batch_size}")
        raise ConfigError(f"replica {index} holds {rows} training examples, fewer than "
                          f"{what}")
    return fields


def gather_state(ctx: Context, params: np.ndarray, state: dict) -> tuple:
    """(whole params, whole optimizer state) on partition 0 of this replica; (None, {...None})
    on its other partitions. Collective over the replica's ranks."""
    return ctx.gather_full(params), {k: ctx.gather_full(v) for k, v in state.items()}


def crossed(step: int, advanced: int, every: int) -> bool:
    """True when moving from ``step - advanced`` to ``step`` passed a multiple of ``every``."""
    return bool(every) and step // every != (step - advanced) // every


def make_optimizer(cfg: RunConfig):
    return optim.make(cfg.optimizer, cfg.lr, cfg.adagrad_eps, cfg.lbfgs_history or 10,
                      momentum=cfg.momentum or 0.0, nesterov=cfg.nesterov == "on")


def checkpoint_path(ctx: Context) -> Path:
    return ctx.run_dir / CHECKPOINT_NAME


def save_checkpoint(ctx: Context, params: np.ndarray, opt_state: dict[str, np.ndarray],
                    step: int, metrics: dict | None = None) -> Path:
    """Write the whole-model state (MLP layout vectors) as one HDF5 checkpoint, atomically.

    Raises NonFiniteError, writing nothing, when the state holds NaN or infinity: the
    checkpoint already in the run directory (the last finite one) stays as it was. An
    embedding model's shards have written their table files of ``step`` before; once the
    checkpoint names it, the files of older steps are removed (:func:`hpcps.io.tables.prune`).
    """
    views = ctx.full_model.views
    bad = checkpoint.nonfinite({**{f"params/{k}": v for k, v in views(params).items()},
                                **{f"optimizer/{k}": v for k, v in opt_state.items()}})
    if bad is not None:
        raise NonFiniteError(step, f"refused to write a checkpoint: its state holds {bad[0]} "
                             f"NaN or infinite value(s), the first in {bad[1]}")
    state = {f"{key}/{name}": a for key, flat in opt_state.items()
             for name, a in views(flat).items()}
    ckpt = checkpoint.Checkpoint(
        params={k: np.ascontiguousarray(v) for k, v in views(params).items()},
        optimizer=ctx.cfg.optimizer, opt_state=state, step=int(step),
        config=ctx.cfg.to_dict(), dataset=ctx.dataset.to_dict(), metrics=dict(metrics or {}))
    path = checkpoint.save(checkpoint_path(ctx), ckpt)
    if is_embedding_spec(ctx.cfg.model):  # the table files of older checkpoints: superseded
        tables.prune(path.parent / tables.TABLES_DIR, int(step), ctx.full_model.n_tables,
                     ctx.full_model.dim)
    return path


def state_from_checkpoint(model: MLP, ckpt: checkpoint.Checkpoint,
                          state_keys) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Flat parameters and optimizer state from a loaded checkpoint."""
    params = model.flatten(ckpt.params)
    state = {}
    for key in state_keys:
        named = {name: ckpt.opt_state[f"{key}/{name}"] for name, _, _ in model.layout}
        state[key] = model.flatten(named)
    return params, state


def evaluate(ctx: Context, params: np.ndarray, step: int,
             split: str = TEST) -> tuple[float, float]:
    """(loss, accuracy) of whole-model ``params`` on the chief's ``split`` (``test`` or
    ``val``).

    Raises NonFiniteError when the loss is NaN or infinite: the data are finite
    (checked at load), so the parameters overflow the forward pass, finite or not.
    """
    loss, acc = ctx.score(ctx.full_model, params, split)
    check_test_loss(loss, step, split)
    return loss, acc


def evaluation(ctx: Context, params: np.ndarray, step: int, split: str = TEST) -> dict:
    """The figures of whole-model ``params`` on ``split``, without the split's prefix:
    ``{"loss", "accuracy"}``, or what :attr:`Context.evaluator` gives (``{"loss", "auc"}``
    for an embedding model). Raises NonFiniteError on a loss that is not finite."""
    if ctx.evaluator is None:
        loss, acc = evaluate(ctx, params, step, split)
        return {"loss": loss, "accuracy": acc}
    figures = ctx.evaluator(params, split)
    check_test_loss(figures["loss"], step, split)
    return figures


def check_test_loss(loss: float, step: int, split: str = TEST) -> None:
    if not math.isfinite(loss):
        what = "validation" if split == VAL else "test"
        raise NonFiniteError(step, f"found a {what} loss of {loss}: the parameters overflow "
                             "the forward pass")


def split_figures(split: str, loss: float, acc: float) -> dict:
    """An evaluation's fields in a record: ``split`` and ``<split>_accuracy``,
    ``<split>_loss`` (``test_accuracy`` on the test set, ``val_accuracy`` on the validation
    split), so every figure says which split it is on."""
    return {"split": split, f"{split}_accuracy": acc, f"{split}_loss": loss}


def periodic_evaluation(ctx: Context, params: np.ndarray, step: int) -> dict:
    """The chief's periodic evaluation, on :attr:`Context.eval_split`: the eval record's
    fields (:func:`split_figures`)."""
    split = ctx.eval_split
    return {"split": split, **{f"{split}_{k}": v
                               for k, v in evaluation(ctx, params, step, split).items()}}


def finish_on_chief(ctx: Context, params: np.ndarray, state: dict, step: int,
                    train_s: float, saved: dict | None = None) -> dict:
    """The chief's end of a run: evaluate the final whole model on the test set (and on the
    validation split when there is one), write the final checkpoint (with the scalars
    ``saved`` among its metrics), and return the summary's common figures."""
    final = {f"{TEST}_{k}": v for k, v in evaluation(ctx, params, step).items()}
    if ctx.val_source is not None:
        final.update({f"{VAL}_{k}": v for k, v in evaluation(ctx, params, step, VAL).items()})
    path = save_checkpoint(ctx, params, state, step, {**final, **(saved or {})})
    return {"step": step, **final, "checkpoint": str(path),
            "examples_per_s": rate((step - ctx.start_step) * ctx.cfg.batch_size, train_s)}


def steps_for_replica(total: int, replicas: int, replica: int, warmup: int = 0) -> int:
    """Mini-batches replica ``replica`` runs: replica 0 does the warm start alone, then the
    rest of the work is split as evenly as possible."""
    warmup = min(warmup, total)
    lo, hi = block_range(total - warmup, replicas, replica) if total > warmup else (0, 0)
    return (hi - lo) + (warmup if replica == 0 else 0)


def rate(examples: float, seconds: float) -> float:
    return examples / seconds if seconds > 0 else math.nan



# -- numerical health ------------------------------------------------------------------------
# A rank that sees a NaN but should not report it waits this long, plus a second per rank, so
# that the reporting rank's abort (after topology.ABORT_GRACE_S) ends it first.
NONFINITE_DEFER_S = 1.0
NONFINITE_DEFER_MAX_S = 5.0


def role_name(ctx: Context) -> str:
    """This rank's role in words, e.g. ``replica 1 (rank 1)`` or ``server shard 0 (rank 3)``."""
    role, rank = ctx.grid.role, ctx.grid.rank
    if role.is_replica:
        part = f" partition {role.partition}" if ctx.partitioned else ""
        return f"replica {role.replica}{part} (rank {rank})"
    if role.is_server:
        return f"server shard {role.shard} (rank {rank})"
    return f"the coordinator (rank {rank})"


def checkpoint_note(ctx: Context) -> str:
    """What the run directory holds after a stop, for the message (reads one attribute)."""
    path = checkpoint_path(ctx)
    step = checkpoint.peek_step(path)
    if step is not None:
        return f"the last checkpoint, {path} (step {step}), is left as it was"
    if ctx.cfg.resume:
        return (f"no checkpoint was written to {ctx.run_dir}; the run started from "
                f"{ctx.cfg.resume} (step {ctx.start_step}), left as it was")
    return f"no checkpoint was written to {ctx.run_dir} (none was due yet)"


def divergence_causes(ctx: Context) -> list[str]:
    """What usually makes a run of this configuration diverge, the likeliest first.

    Read from the options in use, not from strategy names: L-BFGS on small batches,
    asynchronous replicas on parameter servers, thresholded updates (``--tau``), replicas
    applying each other's steps unscaled, the learning rate, averaging rarely.
    """
    cfg, R = ctx.cfg, ctx.grid.layout.replicas
    causes = []
    if cfg.optimizer == "lbfgs":
        causes.append(f"L-BFGS on batches of {cfg.batch(ctx.dataset.n_train)} examples: a "
                      "noisy objective spoils its curvature pairs; use a larger --batch-size "
                      "(0: the whole training set)")
    elif ctx.cfg.spec.uses_servers and R > 1:
        causes.append(f"too many replicas for asynchronous SGD: {R} replicas push gradients "
                      "computed on parameters several updates old (the staleness in the "
                      "progress lines); use fewer replicas, a longer --warmup-steps, "
                      "--staleness-bound or --softsync, or a smaller --lr")
    if cfg.tau == "auto":
        causes.append("--tau auto with too low a --density: few elements are sent, each far "
                      "past the threshold; try a larger --density or --residual-clip 4")
    elif cfg.tau is not None:
        causes.append(f"--tau {cfg.tau:g} too large: each update moves an element by +-tau; "
                      "try a smaller one")
    if cfg.lr_scaling == "sum" and R > 1:
        causes.append(f"every replica applying all {R} replicas' steps at the full rate "
                      "(--lr-scaling sum): try sqrt or mean")
    if cfg.lr is not None:
        causes.append(f"a learning rate too large for {cfg.optimizer} (--lr {cfg.lr:g}): try "
                      "a third of it")
    if cfg.average_every is not None and cfg.average_every > 1 and R > 1:
        causes.append(f"replicas drifting apart between averages (--average-every "
                      f"{cfg.average_every}): average more often")
    return causes


def causes_text(ctx: Context) -> str:
    causes = divergence_causes(ctx)
    if not causes:
        return ""
    return (f"Usual cause{'s' if len(causes) > 1 else ''} with --strategy {ctx.cfg.strategy}: "
            + "; or ".join(causes) + ".")


def explain_nonfinite(ctx: Context, exc: NonFiniteError) -> NonFiniteError:
    """``exc``, raised on this rank, as the job's message: the step, this rank's role, what
    was not finite, the checkpoint left in the run directory and the usual causes.

    The reporting rank's copy prints at once; the others are deferred (see
    :class:`~hpcps.errors.NonFiniteError`), longer the higher their rank, so that when
    several ranks see the same divergence one message is printed.
    """
    rank = ctx.grid.rank
    defer = 0.0 if rank == ctx.reporter else \
        min(NONFINITE_DEFER_MAX_S, NONFINITE_DEFER_S * (1 + rank))
    text = (f"training diverged at step {exc.step}: {role_name(ctx)} {exc.what}; "
            f"{checkpoint_note(ctx)}. {causes_text(ctx)}")
    return NonFiniteError(exc.step, exc.what, text.rstrip(), defer)


def warn_divergence(ctx: Context, watch, fired: dict, step: int) -> None:
    """The divergence warning, once: a ``warning`` record in metrics.jsonl and one line on the
    terminal, with the usual causes. ``watch`` is the
    :class:`~hpcps.runtime.metrics.DivergenceWatch`
    that returned ``fired``. Training goes on: a warning, not a stop."""
    text = f"{watch.describe(fired, step)}. {causes_text(ctx)}".rstrip()
    ctx.metrics.record("warning", echo=False, step=step, reason="diverging", message=text,
                       causes=divergence_causes(ctx), **fired)
    ctx.metrics.message(f"warning: {text}")
