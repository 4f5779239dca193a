"""The model's checks: each cost model against the published figures it declares
(``CostModel.published``), and every model against the emulated cluster's measured runs
(:file:`bench/cluster/bench_cluster.py`)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np

from hpcps.tools.scaling import calibrate
from hpcps.tools.scaling.model import NO_COST_MODEL, bytes_per_step, models, predict


def published_checks() -> dict[str, dict]:
    """Every registered cost model's check against published figures, by strategy."""
    out = {}
    for name, m in models().items():
        check = m.published() if m is not None else None
        if check is not None:
            out[name] = check
    return out


def pair_link(net: dict, computing: float) -> tuple[float, float]:
    """alpha and beta of one pair's link (a replica and a shard) on a bench's network
    ``net`` while ``computing`` other ranks compute on the cores the pair shares: TCP's
    copies and the receiver's turn to run wait for the cores. Interpolated between the
    bench's ping-pongs, each measured with its ranks less the pair computing (``pingpong``:
    none; ``pingpong_at``: one per rank count of the runs)."""
    points = sorted([(0.0, net["pingpong"]["alpha_s"], net["pingpong"]["beta_s_per_byte"])]
                    + [(int(k) - 2.0, pp["alpha_s"], pp["beta_s_per_byte"])
                       for k, pp in net.get("pingpong_at", {}).items()])
    at, alphas, betas = zip(*points)
    return float(np.interp(computing, at, alphas)), float(np.interp(computing, at, betas))


def measured_allreduce(record: dict):
    """``allreduce(nbytes, R)`` from a bench's measured Iallreduce times (``allreduce`` in a
    ping-pong record: seconds per call at several sizes, with the record's ranks): straight
    lines between the measured sizes, in proportion to the size beyond the largest."""
    sizes = np.asarray(record["bytes"], float)
    secs = np.asarray(record["seconds"], float)

    def allreduce(nbytes: float, R: int) -> float:
        if nbytes > sizes[-1]:
            return float(secs[-1] * nbytes / sizes[-1])
        return float(np.interp(nbytes, sizes, secs))
    return allreduce


