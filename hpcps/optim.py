"""Update rules on flat float32 vectors (or any contiguous slice of one). No MPI.

An optimizer is handed to whoever owns the parameters: a parameter-server shard applies it to
its own slice as gradients arrive (``downpour``), a ``sync`` replica to its full copy after the
allreduce. Its state (Adagrad's sum of squared gradients) is a dict of arrays the same length
as the slice, so a shard keeps exactly the state of its own parameters and a checkpoint can
gather and re-split it for any number of shards.
"""
from __future__ import annotations

import numpy as np

from hpcps import kernels
from hpcps.errors import ConfigError


class SGD:
    """Plain gradient descent, w -= lr * g."""

    name = "sgd"
    state_keys: tuple[str, ...] = ()

    def __init__(self, lr: float):
        self.lr = float(lr)

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        return {}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        kernels.sgd_update(w, g, self.lr)


class Adagrad:
    """DistBelief's Adagrad: each parameter's rate is lr / sqrt(sum of its squared gradients).

    ``accum`` starts at zero, so the first step moves each parameter by about lr in the
    direction of its gradient; ``eps`` only keeps 0/0 out. Runs in the compiled kernel
    (``ext/adagrad.pyx``) when it is built, NumPy otherwise.
    """

    name = "adagrad"
    state_keys = ("accum",)

    def __init__(self, lr: float, eps: float = 1e-8):
        self.lr = float(lr)
        self.eps = float(eps)

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        return {"accum": np.zeros(n, dtype=np.float32)}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        kernels.adagrad_update(w, g, state["accum"], self.lr, self.eps)


def make(name: str, lr: float, eps: float = 1e-8):
    """The optimizer called ``name`` ("sgd" or "adagrad")."""
    if name == "sgd":
        return SGD(lr)
    if name == "adagrad":
        return Adagrad(lr, eps)
    raise ConfigError(f"unknown optimizer {name!r}; choose sgd or adagrad")
