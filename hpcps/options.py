"""What one command-line option is: its name, type, help, allowed values and range.

:mod:`hpcps.config` builds the parser, the TOML reader and the frozen :class:`Config` from
these declarations: the options every run has are listed there, and each strategy declares
the options that belong to it in its own module (``STRATEGY.options``, see
:mod:`hpcps.strategies.registry`). Declaring an option once gives it a ``--flag``, a TOML key,
a typed field, its help line and its range check. Pure: no MPI, no hpcps imports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from hpcps.errors import ConfigError

class RunConfig(Protocol):
    """The run's configuration as a type checker sees it: every option all runs have, typed,
    and the methods of :class:`hpcps.config.Config` (which builds the real, frozen object from
    the declarations). A strategy's own options (``cfg.n_fetch``) are read through
    ``__getattr__``, typed ``Any``. Declared here, at the ground, so that every layer may
    name the type; ``tests/test_config.py`` checks it against the options."""

    strategy: str
    servers: int | None
    partitions: int
    layers: tuple[int, ...]
    model: str | None
    activation: str
    optimizer: str | None
    lr: float | None
    adagrad_eps: float
    momentum: float | None
    nesterov: str | None
    epochs: float | None
    steps: int | None
    batch_size: int | None
    threads: int
    data: str
    run_dir: str | None
    checkpoint_every: int
    eval_every: int
    resume: str | None
    seed: int
    progress_every: float
    timeout: float
    trace: bool
    config: str | None
    validation_fraction: float
    data_memory: float | None

    def __getattr__(self, name: str) -> Any: ...

    @property
    def spec(self) -> Any: ...

    def to_dict(self) -> dict[str, Any]: ...

    def batch(self, n_train: int) -> int: ...

    def total_steps(self, n_train: int) -> int: ...


CHECKS = (None, "positive", "nonneg", "fraction")
TAU_TYPE = "tau"  # Option.type of --tau: a positive number or "auto"
AUTO = "auto"


@dataclass(frozen=True)
class Option:
    """One option: ``--name-with-dashes`` on the command line, ``name`` in TOML and Config.

    Parameters
    ----------
    name : the field name (underscores).
    type : ``int``, ``float``, ``str`` or ``"layers"`` (comma-separated widths).
    help : one or two sentences for ``--help``.
    default : the value when not given; ``None`` means "not given", and the strategy in use
        fills its own default (see ``Strategy.defaults``).
    choices : the allowed values, if the option is a choice.
    check : ``"positive"`` (> 0), ``"nonneg"`` (>= 0) or ``"fraction"`` (in [0, 1)) for
        numbers.
    least : ``(smallest value, why)``: a number below it is refused, saying why.
    """

    name: str
    type: Any
    help: str
    default: Any = None
    choices: tuple | None = None
    check: str | None = None
    least: tuple[float, str] | None = None

    def __post_init__(self):
        if self.check not in CHECKS:
            raise ValueError(f"option {self.name}: check must be one of {CHECKS}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check_value(self, value: Any) -> None:
        """Refuse a value outside the option's choices or range (None: not given, fine)."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{self.flag} takes {' or '.join(map(str, self.choices))}, "
                              f"got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{self.flag} must be a finite number, got {value}")
        if self.check == "positive" and not value > 0:
            raise ConfigError(f"{self.flag} must be positive, got {value}")
        if self.check == "nonneg" and not value >= 0:
            raise ConfigError(f"{self.flag} must be >= 0, got {value}")
        if self.check == "fraction" and not 0 <= value < 1:
            raise ConfigError(f"{self.flag} must be >= 0 and below 1, got {value}")
        if self.least is not None and value < self.least[0]:
            raise ConfigError(f"{self.flag} must be at least {self.least[0]:g} "
                              f"({self.least[1]}), got {value}")


def flag(name: str) -> str:
    """``n_fetch`` -> ``--n-fetch``."""
    return "--" + name.replace("_", "-")


