"""The run's configuration: one typed, frozen object built from a TOML file and the command line.

Every option of ``python -m hpcps.train`` is a field of :class:`Config`: the options every run
has are declared below (:data:`COMMON`), and each strategy declares its own in its module
(``STRATEGY.options``, :mod:`hpcps.strategies.registry`). A TOML file given with
``--config FILE.toml`` may hold the same keys (``batch_size`` or ``batch-size``); the command
line wins over the file, the file over the defaults. Unknown keys and options are refused, with
the closest valid name suggested, so a typo never silently trains with a default.

Options that belong to some strategies only (``--n-fetch`` for ``downpour``, say) are refused
when given explicitly with another strategy: a flag that does nothing would mislead.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hpcps.errors import ConfigError
from hpcps.model.spec import (CTR_PRESETS, PRESETS, is_embedding_spec, parse_ctr_spec, parse_spec,
                              preset_name)
from hpcps.mpi.topology import Layout
from hpcps.options import TAU_TYPE, Option, RunConfig, flag, parse_inject_slow, parse_tau
from hpcps.strategies.registry import DEFAULT, Strategy, strategies

ACTIVATIONS = ("relu", "tanh", "sigmoid")
LAYERS = "layers"  # Option.type of --layers: comma-separated widths


def _strategy_names() -> tuple[str, ...]:
    return tuple(strategies())


def _optimizer_names() -> tuple[str, ...]:
    names: list[str] = []
    for s in strategies().values():
        names += [o for o in s.optimizers if o not in names]
    return tuple(names)


# The options every run has, in --help order. None as default: the strategy fills it.
COMMON = (
    Option("strategy", str, "how replicas combine their work; each strategy is described below "
           "with its own options and defaults",
           default=DEFAULT, choices=_strategy_names()),
    Option("servers", int, "parameter-server shard ranks S, for the strategies that have "
           "shards (default: see each strategy's defaults below); the others take none",
           check="nonneg"),
    Option("partitions", int, "ranks per replica P (model parallelism): each holds a slice of "
           "every layer's neurons (default 1)", default=1, check="positive"),
    Option("layers", LAYERS, "layer widths of the MLP, input to output, e.g. 784,512,512,10 "
           "(the first must match the dataset's features, the last its classes)",
           default=(784, 512, 512, 10)),
    Option("model", str, "the network as a spec of conv, pool and fc layers instead of an MLP "
           "(docs/conv.md), e.g. conv5x5x10,pool2,conv5x5x20,pool2,fc400,fc400,fc10, or a "
           f"preset: {', '.join(PRESETS)} (with downpour a preset brings the options it was "
           "tuned with, where not given); needs a dataset with an image_shape; not with "
           "--layers. An embedding model on a categorical dataset (docs/ctr.md): "
           f"embedD[:sum|:mean],fcN,...,fc1 or {', '.join(CTR_PRESETS)}"),
    Option("activation", str, "hidden-layer activation: relu, tanh or sigmoid", default="relu",
           choices=ACTIVATIONS),
    Option("optimizer", str, "update rule applied where the parameters live: adagrad "
           "(DistBelief's per-parameter eta/sqrt(sum g^2)), sgd, momentum (SGD with "
           "momentum) or lbfgs; each strategy runs some of them (its default: below)",
           choices=_optimizer_names()),
    Option("lr", float, "learning rate eta (default: the strategy's, below)",
           check="positive"),
    Option("adagrad_eps", float, "added to sqrt(sum g^2) to avoid dividing by zero",
           default=1e-8, check="positive"),
    Option("momentum", float, "--optimizer momentum: the velocity's decay mu, in [0, 1) "
           "(default 0.9)", check="fraction"),
    Option("nesterov", str, "--optimizer momentum: on for Nesterov's variant (default off)",
           choices=("on", "off")),
    Option("epochs", float, "passes over the training set, counted over all replicas together "
           "(default: the strategy's, below)", check="positive"),
    Option("steps", int, "total mini-batches over all replicas (instead of --epochs)",
           check="positive"),
    Option("batch_size", int, "examples per mini-batch on each replica, or per batch of a "
           "batch method, where 0 means the whole training set (default: the strategy's, "
           "below)", check="nonneg"),
    Option("threads", int, "threads per replica rank (default 1). SGD strategies: T Hogwild "
           "threads (Project Adam) each train on their own mini-batch, lock-free, in compiled "
           "nogil code (with --partitions > 1: an MLP's partitions in NumPy, a conv model's in "
           "the compiled engine, thread t of every partition exchanging over its own "
           "communicator); one replica step then covers T mini-batches. Batch "
           "methods: T threads sum each portion's exact gradient", default=1,
           check="positive"),
    Option("data", str, "HDF5 dataset (layout in docs/formats.md); data/mnist.h5 is prepared "
           "automatically", default="data/mnist.h5"),
    Option("run_dir", str, "directory for metrics.jsonl and checkpoint.h5 (default "
           "runs/<strategy>-<time>)"),
    Option("checkpoint_every", int, "write a checkpoint every this many global steps (0: only "
           "at the end)", default=5000, check="nonneg"),
    Option("eval_every", int, "evaluate accuracy every this many global steps, on the "
           "validation split when there is one, else the test set (0: only at the end)",
           default=2000, check="nonneg"),
    Option("validation_fraction", float, "hold out this fraction of /train as the validation "
           "split (a seeded choice of rows, the same on every rank, not trained on) for the "
           "periodic evaluations; a dataset file with /val uses that instead; the test set is "
           "then scored once, at the end (default 0: none, evaluations on the test set)",
           default=0.0, check="fraction"),
    Option("data_memory", float, "MiB of data each rank may hold in memory; a replica whose "
           "training block (or the chief, whose evaluation splits) would take more streams it "
           "from the file in chunks instead (default: half the node's available memory shared "
           "by the job's ranks on it, or of a per-process address-space limit; docs/formats.md)",
           check="positive"),
    Option("resume", str, "continue from this checkpoint (any number of ranks or shards may "
           "have written it); 'auto': from the newest valid checkpoint in the run directory "
           "if there is one, else start fresh (for jobs that are requeued: needs --run-dir, "
           "or a Slurm job, whose default run directory is runs/slurm-<job id>)"),
    Option("seed", int, "random seed for initial weights and data order", default=0,
           check="nonneg"),
    Option("progress_every", float, "seconds between progress lines", default=5.0,
           check="positive"),
    Option("timeout", float, "seconds a rank waits on another rank before failing with that "
           "rank's number", default=600.0, check="positive"),
    Option("trace", bool, "write RUN_DIR/trace.json: every rank's compute, waits and messages "
           "(with bytes) as a timeline for chrome://tracing or Perfetto (docs/tools.md)",
           default=False),
    Option("config", str, "TOML file with any of these keys (the command line wins)"),
)


def _collect() -> tuple[dict[str, Option], dict[str, tuple[str, ...]]]:
    """Every option by name, and for strategy options the strategies that take them."""
    options = {o.name: o for o in COMMON}
    owners: dict[str, list[str]] = {}
    for s in strategies().values():
        for o in s.options:
            if o.name in options and o is not options[o.name]:
                raise ValueError(f"option {o.name!r} of strategy {s.name} clashes with another "
                                 "declaration of the same name: share one Option object")
            options[o.name] = o
            owners.setdefault(o.name, []).append(s.name)
    return options, {k: tuple(v) for k, v in owners.items()}


OPTIONS, OWNERS = _collect()


class _ConfigMethods:
    """Methods of :class:`Config` (the dataclass itself is built from the declarations)."""

    # the fields the methods read (annotations only: the dataclass declares them)
    strategy: str
    layers: tuple[int, ...]
    batch_size: int | None
    steps: int | None
    epochs: float | None

    @property
    def spec(self) -> Strategy:
        """The declaration of the strategy in use."""
        return strategies()[self.strategy]

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict (lists for tuples), as saved in checkpoints."""
        d = dataclasses.asdict(self)  # type: ignore[call-overload]  # a dataclass at run time
        d["layers"] = list(self.layers)
        return d

    def batch(self, n_train: int) -> int:
        """Examples per batch: --batch-size, where 0 means the whole training set."""
        return min(self.batch_size, n_train) if self.batch_size else n_train

    def total_steps(self, n_train: int) -> int:
        """Global number of batches of ``batch(n_train)`` examples the whole run processes."""
        if self.steps is not None:
            return self.steps
        epochs = self.epochs if self.epochs is not None else self.spec.epochs
        return max(1, math.ceil(epochs * n_train / self.batch(n_train)))


