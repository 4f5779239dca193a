"""Memory per rank against P (partitions) and S (server shards); print one JSON object.

Trains a large MLP (default 64,10000,10000,10000,10 on the digits dataset: 200.7 million
parameters, 803 MB of float32 weights) with Downpour for a few steps at several layouts of
one replica, ``P`` partitions and ``S`` shards, and reads every rank's peak resident memory
from the run's summary (``peak_rss_mib_by_rank``, :mod:`hpcps.runtime.memory`). A tiny model on the
same layout gives the fixed cost of a rank (Python, NumPy, MPI, the dataset). Then, per role,

    peak(rank) = fixed + bytes_per_param * parameters held by the rank

is fitted by least squares over the layouts and the fitted bytes per parameter are set beside
the formula's (:func:`hpcps.runtime.memory.bytes_per_param`). Shard 0 and the chief (replica 0,
partition 0) also receive the whole model at the end (shard 0 gathers it for the final
checkpoint, the chief evaluates it and writes the checkpoint): they are reported, not fitted.

The largest model that fits is estimated from the fit: with ``--memory-gib`` of RAM (default
24) and the same layout, the largest parameter count whose ranks' peaks sum to it.

    python bench/bench_memory.py               # S = 1, 2, 4 at P = 1; P = 1, 2, 4 at S = 4
    python bench/bench_memory.py --layouts 4x4,2x4 --steps 2

Runs are short (``--steps``) but big: the machine needs free RAM (about 14 GiB at P = 4,
S = 4 and at P = 1, S = 1 with the default model). Progress goes to stderr; only the JSON
goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_train import find_mpiexec, log, machine, summary_of, train  # noqa: E402
from machine import cpu_features, save  # noqa: E402

from hpcps.runtime import memory  # noqa: E402
from hpcps.model.mlp import PartitionedMLP  # noqa: E402
from hpcps.mpi.topology import shard_range  # noqa: E402

MIB = memory.MIB


def held(layers: list[int], P: int, S: int) -> dict:
    """Parameters each rank holds, in world order per role: every partition's local size;
    every shard's chunk (each partition's slice split among its S/P shards, as Downpour's
    ``shards_of_partition`` does)."""
    sizes = PartitionedMLP(layers, "relu", P, 0).part_sizes
    per = S // P
    chunks = []
    for size in sizes:
        chunks += [hi - lo for lo, hi in (shard_range(size, per, j) for j in range(per))]
    return {"replica": list(sizes), "server": chunks}


def run_layout(mpiexec: str, args, layers: list[int], P: int, S: int, tmp: Path) -> dict:
    """One run; returns each rank's role, peak MiB and parameters held."""
    workdir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"p{P}s{S}-"))
    ranks = S + P
    log(f"P = {P}, S = {S}: {ranks} ranks, model {','.join(map(str, layers))}")
    records = train(mpiexec, ranks, [
        "--strategy", "downpour", "--servers", str(S), "--partitions", str(P),
        "--layers", ",".join(map(str, layers)), "--data", str(args.data),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "60",
        "--timeout", str(args.timeout)], workdir, args.timeout)
    summ = summary_of(records)
    for f in workdir.rglob("checkpoint*.h5"):
        f.unlink()  # a few GB each: do not keep them
    counts = held(layers, P, S)
    seen = {"replica": 0, "server": 0}
    ranks_out = []
    for role, mib in summ["peak_rss_mib_by_rank"]:
        i = seen[role]
        seen[role] += 1
        # world order (hpcps.mpi.topology): replica 0's partitions, then the shards in order
        ranks_out.append({"role": role, "index": i, "peak_mib": mib,
                          "params": counts[role][i],
                          "holds_whole_model_at_end": i == 0})
    return {"P": P, "S": S, "ranks": ranks, "steps": args.steps,
            "examples_per_s": summ["examples_per_s"], "per_rank": ranks_out}


def fit(rows: list[dict], role: str, fixed_mib: float) -> dict:
    """Least-squares bytes per parameter over the ranks of ``role`` that do not hold the
    whole model at the end, with the fixed cost measured on the tiny model."""
    x = np.array([r["params"] for r in rows], float)
    y = np.array([(r["peak_mib"] - fixed_mib) * MIB for r in rows], float)
    slope = float(x @ y / (x @ x))
    pred = fixed_mib + slope * x / MIB
    err = np.abs(pred - np.array([r["peak_mib"] for r in rows])) / np.array(
        [r["peak_mib"] for r in rows])
    return {"bytes_per_param_fitted": round(slope, 2), "fixed_mib": fixed_mib,
            "points": len(rows), "max_relative_error": round(float(err.max()), 3)}