def parse_inject_slow(text: str) -> tuple[int, float]:
    """``RANK:FACTOR`` -> (world rank, factor); FACTOR >= 1, or ``stall`` (inf): the replica
    stops answering (it only waits for the end of the job)."""
    try:
        rank_text, factor_text = text.split(":")
        rank = int(rank_text)
        factor = math.inf if factor_text == "stall" else float(factor_text)
    except ValueError:
        raise ConfigError(f"--inject-slow wants RANK:FACTOR (e.g. 2:10 or 2:stall), got {text!r}")
    if rank < 0 or not factor >= 1:
        raise ConfigError(f"--inject-slow needs a rank >= 0 and a factor >= 1, got {text!r}")
    return rank, factor


def parse_tau(value):
    """``"auto"`` or a positive float, from the command line or TOML; else ConfigError."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"--tau takes a positive number or 'auto', got {value!r}") \
                from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"--tau takes a positive number or 'auto', got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--tau must be positive and finite (or 'auto'), got {value}")
    return value


# Options several strategies share: declared once here, listed by each strategy that takes them.
PREFETCH = Option("prefetch", int, "mini-batches a background thread prepares ahead of "
                  "training (default 2; 0: none)", check="nonneg")
TAU = Option("tau", TAU_TYPE, "threshold of the compressed updates: each sent element moves "
             "by +-tau (deadreckon: weight units, default auto, starting at 0.002; downpour "
             "--compress threshold: gradient units, default 0.01); 'auto' adapts tau on each "
             "rank so that a fraction --density of the elements is sent per step")
DENSITY = Option("density", float, "--tau auto: the fraction of elements a compressed update "
                 "sends, per step and rank (default 0.002, and at least 32 elements)",
                 check="positive")
SPARSITY_WARMUP = Option("sparsity_warmup", int, "--tau auto: over this many of a replica's "
                         "steps (from when it starts sending) the target density falls "
                         "geometrically from 64x --density to --density (Deep Gradient "
                         "Compression's warm-up; default 0: none)", check="nonneg")
RESIDUAL_CLIP = Option("residual_clip", float, "clip each element of the compression "
                       "residual to +-C*tau after every step (Deeplearning4j's residual "
                       "clipping; default 0: off)", check="nonneg")
GRAD_CLIP = Option("grad_clip", float, "local gradient clipping before compression: scale a "
                   "replica's mini-batch gradient to an L2 norm of at most G/sqrt(R) (Deep "
                   "Gradient Compression; default 0: off)", check="nonneg")
WIRE_DTYPE = Option("wire_dtype", str, "the format of the values the ranks send each other: "
                    "fp32 (default) or bf16, bfloat16 rounded to nearest even, half the bytes "
                    "of fetches, pushes, allreduces, averages and model-parallel exchanges; "
                    "every sum, update and master copy of the weights stays fp32 "
                    "(docs/performance.md, bfloat16 on the wire)", choices=("fp32", "bf16"))
# every option of compressed updates, in the order strategies list them
COMPRESSION = (DENSITY, SPARSITY_WARMUP, RESIDUAL_CLIP, GRAD_CLIP)
DEFAULT_DENSITY = 2e-3       # target density of --tau auto (docs/compression.md)
MIN_WORDS = 32               # ... but at least this many words per step (small models)


def check_compression(cfg, default_tau) -> None:
    """Refuse compression options that would do nothing or cannot work (before defaults are
    filled: ``cfg.tau`` None means the strategy's ``default_tau``)."""
    tau = cfg.tau if cfg.tau is not None else default_tau
    if tau != AUTO:
        for name in ("density", "sparsity_warmup"):
            if getattr(cfg, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} sets the target of an adaptive threshold: it needs "
                                  f"--tau auto, not --tau {tau:g}")
    if cfg.density is not None and not cfg.density <= 1:
        raise ConfigError(f"--density is a fraction of the elements, in (0, 1]; got "
                          f"{cfg.density:g}")


