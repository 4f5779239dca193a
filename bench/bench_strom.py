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

Run::

    python bench/bench_strom.py                  # about 5 minutes on 2 cores
    python bench/bench_strom.py --quick          # digits, seconds: checks the script works

The machine has 2 cores: with R = 2 replicas nothing is oversubscribed.
"""
from __future__ import annotations

import argparse
import json
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
        "mean_staleness", "test_accuracy", "train_s", "bytes_per_step")


def run(mpiexec, ranks, args, tmp, timeout):
    work = Path(tempfile.mkdtemp(prefix="strom-", dir=tmp))
    records = bench_train.train(mpiexec, ranks, args, work, timeout)
    s = bench_train.summary_of(records)
    return {k: s.get(k) for k in KEYS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits dataset, small model, seconds")
    p.add_argument("--replicas", type=int, default=2, help="replicas R (default 2)")
    p.add_argument("--taus", default="0.0005,0.001,0.002,0.004,0.008",
                   help="comma-separated thresholds (weight units)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--epochs", type=float, default=3.0, help="epochs per run (default 3)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel throughput part")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    mpiexec = bench_train.find_mpiexec()
    if a.quick:
        data = HERE.parent / "data" / "digits.h5"
        bench_train.ensure_digits(data)
        common = ["--data", str(data), "--layers", "64,64,10", "--batch-size", "16",
                  "--epochs", "10"]
    else:
        common = ["--epochs", str(a.epochs)]
    common += ["--lr", str(a.lr), "--eval-every", "0", "--checkpoint-every", "0",
               "--progress-every", "1000"]
    t0 = time.perf_counter()
    out = {"machine": bench_train.machine(mpiexec),
           "settings": {"replicas": a.replicas, "lr": a.lr, "quick": a.quick,
                        "common_args": common,
                        "reference": "downpour --optimizer sgd (1 server rank + R replicas), "
                                     "dense pushes"}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bench_train.log("uncompressed reference: downpour sgd")
        ref = run(mpiexec, a.replicas + 1, ["--strategy", "downpour", "--optimizer", "sgd",
                                            "--warmup-steps", "0", *common], tmp, a.timeout)
        out["uncompressed"] = ref
        rows = []
        for tau in (float(t) for t in a.taus.split(",")):
            bench_train.log(f"deadreckon tau={tau}")
            row = {"tau": tau, **run(mpiexec, a.replicas,
                                     ["--strategy", "deadreckon", "--tau", str(tau), *common],
                                     tmp, a.timeout)}
            if ref["test_accuracy"] is not None and row["test_accuracy"] is not None:
                row["accuracy_minus_uncompressed_points"] = round(
                    100 * (row["test_accuracy"] - ref["test_accuracy"]), 2)
            rows.append(row)
        out["table"] = rows
    if not a.no_kernels:
        bench_train.log("kernel throughput")
        import numpy as np
        rng = np.random.default_rng(0)
        n = 1_000_000 if a.quick else 10_000_000
        out["kernels"] = {f"density_{label}": bench_compress.bench_density(n, ratio, 5, rng)
                          for label, ratio in bench_compress.DENSITIES.items()}
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
