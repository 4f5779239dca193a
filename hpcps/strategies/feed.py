"""Where a rank's data come from: memory or the file, decided once for the job.

Every rank's share of the data is known before anything is read: a replica's training block
(its shard of /train, or the whole set for a strategy whose replicas hold all of it) and the
chief's evaluation splits (/test, and the validation split when there is one). :func:`plan`
holds each against the rank's memory budget (``--data-memory``, else
:func:`hpcps.runtime.memory.data_budget`) and decides, the same on every rank:

* the training blocks stream (:class:`~hpcps.io.data.stream.StreamBatches`) on every replica
  when any replica's block does not fit its budget beside its evaluation splits (every
  partition of a replica must draw the same batches, so they all read the same way);
* the evaluation splits stream (scored in chunks, :func:`score`) when they do not fit on the
  chief beside what its training takes.

A strategy whose replicas index the whole training set at random (``replica_data="whole"``)
cannot stream it: its evaluation splits stream when they do not fit beside it, and a training
set larger than the budget alone is refused, naming the options that help.
The roles then ask :func:`batches` for their mini-batches and :func:`score` for an
evaluation, and never ask which way the data come.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import ConfigError
from hpcps.io.data import Batches
from hpcps.io.data.stream import (EVAL_ROWS, MIB, MIN_CHUNK_ROWS, RowSource, StreamBatches,
                                  chunks, decide, describe_stream, plan_stream, row_bytes,
                                  stream_bytes)
from hpcps.options import RunConfig
from hpcps.strategies.registry import strategies


@dataclass(frozen=True)
class Feed:
    """The job's decision. ``budget``: the smallest rank budget in bytes (the chunk plan
    follows it); ``why``: how it was set; ``train``/``evaluation``: whether they stream;
    ``chunk_rows``, ``window``: the chunk plan of streamed training blocks; ``eval_rows``:
    rows of an evaluation split read at a time when it streams."""

    budget: int
    why: str
    train: bool = False
    evaluation: bool = False
    chunk_rows: int = 0
    window: int = 0
    eval_rows: int = EVAL_ROWS
    n_features: int = 0

    def describe(self) -> str:
        """For the start line."""
        if not self.train and not self.evaluation:
            return (f"data in memory (each rank's share fits its {_mib(self.budget)} MiB "
                    f"budget: {self.why})")
        parts = []
        if self.train:
            parts.append("training data stream from the file in "
                         + describe_stream(self.chunk_rows, self.window, self.n_features))
        if self.evaluation:
            parts.append(f"evaluations read {self.eval_rows} rows at a time")
        return "; ".join(parts) + (f" (budget {_mib(self.budget)} MiB a rank: "
                                   f"{self.why})")

    def record(self) -> dict:
        """For the start and summary records."""
        return {"data_streams": self.train, "eval_streams": self.evaluation,
                "data_budget_mib": round(self.budget / MIB, 1),
                **({"stream_chunk_rows": self.chunk_rows, "stream_window": self.window}
                   if self.train else {})}


def plan(cfg: RunConfig, layout, n_train: int, n_test: int, n_features: int, val_rows: int,
         budgets: list[int], why: str) -> Feed:
    """The decision for the whole job from every world rank's budget (``budgets[r]``
    bytes). ``layout``: the grid (a :class:`~hpcps.mpi.topology.Layout`); ``n_features``: a
    row's size in float32 numbers (a categorical row's int64 ids count two each). Raises
    ConfigError when data that cannot stream do not fit."""
    rb = row_bytes(n_features)
    whole = cfg.spec.replica_data == "whole"
    R = layout.replicas
    train_rows = []
    for r in range(layout.n_world):
        role = layout.role(r)
        if role.is_replica:
            lo, hi = (0, n_train) if whole else block_range(n_train, R, role.replica)
            train_rows.append(hi - lo)
        elif role.kind == "spare":  # may take over any replica's block
            train_rows.append(n_train if whole else -(-n_train // R))
        else:
            train_rows.append(0)
    eval_rows = n_test + val_rows
    budget = min(budgets)
    chunk, window = plan_stream(n_features, max(1, max(train_rows)), budget)
    cost = stream_bytes(chunk, window, n_features)
    decisions = [decide(rows * rb, (eval_rows if r == 0 else 0) * rb, budgets[r], cost,
                        not whole) for r, rows in enumerate(train_rows)]
    train = any(d.train for d in decisions)
    evaluation = decisions[0].evaluation
    if train and whole:
        streaming = [n for n, s in strategies().items()
                     if s.replica_data == "shard" and s.dense_models]
        raise ConfigError(
            f"--strategy {cfg.strategy} holds the whole training set on every replica "
            f"({_mib(n_train * rb)} MiB) and cannot stream it (its replicas read rows from "
            f"anywhere in the set), more than the {_mib(budget)} MiB a rank may give its data "
            f"({why}); give --data-memory {_above(n_train * rb)} or more if the "
            f"nodes have it, fewer ranks per node, or a strategy whose replicas stream their "
            f"block: {', '.join(streaming)}")
    eval_chunk = max(MIN_CHUNK_ROWS, min(EVAL_ROWS, budget // (2 * rb)))
    return Feed(budget=budget, why=why, train=train, evaluation=evaluation,
                chunk_rows=chunk if train else 0, window=window if train else 0,
                eval_rows=eval_chunk, n_features=n_features)


def _mib(n: float) -> str:
    """Bytes as MiB for a message: whole MiB from 10 up, else two significant digits."""
    return f"{n / MIB:.0f}" if n >= 10 * MIB else f"{n / MIB:.2g}"


def _above(n: float) -> str:
    """A --data-memory value (MiB) that holds ``n`` bytes."""
    return f"{-(-n * 10 // MIB) / 10:g}"


def batches(x: np.ndarray | None, y: np.ndarray | None, source: RowSource | None,
            feed: Feed | None, batch: int, seed: int):
    """A replica's endless mini-batches: over its block in memory (``x``, ``y``), or
    streamed from ``source`` with ``feed``'s chunk plan."""
    if source is not None and feed is not None:
        return StreamBatches(source, batch, seed, feed.chunk_rows, feed.window)
    if x is None or y is None:
        raise ValueError("no training data on this rank")
    return Batches(x, y, batch, seed)


def score(model, params: np.ndarray, x: np.ndarray | None, y: np.ndarray | None,
          source: RowSource | None = None, rows: int = EVAL_ROWS) -> tuple[float, float]:
    """(mean loss, accuracy) of ``params`` on a split in memory (``x``, ``y``) or read from
    ``source`` ``rows`` rows at a time (the same figures, summed over the pieces)."""
    from hpcps.engine import conv_hogwild  # the compiled forward pass for conv models
    if source is None:
        if x is None or y is None:
            raise ValueError("no evaluation split on this rank")
        return conv_hogwild.evaluate(model, params, x, y)
    loss_sum, correct, n = 0.0, 0.0, 0
    for cx, cy in chunks(source, rows):
        loss, acc = conv_hogwild.evaluate(model, params, cx, cy)
        loss_sum += loss * len(cy)
        correct += round(acc * len(cy))
        n += len(cy)
    return loss_sum / max(1, n), correct / max(1, n)
