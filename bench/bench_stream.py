"""Benchmark streaming training data against holding it in memory; print one JSON object.

Each measurement is a real ``mpiexec -n N python -m hpcps.train`` run (``bench_train.py``'s
launcher, with its time limit and process-group kill), the figures are the runs' summary
records. For each model, runs alternate: in memory (``--data-memory 100000``) and streamed
(``--data-memory MIB``, a budget below a replica's block, so every replica streams its block in
chunks with a reading thread: docs/formats.md#data-larger-than-memory). Both read the same
file; it is read once before timing, so both find it in the page cache (a cold cache measures
the disk instead, which in-memory runs pay once at start and streaming runs all along).

Reported per model: training examples/s of each run, their medians, the ratio streamed / in
memory (the target: 0.9 or more), the chunk plan the streamed runs used and their final test
accuracy (AUC for ``--ctr``; a throughput counts only for a run that learned). ``--ctr``
measures an embedding model on a synthetic click-through file instead (downpour, 1 shard;
its replicas stream ids, labels and dense features). Then, for dense data, in this process,
``reader_interference``: how much a thread reading the file slows a thread computing
gradients, for the ``pread`` path and the h5py one (h5py holds a lock and the GIL while it
reads).

Usage::

    python bench/bench_stream.py                           # MNIST, sync on 2 ranks, ~6 min
    python bench/bench_stream.py --quick                   # digits, a smoke test, ~15 s
    python bench/bench_stream.py --data data/mnist.h5 --repeats 7 --ranks 2
    python bench/bench_stream.py --ctr                     # embedding model, 3 ranks, ~2 min

On a 2-core machine, run it alone: the reading thread shares the cores with the ranks, and
other load skews every figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_train import RunError, find_mpiexec, log, machine, summary_of, train
from machine import git_commit, save

ROOT = Path(__file__).resolve().parents[1]

FULL = {"data": ROOT / "data" / "mnist.h5", "models": ["784,512,512,10", "784,128,10"],
        "steps": 6000, "batch": 32, "stream_mib": 64, "learned": 0.85}
QUICK = {"data": None, "models": ["64,32,10"], "steps": 300, "batch": 16,
         "stream_mib": 0.01, "learned": 0.7}
# an embedding model on 400,000 synthetic click-through rows (26 fields of 10^5 ids, Zipf
# 1.1: 216 bytes a row, some 40 MiB a replica's block), streamed within 8 MiB
CTR = {"data": None, "models": ["embed16,fc64,fc1"], "steps": 600, "batch": 256,
       "stream_mib": 8, "learned": 0.7, "figure": "test_auc", "strategy": "downpour",
       "ranks": 3, "extra": ["--servers", "1"]}


def run_one(mpiexec: str, ranks: int, args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        records = train(mpiexec, ranks, args, Path(tmp), timeout)
    return summary_of(records)


def warm(path: Path) -> None:
    """Read the file once, so every run finds it in the page cache."""
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def reader_interference(data: Path, seconds: float, repeats: int) -> dict:
    """Gradient steps/s of one thread (784-128-10, batch 32) while another thread reads the
    file as fast as it can: none, ``pread`` (the streaming reader's path for contiguous
    float32 files; no lock held during the read) or h5py (chunked or float64 files; h5py
    holds its lock, and the GIL, while it reads). The worst case: a streaming run reads only
    as fast as it trains. Kinds alternate, ``repeats`` times; medians and every value."""
    import threading

    import h5py
    import numpy as np

    from hpcps.io.data.stream import RowSource, _Reader
    from hpcps.model.mlp import MLP

    with h5py.File(data, "r") as f:
        n, d = f["train/x"].shape
    model = MLP([d, 128, 10], "relu")
    params = model.init_params(0)
    x = np.random.default_rng(0).random((32, d), dtype=np.float32)
    y = np.zeros(32, np.int64)
    rows = min(n, max(1, (4 << 20) // (4 * d)))

    def read(kind: str, stop: threading.Event) -> None:
        if kind == "pread":
            r = _Reader(RowSource(str(data), "train", d, 0, n), rows)
            bx, by = np.empty((rows, d), np.float32), np.empty(rows, np.int64)
            while not stop.is_set():
                for lo in range(0, n - rows + 1, rows):
                    r.read_into(np.arange(lo, lo + rows), [bx, by])
            r.close()
        else:
            with h5py.File(data, "r") as f:
                dx = f["train/x"]
                while not stop.is_set():
                    for lo in range(0, n - rows + 1, rows):
                        dx[lo:lo + rows]

    rates: dict[str, list[float]] = {"none": [], "pread": [], "h5py": []}
    for _ in range(repeats):
        for kind in rates:
            stop = threading.Event()
            th = None if kind == "none" else threading.Thread(target=read, args=(kind, stop))
            if th is not None:
                th.start()
            steps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                model.loss_and_grad(params, x, y)
                steps += 1
            rates[kind].append(round(steps / (time.perf_counter() - t0), 1))
            stop.set()
            if th is not None:
                th.join()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"steps_per_s": rates, "median": med,
            "relative": {k: round(v / med["none"], 3) for k, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="digits, one small model, one repeat")
    p.add_argument("--ctr", action="store_true", help="an embedding model on synthetic "
                   "click-through data (downpour, 1 shard) instead of an MLP")
    p.add_argument("--data", type=Path, help="dataset (default data/mnist.h5; --quick: digits)")
    p.add_argument("--ranks", type=int, help="mpiexec -n (default 2; --ctr: 3)")
    p.add_argument("--strategy", help="default sync (--ctr: downpour)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each kind per model "
                   "(default 5: runs of a small model differ by up to 30% on shared cores)")
    p.add_argument("--steps", type=int, help="global mini-batches per run")
    p.add_argument("--models", help="comma-separated --layers specs, separated by ';'")
    p.add_argument("--stream-mib", type=float, help="--data-memory of the streamed runs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = p.parse_args(argv)
    plan = dict(CTR if args.ctr else QUICK if args.quick else FULL)
    args.ranks = args.ranks or plan.get("ranks", 2)
    args.strategy = args.strategy or plan.get("strategy", "sync")
    figure = plan.get("figure", "test_accuracy")
    mpiexec = find_mpiexec()
    tmp = None
    data = args.data or plan["data"]
    if data is None and args.ctr:  # synthetic click-through rows, prepared here
        from hpcps.io.data import prepare_synthetic_ctr
        tmp = tempfile.TemporaryDirectory(prefix="bench-stream-data-")
        data = prepare_synthetic_ctr(Path(tmp.name) / "ctr.h5", rows=400_000, fields=26,
                                     vocab=100_000, zipf=1.1, seed=0, log=lambda s: None)
    elif data is None:  # --quick: digits, prepared here
        from hpcps.io.data import prepare_digits
        tmp = tempfile.TemporaryDirectory(prefix="bench-stream-data-")
        data = prepare_digits(Path(tmp.name) / "digits.h5", log=lambda s: None)
    models = args.models.split(";") if args.models else plan["models"]
    steps = args.steps or plan["steps"]
    stream_mib = args.stream_mib or plan["stream_mib"]
    warm(Path(data))
    common = ["--strategy", args.strategy, "--data", str(data), "--steps", str(steps),
              "--batch-size", str(plan["batch"]), "--eval-every", "0",
              "--checkpoint-every", "0", "--progress-every", "30", "--timeout", "120",
              *plan.get("extra", [])]
    out: dict = {"bench": "bench_stream", "machine": machine(mpiexec),
                 "git_commit": git_commit(), "command": " ".join(["python", *sys.argv]),
                 "ranks": args.ranks, "strategy": args.strategy, "steps": steps,
                 "batch_size": plan["batch"], "data": str(data), "stream_mib": stream_mib,
                 "learned_figure": figure, "models": {}}
    failed = False
    for layers in models:
        runs: dict[str, list] = {"memory": [], "stream": []}
        chunk = None
        for r in range(args.repeats if not args.quick else 1):
            for kind, budget in (("memory", 100000.0), ("stream", stream_mib)):
                log(f"{layers} {kind} run {r + 1}")
                try:
                    model = ["--model" if args.ctr else "--layers", layers]
                    s = run_one(mpiexec, args.ranks, [*common, *model,
                                                      "--data-memory", f"{budget:g}"],
                                args.timeout)
                except RunError as exc:
                    log(str(exc))
                    failed = True
                    continue
                if s["data_streams"] != (kind == "stream"):
                    log(f"{kind} run: data_streams is {s['data_streams']}; give --stream-mib "
                        "below a replica's block")
                    failed = True
                    continue
                if kind == "stream":
                    chunk = {"chunk_rows": s.get("stream_chunk_rows"),
                             "window": s.get("stream_window")}
                runs[kind].append({"examples_per_s": s["examples_per_s"],
                                   figure: s[figure],
                                   "learned": s[figure] >= plan["learned"]})
        med = {k: statistics.median([v["examples_per_s"] for v in rs if v["learned"]])
               if any(v["learned"] for v in rs) else None for k, rs in runs.items()}
        ratio = (med["stream"] / med["memory"]) if med["stream"] and med["memory"] else None
        out["models"][layers] = {"runs": runs, "median_examples_per_s": med,
                                 "stream_over_memory": None if ratio is None
                                 else round(ratio, 3),
                                 "within_10pct": None if ratio is None else ratio >= 0.9,
                                 "stream_plan": chunk}
    if not args.ctr:
        log("reading thread against a training thread")
        out["reader_interference"] = reader_interference(
            Path(data), 0.5 if args.quick else 3.0, 1 if args.quick else args.repeats)
    print(json.dumps(out, indent=1))
    save("bench_stream", out)
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