def describe_tau(cfg) -> str:
    """``tau=0.002`` or ``tau auto (density 0.001, ...)``, and the clipping, for the start line."""
    if cfg.tau == AUTO:
        text = (f"tau auto (density {cfg.density or DEFAULT_DENSITY:g}, at least {MIN_WORDS} "
                "words per step")
        if cfg.sparsity_warmup:
            text += f", sparsity warm-up {cfg.sparsity_warmup} steps"
        text += ")"
    else:
        text = f"tau={cfg.tau}"
    if cfg.residual_clip:
        text += f", residual clip {cfg.residual_clip:g} tau"
    if cfg.grad_clip:
        text += f", gradient clip {cfg.grad_clip:g}/sqrt(R)"
    return text


INJECT_SLOW = Option("inject_slow", str, "for testing: RANK:FACTOR makes that replica rank "
                     "(world rank) FACTOR times slower, to show what one slow replica does "
                     "to the others; RANK:stall makes it stop answering after its first step "
                     "(the others time out: docs/errors.md, stalls)")
WARMUP_STEPS = Option("warmup_steps", int, "warm start: replica 0 trains alone for this "
                      "many of its mini-batches, then the others start from its weights "
                      "(Downpour's and Strom's recipe: fewer replicas early on); each strategy "
                      "has its own default (downpour 200, deadreckon 100); 0: all start at "
                      "once; not applied when resuming", check="nonneg")
GOLOMB = Option("golomb", str, "on: Golomb-Rice code the index gaps of compressed messages "
                "(default); off: send the raw 32-bit words", choices=("on", "off"))
SCHEDULES = ("constant", "cosine")


def varies(schedule: str | None) -> bool:
    """Whether ``schedule`` (``--lr-schedule``) changes the rate over a run."""
    return schedule not in (None, "constant")


LR_SCHEDULE = Option("lr_schedule", str, "the learning rate over the run: constant (default) "
                     "or cosine, annealed from --lr at the start to 0 at the last step "
                     "(SGDR's cosine, no restarts); follows the global step, also on resume",
                     choices=SCHEDULES)
WEIGHT_DECAY = Option("weight_decay", float, "L2 weight decay lambda: lambda * w (the gradient of "
                      "lambda/2 * |w|^2 over every weight and bias) is added to each gradient a "
                      "replica computes, before it is pushed, summed, thresholded or applied "
                      "(default 0: none)", check="nonneg")
DROPOUT = Option("dropout", float, "dropout rate p on the outputs of every hidden fully "
                 "connected layer of a --model network, in training only (inverted dropout: "
                 "kept units are scaled by 1/(1-p); default 0: none)", check="fraction")
AUGMENT = Option("augment", str, "training-time augmentation of image data: shift:K moves "
                 "each training image by a random whole number of pixels, up to K each way "
                 "(dy, dx uniform in [-K, K], zeros moved in; e.g. shift:2), drawn anew every "
                 "time the image is used; the evaluations see the images as they are; needs a "
                 "dataset with an image_shape (default none)")
MAX_SHIFT = 8  # --augment shift:K's largest K: past it an image is mostly border


@dataclass(frozen=True)
class Shift:
    """``--augment shift:K``: random translations of up to ``k`` pixels each way
    (:mod:`hpcps.io.data.augment`)."""

    k: int

    @property
    def text(self) -> str:
        return f"shift:{self.k}"

    def describe(self) -> str:
        pixels = "1 pixel" if self.k == 1 else f"{self.k} pixels"
        return f"training images moved by up to {pixels} each way (--augment {self.text})"


