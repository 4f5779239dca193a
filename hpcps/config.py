"""The run's configuration: one typed, frozen object built from a TOML file and the command line.

Every option of ``python -m hpcps.train`` is a field of :class:`Config`. A TOML file given with
``--config FILE.toml`` may hold the same keys (``batch_size`` or ``batch-size``); the command
line wins over the file, the file over the defaults. Unknown keys and options are refused, with
the closest valid name suggested, so a typo never silently trains with a default.

Options that belong to one strategy only (``--n-fetch`` for ``downpour``, say) are refused when
given explicitly with another strategy: a flag that does nothing would mislead.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hpcps.errors import ConfigError

STRATEGIES = ("downpour", "sync", "deadreckon", "sandblaster")
ACTIVATIONS = ("relu", "tanh", "sigmoid")
OPTIMIZERS = ("adagrad", "sgd", "lbfgs")
COMPRESSIONS = ("none", "threshold")
ON_OFF = ("on", "off")
PUSHES = ("gradients", "activations")

# Defaults that depend on the strategy: None in the dataclass means "not given".
STRATEGY_DEFAULTS = {
    "downpour": {"servers": 1, "optimizer": "adagrad", "lr": 0.01, "n_fetch": 1, "n_push": 1,
                 "warmup_steps": 200, "compress": "none", "batch_size": 32, "prefetch": 2,
                 "push": "gradients"},
    "sync": {"servers": 0, "optimizer": "adagrad", "lr": 0.01, "batch_size": 32, "prefetch": 2},
    "deadreckon": {"servers": 0, "optimizer": "sgd", "lr": 0.1, "tau": 0.002, "golomb": "on",
                   "batch_size": 32, "prefetch": 2},
    "sandblaster": {"servers": 1, "optimizer": "lbfgs", "batch_size": 0, "lbfgs_history": 10,
                    "portions": 64, "flush_every": 4, "replica_timeout": 60.0},
}
# Default threshold for downpour's compressed pushes (gradient units, not weight units).
DOWNPOUR_TAU = 0.01
# Options that mean something only to some strategies: given with another, they are refused.
OPTION_STRATEGIES = {
    "n_fetch": ("downpour",), "n_push": ("downpour",), "warmup_steps": ("downpour",),
    "compress": ("downpour",), "push": ("downpour",), "tau": ("downpour", "deadreckon"),
    "golomb": ("downpour", "deadreckon"),
    "lbfgs_history": ("sandblaster",), "portions": ("sandblaster",),
    "flush_every": ("sandblaster",), "inject_slow": ("sandblaster",),
    "replica_timeout": ("sandblaster",),
    "prefetch": ("downpour", "sync", "deadreckon"),
}
DEFAULT_EPOCHS = 4.0  # when neither --epochs nor --steps is given
# sandblaster's step is one evaluation of a whole batch (by default the whole training set)
SANDBLASTER_EPOCHS = 40.0


@dataclass(frozen=True)
class Config:
    """Everything a run needs to know. Build it with :func:`parse`; see ``--help`` for meanings."""

    strategy: str = "downpour"
    servers: int | None = None
    partitions: int = 1
    layers: tuple[int, ...] = (784, 512, 512, 10)
    activation: str = "relu"
    optimizer: str | None = None
    lr: float | None = None
    adagrad_eps: float = 1e-8
    epochs: float | None = None
    steps: int | None = None
    batch_size: int | None = None
    n_fetch: int | None = None
    n_push: int | None = None
    warmup_steps: int | None = None
    compress: str | None = None
    push: str | None = None
    tau: float | None = None
    golomb: str | None = None
    lbfgs_history: int | None = None
    portions: int | None = None
    flush_every: int | None = None
    inject_slow: str | None = None
    replica_timeout: float | None = None
    threads: int = 1
    prefetch: int | None = None
    data: str = "data/mnist.h5"
    run_dir: str | None = None
    checkpoint_every: int = 5000
    eval_every: int = 2000
    resume: str | None = None
    seed: int = 0
    progress_every: float = 5.0
    timeout: float = 600.0
    config: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict (lists for tuples), as saved in checkpoints."""
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        return d

    def batch(self, n_train: int) -> int:
        """Examples per batch: --batch-size, where 0 means the whole training set."""
        return min(self.batch_size, n_train) if self.batch_size else n_train

    def total_steps(self, n_train: int) -> int:
        """Global number of batches of ``batch(n_train)`` examples the whole run processes."""
        if self.steps is not None:
            return self.steps
        default = SANDBLASTER_EPOCHS if self.strategy == "sandblaster" else DEFAULT_EPOCHS
        epochs = self.epochs if self.epochs is not None else default
        return max(1, math.ceil(epochs * n_train / self.batch(n_train)))


