"""Predictions over the registry's strategies: each strategy's own cost model
(``Strategy.cost``, :mod:`hpcps.strategies.cost`) asked by name. A strategy that declares
none is listed, not predicted."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hpcps.strategies.cost import CostModel, Workload
from hpcps.strategies.registry import strategies

# alpha (s), beta (s per byte): typical MPI figures for each network (latency of a small
# message; the link's line rate)
NETWORKS = {
    "1gbe": (50e-6, 8 / 1e9),
    "10gbe": (20e-6, 8 / 10e9),
    "25gbe": (10e-6, 8 / 25e9),
    "100gbe": (5e-6, 8 / 100e9),
    "ib-edr": (1.5e-6, 8 / 100e9),
    "ib-hdr": (1.2e-6, 8 / 200e9),
}

NO_COST_MODEL = "no cost model declared"


def models() -> dict[str, CostModel | None]:
    """The cost model of every registered strategy that trains MLPs (the workloads this
    model predicts), in the registry's order (None: it declares none). A strategy for
    embedding models only (:attr:`Strategy.dense_models` False) is left out."""
    return {name: spec.cost_model() for name, spec in strategies().items()
            if spec.dense_models}


def modelled() -> tuple[str, ...]:
    """The registered strategies that declare a cost model."""
    return tuple(name for name, m in models().items() if m is not None)


def cost_model(strategy: str | CostModel) -> CostModel:
    """The cost model of the strategy named ``strategy`` (a model is taken as it is)."""
    if isinstance(strategy, CostModel):
        return strategy
    known = models()
    if strategy not in known:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {tuple(known)}")
    found = known[strategy]
    if found is None:
        raise ValueError(f"strategy {strategy!r}: {NO_COST_MODEL}")
    return found


def bytes_per_step(strategy: str | CostModel, w: Workload, R: int) -> float:
    """Bytes moved per step, as the strategy's summary counts them (per replica step)."""
    return cost_model(strategy).bytes_per_step(w, R)


def predict(strategy: str | CostModel, w: Workload, nodes: int, alpha: float, beta: float,
            allreduce: Callable[[float, int], float] | None = None) -> float:
    """Examples per second of ``strategy`` on ``nodes`` nodes (0.0 where it cannot run).
    ``allreduce(nbytes, R)``: seconds of MPI's allreduce as measured on the network (its sum
    included), in place of the ring formula, for strategies whose exchange is one."""
    return cost_model(strategy).examples_per_s(w, nodes, alpha, beta, allreduce=allreduce)


def curve(strategy: str | CostModel, w: Workload, nodes: list[int], alpha: float,
          beta: float) -> list:
    """(nodes, examples/s, speed-up over one node computing alone) for each node count."""
    single = w.batch / (replace(w, cores=None).compute(1) + w.n_params * w.update_s_per_param)
    out = []
    for k in nodes:
        eps = predict(strategy, w, k, alpha, beta)
        out.append((k, eps, eps / single))
    return out


def computing_beside(strategy: str | CostModel, w: Workload, nodes: int,
                     link: Callable[[float], tuple[float, float]]) -> float:
    """How many ranks compute, on average, while a replica and the rank it talks to move a
    message (strategies whose exchange is not ring-like); ``link(computing)`` gives that
    link's (alpha, beta)."""
    return cost_model(strategy).computing_beside(w, nodes, link)
