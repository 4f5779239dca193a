"""What an average's own work on its vectors costs per parameter, timed on the replica's code
(``pack``, ``to_mean``, ``unpack``): :class:`hpcps.strategies.averaging.cost.AveragingCost`'s
``average_s_per_param``. Loaded only when the scaling tool measures (the replica module
loads MPI)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from hpcps.strategies.averaging.replica import pack, to_mean, unpack
from hpcps.strategies.cost import Bench


def measure(bench: Bench) -> dict:
    n = bench.model.n_params
    mine = bench.params.copy()
    own_state = {k: v.copy() for k, v in bench.state.items()}
    keys = list(own_state)  # Adagrad's one vector, as averaging's default averages it
    buf = np.empty((1 + len(keys)) * n + 1, np.float32)
    average = []
    for _ in range(bench.repeats):
        c = time.process_time()
        pack(buf, mine, own_state, keys)
        to_mean(buf, mine, 2)
        unpack(buf, mine, own_state, keys)
        average.append(time.process_time() - c)
    return {"average_s_per_param": statistics.median(average) / n}
