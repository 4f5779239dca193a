"""Steps timed as a deadreckon replica takes them, on its own code (:class:`Reckoner`, the
codec's :class:`~hpcps.compress.codec.Compressor`): the inputs of
:class:`hpcps.strategies.deadreckon.cost.DeadreckonCost` the common measurement lacks. Its
vectors evict the weights from the caches (a pass timed alone ran 1.1-1.3x faster), so the
pass is timed here again, between the step's other work. Loaded only when the scaling tool
measures (the replica module loads MPI)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from hpcps.compress import codec as compress
from hpcps.strategies.cost import Bench, rng_normal
from hpcps.strategies.deadreckon.replica import Reckoner

RECKON_DENSITY = 0.002  # deadreckon's messages: about 2 words per 1,000 parameters
PEER_MESSAGES = 8  # distinct peer messages cycled through (other words each step)


def measure(bench: Bench) -> dict:
    """In CPU seconds, medians of ``repeats`` after ``warm_steps``: the pass (``step`` on the
    next mini-batch; ``reckon_compute_s``), the step scaled and thresholded into the
    residual and packed (``reckon_s_per_param``), then its own words and one peer's message
    (decoded) applied to the replica's copy (``receive_s_per_word``). Tau sends about
    ``RECKON_DENSITY`` of the elements, as the adaptive tau does."""
    step, x, y, batch = bench.step, bench.x, bench.y, bench.batch
    n = bench.model.n_params
    reckoner = Reckoner(bench.params.copy(), 1e-7)
    peers = []
    for k in range(PEER_MESSAGES):
        v = rng_normal(n, 10 + k)
        c = compress.Compressor(n, float(np.quantile(np.abs(v), 1.0 - RECKON_DENSITY)))
        msg, words = c.compress(v)
        peers.append((msg.copy(), len(words)))
    grad = np.empty(n, np.float32)
    comp, scale = None, np.float32(-0.01)
    passes, work, per_word = [], [], []
    for i in range(bench.warm_steps + bench.repeats):
        j = i % (len(x) // batch)
        c = time.process_time()
        step(reckoner.params, x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch],
             grad=grad)
        passes.append(time.process_time() - c)
        if comp is None:
            tau = float(np.quantile(np.abs(grad * scale), 1.0 - RECKON_DENSITY))
            comp = compress.Compressor(n, max(tau, 1e-12))
        comp.residual[:] = 0.0  # each step sends about RECKON_DENSITY of the elements
        c = time.process_time()
        grad *= scale
        _, words = comp.compress(grad)
        work.append(time.process_time() - c)
        msg, k = peers[i % PEER_MESSAGES]
        c = time.process_time()
        reckoner.apply(words, 1)
        reckoner.apply(compress.decode(msg, n), 1)
        per_word.append((time.process_time() - c) / max(1, len(words) + k))
    warm = bench.warm_steps
    return {"reckon_compute_s": statistics.median(passes[warm:]),
            "reckon_s_per_param": statistics.median(work[warm:]) / n,
            "receive_s_per_word": statistics.median(per_word[warm:])}