def parse_augment(text: str | None) -> Shift | None:
    """``"shift:K"`` -> :class:`Shift` (1 <= K <= :data:`MAX_SHIFT`); None or ``"none"``: no
    augmentation. Raises ConfigError naming the form for anything else."""
    if text is None or text == "none":
        return None
    kind, _, arg = text.partition(":")
    if kind == "shift" and arg.isdigit() and 1 <= int(arg) <= MAX_SHIFT:
        return Shift(int(arg))
    raise ConfigError(f"--augment takes shift:K (random translations of up to K pixels each "
                      f"way, K from 1 to {MAX_SHIFT}, e.g. shift:2) or none; got {text!r}")


HEARTBEAT_TIMEOUT = Option(
    "heartbeat_timeout", float, "replicas may die (Project Adam; launch with mpiexec "
    "-disable-auto-cleanup ... python -m hpcps.keeper, or srun --wait=0 ... python -m "
    "hpcps.keeper): the run goes on "
    "without a replica rank that dies, and ends without collectives over the world. downpour "
    "(--partitions 1): each replica sends the shards a heartbeat 5 times per this many seconds, "
    "and one silent for longer is dropped; sandblaster: the coordinator drops a replica silent "
    "for --replica-timeout, and a shard waits at most this long for a message to or from a "
    "replica. The chief, rank 0, must survive (default: none, any failure ends the job)",
    check="positive")
DEFAULT_CHUNK_BYTES = 1 << 20
CHUNK_BYTES = Option("chunk_bytes", int, "bytes per chunk of the parameter vector; chunks are "
                     "hashed to the server shards (Project Adam; default 1048576 = 1 MiB); a "
                     "model smaller than one chunk per shard is cut into one chunk per shard",
                     check="positive", least=(4, "a chunk holds at least one 4-byte parameter"))

# Embedding models (--model embed..., docs/ctr.md): the rows' own optimizer and rate, applied
# where the rows live; a strategy that trains embedding models lists them.
ROW_LR = Option("row_lr", float, "embedding models: the rate of the embedding rows' optimizer "
                "(default: the strategy's, below)", check="positive")
ROW_OPTIMIZER = Option("row_optimizer", str, "embedding models: the rows' update rule: "
                       "rowwise_adagrad (one accumulator per row, the default), adagrad (one per "
                       "element) or sgd", choices=("rowwise_adagrad", "adagrad", "sgd"))
ROW_L2 = Option("row_l2", float, "embedding models: L2 weight decay of the rows, lambda * row "
                "added to a row's gradient each time a batch uses it (default: the strategy's, "
                "below; 0: none)", check="nonneg")
ROW_INIT_SCALE = Option("row_init_scale", float, "embedding models: a row is created on first "
                        "use uniform in [-s, s), from its (table, id) and --seed (default: the "
                        "strategy's, below)", check="positive")
TABLE_CAPACITY = Option("table_capacity", int, "embedding models: each server shard holds at "
                        "most this many rows of each table; new rows beyond it evict the rows "
                        "unused for the longest (an evicted row starts again from its initial "
                        "row), and a pushed gradient of a row evicted since its pull is "
                        "dropped; at least the rows one pull (--threads batches) can touch "
                        "in one table (default: none, unbounded)", check="positive")
# --admit-after's largest value: sightings are counted in 16-bit saturating counters
# (hpcps.ps.admission.COUNTER_MAX; declared here, below the layers that load MPI)
ADMIT_AFTER_MAX = 0xFFFF
ADMIT_AFTER = Option("admit_after", int, "embedding models: a row is created only once its id "
                     "has been seen in this many training pulls (counted per shard in a "
                     "fixed-size count-min sketch); until then it reads as zeros and its "
                     "gradients are dropped (default 1: at first sight)", check="positive")
EMBEDDING_OPTIONS = (ROW_LR, ROW_OPTIMIZER, ROW_L2, ROW_INIT_SCALE, TABLE_CAPACITY, ADMIT_AFTER)


