"""What a strategy's step costs on a cluster: the pieces every strategy's cost model shares.

A strategy declares its cost model in its declaration (``Strategy(cost=
"hpcps.strategies.<name>.cost:COST")``, loaded when the scaling tool asks for it): a
:class:`CostModel` that says, from a :class:`Workload` and a network's ``alpha`` (seconds of
latency) and ``beta`` (seconds per byte), how many examples per second the strategy trains on
a number of nodes and how many bytes a step moves. ``python -m hpcps.scaling`` draws its
curves and checks from the models of every registered strategy.

The model is the alpha-beta (Hockney) one: sending m bytes costs ``alpha + m * beta`` seconds;
a node's link is full duplex (sending and receiving overlap), and a node computes or
communicates, never both at once (no overlap, as the strategies' loops run).

Pure math: no MPI, nothing measured here. What a model needs measured on the CPU beyond the
common figures (:func:`hpcps.tools.scaling.measure_compute`) it names in ``calibrate``, a
function loaded only when the tool measures.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Workload:
    """What one step costs on one node, apart from the network: the inputs of the cost models.

    Common to every strategy:

    n_params : parameters of the model.
    batch : examples per mini-batch per replica.
    compute_s : seconds for one mini-batch's forward and backward pass on a core of its own.
    update_s_per_param : seconds of the optimizer's update per parameter.
    state_vectors : optimizer state vectors (adagrad: 1).
    servers : parameter-server shards S (nodes that do not train), where a strategy has them.
    reduce_s_per_param : seconds per float an allreduce sums.
    value_bytes : bytes a parameter or gradient value takes on the wire: 4, or 2 with
        ``--wire-dtype bf16`` (headers, losses and optimizer state copies keep theirs).
    run_steps : steps each replica takes in the run, for costs paid once per run (None: a
        long run, where they vanish).
    cores : cores shared by all nodes (the emulated cluster: every node is a namespace of one
        machine); None for real nodes, each with its own CPU.
    background : runnable threads of other jobs on those cores while the nodes run (a
        shared machine's load).
    co_run : how much slower a pass runs on those cores when all of them compute at once
        than on one alone (:func:`hpcps.tools.scaling.measure_together`; 1 for real nodes);
        measured with more processes than cores, it also holds what taking turns on a core
        does to a pass (its caches refilled after every switch), which :meth:`share`'s time
        slices do not.

    Read by one strategy's model each (its ``cost.py`` says how):

    average_every : steps between two averages of the parameters (and the state).
    average_s_per_param : seconds per parameter of an average's own work on its vectors
        (copied into the buffer, the mean, copied back), with ``state_vectors`` vectors.
    updates_per_step : thresholded elements per message (a run's summary gives
        ``updates_per_step``; Strom's Table 3 gives update sizes).
    bits_per_update : bits per sent element (``bits_per_update`` in a summary).
    reckon_s_per_param : seconds per parameter of a thresholding step's work on the whole
        vector (scale the gradient, add it to the residual, threshold, pack).
    receive_s_per_word : seconds per thresholded element to decode and apply a message, its
        own words and each peer's (0: ``update_s_per_param``).
    reckon_compute_s : the pass of a thresholding step, which runs slower than ``compute_s``
        because the step's vectors (residual, counts, reference weights) push the weights out
        of the caches between passes; None: ``compute_s``.
    batch_examples : examples per batch evaluation of a batch method (the training set).
    portion_s_per_example : seconds per example of a portion's gradient (large portions run
        BLAS faster per example than mini-batches); default compute_s / batch.
    portions, flush_every : portions per batch evaluation, portions between two pushes.
    """

    n_params: int
    batch: int
    compute_s: float
    update_s_per_param: float = 1e-9
    state_vectors: int = 1
    average_every: int = 4
    updates_per_step: float = 0.0
    bits_per_update: float = 11.0
    batch_examples: int = 60000
    portion_s_per_example: float | None = None
    portions: int = 64
    flush_every: int = 4
    servers: int = 1
    reduce_s_per_param: float = 0.0
    value_bytes: int = 4
    reckon_s_per_param: float = 0.0
    receive_s_per_word: float = 0.0
    average_s_per_param: float = 0.0
    reckon_compute_s: float | None = None
    cores: int | None = None
    background: float = 0.0
    co_run: float = 1.0
    run_steps: int | None = None

    def share(self, nodes: int) -> float:
        """How many times longer CPU work takes when ``nodes`` ranks run than on a core of
        its own: 1 on real nodes; on shared cores each of the runnable threads (ours and
        the background's) gets cores / threads of a core, at ``co_run`` times the time once
        every core is busy (in proportion before)."""
        if not self.cores:
            return 1.0
        busy = min(float(self.cores), nodes + self.background)
        co_run = 1.0 if self.cores < 2 else \
            1.0 + (self.co_run - 1.0) * max(0.0, busy - 1.0) / (self.cores - 1.0)
        return co_run * max(1.0, (nodes + self.background) / self.cores)

    def compute(self, nodes: int, own: float | None = None) -> float:
        """Seconds of one mini-batch when ``nodes`` ranks compute at once (:meth:`share`);
        ``own``: a strategy's own pass time in place of ``compute_s``, where it has one."""
        return (own or self.compute_s) * self.share(nodes)


def ring(nbytes: float, R: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Seconds of a ring allreduce of ``nbytes`` (float32) over R nodes; ``gamma``: seconds per
    float summed (each node sums (R-1)/R of the vector)."""
    if R <= 1:
        return 0.0
    return 2 * (R - 1) * alpha + (R - 1) / R * nbytes * (2 * beta + gamma / 4)


def allreduce_s(nbytes: float, R: int, alpha: float, beta: float, gamma: float,
                allreduce: Callable[[float, int], float] | None = None) -> float:
    """An allreduce of ``nbytes`` over R nodes: the ring formula, or ``allreduce(nbytes, R)``
    (MPI's own, as measured on the network, its sum included) where given."""
    if allreduce is None or R <= 1:
        return ring(nbytes, R, alpha, beta, gamma)
    return allreduce(nbytes, R)


class CostModel(ABC):
    """One strategy's costs. A strategy's ``cost.py`` subclasses it and sets ``COST`` to an
    instance; every method is pure.

    ``ring_like``: every replica sends and receives at once in each step (a ring allreduce's
    steps, or a message to every peer), so the cluster check takes the latency and bandwidth
    of a ring exchange; False: a replica talks to one other rank (a shard), and the check
    takes one pair's link with the other ranks computing beside it
    (:meth:`computing_beside`).

    ``calibrate``: ``"module:function"`` measuring this strategy's own inputs on the CPU
    (``function(bench) -> dict`` of :class:`Workload` fields; ``bench`` is a :class:`Bench`),
    loaded only when the tool measures (it may run the strategy's role code); None: the
    common figures suffice.
    """

    ring_like: bool = True
    calibrate: str | None = None

    @abstractmethod
    def bytes_per_step(self, w: Workload, R: int) -> float:
        """Bytes moved per step with R replicas, as the strategy's summary counts them."""

    @abstractmethod
    def examples_per_s(self, w: Workload, nodes: int, alpha: float, beta: float,
                       allreduce: Callable[[float, int], float] | None = None) -> float:
        """Examples per second on ``nodes`` nodes (0.0 where it cannot run).
        ``allreduce(nbytes, R)``: seconds of MPI's allreduce as measured on the network, for
        a model whose exchange is one (else ignored)."""

    def computing_beside(self, w: Workload, nodes: int,
                         link: Callable[[float], tuple[float, float]]) -> float:
        """How many ranks compute, on average, while a replica and the rank it talks to move
        a message (for a model that is not ``ring_like``); ``link(computing)`` gives that
        link's (alpha, beta). Default: every rank but the pair."""
        return float(max(0, nodes - 2))

    def from_run(self, w: Workload, run: dict) -> Workload:
        """``w`` with the inputs a measured run's record gives (``bytes_per_step``,
        ``replicas``...), for the cluster check. Default: ``w``."""
        return w

    def published(self) -> dict | None:
        """A check against published figures: ``{"title": ..., "rows": [{"nodes",
        "paper_speedup", "model_speedup", "relative_difference"}, ...]}``, or None."""
        return None


@dataclass(frozen=True)
class Bench:
    """What a strategy's own measurement (``CostModel.calibrate``) is handed: the model and
    the optimizer as a replica runs them, on one thread.

    layers, batch, repeats : the model's widths, examples per mini-batch, steps timed.
    warm_steps : steps taken before timing.
    model : the :class:`hpcps.model.mlp.MLP`; ``params`` its parameters.
    state : the optimizer's state (Adagrad's sums).
    x, y : the inputs to time with (at least ``portion`` rows, and ``batch`` per step).
    step : the pass a replica runs, ``step(params, x, y, grad=grad)``.
    portion : rows of a batch method's portion.
    """

    layers: list[int]
    batch: int
    repeats: int
    warm_steps: int
    model: Any
    params: np.ndarray
    state: dict
    x: np.ndarray
    y: np.ndarray
    step: Callable[..., Any]
    portion: int


def rng_normal(n: int, seed: int) -> np.ndarray:
    """``n`` standard-normal float32 values, the same for a seed (the vectors timed with)."""
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)
