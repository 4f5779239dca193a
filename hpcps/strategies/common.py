"""What every strategy is handed, and the pieces they share (checkpoints, evaluation, waits).

:class:`Context` is built once by ``train.py`` and holds the config, the grid, the model, the
starting state (fresh or resumed) and the data this rank needs. A strategy's ``run(ctx)``
returns a dict of final figures for the summary.
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcps import checkpoint, optim
from hpcps.config import Config
from hpcps.data import DatasetInfo, block_range
from hpcps.metrics import Metrics
from hpcps.model import MLP
from hpcps.ps.waiting import wait_all
from hpcps.topology import Grid

CHECKPOINT_NAME = "checkpoint.h5"


@dataclass
class Context:
    """Everything one rank needs to run its part of a strategy.

    ``params`` and ``opt_state`` are full flat vectors (fresh or from ``--resume``); a server
    shard keeps only its slice of them. ``train_x/train_y`` hold this replica's shard of the
    training set (empty on servers); ``test_x/test_y`` are loaded on the chief only.
    """

    cfg: Config
    grid: Grid
    model: MLP
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

    @property
    def remaining_steps(self) -> int:
        return max(0, self.total_steps - self.start_step)

    def epochs(self, step: int) -> float:
        return step * self.cfg.batch_size / self.dataset.n_train

    def batch_seed(self, replica: int) -> int:
        """Data order differs per replica and per resume point, reproducibly from --seed."""
        return self.cfg.seed * 1_000_003 + replica * 7919 + self.start_step


def make_optimizer(cfg: Config):
    return optim.make(cfg.optimizer, cfg.lr, cfg.adagrad_eps)


def checkpoint_path(ctx: Context) -> Path:
    return ctx.run_dir / CHECKPOINT_NAME


def save_checkpoint(ctx: Context, params: np.ndarray, opt_state: dict[str, np.ndarray],
                    step: int, metrics: dict | None = None) -> Path:
    """Write the full state as one HDF5 checkpoint, atomically, and log it."""
    views = ctx.model.views
    state = {f"{key}/{name}": a for key, flat in opt_state.items()
             for name, a in views(flat).items()}
    ckpt = checkpoint.Checkpoint(
        params={k: np.ascontiguousarray(v) for k, v in views(params).items()},
        optimizer=ctx.cfg.optimizer, opt_state=state, step=int(step),
        config=ctx.cfg.to_dict(), dataset=ctx.dataset.to_dict(), metrics=dict(metrics or {}))
    return checkpoint.save(checkpoint_path(ctx), ckpt)


def state_from_checkpoint(model: MLP, ckpt: checkpoint.Checkpoint,
                          state_keys) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Flat parameters and optimizer state from a loaded checkpoint."""
    params = model.flatten(ckpt.params)
    state = {}
    for key in state_keys:
        named = {name: ckpt.opt_state[f"{key}/{name}"] for name, _, _ in model.layout}
        state[key] = model.flatten(named)
    return params, state


def evaluate(ctx: Context, params: np.ndarray) -> tuple[float, float]:
    """(test loss, test accuracy) on the chief's copy of the test set."""
    return ctx.model.evaluate(params, ctx.test_x, ctx.test_y)


def steps_for_replica(total: int, replicas: int, replica: int, warmup: int = 0) -> int:
    """Mini-batches replica ``replica`` runs: replica 0 does the warm start alone, then the
    rest of the work is split as evenly as possible."""
    warmup = min(warmup, total)
    lo, hi = block_range(total - warmup, replicas, replica) if total > warmup else (0, 0)
    return (hi - lo) + (warmup if replica == 0 else 0)


def barrier(comm, timeout: float, what: str) -> None:
    """A barrier that fails after ``timeout`` seconds instead of hanging."""
    wait_all([comm.Ibarrier()], timeout, what)


def host() -> str:
    return socket.gethostname()


def rate(examples: float, seconds: float) -> float:
    return examples / seconds if seconds > 0 else math.nan