def check_embedding_options(cfg, embedding: bool, refused: dict[str, bool]) -> None:
    """Embedding options only with an embedding model (``embedding``: ``--model`` is one);
    with one, none of ``refused`` (``{"--flag": given}``: what the strategy cannot do with
    embedding rows)."""
    if not embedding:
        for o in EMBEDDING_OPTIONS:
            if getattr(cfg, o.name) is not None:
                raise ConfigError(f"{flag(o.name)} applies to embedding models (--model "
                                  "embed..., ctr-dnn, movielens) only")
        return
    given = [name for name, on in refused.items() if on]
    if given:
        raise ConfigError(f"--model {cfg.model} is an embedding model; its rows are pulled "
                          f"and pushed by id, which {', '.join(given)} "
                          f"{'does' if len(given) == 1 else 'do'} not handle here: drop "
                          f"{'it' if len(given) == 1 else 'them'} (docs/ctr.md lists what "
                          "embedding models run with)")
    if cfg.admit_after is not None and cfg.admit_after > ADMIT_AFTER_MAX:
        raise ConfigError(f"--admit-after {cfg.admit_after}: sightings are counted in 16-bit "
                          f"counters (hpcps.ps.admission), so at most {ADMIT_AFTER_MAX}")


# Defaults of the embedding options, for a strategy that trains embedding models (chosen on
# MovieLens-100k: docs/ctr.md)
EMBEDDING_DEFAULTS = {"lr": 0.005, "row_lr": 0.05, "row_optimizer": "rowwise_adagrad",
                      "row_l2": 3e-4, "row_init_scale": 0.01, "batch_size": 256,
                      "admit_after": 1}
EMBEDDING_EPOCHS = 5.0  # --epochs' default for embedding models


def describe_rows(cfg) -> str:
    """How an embedding model's rows are trained, for the start line."""
    how = (f"embedding rows pulled and pushed by id, {cfg.row_optimizer} row_lr={cfg.row_lr}"
           " on the shards")
    if cfg.table_capacity is not None:
        how += (f", at most {cfg.table_capacity} rows per table and shard (least recently "
                "used evicted)")
    if (cfg.admit_after or 1) > 1:
        how += f", a row created once its id is seen in {cfg.admit_after} pulls"
    return how


# The options every strategy built on this loop takes (each lists ``*LOOP_OPTIONS``): batch
# prefetch, a slowed replica for tests, weight decay, added to every gradient (in
# ``GradientSource``) whatever the strategy then does with it, the learning-rate schedule,
# which each strategy applies where its updates are taken (``ReplicaLoop.lr_factor``), and
# dropout, which lives in the model's training pass (``hpcps.model.convnet``), and image
# augmentation, applied to the batches a replica draws (``Context.train_batches``).
LOOP_OPTIONS = (PREFETCH, INJECT_SLOW, WEIGHT_DECAY, LR_SCHEDULE, DROPOUT, AUGMENT)


def check_loop_options(cfg) -> None:
    """Checks every strategy built on this loop shares (its ``validate``, or part of it)."""
    if cfg.inject_slow is not None:
        parse_inject_slow(cfg.inject_slow)
    parse_augment(cfg.augment)
    if cfg.dropout and cfg.model is None:
        widths = ",".join(f"fc{n}" for n in cfg.layers[1:])
        raise ConfigError("--dropout applies to the hidden fc layers of a --model network; "
                          f"an MLP with dropout is --model {widths} (the same network as "
                          "--layers without its input width)")


def check_fault_options(cfg) -> None:
    """What no strategy can do while replicas may die (its ``validate`` calls this)."""
    copies = (getattr(cfg, "ps_copies", None) or 1) > 1  # brings a heartbeat timeout
    spares = (getattr(cfg, "spares", None) or 0) > 0  # so do spares
    if cfg.trace and (cfg.heartbeat_timeout is not None or copies or spares):
        why = ("--ps-copies > 1 shards" if copies else "--spares replicas" if spares
               else "--heartbeat-timeout replicas")
        raise ConfigError("--trace merges every rank's timeline at the end of the run, which "
                          f"needs every rank alive; with {why} may die: drop one of the two")
