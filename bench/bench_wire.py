"""bfloat16 on the wire (``--wire-dtype bf16``) against float32: speed on an emulated network
and accuracy on MNIST, printed as one JSON object.

``throughput``
    For each network rate (``--networks``, shaped by ``bench/cluster/netns.sh``: one host per
    rank, MPI over TCP between them), each strategy (``--strategies``) and each rank count
    (``--ranks``): ``--repeats`` pairs of runs, fp32 then bf16, of ``--steps`` global
    mini-batches of the ``--layers`` MLP without evaluation or warm start. Per run the steady
    examples/s (between its progress records) and the bytes per step from its summary; per
    strategy the median of the pairs' bf16/fp32 ratios (each pair ran back to back, so a
    drift of the shared machine's speed touches both alike).
``accuracy``
    Each strategy that takes ``--wire-dtype`` with its defaults on MNIST, ``mpiexec -n
    --accuracy-ranks`` on this machine (no emulated network), fp32 and bf16: the final test
    accuracy and the difference in points.

Needs root for the network namespaces (``throughput``). The hosts are taken down at the end,
also on an error or Ctrl-C.

    python bench/bench_wire.py                                  # both, ~25 minutes
    python bench/bench_wire.py --only throughput --networks 1gbit --ranks 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "cluster"))
sys.path.insert(0, str(HERE.parent))

from bench_cluster import (MPIEXEC, PROGRESS_S, hosts_down, hosts_up, layout,  # noqa: E402
                           length, steady_rate)
from bench_train import RunError, find_mpiexec, log, machine, summary_of, train  # noqa: E402
from machine import cpu_features, save  # noqa: E402

from hpcps.strategies.registry import strategies  # noqa: E402

WIRES = ("fp32", "bf16")


def takes_wire(name: str) -> bool:
    return any(o.name == "wire_dtype" for o in strategies()[name].options)


def run_once(mpiexec: str, ranks: int, argv: list[str], tmp: Path, timeout: float) -> dict:
    work = Path(tempfile.mkdtemp(dir=tmp))
    records = train(mpiexec, ranks, argv, work, timeout)
    return {**summary_of(records), "steady_examples_per_s": steady_rate(records)}


def throughput(args, strategy: str, ranks: int, tmp: Path) -> dict:
    """``--repeats`` pairs fp32, bf16 of one strategy on ``ranks`` emulated hosts."""
    argv = ["--strategy", strategy, *length(args, strategy), "--eval-every", "0",
            "--data", args.data, "--layers", args.layers, "--checkpoint-every", "0",
            "--progress-every", f"{PROGRESS_S:g}", "--timeout", str(args.timeout)]
    runs: dict[str, list[dict]] = {w: [] for w in WIRES}
    try:
        for _ in range(args.repeats):
            for wire in WIRES:
                runs[wire].append(run_once(str(MPIEXEC), ranks, argv + ["--wire-dtype", wire],
                                           tmp, args.timeout))
    except RunError as exc:
        log(f"  {strategy} N={ranks}: failed: {str(exc)[:300]}")
        return {"strategy": strategy, **layout(strategy, ranks), "error": str(exc)[-2000:]}
    entry: dict = {"strategy": strategy, **layout(strategy, ranks)}
    for wire in WIRES:
        rates = [r["steady_examples_per_s"] or r["examples_per_s"] for r in runs[wire]]
        entry[wire] = {"examples_per_s": statistics.median(rates), "examples_per_s_all": rates,
                       "bytes_per_step": statistics.median(r["bytes_per_step"]
                                                           for r in runs[wire])}
    ratios = [(b["steady_examples_per_s"] or b["examples_per_s"])
              / (a["steady_examples_per_s"] or a["examples_per_s"])
              for a, b in zip(runs["fp32"], runs["bf16"])]
    entry["speedup_median"] = statistics.median(ratios)
    entry["speedup_all"] = ratios
    entry["bytes_ratio"] = entry["bf16"]["bytes_per_step"] / entry["fp32"]["bytes_per_step"]
    log(f"  {strategy} N={ranks}: bf16/fp32 examples/s {entry['speedup_median']:.2f}x "
        f"(pairs {', '.join(f'{r:.2f}' for r in ratios)}), bytes per step "
        f"{entry['bytes_ratio']:.3f}x")
    return entry


def accuracy(args, strategy: str, tmp: Path) -> dict:
    mpiexec = find_mpiexec()
    entry: dict = {"strategy": strategy, "ranks": args.accuracy_ranks}
    for wire in WIRES:
        try:
            s = run_once(mpiexec, args.accuracy_ranks,
                         ["--strategy", strategy, "--data", args.data, "--wire-dtype", wire,
                          "--checkpoint-every", "0", "--timeout", str(args.timeout)],
                         tmp, args.timeout)
        except RunError as exc:
            log(f"  {strategy} {wire}: failed: {str(exc)[:300]}")
            entry[wire] = {"error": str(exc)[-2000:]}
            continue
        entry[wire] = {"test_accuracy": s["test_accuracy"], "train_s": s.get("train_s"),
                       "bytes_per_step": s.get("bytes_per_step")}
    if all("test_accuracy" in entry[w] for w in WIRES):
        entry["points_lost"] = round(100 * (entry["fp32"]["test_accuracy"]
                                            - entry["bf16"]["test_accuracy"]), 3)
        log(f"  {strategy}: fp32 {entry['fp32']['test_accuracy']:.4f}, bf16 "
            f"{entry['bf16']['test_accuracy']:.4f} ({entry['points_lost']:+.2f} points lost)")
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("throughput", "accuracy"))
    p.add_argument("--networks", default="1gbit")
    p.add_argument("--strategies", default="sync,downpour,averaging")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", default="784,1024,1024,10")
    p.add_argument("--accuracy-strategies", default=",".join(
        n for n in strategies() if takes_wire(n) and strategies()[n].dense_models))
    p.add_argument("--accuracy-ranks", type=int, default=4)
    p.add_argument("--data", default=str(HERE.parent / "data" / "mnist.h5"))
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    out: dict = {"bench": "wire", "machine": {**machine(find_mpiexec()),
                                              "cpu_features": cpu_features()},
                 "command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "layers": args.layers, "networks": [], "accuracy": []}
    with tempfile.TemporaryDirectory(prefix="bench_wire-") as tmp_s:
        tmp = Path(tmp_s)
        if args.only in (None, "throughput"):
            if os.geteuid() != 0:
                raise SystemExit("bench_wire: the emulated network needs root")
            ranks = [int(v) for v in args.ranks.split(",")]
            try:
                for rate in args.networks.split(","):
                    log(f"{rate}: {max(ranks)} hosts")
                    hosts_up(max(ranks), rate)
                    out["networks"].append({"rate": rate, "throughput": [
                        throughput(args, s, n, tmp) for s in args.strategies.split(",")
                        for n in ranks if layout(s, n)]})
                    hosts_down()
            finally:
                hosts_down()
        if args.only in (None, "accuracy"):
            log(f"accuracy on MNIST, {args.accuracy_ranks} ranks, each strategy's defaults")
            out["accuracy"] = [accuracy(args, s, tmp)
                               for s in args.accuracy_strategies.split(",")]
    save("bench_wire", out, argv)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
