"""Hogwild training of a :class:`hpcps.convnet.ConvNet` inside one rank (``--threads T``).

The same contract as :class:`hpcps.hogwild.HogwildEngine` (``train``, ``gradient_sum``,
``loss_and_grad``), so the strategies call either without knowing which model they train:
:func:`engine_for` picks the engine for a model. T Python threads each train on their own
mini-batches and add their updates into the shared parameter vector without a lock (Project
Adam, section 3.2; the races this allows, and why training tolerates them, are described in
:mod:`hpcps.hogwild`). A thread's forward and backward pass is the model's NumPy code
(im2col + GEMM through NumPy's BLAS, which releases the GIL during each GEMM and each large
elementwise operation, so the threads overlap there and serialize in the Python between them).
"""
from __future__ import annotations

import operator
import threading

import numpy as np

from hpcps.blocks import block_range
from hpcps.convnet import ConvNet


def engine_for(model, activation: str, threads: int, batch: int):
    """The Hogwild engine for ``model``: :class:`ConvHogwild` for a :class:`ConvNet`, the
    compiled :class:`hpcps.hogwild.HogwildEngine` for an MLP."""
    if isinstance(model, ConvNet):
        return ConvHogwild(model, threads=threads, batch=batch)
    from hpcps.hogwild import HogwildEngine
    return HogwildEngine(model.sizes, activation, threads=threads, batch=batch)


def _run_threads(fn, T: int) -> None:
    """Run ``fn(t)`` for t in 0..T-1, on T-1 extra threads and this one; re-raise the first
    failure after every thread has ended (a thread never outlives the call)."""
    errors: list[BaseException] = []

    def guarded(t):
        try:
            fn(t)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    workers = [threading.Thread(target=guarded, args=(t,), name=f"hpcps-conv-hogwild-{t}")
               for t in range(1, T)]
    for w in workers:
        w.start()
    guarded(0)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


class ConvHogwild:
    """T threads training one :class:`ConvNet`'s shared flat parameters, lock-free.

    Parameters
    ----------
    model : the ConvNet.
    threads : T >= 1.
    batch : examples per mini-batch of each thread.
    """

    compiled = False

    def __init__(self, model: ConvNet, threads: int = 1, batch: int = 128):
        for name, v in (("threads", threads), ("batch", batch)):
            if operator.index(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.model = model
        self.threads = int(threads)
        self.batch = int(batch)
        self.n_params = model.n_params
        # one gradient buffer per thread, allocated once
        self._grads = [np.empty(model.n_params, dtype=np.float32) for _ in range(self.threads)]

    def _check(self, params, x, y, writable=True):
        if not isinstance(params, np.ndarray) or params.dtype != np.float32 \
                or params.shape != (self.n_params,):
            raise ValueError(f"params must be a float32 vector of {self.n_params} elements")
        if writable and not params.flags.writeable:
            raise ValueError("params is read-only")
        if x.ndim != 2 or x.shape[1] != self.model.n_features or len(y) != len(x):
            raise ValueError(f"x must be (N, {self.model.n_features}) with one label per row")

    def train(self, params, x, y, order, lr, steps_per_thread=None, delta=None):
        """Train in place, T threads, each on its part of ``order`` (as
        :meth:`hpcps.hogwild.HogwildEngine.train`: with ``steps_per_thread = S`` thread t
        takes ``order[t*S*batch:(t+1)*S*batch]``, else ``order`` is split into T parts).
        Each step applies ``params -= lr * grad``; ``delta`` (when given) receives the sum of
        the updates applied. Returns (loss_sum, examples)."""
        self._check(params, x, y)
        if delta is not None and (delta.shape != params.shape or
                                  np.may_share_memory(params, delta)):
            raise ValueError("delta must be a separate vector like params")
        lr = float(lr)
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"lr must be finite and >= 0, got {lr}")
        T, B = self.threads, self.batch
        if steps_per_thread is None:
            parts = [order[slice(*block_range(len(order), T, t))] for t in range(T)]
        else:
            S = operator.index(steps_per_thread)
            if S < 1 or len(order) < T * S * B:
                raise ValueError(f"order has {len(order)} indices; {T} threads x {S} steps "
                                 f"x batch {B} need {T * S * B}")
            parts = [order[t * S * B:(t + 1) * S * B] for t in range(T)]
        losses = [0.0] * T
        neg_lr = np.float32(-lr)

        def work(t):
            g = self._grads[t]
            part = parts[t]
            for lo in range(0, len(part), B):
                idx = part[lo:lo + B]
                loss, _ = self.model.loss_and_grad(params, x[idx], y[idx], g)
                losses[t] += loss * len(idx)
                g *= neg_lr
                # lock-free: another thread may add to the same weights at the same time
                np.add(params, g, out=params)
                if delta is not None:
                    np.add(delta, g, out=delta)

        _run_threads(work, T)
        return float(sum(losses)), int(sum(len(p) for p in parts))

    def gradient_sum(self, params, x, y, rows, grad=None):
        """(loss_sum, grad_sum, examples) over ``rows``: T threads each sum their even share
        in mini-batches into their own buffer; the sums are added in thread order, so the
        result is deterministic for a given T and batch."""
        self._check(params, x, y, writable=False)
        if grad is None:
            grad = np.empty(self.n_params, dtype=np.float32)
        T, B = self.threads, self.batch
        sums = [np.zeros(self.n_params, dtype=np.float32) for _ in range(T)]
        losses = [0.0] * T

        def work(t):
            lo_t, hi_t = block_range(len(rows), T, t)
            g = self._grads[t]
            for lo in range(lo_t, hi_t, B):
                idx = rows[lo:min(lo + B, hi_t)]
                loss, _ = self.model.loss_and_grad(params, x[idx], y[idx], g)
                losses[t] += loss * len(idx)
                g *= np.float32(len(idx))
                sums[t] += g

        _run_threads(work, T)
        grad[...] = 0.0
        for s in sums:
            grad += s
        return float(sum(losses)), grad, int(len(rows))

    def loss_and_grad(self, params, x, y, grad=None):
        """Mean loss over the rows of x and its gradient, one thread."""
        self._check(params, x, y, writable=False)
        return self.model.loss_and_grad(params, x, y, grad)
