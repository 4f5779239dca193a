"""A scaling model: examples/s and speed-up of each strategy on 1 to 128+ nodes of a network.

    python -m hpcps.scaling --layers 784,2560,2560,2560,2560,8192 --network 10gbe
    python -m hpcps.scaling --layers 784,512,512,10 --alpha 30e-6 --beta 8e-9 --png curves.png
    python -m hpcps.scaling --validate-cluster cluster.json     # against bench/cluster's runs

Each strategy declares its own cost model (``Strategy.cost``, :mod:`hpcps.strategies.cost`:
the alpha-beta model, ``alpha + m * beta`` seconds per message of m bytes, full-duplex links,
no overlap of computing and communicating); this package knows no strategy. Every registered
strategy is predicted, a plug-in's too; one that declares no cost model is listed as such.
The models' CPU inputs are measured here, on this CPU: a mini-batch's pass ``t_c`` and the
optimizer's update per parameter ``t_u`` as a replica runs them, the seconds per float an
allreduce sums, and what each model's own ``calibrate`` hook measures on its strategy's code.
Bytes per step are the figures the strategies report in their summaries
(``--validate-cluster`` prints both). Model parallelism (P > 1) is not modelled.

By job: :mod:`.model` (predictions over the registry's strategies), :mod:`.calibrate` (the
measurements), :mod:`.validate` (the checks: each model against the published figures it
declares, such as Strom 2015's Table 2, and against the emulated cluster's measured runs,
:file:`bench/cluster/bench_cluster.py`), :mod:`.cli` (the parser, the tables, the plot).
"""
from __future__ import annotations

import os

# one BLAS thread, as hpcps.train runs each rank (set before NumPy is first imported)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from hpcps.strategies.cost import CostModel, Workload, ring  # noqa: E402
from hpcps.tools.scaling.calibrate import (  # noqa: E402
    WARM_STEPS, in_run_workload, measure_compute, measure_together, measured_workload,
    sample_inputs)
from hpcps.tools.scaling.cli import build_parser, main, plot  # noqa: E402
from hpcps.tools.scaling.model import (  # noqa: E402
    NETWORKS, NO_COST_MODEL, bytes_per_step, computing_beside, cost_model, curve, models,
    modelled, predict)
from hpcps.tools.scaling.validate import (  # noqa: E402
    measured_allreduce, pair_link, published_checks, validate_cluster)

__all__ = ["CostModel", "Workload", "ring", "WARM_STEPS", "in_run_workload", "measure_compute",
           "measure_together", "measured_workload", "sample_inputs", "build_parser", "main",
           "plot", "NETWORKS", "NO_COST_MODEL", "bytes_per_step", "computing_beside",
           "cost_model", "curve", "models", "modelled", "predict", "measured_allreduce",
           "pair_link", "published_checks", "validate_cluster"]