def validate_cluster(path: str, repeats: int = 15, background: float | None = None,
                     data: str | None = None) -> list:
    """Every cost model against bench/cluster's measured throughput: for each run, the
    examples/s predicted with that network's measured alpha and beta (measured with as many
    ranks running as the run had, ``pingpong_at``, where the bench recorded it: on shared
    cores a message waits for its receiver to be scheduled; for a ring-like model
    (``CostModel.ring_like``: every rank sends at once) those of a ring exchange, ``ring``,
    where recorded, and MPI's own allreduce timed at several sizes, ``allreduce``, where
    recorded with the run's ranks (:func:`measured_allreduce`; a model whose exchange is not
    an allreduce ignores it); for the others one pair's link with as many other ranks
    computing beside it as the model says (:func:`pair_link`,
    ``CostModel.computing_beside``)), this machine's cores shared by the computing ranks and
    by ``background`` runnable threads of other jobs (given: for every run; default: those
    the bench sampled just before each run, ``background`` in its record; for a bench
    that did not, the load average it recorded, else the current one, less the measuring
    process), each pass slower by what
    :func:`~hpcps.tools.scaling.calibrate.measure_together` measures with every core
    computing (with as many processes as the run's computing ranks, where the bench's
    calibration says so: ``co_run_processes``), and what the model takes from the run's own
    record (``CostModel.from_run``: a thresholded message's size from its bytes per step);
    against the run's steady examples/s where recorded (the model has no start or end). The
    compute is what the bench measured just before each run (``compute`` in its record: a
    shared machine's speed drifts over minutes); for a bench that did not, it is measured
    here, on rows of ``data`` (default: the bench's dataset, where that file is here), whose
    zeros the first layer skips as it did in the runs. Where a run recorded its replicas' own
    pass time, each row also has ``predicted_in_run``: the model with that pass
    (:func:`~hpcps.tools.scaling.calibrate.in_run_workload`), which leaves out what
    co-running and the machine's drift during the run did to the CPU work and checks the
    rest: the pass's CPU time (``pass_cpu_s`` in the summary) for every run, the cores'
    sharing left to the model; for a bench that recorded only its wall time (``pass_s``),
    runs with no more ranks than cores. A run of a strategy without a cost model here gets
    a row with ``no_cost_model`` and no prediction."""
    with open(path) as fh:
        bench = json.load(fh)
    layers = [int(v) for v in str(bench["layers"]).split(",")]
    batch = int(bench.get("batch", 32))  # bench_cluster's BATCH (recorded since it was 32)
    if data is None and bench.get("data") and os.path.exists(bench["data"]):
        data = bench["data"]
    n = sum((layers[i] + 1) * layers[i + 1] for i in range(len(layers) - 1))
    cores = bench.get("machine", {}).get("nproc") or os.cpu_count()
    given = background  # the caller's figure holds for every run
    if background is None:
        load = bench.get("machine", {}).get("load_average")
        background = max(0.0, (os.getloadavg()[0] if load is None else load) - 1)
    runs = [r for net in bench["networks"] for r in net.get("throughput", [])
            if "error" not in r]
    here = None  # measured now, for runs the bench did not calibrate
    if not all("compute" in r for r in runs):
        here = calibrate.measure_compute(layers, batch, repeats, data=data)
        here["co_run"] = calibrate.measure_together(layers, batch, min(cores, os.cpu_count() or 1),
                                          data=data)["slowdown"]
    rows = []
    known = models()
    for net in bench["networks"]:
        for run in net.get("throughput", []):
            if "error" in run:
                continue
            # the steady rate (without the run's start and end), where the bench took it
            measured = run.get("steady_examples_per_s") or run["examples_per_s"]
            model = known.get(run["strategy"])
            if model is None:
                rows.append({"network": net["rate"], "strategy": run["strategy"],
                             "ranks": run["ranks"], "measured": measured,
                             "no_cost_model": NO_COST_MODEL if run["strategy"] in known
                             else "not a registered strategy"})
                continue
            c = run.get("compute", here)  # the bench's calibration just before the run
            # other jobs' threads just before the run, where the bench sampled them
            others = background if given is not None else run.get("background", background)
            shared = calibrate.measured_workload(c, n, batch, cores=cores,
                                                 background=others,
                                                 co_run=c.get("co_run", 1.0))
            w = replace(shared, servers=max(1, run.get("servers", 1)))
            pp = net.get("pingpong_at", {}).get(str(run["ranks"]), net["pingpong"])
            computing = None  # not ring-like: ranks computing beside the pair's link
            allreduce = None  # MPI's allreduce as measured with the run's ranks, if it was
            if "allreduce" in pp and pp.get("ranks", 2) == run["ranks"]:
                allreduce = measured_allreduce(pp["allreduce"])
            if model.ring_like:
                if "ring" in pp:
                    pp = pp["ring"]  # every rank sends at once, as these strategies' steps do
            else:
                # one pair's link, with as many other ranks computing as the run had
                computing = model.computing_beside(w, run["ranks"],
                                                   lambda c: pair_link(net, c))
                pp = dict(zip(("alpha_s", "beta_s_per_byte"), pair_link(net, computing)))
            if run.get("steps_trained") and run.get("replicas"):
                # costs paid once per run (averaging's last average) over the run's steps
                w = replace(w, run_steps=max(1, round(run["steps_trained"] / run["replicas"])))
            w = model.from_run(w, run)
            link = (run["ranks"], pp["alpha_s"], pp["beta_s_per_byte"])
            pred = predict(model, w, *link, allreduce=allreduce)
            row = {"network": net["rate"], "strategy": run["strategy"],
                   "ranks": run["ranks"], "measured": measured,
                   "predicted": round(pred, 1), "alpha_s": pp["alpha_s"],
                   "relative_difference": round(pred / measured - 1, 3),
                   "background": round(others, 1),
                   "co_run": round(w.co_run, 3),
                   "compute_s": w.compute_s,
                   "bytes_measured": run["bytes_per_step"],
                   "bytes_model": round(bytes_per_step(model, w, run["replicas"]))}
            if computing is not None:
                row["computing_beside"] = computing
            # the replicas' pass as the run itself timed it: its CPU time where recorded
            # (the cores' sharing is then the model's), else its wall time where no rank
            # was time-sliced (with more ranks than cores the wall time of a pass of a few
            # ms holds only part of the sharing the rest of the step takes)
            cpu_time = bool(run.get("pass_cpu_s"))
            own = None
            if cpu_time:
                own = calibrate.in_run_workload(w, run["pass_cpu_s"], cpu_time=True)
            elif run.get("pass_s") and run["ranks"] <= cores:
                own = calibrate.in_run_workload(w, run["pass_s"])
            if own is not None:
                pred_run = predict(model, own, *link, allreduce=allreduce)
                row.update(pass_s_in_run=own.compute_s, pass_in_run_is_cpu_time=cpu_time,
                           predicted_in_run=round(pred_run, 1),
                           relative_difference_in_run=round(pred_run / measured - 1, 3))
            rows.append(row)
    return rows