HELP = {
    "strategy": "how replicas combine their work: 'downpour' (asynchronous, sharded parameter "
                "server, the default), 'sync' (allreduce of gradients every step, no servers), "
                "'deadreckon' (Strom's thresholded 1-bit updates sent peer to peer, no servers) "
                "or 'sandblaster' (batch L-BFGS driven by a coordinator through the shards)",
    "servers": "number of parameter-server shard ranks S (downpour: default P, one per "
               "partition, and a multiple of P; the other strategies use none)",
    "partitions": "ranks per replica P (model parallelism): each holds a slice of every layer's "
                  "neurons (default 1)",
    "layers": "layer widths of the MLP, input to output, e.g. 784,512,512,10 (the first must "
              "match the dataset's features, the last its classes)",
    "activation": "hidden-layer activation: relu, tanh or sigmoid",
    "optimizer": "update rule applied where the parameters live: adagrad (default; DistBelief's "
                 "per-parameter eta/sqrt(sum g^2)), sgd, or lbfgs (sandblaster only)",
    "lr": "learning rate eta (default 0.01; 0.1 for deadreckon's plain SGD)",
    "adagrad_eps": "added to sqrt(sum g^2) to avoid dividing by zero",
    "epochs": "passes over the training set, counted over all replicas together (default 4; "
              "sandblaster 40, one per whole-set evaluation)",
    "steps": "total mini-batches over all replicas (instead of --epochs)",
    "batch_size": "examples per mini-batch on each replica (default 32); sandblaster: examples "
                  "per L-BFGS batch, 0 (its default) for the whole training set",
    "n_fetch": "downpour: fetch fresh parameters from the shards every n_fetch steps (default 1)",
    "n_push": "downpour: push the accumulated gradient every n_push steps (default 1)",
    "warmup_steps": "downpour: steps replica 0 trains alone before the others join (default 200; "
                    "not applied when resuming)",
    "compress": "downpour: 'threshold' pushes Strom-compressed gradients (residual kept on the "
                "replica) instead of dense ones; default 'none'",
    "push": "downpour: 'activations' sends, for fully connected layers where it is fewer "
            "numbers, the k rows of layer inputs and errors since the last push and lets the "
            "shard compute the update (Project Adam); default 'gradients'",
    "tau": "threshold of the compressed updates: each sent element moves by +-tau "
           f"(deadreckon: weight units, default 0.002; downpour: gradient units, default "
           f"{DOWNPOUR_TAU})",
    "golomb": "on: Golomb-Rice code the index gaps of compressed messages (default); off: send "
              "the raw 32-bit words",
    "lbfgs_history": "sandblaster: (s, y) pairs L-BFGS keeps (default 10)",
    "portions": "sandblaster: portions each batch is cut into and handed to free replicas "
                "(default 64)",
    "flush_every": "sandblaster: a replica pushes its accumulated gradient every this many "
                   "portions (default 4)",
    "inject_slow": "sandblaster, for testing: RANK:FACTOR makes that replica rank FACTOR times "
                   "slower; RANK:stall makes it stop answering",
    "replica_timeout": "sandblaster: seconds without an answer before a replica's portions go "
                       "to the others (default 60)",
    "threads": "Hogwild threads per replica rank (Project Adam): T threads each train on their "
               "own mini-batch, lock-free, in compiled nogil code (with --partitions > 1: "
               "NumPy, thread t of every partition exchanging over its own communicator); "
               "one replica step then covers T mini-batches; sandblaster: T threads sum each "
               "portion's exact gradient (default 1: one thread, the same compiled engine)",
    "prefetch": "mini-batches a background thread prepares ahead of training (default 2; 0: "
                "none)",
    "data": "HDF5 dataset (layout in the README); data/mnist.h5 is prepared automatically",
    "run_dir": "directory for metrics.jsonl and checkpoint.h5 (default runs/<strategy>-<time>)",
    "checkpoint_every": "write a checkpoint every this many global steps (0: only at the end)",
    "eval_every": "evaluate test accuracy every this many global steps (0: only at the end)",
    "resume": "continue from this checkpoint (any number of ranks or shards may have written it)",
    "seed": "random seed for initial weights and data order",
    "progress_every": "seconds between progress lines",
    "timeout": "seconds a rank waits on another rank before failing with that rank's number",
    "config": "TOML file with any of these keys (the command line wins)",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so train.py reports it once."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise ConfigError(f"{message} (see --help)")


def _layers(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in str(text).replace(" ", "").split(",") if t != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {text!r}")
    return sizes


def build_parser(prog: str = "python -m hpcps.train") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Train an MLP with hpcps under MPI: "
                "mpiexec -n N python -m hpcps.train [options]",
                argument_default=argparse.SUPPRESS)
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for name, text in HELP.items():
        flag = "--" + name.replace("_", "-")
        t = types[name]
        if name == "layers":
            p.add_argument(flag, type=_layers, help=text)
        elif name == "strategy":
            p.add_argument(flag, choices=STRATEGIES, help=text)
        elif name == "activation":
            p.add_argument(flag, choices=ACTIVATIONS, help=text)
        elif name == "optimizer":
            p.add_argument(flag, choices=OPTIMIZERS, help=text)
        elif name == "compress":
            p.add_argument(flag, choices=COMPRESSIONS, help=text)
        elif name == "golomb":
            p.add_argument(flag, choices=ON_OFF, help=text)
        elif name == "push":
            p.add_argument(flag, choices=PUSHES, help=text)
        elif "float" in str(t):
            p.add_argument(flag, type=float, help=text)
        elif "int" in str(t):
            p.add_argument(flag, type=int, help=text)
        else:
            p.add_argument(flag, type=str, help=text)
    return p


def parse_inject_slow(text: str) -> tuple[int, float]:
    """``RANK:FACTOR`` -> (world rank, factor); FACTOR >= 1, or ``stall`` (inf): the replica
    stops answering (it only waits for the end of the job)."""
    try:
        rank, factor = text.split(":")
        rank = int(rank)
        factor = math.inf if factor == "stall" else float(factor)
    except ValueError:
        raise ConfigError(f"--inject-slow wants RANK:FACTOR (e.g. 2:10 or 2:stall), got {text!r}")
    if rank < 0 or not factor >= 1:
        raise ConfigError(f"--inject-slow needs a rank >= 0 and a factor >= 1, got {text!r}")
    return rank, factor


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}")
    out = {}
    valid = [f.name for f in dataclasses.fields(Config) if f.name != "config"]
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r} in config file {path}{hint}; "
                              f"valid keys: {', '.join(valid)}")
        if name == "layers":
            if isinstance(value, list):
                value = tuple(value)
            else:
                value = _layers(value)
        out[name] = value
    return out


