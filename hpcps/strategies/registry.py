"""The strategy registry: each strategy package declares everything the program needs to know.

A strategy is a package in ``hpcps/strategies/`` whose ``__init__`` exports ``STRATEGY``, a
:class:`Strategy`. The declaration imports no MPI: its roles are named by import path
(``"hpcps.strategies.sync.replica:run"``) and load only when a rank runs them, so ``--help``,
config parsing and every tool that reads declarations work where MPI does not.
:func:`strategies` finds every such package (no list to edit elsewhere), plus the declaration
modules named in ``HPCPS_STRATEGIES`` (comma-separated module names, for strategies kept outside
hpcps) and those installed under the ``hpcps.strategies`` entry-point group. ``config`` builds
the options, defaults and checks from the declarations, ``train`` plans the layout, dispatches
each rank's role and prints the summary from them. No strategy name appears outside its own
package and its tests.

Adding a strategy: docs/adding-a-strategy.md.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import sys
from enum import IntEnum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hpcps.errors import ConfigError
from hpcps.options import Option, RunConfig

if TYPE_CHECKING:  # annotations only: a declaration needs neither type at run time
    from hpcps.strategies.context import Context
    from hpcps.strategies.cost import CostModel

PLUGINS_ENV = "HPCPS_STRATEGIES"  # extra declaration modules, comma-separated
# A strategy's own message tags start here, above the shared protocol's (hpcps.mpi.protocol.Tag,
# checked by tests/test_layers.py); only one strategy runs in a job, so strategies may reuse
# the same numbers.
STRATEGY_TAGS_START = 100
TAG_UB = 32767  # the largest tag MPI guarantees
ENTRY_POINTS = "hpcps.strategies"  # entry-point group of installed strategies
ROLES = ("replica", "server", "coordinator", "spare")  # spare: --spares ranks, idle at start
NO_SERVERS, SERVERS = "none", "required"


def _no_checks(cfg: RunConfig) -> None:
    return None


@dataclass(frozen=True)
class Strategy:
    """One strategy's declaration.

    Parameters
    ----------
    name : the value of ``--strategy``.
    help : one sentence for ``--help``: what the replicas do and how they combine their work.
    roles : the function each role runs, by import path: ``{"replica":
        "hpcps.strategies.sync.replica:run", "server": ..., "coordinator": ...}`` (loaded
        when a rank runs it; a callable is taken too); each takes the
        :class:`~hpcps.strategies.context.Context` and returns a dict of figures (the
        reporter's goes into the summary).
    servers : ``"none"`` (``--servers`` must be 0) or ``"required"`` (at least one shard).
    coordinator : one extra rank, the last, runs the ``coordinator`` role.
    options : the options that belong to this strategy (refused with the others). An option
        several strategies share is the same :class:`~hpcps.options.Option` object in each.
    defaults : values for options left unset: a dict, or a function of the config returning
        one (for defaults that depend on other options, such as one shard per partition).
    optimizers : the ``--optimizer`` values it runs; the first is the default.
    model_parallel : accepts ``--partitions P > 1``.
    whole_batch : accepts ``--batch-size 0`` (the whole training set per step).
    epochs : default ``--epochs`` when neither ``--epochs`` nor ``--steps`` is given.
    recipes : ``{preset: {option: value}}``, what ``--model PRESET`` was tuned with under
        this strategy: added where not given, as far as the options given accept it
        (:mod:`hpcps.config`); the start line says which.
    embeddings : trains embedding models (``--model embed...``, ``ctr-dnn``, ``movielens``:
        :mod:`hpcps.model.ctr`) on categorical datasets; the others refuse them at start.
    dense_models : trains MLPs and conv models (False: embedding models only; the scaling
        tool, whose workloads are MLPs, leaves it out).
    replica_data : ``"shard"`` (each replica reads its block of the training set) or
        ``"whole"`` (each replica holds all of it).
    validate : strategy-specific checks of a config (raise ConfigError), after the generic
        ones and before defaults are filled.
    check_resume : ``check_resume(cfg, checkpoint)``, raising CheckpointError when the
        checkpoint cannot continue this strategy.
    describe : ``describe(cfg, n_train) -> str``, how it trains, for the start line; one
        that also takes a keyword ``replicas`` is handed the number of replicas of the run
        (a rate scaled with them, :mod:`hpcps.strategies.lr_rule`).
    summarize : ``summarize(ctx, results) -> dict``, or its import path: the strategy's own
        summary figures from every rank's result (default: the reporter's ``figures``).
        ``bytes_per_step`` and
        ``mean_staleness`` go into the summary's common columns.
    summary_lines : ``summary_lines(figures) -> list[str]``, extra lines for the terminal.
    tags : the strategy's own message tags, an IntEnum made by :func:`message_tags` (the
        parameter server's and the run's shared tags are in :mod:`hpcps.mpi.protocol`).
    stops_alone : in a run whose ranks may die (``--heartbeat-timeout``), where there is no
        stop vote (a world-wide collective), it stops on a signal to the rank that reports
        (rank 0, or the coordinator; SIGTERM, and SIGUSR1 outside Hydra) by its own
        messages, with the final checkpoint and exit code 75 (``ctx.stop_flag``; the other
        ranks keep the signal for their own use or until the end). False: SIGTERM ends
        each rank it reaches.
    cost : its cost model for the scaling tool (``python -m hpcps.scaling``): a
        :class:`~hpcps.strategies.cost.CostModel`, or its import path
        (``"hpcps.strategies.sync.cost:COST"``, loaded when the tool asks); None: the tool
        lists the strategy as having no cost model.
    """

    name: str
    help: str
    roles: Mapping[str, str | Callable[["Context"], dict]]
    servers: str = NO_SERVERS
    coordinator: bool = False
    options: tuple[Option, ...] = ()
    defaults: Mapping[str, Any] | Callable[[RunConfig], Mapping[str, Any]] = \
        field(default_factory=dict)
    optimizers: tuple[str, ...] = ("adagrad", "sgd", "momentum")
    model_parallel: bool = True
    whole_batch: bool = False
    epochs: float = 4.0
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    embeddings: bool = False
    dense_models: bool = True
    replica_data: str = "shard"
    validate: Callable[[RunConfig], None] = _no_checks
    check_resume: Callable[[RunConfig, Any], None] | None = None
    describe: Callable[..., str] | None = None
    summarize: str | Callable[["Context", list], dict] | None = None
    summary_lines: Callable[[dict], list[str]] | None = None
    tags: type[IntEnum] | None = None
    stops_alone: bool = False
    cost: "str | CostModel | None" = None

    def __post_init__(self):
        unknown = set(self.roles) - set(ROLES)
        if unknown or "replica" not in self.roles:
            raise ValueError(f"strategy {self.name}: roles must include 'replica' and be among "
                             f"{ROLES}, got {sorted(self.roles)}")
        if self.servers not in (NO_SERVERS, SERVERS):
            raise ValueError(f"strategy {self.name}: servers must be 'none' or 'required'")
        if (self.servers == SERVERS) != ("server" in self.roles):
            raise ValueError(f"strategy {self.name}: a 'server' role goes with servers='required'")
        if self.coordinator != ("coordinator" in self.roles):
            raise ValueError(f"strategy {self.name}: coordinator=True goes with a "
                             "'coordinator' role")
        if self.replica_data not in ("shard", "whole"):
            raise ValueError(f"strategy {self.name}: replica_data is 'shard' or 'whole'")
        if self.tags is not None and any(not STRATEGY_TAGS_START <= t <= TAG_UB
                                         for t in self.tags):
            raise ValueError(f"strategy {self.name}: its tags come from message_tags()")
        for role, target in self.roles.items():
            if isinstance(target, str) and ":" not in target:
                raise ValueError(f"strategy {self.name}: role {role} is 'module:function', "
                                 f"got {target!r}")
        if isinstance(self.cost, str) and ":" not in self.cost:
            raise ValueError(f"strategy {self.name}: cost is 'module:attribute', got "
                             f"{self.cost!r}")

    @property
    def uses_servers(self) -> bool:
        return self.servers == SERVERS

    def default_values(self, cfg: RunConfig) -> dict[str, Any]:
        d = self.defaults(cfg) if callable(self.defaults) else self.defaults
        return {"optimizer": self.optimizers[0], **d}

    def how(self, cfg: RunConfig, n_train: int, replicas: int) -> str:
        """How it trains, for the start line: its ``describe`` (with ``replicas`` when it
        takes them), or the optimizer's name."""
        if self.describe is None:
            return str(cfg.optimizer)
        if "replicas" in inspect.signature(self.describe).parameters:
            return self.describe(cfg, n_train, replicas=replicas)
        return self.describe(cfg, n_train)

    def role(self, kind: str) -> Callable[["Context"], dict]:
        """The function of role ``kind``, imported now if it is named by path."""
        return load(self.roles[kind])

    def run(self, ctx: "Context") -> dict:
        """Run this rank's role."""
        return self.role(ctx.grid.role.kind)(ctx)

    def cost_model(self) -> "CostModel | None":
        """Its cost model, imported now if it is named by path; None if it declares none."""
        return None if self.cost is None else load(self.cost)

    def summarizer(self) -> Callable[["Context", list], dict] | None:
        return None if self.summarize is None else load(self.summarize)