def _field_type(o: Option):
    if o.type == TAU_TYPE:
        return float | str | None
    return tuple[int, ...] if o.type == LAYERS else (o.type | None)


_Config = dataclasses.make_dataclass(
    "Config",
    [(o.name, _field_type(o), dataclasses.field(default=o.default, compare=o.name != "config"))
     for o in OPTIONS.values()],
    bases=(_ConfigMethods,), frozen=True,
    namespace={"__module__": __name__, "__doc__": "Everything a run needs to know. Build it "
               "with :func:`parse`; see ``--help`` for meanings. Fields: every option of "
               ":data:`COMMON` and of every strategy's declaration."})

if TYPE_CHECKING:
    Config = RunConfig  # what a type checker reads (hpcps.options.RunConfig)
else:
    Config = _Config


def new(**values: Any) -> RunConfig:
    """A :class:`Config` of these values (the others at their declared defaults), unchecked."""
    return _Config(**values)


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


def _add(parser, o: Option, help_text: str) -> None:
    if o.type == LAYERS:
        parser.add_argument(o.flag, type=_layers, help=help_text)
    elif o.type == TAU_TYPE:
        parser.add_argument(o.flag, type=parse_tau, help=help_text)
    elif o.type is bool:  # a switch: --trace
        parser.add_argument(o.flag, action="store_true", help=help_text)
    elif o.choices is not None:
        parser.add_argument(o.flag, choices=o.choices, help=help_text)
    else:
        parser.add_argument(o.flag, type=o.type, help=help_text)


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _with_default(o: Option, owners: Sequence[str] = ()) -> str:
    """The option's help, ending with its default where the text does not already say it:
    the option's own, else each owning strategy's (``--help`` shows every default)."""
    if "default" in o.help:
        return o.help
    if o.type is bool:
        return f"{o.help} (default off)"
    if o.default is not None:
        return f"{o.help} (default {_show(o.default)})"
    found = {}
    for name in owners:
        d = strategies()[name].default_values(new(strategy=name))
        if o.name in d and d[o.name] is not None:
            found[name] = _show(d[o.name])
    if not found:
        return f"{o.help} (default: none)"
    if len(set(found.values())) == 1 and len(found) == len(owners):
        return f"{o.help} (default {next(iter(found.values()))})"
    return f"{o.help} (default: {', '.join(f'{k} {v}' for k, v in found.items())})"