def _check_types(values: dict[str, Any]) -> None:
    """TOML values arrive untyped; refuse a string where a number belongs, and the like."""
    for f in dataclasses.fields(Config):
        if f.name not in values or values[f.name] is None:
            continue
        v = values[f.name]
        t = str(f.type)
        ok = True
        if f.name == "layers":
            ok = isinstance(v, tuple) and all(isinstance(i, int) and not isinstance(i, bool)
                                               for i in v)
        elif "float" in t:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if ok:
                values[f.name] = float(v)
        elif "int" in t:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif "str" in t:
            ok = isinstance(v, str)
        if not ok:
            raise ConfigError(f"{f.name} has the wrong type: got {v!r}")


def validate(cfg: Config) -> Config:
    """Check values and fill strategy-dependent defaults. Returns the completed config."""
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {cfg.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if cfg.activation not in ACTIVATIONS:
        raise ConfigError(f"unknown activation {cfg.activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if cfg.optimizer is not None and cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.compress is not None and cfg.compress not in COMPRESSIONS:
        raise ConfigError(f"unknown compression {cfg.compress!r}; choose one of "
                          f"{', '.join(COMPRESSIONS)}")
    if cfg.push is not None and cfg.push not in PUSHES:
        raise ConfigError(f"--push takes gradients or activations, got {cfg.push!r}")
    if cfg.push == "activations" and (cfg.compress == "threshold" or cfg.partitions > 1
                                      or cfg.threads > 1):
        raise ConfigError("--push activations goes with dense pushes of whole replicas: not "
                          "with --compress threshold, --partitions > 1 or --threads > 1")
    if cfg.golomb is not None and cfg.golomb not in ON_OFF:
        raise ConfigError(f"--golomb takes on or off, got {cfg.golomb!r}")
    for name, allowed in OPTION_STRATEGIES.items():
        if getattr(cfg, name) is not None and cfg.strategy not in allowed:
            raise ConfigError(f"--{name.replace('_', '-')} applies only to --strategy "
                              f"{' or '.join(allowed)}, not {cfg.strategy}")
    if cfg.strategy == "downpour" and cfg.compress != "threshold":
        for name in ("tau", "golomb"):
            if getattr(cfg, name) is not None:
                raise ConfigError(f"--{name} applies to downpour only with --compress threshold")
    if cfg.strategy not in ("downpour", "sandblaster") and cfg.servers not in (None, 0):
        raise ConfigError(f"--strategy {cfg.strategy} uses no parameter servers; "
                          f"got --servers {cfg.servers}")
    if cfg.strategy in ("downpour", "sandblaster") and cfg.servers == 0:
        raise ConfigError(f"--strategy {cfg.strategy} needs at least one server shard "
                          "(--servers >= 1)")
    if (cfg.strategy == "sandblaster") != (cfg.optimizer in (None, "lbfgs")) \
            and cfg.optimizer is not None:
        raise ConfigError("--optimizer lbfgs goes with --strategy sandblaster, and sandblaster "
                          f"runs L-BFGS only (got --strategy {cfg.strategy} --optimizer "
                          f"{cfg.optimizer})")
    if cfg.prefetch is not None and cfg.prefetch < 0:
        raise ConfigError(f"--prefetch must be >= 0, got {cfg.prefetch}")
    if cfg.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.strategy == "sandblaster" and cfg.lr is not None:
        raise ConfigError("--lr does not apply to --strategy sandblaster: L-BFGS chooses each "
                          "step's length by its line search")
    if cfg.batch_size == 0 and cfg.strategy != "sandblaster":
        raise ConfigError("--batch-size 0 (the whole training set) is for --strategy "
                          "sandblaster; give a positive batch size")
    if cfg.strategy == "sandblaster" and cfg.partitions > 1:
        raise ConfigError("--strategy sandblaster runs replicas of one rank each in this "
                          "version: use --partitions 1")
    if cfg.inject_slow is not None:
        parse_inject_slow(cfg.inject_slow)
    if cfg.strategy == "deadreckon" and cfg.optimizer not in (None, "sgd"):
        raise ConfigError("--strategy deadreckon exchanges plain SGD weight deltas: only "
                          "--optimizer sgd is possible (an Adagrad state would differ between "
                          "replicas, so their weights would drift apart)")
    if len(cfg.layers) < 2:
        raise ConfigError(f"--layers needs at least an input and an output width, got {cfg.layers}")
    if any(n < 1 for n in cfg.layers):
        raise ConfigError(f"--layers widths must be positive, got {cfg.layers}")
    if cfg.partitions < 1:
        raise ConfigError(f"--partitions must be at least 1, got {cfg.partitions}")
    if cfg.strategy == "downpour" and cfg.servers is not None and cfg.servers % cfg.partitions:
        raise ConfigError(f"--servers {cfg.servers} does not divide among --partitions "
                          f"{cfg.partitions}: each partition talks to its own server shards, so "
                          f"S must be a multiple of P (e.g. --servers {cfg.partitions})")
    if cfg.epochs is not None and cfg.steps is not None:
        raise ConfigError("give --epochs or --steps, not both")
    if cfg.batch_size is not None and cfg.batch_size < 0:
        raise ConfigError(f"--batch-size must be positive, got {cfg.batch_size}")
    positive = {"steps": cfg.steps, "n_fetch": cfg.n_fetch,
                "n_push": cfg.n_push, "epochs": cfg.epochs, "lr": cfg.lr,
                "progress_every": cfg.progress_every, "timeout": cfg.timeout,
                "adagrad_eps": cfg.adagrad_eps, "tau": cfg.tau,
                "lbfgs_history": cfg.lbfgs_history, "portions": cfg.portions,
                "flush_every": cfg.flush_every, "replica_timeout": cfg.replica_timeout}
    for name, v in positive.items():
        if v is not None and not v > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
    nonneg = {"servers": cfg.servers, "warmup_steps": cfg.warmup_steps,
              "checkpoint_every": cfg.checkpoint_every, "eval_every": cfg.eval_every}
    for name, v in nonneg.items():
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    defaults = dict(STRATEGY_DEFAULTS[cfg.strategy])
    if cfg.strategy == "downpour":
        defaults["servers"] = cfg.partitions  # one shard per partition
    if cfg.strategy == "downpour" and cfg.compress == "threshold":
        defaults.update(tau=DOWNPOUR_TAU, golomb="on")
    fill = {k: v for k, v in defaults.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **fill)


def parse(argv: Sequence[str] | None = None) -> Config:
    """Build the validated config from ``--config FILE.toml`` and the command line."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(_read_toml(ns["config"]))
    values.update(ns)
    _check_types(values)
    return validate(Config(**values))


def from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a config saved in a checkpoint (unknown keys refused as everywhere else)."""
    valid = {f.name for f in dataclasses.fields(Config)}
    unknown = set(d) - valid
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(unknown)}")
    d = dict(d)
    if "layers" in d:
        d["layers"] = tuple(d["layers"])
    return Config(**d)


def default_run_dir(cfg: Config, stamp: str) -> Path:
    return Path("runs") / f"{cfg.strategy}-{stamp}"
