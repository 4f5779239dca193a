"""Update rules on flat float32 vectors (or any contiguous slice of one). No MPI.

An optimizer is handed to whoever owns the parameters: a parameter-server shard applies it to
its own slice as gradients arrive (``downpour``), a ``sync`` replica to its full copy after the
allreduce. Its state (Adagrad's sum of squared gradients) is a dict of arrays the same length
as the slice, so a shard keeps exactly the state of its own parameters and a checkpoint can
gather and re-split it for any number of shards.

``apply(w, g, state, lr_scale, step_scale)`` takes one gradient at ``lr * lr_scale``: a
per-gradient rate (staleness-dependent rates scale a late gradient's), which Adagrad applies to
the step only, its accumulator taking the gradient as it is. ``step_scale`` scales the step
taken, the learning-rate schedule's multiplier (:func:`lr_factor`): the same as ``lr_scale``
for SGD and Adagrad, while momentum takes the gradient into its velocity unscaled and scales
the step ``lr * step_scale * v``, as a schedule on momentum SGD usually does.
"""
from __future__ import annotations

import math

import numpy as np

from hpcps import kernels
from hpcps.errors import ConfigError
from hpcps.options import SCHEDULES, varies


class SGD:
    """Plain gradient descent, w -= lr * g."""

    name = "sgd"
    state_keys: tuple[str, ...] = ()

    def __init__(self, lr: float):
        self.lr = float(lr)

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        return {}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
              lr_scale: float = 1.0, step_scale: float = 1.0) -> None:
        kernels.sgd_update(w, g, self.lr * lr_scale * step_scale)


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

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
              lr_scale: float = 1.0, step_scale: float = 1.0) -> None:
        kernels.adagrad_update(w, g, state["accum"], self.lr * lr_scale * step_scale, self.eps)


class Momentum:
    """SGD with momentum (heavy ball), optionally Nesterov's variant.

    ``v = mu * v + g``; then ``w -= lr * v``, or with Nesterov ``w -= lr * (g + mu * v)``
    (the formulation of PyTorch and Sutskever et al. 2013, on the gradient at ``w``). The
    velocity ``v`` is the state, as long as the slice, so a shard keeps its own part.
    """

    name = "momentum"
    state_keys = ("velocity",)

    def __init__(self, lr: float, momentum: float = 0.9, nesterov: bool = False):
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"--momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.mu = np.float32(momentum)
        self.nesterov = bool(nesterov)
        self._step = np.float32(-self.lr)

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        return {"velocity": np.zeros(n, dtype=np.float32)}

    def apply(self, w: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
              lr_scale: float = 1.0, step_scale: float = 1.0) -> None:
        v = state["velocity"]
        v *= self.mu
        if lr_scale == 1.0:
            v += g
        else:  # this gradient's rate is lr * lr_scale, in the velocity as in the step
            g = np.float32(lr_scale) * g
            v += g
        step = self._step if step_scale == 1.0 else np.float32(-self.lr * step_scale)
        if self.nesterov:  # w -= lr * (g + mu * v)
            w += step * g
            w += (step * self.mu) * v
        else:
            w += step * v


class LBFGSState:
    """What L-BFGS keeps per parameter, for checkpoints: the gradient at x and the m history
    pairs (the vectors live on Sandblaster's shards; :class:`LBFGS` drives them)."""

    name = "lbfgs"

    def __init__(self, m: int):
        self.m = m
        self.state_keys = ("g",) + tuple(f"s{i}" for i in range(m)) + \
            tuple(f"y{i}" for i in range(m))

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        return {k: np.zeros(n, dtype=np.float32) for k in self.state_keys}


# --lr-schedule: the learning rate's multiplier over a run
def lr_factor(schedule: str | None, step: int, total: int) -> float:
    """The learning rate's multiplier at global step ``step`` of a run of ``total``: 1 for
    ``constant`` (or None); for ``cosine``, 0.5 (1 + cos(pi step / total)), which falls from 1
    at the start to 0 at the end (SGDR's cosine annealing, Loshchilov & Hutter 2017, without
    restarts). A resumed run continues the same curve: ``step`` is the global step."""
    if not varies(schedule) or total <= 0:
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(max(step, 0), total) / total))
    raise ConfigError(f"unknown learning-rate schedule {schedule!r}; choose one of {SCHEDULES}")