def _defaults_help(spec: Strategy) -> str:
    """The strategy's defaults for the common options, for its --help group."""
    shown = ("servers", "optimizer", "lr", "batch_size")
    d = spec.default_values(new(strategy=spec.name))
    parts = [f"{flag(k)} {d[k]}" for k in shown if k in d]
    if "servers" not in d and not spec.uses_servers:
        parts.insert(0, "--servers 0")
    parts.append(f"--epochs {spec.epochs:g}")
    return f"{spec.help}. Defaults: {', '.join(parts)}."


@functools.cache
def build_parser(prog: str = "python -m hpcps.train") -> argparse.ArgumentParser:
    """The command-line parser, built once from the option declarations."""
    return _build_parser(prog)


def _build_parser(prog: str) -> argparse.ArgumentParser:
    specs = strategies()
    p = _Parser(prog=prog, description="Train an MLP with hpcps under MPI: "
                "mpiexec -n N python -m hpcps.train [options]",
                argument_default=argparse.SUPPRESS)
    for o in COMMON:
        _add(p, o, _with_default(o))
    groups = {name: p.add_argument_group(f"{name} options", _defaults_help(s))
              for name, s in specs.items()}
    shared = p.add_argument_group("options of several strategies")
    for name, owners in OWNERS.items():
        text = _with_default(OPTIONS[name], owners)
        if len(owners) == 1:
            _add(groups[owners[0]], OPTIONS[name], text)
        else:
            _add(shared, OPTIONS[name], f"{text} [{', '.join(owners)}]")
    return p


