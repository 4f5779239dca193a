"""A portion's gradient per example, summed as sandblaster's replicas sum it (``gradient_sum``
in chunks of ``PORTION_CHUNK`` rows; NumPy's pass without the compiled engine):
:class:`hpcps.strategies.sandblaster.cost.SandblasterCost`'s ``portion_s_per_example``.
Loaded only when the scaling tool measures."""
from __future__ import annotations

import time

import numpy as np

from hpcps.engine import hogwild
from hpcps.strategies.cost import Bench
from hpcps.strategies.sandblaster.common import PORTION_CHUNK


def measure(bench: Bench) -> dict:
    params, x, y, portion = bench.params, bench.x, bench.y, bench.portion
    grad = np.empty_like(params)
    rows = np.arange(portion, dtype=np.int64)
    if hogwild.HAVE_EXTENSION:
        chunks = hogwild.HogwildEngine(bench.layers, "relu", threads=1, batch=PORTION_CHUNK)
        chunks.gradient_sum(params, x, y, rows[:PORTION_CHUNK], grad)  # warm
        c = time.process_time()
        chunks.gradient_sum(params, x, y, rows, grad)
    else:
        c = time.process_time()
        bench.model.loss_and_grad(params, x[:portion], y[:portion], grad)
    return {"portion_s_per_example": (time.process_time() - c) / portion}