def scheduled(apply, schedule: str | None, step, total: int):
    """An optimizer's ``apply`` whose steps follow ``schedule``: each call passes
    :func:`lr_factor` at the global step ``step()`` as its ``step_scale`` (for a
    parameter-server shard, which applies the pushes of every replica); ``apply`` itself for
    ``constant``."""
    if not varies(schedule):
        return apply

    def run(w, g, state, lr_scale: float = 1.0) -> None:
        apply(w, g, state, lr_scale, step_scale=lr_factor(schedule, step(), total))

    return run


def make(name: str, lr: float | None, eps: float = 1e-8, history: int = 10,
         momentum: float = 0.9, nesterov: bool = False):
    """The optimizer called ``name`` ("sgd", "adagrad", "momentum" or "lbfgs")."""
    if name == "lbfgs":
        return LBFGSState(history)
    if lr is None:
        raise ValueError(f"optimizer {name} needs a learning rate")
    if name == "sgd":
        return SGD(lr)
    if name == "adagrad":
        return Adagrad(lr, eps)
    if name == "momentum":
        return Momentum(lr, momentum, nesterov)
    raise ConfigError(f"unknown optimizer {name!r}; choose sgd, adagrad, momentum or lbfgs")


# -- L-BFGS, written against named vectors so the same code drives local arrays or shards ----
class ArraySpace:
    """Named float32 vectors in this process: the reference for :class:`LBFGS`.

    ``evaluate(x, g)`` must return the objective at vector ``x`` and leave its gradient in
    vector ``g``; here it is a callable on arrays. The distributed space of Sandblaster has
    the same methods but each one is a small command to the parameter-server shards.
    """

    def __init__(self, objective, n: int, names):
        self.objective = objective
        self.v = {name: np.zeros(n, dtype=np.float32) for name in names}
        self.evaluations = 0

    def copy(self, dst, src):
        self.v[dst][...] = self.v[src]

    def axpy(self, dst, alpha, src):
        self.v[dst] += np.float32(alpha) * self.v[src]

    def scale(self, dst, alpha):
        self.v[dst] *= np.float32(alpha)

    def dot(self, a, b) -> float:
        return float(np.dot(self.v[a].astype(np.float64), self.v[b].astype(np.float64)))

    def evaluate(self, x, g) -> float:
        self.evaluations += 1
        return float(self.objective(self.v[x], self.v[g]))