def fit_all(runs: list[dict], fixed: dict) -> dict:
    """:func:`fit` per role over every run's ranks that do not hold the whole model at the end."""
    fits = {}
    for role in ("server", "replica"):
        rows = [r for run in runs for r in run["per_rank"]
                if r["role"] == role and not r["holds_whole_model_at_end"]]
        if rows:
            fits[role] = fit(rows, role, fixed[role])
    return fits


def largest_models(out: dict, layouts, memory_gib: float) -> dict:
    """The largest parameter count that fits ``memory_gib`` for each layout: every rank's
    fixed cost, the fitted bytes per parameter of a shard and a partition, and what shard 0
    and the chief add at the end (measured: their peak over their role's others', per
    parameter of the model)."""
    fits, fixed = out["fit"], out["fixed_mib"]
    if not {"server", "replica"} <= set(fits):
        return {}
    extra = []
    for run in out["runs"]:
        n = sum(r["params"] for r in run["per_rank"] if r["role"] == "replica")
        for role in ("server", "replica"):
            ranks = [r for r in run["per_rank"] if r["role"] == role]
            others = [r["peak_mib"] for r in ranks if not r["holds_whole_model_at_end"]]
            first = next(r for r in ranks if r["holds_whole_model_at_end"])
            if others:
                extra.append((role, (first["peak_mib"] - max(others)) * MIB / n))
    per_role = {role: statistics.median([e for r, e in extra if r == role])
                for role in ("server", "replica") if any(r == role for r, _ in extra)}
    budget = memory_gib * 1024 * MIB
    best = {}
    for P, S in layouts:
        fixed_all = (P * fixed["replica"] + S * fixed["server"]) * MIB
        per_param = fits["replica"]["bytes_per_param_fitted"] + \
            fits["server"]["bytes_per_param_fitted"] + sum(per_role.values())
        best[f"{P}x{S}"] = int((budget - fixed_all) / per_param)
    return {"end_of_run_extra_bytes_per_param": {k: round(v, 2) for k, v in per_role.items()},
            "largest_model_params": best, "memory_gib": memory_gib}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="64,10000,10000,10000,10")
    p.add_argument("--data", default="/work/scratch/data/digits.h5")
    p.add_argument("--layouts", default="1x1,1x2,1x4,2x4,4x4",
                   help="comma-separated PxS layouts (one replica each; S a multiple of P)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--memory-gib", type=float, default=24.0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--from", dest="saved", metavar="JSON",
                   help="recompute the fits and the largest models of a saved run's JSON")
    args = p.parse_args(argv)
    if args.saved:
        with open(args.saved) as fh:
            out = json.load(fh)
        done = [(r["P"], r["S"]) for r in out["runs"]]
        out["fit"] = fit_all(out["runs"], out["fixed_mib"])
        out.update(largest_models(out, done, args.memory_gib))
        print(json.dumps(out, indent=1))
        return 0
    layers = [int(v) for v in args.layers.split(",")]
    layouts = [tuple(int(v) for v in lay.split("x")) for lay in args.layouts.split(",")]
    mpiexec = find_mpiexec()
    out = {"bench": "memory", "machine": {**machine(mpiexec), "cpu_features": cpu_features()},
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "layers": layers, "parameters": sum(PartitionedMLP(layers, "relu", 1, 0).part_sizes),
           "formula_bytes_per_param": {r: memory.bytes_per_param(r, "adagrad")
                                       for r in ("server", "replica")}}
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        tmp = Path(tmp)
        tiny = [layers[0], 16, layers[-1]]
        base = run_layout(mpiexec, args, tiny, 1, 1, tmp)
        fixed = {r["role"]: r["peak_mib"] for r in base["per_rank"]}
        out["fixed_mib"] = fixed
        runs = [run_layout(mpiexec, args, layers, P, S, tmp) for P, S in layouts]
    out["runs"] = runs
    fits = fit_all(runs, fixed)
    out["fit"] = fits
    out.update(largest_models(out, layouts, args.memory_gib))
    print(json.dumps(out, indent=1))
    save("bench_memory", out)  # bench/results/, for bench/render.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
