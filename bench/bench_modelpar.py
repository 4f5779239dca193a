"""Model parallelism: examples/s, exchange traffic and compute time per rank against P.

At a fixed number of ranks N (default 4), runs ``--strategy sync`` with P = 1, 2 and 4
partitions per replica (so R = N/P replicas) for the default model 784-512-512-10 and a wide
one 784-4096-4096-10, and prints one JSON object with, per run:

* examples/s over the whole job;
* ``replica_bytes_per_step``: bytes rank 0 sends inside its replica per mini-batch,
  measured, next to the formula below;
* ``compute_s_per_step`` and ``exchange_s_per_step`` on rank 0 (the exchange time includes
  waiting for the other partitions): compute should shrink as 1/P.

Traffic formula (what one rank p sends per mini-batch of B examples, float32): forward, its
block of every layer's outputs to the P-1 others, sum_l w_p(l) * B * 4 * (P-1); backward, the
other partitions' rows of its contribution to every hidden layer's error terms,
sum_{l<L} (n_l - w_p(l)) * B * 4, where n_l is layer l's width and w_p(l) its share of it.

With ``--conv`` the models are conv models on MNIST's 1x28x28 images instead: Project Adam's
``adam-mnist`` (conv5x5x10, pool2, conv5x5x20, pool2, fc400, fc400, fc10) and a wide one
(conv5x5x64, pool2, conv5x5x128, pool2, fc1024, fc10), partitioned by output maps and units
(:class:`hpcps.model.convnet.PartitionedConvNet`, whose ``exchange_bytes`` is the same formula with
n_l the values per example at the input of the l-th layer with parameters, after pooling).
Every P runs twice: on the compiled engine (a whole model on
:class:`hpcps.engine.conv_hogwild.ConvHogwild`, a partition on
:class:`hpcps.engine.conv_hogwild.CompiledPartition`) and with ``HPCPS_NO_EXTENSION=1`` on the
NumPy layers; each run's ``engine`` says which, and ``conv_speedup`` lists per model and P
both examples/s and their ratio (compiled / NumPy). ``--quick`` with ``--conv`` runs a small
conv model on digits instead (seconds: a check that the bench runs, not a measurement).

Run::

    python bench/bench_modelpar.py            # about 5 minutes on 2 cores
    python bench/bench_modelpar.py --quick    # digits, seconds
    python bench/bench_modelpar.py --conv --data data/mnist.h5
    python bench/bench_modelpar.py --conv --quick    # digits, seconds

This machine has 2 cores: at N = 4 every configuration is oversubscribed, so absolute
speed-ups are bounded by 2; the figures to read are the compute per rank and the traffic.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_train  # noqa: E402  (sibling script: launching runs, machine info)

from hpcps.model.convnet import PartitionedConvNet  # noqa: E402
from hpcps.model.mlp import partition_widths  # noqa: E402

CONV_MODELS = {"adam-mnist": ("conv5x5x10,pool2,conv5x5x20,pool2,fc400,fc400,fc10", 120),
               "wide-conv": ("conv5x5x64,pool2,conv5x5x128,pool2,fc1024,fc10", 12)}
QUICK_CONV = {"digits-conv": ("conv3x3x8p1,pool2,fc32,fc10", 40)}  # on 1x8x8 digits


def predicted_bytes(sizes, parts, part, batch):
    """The traffic formula of the module docstring, for rank ``part``."""
    layers = len(sizes) - 1
    w = [partition_widths(sizes[l + 1], parts, l)[part] for l in range(layers)]
    w = [hi - lo for lo, hi in w]
    fwd = sum(w[l] * batch * 4 * (parts - 1) for l in range(layers))
    bwd = sum((sizes[l] - w[l - 1]) * batch * 4 for l in range(1, layers))
    return fwd + bwd


def conv_speedup(runs) -> dict:
    """``{model: {P: {"numpy": examples/s, "compiled": examples/s, "ratio": compiled /
    numpy}}}`` from the runs of both engines."""
    table: dict = {}
    for r in runs:
        table.setdefault(r["model"], {}).setdefault(str(r["partitions"]), {})[r["engine"]] = \
            r["examples_per_s"]
    for per_p in table.values():
        for row in per_p.values():
            if row.get("numpy") and row.get("compiled"):
                row["ratio"] = round(row["compiled"] / row["numpy"], 2)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits, small models, seconds")
    p.add_argument("--ranks", type=int, default=4, help="total ranks N (default 4)")
    p.add_argument("--parts", default="1,2,4", help="partitions per replica to try")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--conv", action="store_true", help="conv models on MNIST images")
    p.add_argument("--data", help="dataset (with --conv: MNIST with its image_shape)")
    a = p.parse_args(argv)
    mpiexec = bench_train.find_mpiexec()
    image = (1, 28, 28)
    if a.conv and a.quick:
        data = HERE.parent / "data" / "digits.h5"
        bench_train.ensure_digits(data)
        models, common, image = dict(QUICK_CONV), ["--data", str(data)], (1, 8, 8)
    elif a.conv:
        models = {name: (spec, steps) for name, (spec, steps) in CONV_MODELS.items()}
        common = ["--data", a.data] if a.data else []
    elif a.quick:
        data = HERE.parent / "data" / "digits.h5"
        bench_train.ensure_digits(data)
        models = {"small": ((64, 64, 10), 300), "wide": ((64, 1024, 1024, 10), 60)}
        common = ["--data", str(data)]
    else:
        models = {"default": ((784, 512, 512, 10), 600), "wide": ((784, 4096, 4096, 10), 60)}
        common = ["--data", a.data] if a.data else []
    t0 = time.perf_counter()
    out = {"machine": bench_train.machine(mpiexec),
           "settings": {"ranks": a.ranks, "batch_size": a.batch_size, "strategy": "sync"},
           "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sizes, steps) in models.items():
            # conv: each P on both engines, back to back (load from other jobs hits both)
            plan = [(int(x), engine) for x in a.parts.split(",")
                    for engine in (("compiled", "numpy") if a.conv else ("default",))]
            for parts, engine in plan:
                if a.ranks % parts:
                    continue
                bench_train.log(f"{name} {sizes} P={parts} ({engine})")
                if engine == "numpy":
                    os.environ["HPCPS_NO_EXTENSION"] = "1"
                else:
                    os.environ.pop("HPCPS_NO_EXTENSION", None)
                work = Path(tempfile.mkdtemp(dir=tmp))
                if a.conv:
                    shape = ["--model", sizes]
                    predicted = PartitionedConvNet(sizes, image, "relu", parts,
                                                   0).exchange_bytes(a.batch_size)
                else:
                    shape = ["--layers", ",".join(map(str, sizes))]
                    predicted = predicted_bytes(sizes, parts, 0, a.batch_size)
                args = ["--strategy", "sync", "--partitions", str(parts), *shape,
                        "--batch-size", str(a.batch_size),
                        "--steps", str(steps * a.ranks // parts), "--eval-every", "0",
                        "--checkpoint-every", "0", "--progress-every", "1000", *common]
                s = bench_train.summary_of(bench_train.train(mpiexec, a.ranks, args, work,
                                                             a.timeout))
                out["runs"].append({
                    "model": name, "layers": sizes if a.conv else list(sizes),
                    "partitions": parts, "engine": engine,
                    "replicas": a.ranks // parts, "steps": s["steps_trained"],
                    "examples_per_s": s["examples_per_s"],
                    "replica_bytes_per_step": s.get("replica_bytes_per_step", 0),
                    "predicted_bytes_per_step": predicted,
                    # wall time of one update of every replica (all of sync's work per step)
                    "s_per_update": round(s["train_s"] * (a.ranks // parts)
                                          / s["steps_trained"], 5),
                    "compute_s_per_step": s.get("compute_s_per_step"),
                    "exchange_s_per_step": s.get("exchange_s_per_step", 0.0),
                    "allreduce_bytes_per_step": s["bytes_per_step"]})
    os.environ.pop("HPCPS_NO_EXTENSION", None)
    if a.conv:
        out["conv_speedup"] = conv_speedup(out["runs"])
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1)
    print(text)
    from machine import save  # bench/machine.py
    save("bench_modelpar", out)  # bench/results/, for bench/render.py
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