def message_tags(strategy: str, *names: str) -> type[IntEnum]:
    """The message tags of ``strategy``, named ``names``, numbered from
    :data:`STRATEGY_TAGS_START` in the order given (the same on every rank)."""
    if len(set(names)) != len(names) or STRATEGY_TAGS_START + len(names) > TAG_UB:
        raise ValueError(f"strategy {strategy}: tag names must be distinct and few, got {names}")
    made = IntEnum(f"{strategy.capitalize()}Tag",  # type: ignore[misc]  # functional API
                   [(n, STRATEGY_TAGS_START + i) for i, n in enumerate(names)])
    return made


def load(target):
    """``"package.module:name"`` imported, or a callable as it is."""
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


# The strategy run when --strategy is not given.
DEFAULT = "downpour"


def _declaration_modules() -> list[str]:
    """Where declarations live: hpcps's own strategy packages, then the plug-ins."""
    import hpcps.strategies as package
    names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
             if m.ispkg]
    names += [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    names += installed_plugins()
    return names


def installed_plugins(group: str = ENTRY_POINTS) -> list[str]:
    """The modules installed distributions declare under the entry-point ``group``.

    ``importlib.metadata`` is asked only when some distribution's entry points name the
    group (:func:`_entry_points_may_name`): its import and its parse of every distribution's
    metadata cost each rank of each job 20-30 ms of CPU, and find nothing where no plug-in
    is installed."""
    if not _entry_points_may_name(group):
        return []
    from importlib.metadata import entry_points
    return [ep.value for ep in entry_points(group=group)]


def _entry_points_may_name(group: str) -> bool:
    """False only if no distribution ``importlib.metadata`` finds declares entry points that
    mention ``group``: the ``entry_points.txt`` of every ``*.dist-info`` and ``*.egg-info``
    folder in the folders of ``sys.path`` (where its standard finder looks) searched for the
    name. True where this look would not see all it sees: another finder of distributions on
    ``sys.meta_path``, a zip file or an ``.egg`` on ``sys.path``."""
    from importlib.machinery import PathFinder
    if any(getattr(f, "find_distributions", None) is not None and f is not PathFinder
           for f in sys.meta_path):
        return True
    name = group.encode()
    for entry in sys.path:
        root = entry or "."  # "" is the current directory
        if not os.path.isdir(root):
            if os.path.exists(root):  # a zip file
                return True
            continue
        if root.lower().endswith(".egg"):
            return True
        try:
            children = os.listdir(root)
        except OSError:  # importlib.metadata skips it too
            continue
        for child in children:
            if not child.lower().endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(root, child, "entry_points.txt"), "rb") as fh:
                    if name in fh.read():
                        return True
            except OSError:  # none, or an .egg-info file rather than a folder
                continue
    return False


@functools.cache
def strategies() -> dict[str, Strategy]:
    """Every declared ``STRATEGY``, by name (the default first, then by name)."""
    found: dict[str, Strategy] = {}
    for name in _declaration_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # what is installed or named, not a bug: exit code 2
            raise ConfigError(f"strategy module {name!r} ({PLUGINS_ENV} or an installed "
                              f"plug-in) cannot be imported: {exc}") from exc
        spec = getattr(module, "STRATEGY", None)
        if isinstance(spec, Strategy):
            if spec.name in found:
                raise ConfigError(f"two strategies named {spec.name!r} (a plug-in named in "
                                  f"{PLUGINS_ENV} or installed, and another)")
            found[spec.name] = spec
    if DEFAULT not in found:
        raise ValueError(f"the default strategy {DEFAULT!r} is not installed")
    return {DEFAULT: found.pop(DEFAULT), **dict(sorted(found.items()))}


def get(name: str) -> Strategy:
    return strategies()[name]
