"""Strom's Table 3 on MNIST: threshold tau against compression, bits per update and accuracy.

For each tau, one ``deadreckon`` run (R replicas exchanging thresholded 1-bit updates peer to
peer) and, as the uncompressed reference, asynchronous SGD with the same learning rate and
replicas through a parameter server (``downpour --optimizer sgd``: every replica's full
gradient step is applied, nothing is thresholded). Printed as one JSON object:

* compression ratio: dense float32 gradient bytes / bytes of one message actually sent;
* bits per update with Golomb-Rice (message headers included), without headers, as raw
  32-bit words (what ``--golomb off`` sends), and the empirical entropy of the index gaps
  (+1 bit for the sign) measured on a sample of the same messages;
* updates per step, examples/s, mean staleness and final test accuracy.

Then the kernels' throughput (threshold, Golomb-Rice encode and decode, apply) next to NumPy
doing the same work, from ``bench_compress.py``.

Repeats and spread (``--repeats N``, ``--replicas 2,4,8``): every setting (the uncompressed
reference, each fixed tau of ``--taus``, each target density of ``--densities`` with
``--tau auto``) runs N times at each R; the JSON holds every run and, per setting, the median,
minimum and maximum of the accuracy and the compression, and how many runs reached at least
``--min-compression`` with an accuracy within ``--max-drop`` points of the reference's median.

Run::

    python bench/bench_strom.py                  # about 5 minutes on 2 cores
    python bench/bench_strom.py --quick          # digits, seconds: checks the script works
    python bench/bench_strom.py --repeats 5 --replicas 2,4,8 --taus "" --densities 0.001

The machine has 2 cores: with R = 2 replicas nothing is oversubscribed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_compress  # noqa: E402  (sibling script: kernel throughput)
import bench_train  # noqa: E402  (sibling script: launching runs, machine info)

KEYS = ("compression_ratio", "bits_per_update", "payload_bits_per_update",
        "raw_bits_per_update", "gap_entropy_bits", "updates_per_step", "examples_per_s",
        "mean_staleness", "test_accuracy", "train_s", "bytes_per_step", "final_tau",
        "replicas_identical")


def run(mpiexec, ranks, args, tmp, timeout):
    work = Path(tempfile.mkdtemp(prefix="strom-", dir=tmp))
    try:
        records = bench_train.train(mpiexec, ranks, args, work, timeout)
    except bench_train.RunError as exc:  # one failed run is a result, not the end of the bench
        bench_train.log(f"run failed: {exc}")
        return {"error": str(exc)[-2000:]}
    s = bench_train.summary_of(records)
    return {k: s.get(k) for k in KEYS if k in s}


def spread(runs, ref_acc, min_compression, max_drop):
    """Median, min and max of accuracy and compression over ``runs``; runs that pass."""
    ok = [r for r in runs if r.get("test_accuracy") is not None]
    out = {"runs": len(runs), "failed": len(runs) - len(ok)}
    for key in ("test_accuracy", "compression_ratio"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    if ref_acc is not None:
        drops = [round(100 * (ref_acc - r["test_accuracy"]), 2) for r in ok]
        out["drop_points"] = drops
        out["passing"] = sum(1 for r, d in zip(ok, drops)
                             if d <= max_drop and (r.get("compression_ratio") is None
                                                   or r["compression_ratio"] >= min_compression))
    return out


def settings(a) -> list[tuple[str, list[str]]]:
    """(label, deadreckon arguments) of each compressed setting."""
    out = [(f"tau={t}", ["--tau", t]) for t in filter(None, a.taus.split(","))]
    out += [(f"auto density={d}", ["--tau", "auto", "--density", d])
            for d in filter(None, a.densities.split(","))]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits dataset, small model, seconds")
    p.add_argument("--replicas", default="2", help="comma-separated replica counts (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting and R (default 1)")
    p.add_argument("--taus", default="0.0005,0.001,0.002,0.004,0.008",
                   help="comma-separated fixed thresholds (weight units); '' for none")
    p.add_argument("--densities", default="",
                   help="comma-separated target densities for --tau auto; '' for none")
    p.add_argument("--extra", default="", help="more deadreckon arguments, space-separated "
                   "(e.g. '--residual-clip 4')")
    p.add_argument("--no-reference", action="store_true", help="skip the uncompressed runs")
    p.add_argument("--ref-extra", default="--warmup-steps 0",
                   help="more arguments of the reference's downpour runs, space-separated, "
                        "after the common ones (so '--lr X' overrides --lr there; default "
                        "'--warmup-steps 0'; e.g. '--warmup-steps 100' for the warm start "
                        "deadreckon has)")
    p.add_argument("--min-compression", type=float, default=1000.0,
                   help="compression a passing run reaches (default 1000)")
    p.add_argument("--max-drop", type=float, default=0.3,
                   help="accuracy points below the reference's median a passing run may lose "
                        "(default 0.3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--epochs", type=float, default=3.0, help="epochs per run (default 3)")
    p.add_argument("--data", help="HDF5 dataset (default: the training default)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel throughput part")
    p.add_argument("--out", help="also write the JSON here (rewritten after every run)")
    a = p.parse_args(argv)
    mpiexec = bench_train.find_mpiexec()
    if a.quick:
        data = HERE.parent / "data" / "digits.h5"
        bench_train.ensure_digits(data)
        common = ["--data", str(data), "--layers", "64,64,10", "--batch-size", "16",
                  "--epochs", "10"]
    else:
        common = ["--epochs", str(a.epochs)] + (["--data", a.data] if a.data else [])
    common += ["--lr", str(a.lr), "--eval-every", "0", "--checkpoint-every", "0",
               "--progress-every", "1000"]
    extra = a.extra.split()
    t0 = time.perf_counter()
    out = {"machine": bench_train.machine(mpiexec),
           "settings": {"replicas": a.replicas, "repeats": a.repeats, "lr": a.lr,
                        "quick": a.quick, "common_args": common, "deadreckon_extra": extra,
                        "reference_extra": a.ref_extra.split(),
                        "min_compression": a.min_compression, "max_drop_points": a.max_drop,
                        "reference": "downpour --optimizer sgd (1 server rank + R replicas), "
                                     "dense pushes"},
           "by_replicas": {}}

    def save():
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for R in (int(r) for r in a.replicas.split(",")):
            res = out["by_replicas"][str(R)] = {}
            ref_acc = None
            if not a.no_reference:
                refs = res["uncompressed"] = {"runs_detail": []}
                for i in range(a.repeats):
                    bench_train.log(f"R={R} uncompressed reference (downpour sgd), run {i + 1}")
                    refs["runs_detail"].append(run(
                        mpiexec, R + 1, ["--strategy", "downpour", "--optimizer", "sgd",
                                         *common, *a.ref_extra.split()], tmp, a.timeout))
                    save()
                refs.update(spread(refs["runs_detail"], None, 0, 0))
                if "test_accuracy" in refs:
                    ref_acc = refs["test_accuracy"]["median"]
            for label, args in settings(a):
                row = res[label] = {"args": args + extra, "runs_detail": []}
                for i in range(a.repeats):
                    bench_train.log(f"R={R} deadreckon {label} {' '.join(extra)}, run {i + 1}")
                    row["runs_detail"].append(run(
                        mpiexec, R, ["--strategy", "deadreckon", *args, *extra, *common],
                        tmp, a.timeout))
                    save()
                row.update(spread(row["runs_detail"], ref_acc, a.min_compression, a.max_drop))
                save()
    if not a.no_kernels:
        bench_train.log("kernel throughput")
        import numpy as np
        rng = np.random.default_rng(0)
        n = 1_000_000 if a.quick else 10_000_000
        out["kernels"] = {f"density_{label}": bench_compress.bench_density(n, ratio, 5, rng)
                          for label, ratio in bench_compress.DENSITIES.items()}
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(json.dumps(out, indent=1))
    from machine import save  # bench/machine.py
    save("bench_strom", out)  # bench/results/, for bench/render.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