def _read_toml(path: str) -> dict[str, Any]:
    import difflib  # here: only runs given --config pay for these two
    import tomllib
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}")
    out = {}
    valid = [name for name in OPTIONS if name != "config"]
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r} in config file {path}{hint}; "
                              f"valid keys: {', '.join(valid)}")
        if name in out:  # validation-fraction and validation_fraction: one option
            first = next(k for k in raw if k.replace("-", "_") == name)
            raise ConfigError(f"config file {path} gives option {name} twice, as {first!r} "
                              f"and {key!r}: keep one")
        if name == "layers":
            value = tuple(value) if isinstance(value, list) else _layers(value)
        out[name] = value
    return out


# what a value of each option type must be, for the message refusing another
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false",
             LAYERS: "a list of integers or a string such as \"784,512,10\"",
             TAU_TYPE: "a positive number or \"auto\""}


def _check_types(values: dict[str, Any]) -> None:
    """TOML values arrive untyped; refuse a string where a number belongs, and the like."""
    for name, v in values.items():
        if v is None:
            continue
        o = OPTIONS[name]
        if type(v) is o.type and o.type in (int, float, str):  # already what it must be
            continue
        if o.type == LAYERS:
            ok = isinstance(v, tuple) and all(isinstance(i, int) and not isinstance(i, bool)
                                               for i in v)
        elif o.type == TAU_TYPE:
            values[name], ok = parse_tau(v), True
        elif o.type is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if ok:
                values[name] = float(v)
        elif o.type is bool:
            ok = isinstance(v, bool)
        elif o.type is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, str)
        if not ok:
            want = _EXPECTED.get(o.type, "a string")
            raise ConfigError(f"{name} has the wrong type: got {v!r}, expected {want}")


