"""Sandblaster L-BFGS on MNIST: time per batch against replicas, coordinator traffic, backups.

Prints one JSON object:

* ``scaling``: for R = 1, 2, 3 replicas and S = 1, 2, 3 server shards (plus the
  coordinator, so N = S + R + 1 ranks; ``--shards`` picks the S values), a short run of
  whole-training-set batches: median seconds per batch, bytes the coordinator sends per
  L-BFGS iteration (commands only: it never holds a vector; it grows with S, one command per
  shard), commands per iteration, portions re-issued as backup tasks, late duplicates
  discarded;
* ``slow_replica``: R = 3 with one replica made 10x slower (``--inject-slow``), next to the
  healthy R = 3 run: the batch time should stay close to it;
* ``accuracy``: a full default run (40 whole-set evaluations, R = 2): final test accuracy,
  training loss, whether the loss fell at every iteration, and the time it took.

Run::

    python bench/bench_sandblaster.py            # about 6 minutes on 2 cores
    python bench/bench_sandblaster.py --quick    # digits, seconds

On this 2-core machine N = R + 2 ranks are oversubscribed from R = 1 on, so time per batch
cannot fall as 1/R; what it shows is that the work is shared and a slow replica does not set
the pace.
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

import bench_train  # noqa: E402  (sibling script: launching runs, machine info)

KEYS = ("median_batch_s", "coordinator_bytes_per_iteration", "commands_per_iteration",
        "portions_reissued", "duplicates_discarded", "iterations", "final_train_loss",
        "loss_monotone", "test_accuracy", "train_s", "steps_trained", "lost_replicas")


def run(mpiexec, ranks, args, tmp, timeout):
    work = Path(tempfile.mkdtemp(prefix="sb-", dir=tmp))
    s = bench_train.summary_of(bench_train.train(mpiexec, ranks, args, work, timeout))
    return {k: s.get(k) for k in KEYS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="digits dataset, seconds")
    p.add_argument("--steps", type=int, default=8, help="evaluations per scaling run")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3],
                   help="server shard counts S of the scaling runs")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    mpiexec = bench_train.find_mpiexec()
    common = ["--strategy", "sandblaster", "--eval-every", "0", "--checkpoint-every", "0",
              "--progress-every", "1000"]
    if a.quick:
        data = HERE.parent / "data" / "digits.h5"
        bench_train.ensure_digits(data)
        common += ["--data", str(data), "--layers", "64,256,256,10"]
    t0 = time.perf_counter()
    out = {"machine": bench_train.machine(mpiexec), "scaling": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for shards in a.shards:
            for replicas in (1, 2, 3):
                n = shards + replicas + 1
                bench_train.log(f"sandblaster S={shards} R={replicas} (N={n})")
                out["scaling"].append({"servers": shards, "replicas": replicas, "ranks": n,
                                       **run(mpiexec, n, [*common, "--servers", str(shards),
                                                          "--steps", str(a.steps)],
                                             tmp, a.timeout)})
        bench_train.log("sandblaster S=1 R=3, replica rank 1 slowed 10x")
        slowed = run(mpiexec, 5, [*common, "--steps", str(a.steps), "--inject-slow", "1:10"],
                     tmp, a.timeout)
        healthy = next(r for r in out["scaling"] if r["servers"] == 1 and r["replicas"] == 3)
        out["slow_replica"] = {"healthy_median_batch_s": healthy["median_batch_s"],
                               "slowed": slowed,
                               "ratio": slowed["median_batch_s"] / healthy["median_batch_s"]}
        bench_train.log("sandblaster accuracy run (defaults, R=2)")
        acc_args = [*common[:2], "--checkpoint-every", "0", "--progress-every", "1000",
                    *common[6:]]
        out["accuracy"] = {"replicas": 2, **run(mpiexec, 4, acc_args, tmp, a.timeout)}
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=1)
    print(text)
    from machine import save  # bench/machine.py
    save("bench_sandblaster", out)  # bench/results/, for bench/render.py
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