class LBFGS:
    """L-BFGS with the two-loop recursion and a strong-Wolfe line search (Nocedal & Wright,
    algorithms 7.4, 3.5 and 3.6), expressed as operations on named vectors of a *space*.

    The optimizer itself holds only scalars: the history's rho = 1/(s.y), the order of its m
    slots (``s0..s{m-1}``, ``y0..``), the current objective. Every vector (parameters ``x``,
    gradient ``g``, direction ``d``, trial point ``xt``/``gt``, the two-loop's ``q`` and the
    history) lives in the space, so in Sandblaster it never leaves the server shards.

    Parameters
    ----------
    space : object with copy, axpy, scale, dot and evaluate (see :class:`ArraySpace`).
    m : history pairs kept.
    c1, c2 : the Wolfe constants (sufficient decrease, curvature).
    max_evals : objective evaluations allowed per line search.
    """

    VECTORS = ("x", "g", "d", "q", "xt", "gt")

    def __init__(self, space, m: int = 10, c1: float = 1e-4, c2: float = 0.9,
                 max_evals: int = 20):
        if m < 1:
            raise ConfigError(f"L-BFGS history must hold at least one pair, got {m}")
        self.space, self.m, self.c1, self.c2, self.max_evals = space, m, c1, c2, max_evals
        self.order: list[int] = []          # history slots, oldest first
        self.rho: dict[int, float] = {}
        self.f: float | None = None
        self.iterations = 0

    @staticmethod
    def vector_names(m: int) -> list[str]:
        return list(LBFGS.VECTORS) + [f"s{i}" for i in range(m)] + [f"y{i}" for i in range(m)]

    def state(self) -> dict:
        """The scalar state (for checkpoints; the vectors are saved by whoever holds them)."""
        return {"order": list(self.order), "rho": {str(k): v for k, v in self.rho.items()},
                "f": self.f, "iterations": self.iterations, "m": self.m}

    def load_state(self, st: dict) -> None:
        if st.get("m") != self.m:
            raise ConfigError(f"checkpoint's L-BFGS history holds {st.get('m')} pairs, this run "
                              f"asks for --lbfgs-history {self.m}")
        self.order = [int(i) for i in st["order"]]
        self.rho = {int(k): float(v) for k, v in st["rho"].items()}
        self.f, self.iterations = st["f"], int(st["iterations"])

    def start(self) -> float:
        """Objective and gradient at the current x (once, before the first step)."""
        self.f = self.space.evaluate("x", "g")
        return self.f

    def _direction(self) -> float:
        """d = -H g by the two-loop recursion; returns g.d."""
        sp = self.space
        sp.copy("q", "g")
        alpha = {}
        for i in reversed(self.order):
            alpha[i] = self.rho[i] * sp.dot(f"s{i}", "q")
            sp.axpy("q", -alpha[i], f"y{i}")
        if self.order:
            j = self.order[-1]
            sp.scale("q", 1.0 / (self.rho[j] * sp.dot(f"y{j}", f"y{j}")))  # gamma = s.y / y.y
        else:  # first step: steepest descent of unit length
            sp.scale("q", 1.0 / max(math.sqrt(sp.dot("g", "g")), 1e-12))
        for i in self.order:
            beta = self.rho[i] * sp.dot(f"y{i}", "q")
            sp.axpy("q", alpha[i] - beta, f"s{i}")
        sp.copy("d", "q")
        sp.scale("d", -1.0)
        return sp.dot("g", "d")

    def _phi(self, t: float) -> tuple[float, float]:
        sp = self.space
        sp.copy("xt", "x")
        sp.axpy("xt", t, "d")
        ft = sp.evaluate("xt", "gt")
        return ft, sp.dot("gt", "d")

    def _line_search(self, f0: float, d0: float) -> tuple[float, float] | None:
        """A step t meeting the strong Wolfe conditions, with xt/gt evaluated at it."""
        evals = 0
        t_prev, f_prev, dp_prev = 0.0, f0, d0
        t = 1.0
        while evals < self.max_evals:
            ft, dt = self._phi(t)
            evals += 1
            if ft > f0 + self.c1 * t * d0 or (evals > 1 and ft >= f_prev):
                return self._zoom(f0, d0, t_prev, f_prev, dp_prev, t, ft, evals)
            if abs(dt) <= -self.c2 * d0:
                return t, ft
            if dt >= 0:
                return self._zoom(f0, d0, t, ft, dt, t_prev, f_prev, evals)
            t_prev, f_prev, dp_prev = t, ft, dt
            t *= 2.0
        return None

    def _zoom(self, f0, d0, lo, f_lo, d_lo, hi, f_hi, evals):
        while evals < self.max_evals:
            # minimum of the quadratic through (lo, f_lo, d_lo) and (hi, f_hi), kept inside
            # the middle 80% of the bracket
            width = hi - lo
            denom = 2.0 * (f_hi - f_lo - d_lo * width)
            t = lo - d_lo * width * width / denom if denom > 0 else lo + 0.5 * width
            a, b = sorted((lo + 0.1 * width, hi - 0.1 * width))
            t = min(max(t, a), b)
            ft, dt = self._phi(t)
            evals += 1
            if ft > f0 + self.c1 * t * d0 or ft >= f_lo:
                hi, f_hi = t, ft
            else:
                if abs(dt) <= -self.c2 * d0:
                    return t, ft
                if dt * (hi - lo) >= 0:
                    hi, f_hi = lo, f_lo
                lo, f_lo, d_lo = t, ft, dt
        if lo > 0 and f_lo < f0:  # sufficient decrease at least: take it
            ft, _ = self._phi(lo)
            return lo, ft
        return None

    def step(self) -> dict:
        """One iteration: direction, line search, history update. Returns its figures."""
        sp = self.space
        if self.f is None:
            self.start()
        gd = self._direction()
        if gd >= 0:  # not a descent direction (history gone stale): restart from -g
            self.order.clear()
            self.rho.clear()
            gd = self._direction()
        f0 = self.f
        if f0 is None:
            raise RuntimeError("L-BFGS has no objective value at its point (start() failed)")
        found = self._line_search(f0, gd)
        if found is None:
            self.order.clear()
            self.rho.clear()
            return {"f": self.f, "t": 0.0, "accepted": False}
        t, ft = found
        slot = self.order.pop(0) if len(self.order) == self.m else \
            next(i for i in range(self.m) if i not in self.order)
        sp.copy(f"s{slot}", "d")
        sp.scale(f"s{slot}", t)
        sp.copy(f"y{slot}", "gt")
        sp.axpy(f"y{slot}", -1.0, "g")
        sy = sp.dot(f"s{slot}", f"y{slot}")
        if sy > 1e-10:  # keep the pair only if it keeps H positive definite
            self.order.append(slot)
            self.rho[slot] = 1.0 / sy
        sp.copy("x", "xt")
        sp.copy("g", "gt")
        self.f = ft
        self.iterations += 1
        return {"f": ft, "t": t, "accepted": True}