@functools.cache
def _foreign(strategy: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The options other strategies own and ``strategy`` does not: (name, owners)."""
    return tuple((name, tuple(owners)) for name, owners in OWNERS.items()
                 if strategy not in owners)


def _check_generic(cfg, spec: Strategy) -> None:
    """What holds for every strategy, read from its declaration."""
    for name, owners in _foreign(cfg.strategy):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{flag(name)} applies only to --strategy {' or '.join(owners)}, "
                              f"not {cfg.strategy}")
    if not spec.uses_servers and cfg.servers not in (None, 0):
        raise ConfigError(f"--strategy {cfg.strategy} uses no parameter servers; "
                          f"got --servers {cfg.servers}")
    if spec.uses_servers and cfg.servers == 0:
        raise ConfigError(f"--strategy {cfg.strategy} needs at least one server shard "
                          "(--servers >= 1)")
    if cfg.optimizer is not None and cfg.optimizer not in spec.optimizers:
        raise ConfigError(f"--strategy {cfg.strategy} runs only --optimizer "
                          f"{' or '.join(spec.optimizers)}, got --optimizer {cfg.optimizer}")
    optimizer = cfg.optimizer or spec.optimizers[0]
    for name in ("momentum", "nesterov"):
        if getattr(cfg, name) is not None and optimizer != "momentum":
            raise ConfigError(f"{flag(name)} applies only to --optimizer momentum, not "
                              f"{optimizer}")
    if cfg.partitions > 1 and not spec.model_parallel:
        raise ConfigError(f"--strategy {cfg.strategy} runs replicas of one rank each: use "
                          "--partitions 1")
    if cfg.batch_size == 0 and not spec.whole_batch:
        raise ConfigError(f"--batch-size 0 (the whole training set) is not for --strategy "
                          f"{cfg.strategy}; give a positive batch size")
    if len(cfg.layers) < 2:
        raise ConfigError(f"--layers needs at least an input and an output width, got {cfg.layers}")
    if any(n < 1 for n in cfg.layers):
        raise ConfigError(f"--layers widths must be positive, got {cfg.layers}")
    if cfg.epochs is not None and cfg.steps is not None:
        raise ConfigError("give --epochs or --steps, not both")
    if is_embedding_spec(cfg.model):
        if not spec.embeddings:
            takers = [name for name, s in strategies().items() if s.embeddings]
            raise ConfigError(f"--model {cfg.model} is an embedding model (docs/ctr.md), which "
                              f"--strategy {cfg.strategy} does not train: use --strategy "
                              f"{' or '.join(takers)}")
        parse_ctr_spec(cfg.model)
    elif cfg.model is not None:
        parse_spec(cfg.model)


# (option, value) pairs whose value check passed: it depends on nothing else, and the
# combination matrix's collection checks about 20 million of them, mostly the same few
_VALID: set[tuple[str, Any]] = set()


def _check(cfg, spec: Strategy) -> None:
    """Refuse what the options given (None: not given) do not allow, alone or together."""
    given = vars(cfg)
    for o in OPTIONS.values():
        value = given[o.name]
        if value is not None and (o.name, value) not in _VALID:  # None: not given
            o.check_value(value)
            _VALID.add((o.name, value))
    _check_generic(cfg, spec)
    spec.validate(cfg)


def _recipe(cfg) -> dict | None:
    """The options ``--model``'s preset was tuned with under the strategy (its declaration's
    ``recipes``), or None."""
    found = strategies()[cfg.strategy].recipes.get(preset_name(cfg.model) or "")
    return dict(found) if found else None


def _with_recipe(cfg, spec: Strategy):
    """``--model PRESET``: the options the preset was tuned with under this strategy (its
    ``recipes``) added as if given, where they were not and the options given accept them
    (an item they refuse, such as --weight-decay beside --push activations, is left out);
    --epochs only without --steps. The options given are checked first, so their own
    refusals come unchanged."""
    options = _recipe(cfg)
    if not options:
        return cfg
    _check(cfg, spec)
    given = vars(cfg)
    kept: dict[str, Any] = {}
    for name, value in options.items():
        if given[name] is not None or (name == "epochs" and cfg.steps is not None):
            continue
        try:
            _check(_Config(**{**given, **kept, name: value}), spec)
        except ConfigError:
            continue
        kept[name] = value
    return _Config(**{**given, **kept})


def recipe_note(cfg) -> str | None:
    """For the start line: the recipe ``--model`` brought, as options (those given on the
    command line in their place), or None."""
    options = _recipe(cfg)
    if not options:
        return None
    def show(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else _show(v)
    used = [f"{flag(k)} {show(v)}" for k, v in options.items() if getattr(cfg, k) == v]
    other = [f"{flag(k)} {show(getattr(cfg, k))}" for k, v in options.items()
             if getattr(cfg, k) not in (v, None)]
    text = f"--model {cfg.model}'s recipe (docs/conv.md): {' '.join(used) or 'none of it'}"
    return text + (f"; in effect instead: {' '.join(other)}" if other else "")


def validate(cfg):
    """Check values and fill strategy-dependent defaults. Returns the completed config."""
    names = _strategy_names()
    if cfg.strategy not in names:
        raise ConfigError(f"unknown strategy {cfg.strategy!r}; choose one of {', '.join(names)}")
    spec = strategies()[cfg.strategy]
    cfg = _with_recipe(cfg, spec)
    _check(cfg, spec)
    given = vars(cfg)  # the fields by name (a plain dataclass: no slots)
    defaults = {"servers": 0, **spec.default_values(cfg)}
    if (cfg.optimizer or defaults["optimizer"]) == "momentum":
        defaults.update(momentum=0.9, nesterov="off")
    fill = {k: v for k, v in defaults.items() if given[k] is None}
    # what dataclasses.replace(cfg, **fill) gives, built directly: replace walks every field's
    # declaration, several times the cost of the rest of this check (the combination matrix's
    # collection validates about 250,000 configurations)
    return _Config(**{**given, **fill}) if fill else cfg


def parse(argv: Sequence[str] | None = None):
    """Build the validated config from ``--config FILE.toml`` and the command line."""
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    if ns.get("config"):
        values.update(_read_toml(ns["config"]))
    values.update(ns)
    return from_values(values)


def from_values(values: dict[str, Any]):
    """The validated config of the options given, by name (what :func:`parse` has once the
    command line and any ``--config`` file are read); options not given are absent."""
    values = dict(values)
    if values.get("model") is not None and "layers" in values:
        raise ConfigError("give --model or --layers, not both: --layers is an MLP's widths, "
                          "--model a spec of conv, pool and fc layers")
    _check_types(values)
    return validate(new(**values))


def from_dict(d: dict[str, Any]):
    """Rebuild a config saved in a checkpoint (unknown keys refused as everywhere else)."""
    unknown = set(d) - set(OPTIONS)
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(unknown)}")
    d = dict(d)
    if "layers" in d:
        d["layers"] = tuple(d["layers"])
    return new(**d)


RESUME_AUTO = "auto"  # --resume auto: the run directory's newest valid checkpoint, if any


def plan(cfg, n_world: int) -> Layout:
    """The grid of ranks ``cfg`` asks for on ``n_world`` ranks (ConfigError if it cannot fit,
    or if --inject-slow names a rank that is not a replica's)."""
    layout = Layout.plan(n_world, cfg.servers, cfg.partitions, int(cfg.spec.coordinator),
                         spares=getattr(cfg, "spares", None) or 0,
                         joins=getattr(cfg, "joins", None) or 0)
    if cfg.inject_slow is not None:
        who, _ = parse_inject_slow(cfg.inject_slow)
        n_rep = layout.replicas * layout.partitions
        if who >= n_rep:
            role = layout.role(who) if who < n_world else None
            where = (f"outside the job's {n_world} ranks" if role is None else
                     f"server shard {role.shard}" if role.is_server else
                     f"spare {role.spare}" if role.kind == "spare" else "the coordinator")
            raise ConfigError(f"--inject-slow {cfg.inject_slow} names world rank {who}, "
                              f"{where}; it slows a replica: the replicas are ranks 0-"
                              f"{n_rep - 1} here")
    return layout


def default_run_dir(cfg, stamp: str, slurm_job: str | None = None) -> Path:
    """``runs/slurm-<job>`` in a Slurm job (the same when it is requeued, whatever the job
    step), else ``runs/<strategy>-<stamp>``."""
    if slurm_job:
        return Path("runs") / f"slurm-{slurm_job}"
    return Path("runs") / f"{cfg.strategy}-{stamp}"


def run_dir_for(cfg, stamp: str, slurm_job: str | None = None) -> Path:
    """The run directory: ``--run-dir``, else the directory of the ``--resume`` checkpoint,
    else :func:`default_run_dir`. ``--resume auto`` needs a directory that is the same when
    the job runs again: ``--run-dir`` or a Slurm job's; a time stamp is refused.

    A Slurm job's default directory is shared by every run of the job: one that holds
    another run (another configuration, or a run this one would start over) is refused,
    naming ``--run-dir`` (:func:`hpcps.runtime.slurm.check_owner`); reads that directory's
    ``metrics.jsonl``."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    if cfg.resume and cfg.resume != RESUME_AUTO:
        return Path(cfg.resume).parent
    if cfg.resume == RESUME_AUTO and not slurm_job:
        raise ConfigError("--resume auto looks for a checkpoint in the run directory, but "
                          "outside a Slurm job the default run directory is new each time: "
                          "give --run-dir DIR")
    path = default_run_dir(cfg, stamp, slurm_job)
    if slurm_job:
        from hpcps.runtime import slurm
        slurm.check_owner(path, slurm_job, cfg.to_dict(), cfg.resume == RESUME_AUTO)
    return path
