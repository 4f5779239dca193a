"""``python -m hpcps.scaling``: the parser, the tables and the plot of the scaling model."""
from __future__ import annotations

import argparse
import json
import os
import sys

from hpcps.errors import DataError
from hpcps.tools.scaling import calibrate
from hpcps.tools.scaling.model import NETWORKS, NO_COST_MODEL, curve, models
from hpcps.tools.scaling.validate import published_checks, validate_cluster

def plot(curves: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        pts = [p for p in pts if p[1] > 0]  # node counts the strategy cannot run on
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ms=3, label=name)
    top = max(p[0] for pts in curves.values() for p in pts)
    ax.plot([1, top], [1, top], color="grey", lw=0.8, ls="--", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("speed-up over one node")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcps.scaling",
        description="Predict examples/s and speed-up per strategy for 1..N nodes (alpha-beta "
                    "model), each strategy from the cost model it declares; measures a "
                    "mini-batch's pass and update on this CPU first.")
    p.add_argument("--layers", "--model", dest="layers", metavar="WIDTHS",
                   default="784,512,512,10",
                   help="the model's layer widths, comma-separated, inputs first and classes "
                        "last (as hpcps.train --layers; --model is the old name) "
                        "(default: %(default)s)")
    p.add_argument("--network", default="10gbe", choices=sorted(NETWORKS),
                   help="typical latency and line rate of this network (default: "
                        "%(default)s)")
    p.add_argument("--alpha", type=float, metavar="SECONDS",
                   help="latency of a message, in place of --network's (give --beta too; "
                        "default: --network's)")
    p.add_argument("--beta", type=float, metavar="SECONDS",
                   help="seconds per byte, in place of --network's (give --alpha too; "
                        "default: --network's)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="examples per mini-batch per replica (default: %(default)s)")
    p.add_argument("--servers", type=int, default=1,
                   help="parameter-server shard nodes S, for strategies with servers (they "
                        "do not train) (default: %(default)s)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256",
                   help="node counts to predict, comma-separated (default: %(default)s)")
    p.add_argument("--strategies", default=",".join(models()),
                   help="strategies to predict, comma-separated; one that declares no cost "
                        "model is listed as such (default: every registered strategy, "
                        "%(default)s)")
    p.add_argument("--compression", type=float, default=1000.0,
                   help="thresholded messages: dense gradient bytes / message bytes (Strom: "
                        "~850 at tau 4; a run's summary gives compression_ratio) (default: "
                        "%(default)g)")
    p.add_argument("--wire-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the format of parameter and gradient values on the wire, as "
                        "hpcps.train's --wire-dtype (bf16: 2 bytes a value; deadreckon's "
                        "messages keep their own) (default: %(default)s)")
    p.add_argument("--run-steps", type=int, default=10000,
                   help="steps each replica takes in the run, for costs a strategy pays once "
                        "per run (default: %(default)s)")
    p.add_argument("--png", default="scaling.png",
                   help="where the plot goes ('' for none) (default: %(default)s)")
    p.add_argument("--validate-cluster", metavar="JSON",
                   help="bench/cluster/bench_cluster.py output to check the model against "
                        "(default: none, check 2 not run)")
    p.add_argument("--background-load", type=float, metavar="THREADS",
                   help="--validate-cluster: runnable threads of other jobs on the machine "
                        "while the bench ran (default: its recorded load average, else now's)")
    p.add_argument("--data", metavar="H5",
                   help="time the mini-batches on rows of this dataset (hpcps HDF5; the "
                        "first layer skips their zeros) (default: dense random inputs)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables (default: tables)")
    return p


def _positive_ints(text: str, what: str, parser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{what} takes comma-separated whole numbers, got {text!r}")
    if any(v < 1 for v in values):
        parser.error(f"{what} must be at least 1, got {text!r}")
    return values


def _bench_json(path: str, parser) -> None:
    """Refuse a --validate-cluster file that bench_cluster.py did not write, before any
    measuring."""
    try:
        with open(path) as fh:
            bench = json.load(fh)
        if not isinstance(bench, dict) or bench.get("bench") != "cluster" \
                or not isinstance(bench.get("networks"), list) or "layers" not in bench:
            raise ValueError("no 'bench': 'cluster' record with 'layers' and 'networks'")
    except (OSError, ValueError) as exc:
        parser.error(f"--validate-cluster {path}: not the JSON of "
                     f"bench/cluster/bench_cluster.py ({exc})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.alpha is None) != (args.beta is None):
        parser.error("give both --alpha and --beta, or neither (then --network)")
    if args.alpha is not None and not (args.alpha >= 0 and args.beta > 0):
        parser.error(f"--alpha must be >= 0 and --beta > 0 seconds, got {args.alpha:g} and "
                     f"{args.beta:g}")
    alpha, beta = (args.alpha, args.beta) if args.alpha is not None else NETWORKS[args.network]
    net = (f"alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/byte "
           f"({8 / beta / 1e9:.1f} Gb/s)")
    layers = _positive_ints(args.layers, "--layers (layer widths)", parser)
    if len(layers) < 2:
        parser.error(f"--layers needs at least two layer widths (inputs, classes), got "
                     f"{args.layers!r}")
    nodes = _positive_ints(args.nodes, "--nodes", parser)
    if args.batch_size < 1 or args.servers < 1:
        parser.error(f"--batch-size and --servers must be at least 1, got {args.batch_size} "
                     f"and {args.servers}")
    if not args.compression > 0:
        parser.error(f"--compression must be > 0, got {args.compression:g}")
    if args.run_steps < 1:
        parser.error(f"--run-steps must be at least 1, got {args.run_steps}")
    known = models()
    unknown = sorted(set(args.strategies.split(",")) - set(known))
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(known)}")
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    if args.png:  # refused before the calibration, not after it
        where = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(where):
            parser.error(f"--png {args.png}: {where} is not a directory")
    if args.validate_cluster:
        _bench_json(args.validate_cluster, parser)
    try:
        m = calibrate.measure_compute(layers, args.batch_size, data=args.data)
    except DataError as exc:  # not a dataset, or its rows do not fit --layers
        print(f"hpcps.scaling: error: {exc}", file=sys.stderr)
        return exc.exit_code
    t_c, t_u = m["compute_s"], m["update_s_per_param"]
    n = sum((layers[i] + 1) * layers[i + 1] for i in range(len(layers) - 1))
    bits = 11.0
    w = calibrate.measured_workload(m, n, args.batch_size, servers=args.servers,
                                    bits_per_update=bits, run_steps=args.run_steps,
                                    value_bytes=2 if args.wire_dtype == "bf16" else 4,
                                    updates_per_step=4 * n / args.compression * 8 / bits)
    chosen = args.strategies.split(",")
    names = [s for s in chosen if known[s] is not None]
    without = [s for s in chosen if known[s] is None]
    curves = {s: curve(s, w, nodes, alpha, beta) for s in names}
    checks = published_checks()
    out = {"model": layers, "parameters": n, "network": args.network if args.alpha is None
           else "custom", "alpha_s": alpha, "beta_s_per_byte": beta,
           "compute_s_per_batch": t_c, "update_s_per_param": t_u,
           "compute_wall_s_per_batch": m["compute_wall_s"], "load_average": m["load_average"],
           "compute_measured": m["path"],
           "curves": {s: [{"nodes": k, "examples_per_s": round(e, 1), "speedup": round(x, 2)}
                          for k, e, x in pts] for s, pts in curves.items()},
           "no_cost_model": without, "published": checks}
    if args.validate_cluster:
        out["cluster"] = validate_cluster(args.validate_cluster,
                                          background=args.background_load, data=args.data)
    if args.png and curves:
        plot(curves, f"{args.layers} ({n / 1e6:.1f}M parameters), batch {args.batch_size}\n"
                     f"{out['network']}: {net}", args.png)
        out["png"] = args.png
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"layers {args.layers}: {n:,} parameters; network {out['network']}: {net}")
    print(f"measured on this CPU: {t_c * 1e3:.2f} ms of CPU time per mini-batch of "
          f"{args.batch_size} (forward + backward; {m['compute_wall_s'] * 1e3:.2f} ms wall at "
          f"load average {m['load_average']:.1f}), {t_u * 1e9:.2f} ns per parameter per update"
          f"\n  ({m['path']})")
    print(f"\npredicted examples/s (speed-up over one node) per strategy; thresholded "
          f"messages at compression {args.compression:g}, {args.run_steps} steps per replica")
    print("nodes  " + "".join(f"{s:>22}" for s in names))
    for i, k in enumerate(nodes):
        cells = []
        for s in names:
            _, e, x = curves[s][i]
            cells.append(f"{e:>12,.0f} ({x:6.1f}x)" if e > 0 else f"{'-':>22}")
        print(f"{k:>5}  " + "".join(cells))
    for s in without:
        print(f"{s}: {NO_COST_MODEL} (not predicted)")
    number = 0
    for name, check in checks.items():
        number += 1
        print(f"\ncheck {number}, {check['title']} ({name}'s model):")
        print(f"  {'nodes':>5} {'paper':>8} {'model':>8} {'diff':>7}")
        for r in check["rows"]:
            print(f"  {r['nodes']:>5} {r['paper_speedup']:>8.1f} {r['model_speedup']:>8.1f} "
                  f"{100 * r['relative_difference']:>6.1f}%")
    print(f"\ncheck {number + 1}, the emulated cluster (bench/cluster, measured alpha and "
          "beta, ranks sharing this machine's cores): " + ("" if args.validate_cluster else
                                                           "give --validate-cluster JSON"))
    if args.validate_cluster:
        _print_cluster([r for r in out["cluster"] if "no_cost_model" not in r])
        for r in out["cluster"]:
            if "no_cost_model" in r:
                print(f"  {r['network']:>8} {r['strategy']:>12} {r['ranks']:>5} measured "
                      f"{r['measured']:,.0f}: {r['no_cost_model']}")
    if args.png and curves:
        print(f"\nplot: {args.png}")
    return 0


def _print_cluster(rows: list[dict]) -> None:
    """The emulated cluster's table: each modelled run, measured against predicted."""
    if rows:
        print(f"  (cores shared with {rows[0]['background']} runnable threads of "
              "other jobs; pass: a mini-batch's forward and backward on a core alone, "
              "co-run: how much slower with every core computing, by as many processes "
              "as the run had computing where the bench measured so)")
        cpu = any(r.get("pass_in_run_is_cpu_time") for r in rows)
        print("  in run: the same model with the pass as each run timed it, every other "
              "CPU term slowed as much: " + (
                  "its CPU time (the summary's pass_cpu_s; the cores' sharing is the "
                  "model's)" if cpu else "its wall time (the summary's pass_s), runs "
                  "with no more ranks than cores"))
    print(f"  {'network':>8} {'strategy':>12} {'ranks':>5} {'alpha':>9} {'pass':>8} "
          f"{'co-run':>6} {'measured':>10} "
          f"{'predicted':>10} {'diff':>7} {'in run: pass':>15} {'predicted':>10} "
          f"{'diff':>7} {'bytes/step':>12} {'model':>12}")
    for r in rows:
        in_run = (f"{1e3 * r['pass_s_in_run']:>12.2f} ms {r['predicted_in_run']:>10,.0f} "
                  f"{100 * r['relative_difference_in_run']:>6.1f}%"
                  if "pass_s_in_run" in r else f"{'-':>15} {'-':>10} {'-':>7}")
        print(f"  {r['network']:>8} {r['strategy']:>12} {r['ranks']:>5} "
              f"{1e6 * r['alpha_s']:>6,.0f} us {1e3 * r['compute_s']:>5.2f} ms "
              f"{r['co_run']:>6.2f} {r['measured']:>10,.0f} "
              f"{r['predicted']:>10,.0f} {100 * r['relative_difference']:>6.1f}% "
              f"{in_run} {r['bytes_measured']:>12,.0f} {r['bytes_model']:>12,}")
    within = sum(abs(r["relative_difference"]) <= 0.25 for r in rows)
    print(f"  within 25%: {within} of {len(rows)} runs")
    timed = [r for r in rows if "relative_difference_in_run" in r]
    if timed:
        within = sum(abs(r["relative_difference_in_run"]) <= 0.25 for r in timed)
        print(f"  within 25% with each run's own pass time: {within} of {len(timed)} runs "
              "that timed it")
