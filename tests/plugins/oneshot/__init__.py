"""A strategy kept outside hpcps, to show that a plug-in needs no edit of hpcps itself.

One-shot averaging (Zinkevich et al. 2010, "Parallelized stochastic gradient descent"): every
replica trains alone on its own shard of the data, and at the end one allreduce averages the
replicas' parameters. Registered with ``HPCPS_STRATEGIES=oneshot`` and this folder on
``PYTHONPATH`` (tests/test_plugin_strategy.py). The declaration imports no MPI; the role
module loads when a rank runs it, and its cost model (``cost.py``) when the scaling tool asks.
"""
from hpcps.options import LOOP_OPTIONS, check_loop_options
from hpcps.strategies.registry import Strategy

STRATEGY = Strategy(
    name="oneshot",
    help="replicas train alone on their own data and average their parameters once, at the "
         "end (one-shot averaging); no servers",
    roles={"replica": "oneshot.replica:run"},
    options=LOOP_OPTIONS,
    validate=check_loop_options,
    defaults={"lr": 0.05, "batch_size": 32, "prefetch": 2},
    optimizers=("sgd", "momentum", "adagrad"),
    describe=lambda cfg, n_train: f"{cfg.optimizer} lr={cfg.lr}, batch {cfg.batch_size}/"
                                  "replica, parameters averaged once at the end",
    summary_lines=lambda f: [f"replicas' RMS distance to their average at the end: "
                             f"{f['final_spread']:.3g}"],
    cost="oneshot.cost:COST",  # its cost model for python -m hpcps.scaling (no MPI)
)
