"""Every strategy on an emulated cluster: K hosts as network namespaces on this machine,
joined by links shaped to 1 Gb/s or 10 Gb/s, MPI over TCP between them; one JSON object.

For each network (``--networks``): bring the hosts up (``netns.sh up K RATE``), measure
MPI's latency and bandwidth between two hosts and in a ring of every rank sending at once
(``pingpong.py``), and again with as many ranks as each throughput run has (``pingpong_at``:
the ring over all of them, the others computing mini-batches during the ping-pong, all sharing
this machine's cores), then train with ``mpiexec.sh`` (one rank per host, each host pinned to
a core: ``launch.sh``):

``throughput``
    every strategy at each of ``--ranks`` (2, 4, 8), a short run of ``--steps`` global
    mini-batches without evaluation or warm start: examples/s and bytes per step from the
    run's summary, and the steady examples/s between its progress records (every 0.1 s,
    without the run's start and end), the median of ``--repeats`` runs.
``time_to_accuracy``
    every strategy at ``--tta-ranks`` ranks for ``--epochs`` epochs, evaluated every
    ``--eval-every`` steps: seconds (of the run's own clock) to the first evaluation at or
    above ``--target``. Sandblaster (a batch method: a step is a pass over the training set)
    runs ``--tta-batch-steps`` L-BFGS iterations instead, evaluated every 5.

A run that fails or exceeds ``--timeout`` is recorded with its error; the bench goes on.

The hosts are taken down when the bench ends, also on an error, Ctrl-C or SIGTERM: no
namespace, veth or bridge is left behind (``netns.sh status`` shows none). Needs root, ``ip``
and ``tc`` (iproute2), and the mpich wheel's mpiexec (hydra).

    sudo python bench/cluster/bench_cluster.py                     # everything, ~30 minutes
    python bench/cluster/bench_cluster.py --networks 1gbit --ranks 2,4 --only throughput

Layouts: downpour runs 1 shard and N-1 replicas, sandblaster 1 shard, a coordinator and N-2
replicas (N >= 3), sync, averaging and deadreckon N replicas. Every host is a namespace of
one 2-core machine: the ranks share its cores, so compute does not scale with N here; what
the bench shows is how each strategy's communication meets the network.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from bench_train import RunError, log, machine, summary_of, train  # noqa: E402
from machine import cpu_features, save  # noqa: E402

from hpcps.strategies.registry import strategies  # noqa: E402

BATCH = 32  # the SGD strategies' mini-batch per replica (hpcps.train's default), as calibrated
NETNS = HERE / "netns.sh"
MPIEXEC = HERE / "mpiexec.sh"


def layout(strategy: str, ranks: int) -> dict | None:
    """The layout a strategy gets on ``ranks`` ranks, None where it cannot run."""
    spec = strategies()[strategy]
    servers = 1 if spec.uses_servers else 0
    replicas = ranks - servers - int(spec.coordinator)
    if replicas < 1:
        return None
    return {"ranks": ranks, "servers": servers, "coordinator": int(spec.coordinator),
            "replicas": replicas}


def hosts_up(k: int, rate: str) -> None:
    subprocess.run([str(NETNS), "up", str(k), rate], check=True)


def hosts_down() -> None:
    subprocess.run([str(NETNS), "down"], check=False)


def pingpong(tmp: Path, ranks: int = 2) -> dict:
    """MPI's alpha and beta between hosts 1 and 2 while ``ranks`` ranks run (the rest
    compute)."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    out = subprocess.run([str(MPIEXEC), "-n", str(ranks), sys.executable,
                          str(HERE / "pingpong.py")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    if out.returncode != 0:
        raise RuntimeError(f"pingpong failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def links(pp: dict) -> str:
    """A ping-pong record in words: the pair's, and the ring's where measured."""
    out = f"alpha {1e6 * pp['alpha_s']:.0f} us, {pp['bandwidth_gbit_s']:.2f} Gb/s"
    if "ring" in pp:
        out += (f"; in a ring of {pp['ranks']}: {1e6 * pp['ring']['alpha_s']:.0f} us, "
                f"{pp['ring']['bandwidth_gbit_s']:.2f} Gb/s")
    if "allreduce" in pp:
        ar = pp["allreduce"]
        out += "; allreduce " + ", ".join(f"{b / 2**20:g} MiB {1e3 * t:.1f} ms"
                                          for b, t in zip(ar["bytes"], ar["seconds"]) if b > 8)
    return out


def common_args(args, progress_every: float = 1000.0) -> list[str]:
    return ["--data", args.data, "--layers", args.layers, "--checkpoint-every", "0",
            "--progress-every", f"{progress_every:g}", "--timeout", str(args.timeout)]


PROGRESS_S = 0.1  # seconds between a throughput run's progress records (steady_rate)


def steady_rate(records: list[dict]) -> float | None:
    """Examples per second between a run's first and last progress record but one (every
    ``PROGRESS_S``): the strategy's steady rate, without the start (connections made at the
    first messages, cold caches, deadreckon's first tau) and the end (the stop vote, the
    final gathers) that the summary's rate includes; None with fewer than three records or
    no step between them (sandblaster: a step is a pass over the training set)."""
    progress = [r for r in records if r.get("kind") == "progress"]
    if len(progress) < 3 or progress[-2]["step"] <= progress[0]["step"]:
        return None
    first, last = progress[0], progress[-2]
    batch = next(r["config"]["batch_size"] for r in records if r.get("kind") == "start")
    return (last["step"] - first["step"]) * batch / (last["time_s"] - first["time_s"])


def length(args, strategy: str) -> list[str]:
    """A short run: ``--steps`` mini-batches, or ``--batch-steps`` whole-batch iterations for
    a batch method (sandblaster: one step is a pass over the training set). Every replica
    trains from the start (``--warmup-steps 0`` where the strategy has a warm start: replica 0
    alone for its first 100-200 steps would be half of a short run), so the examples/s are
    the strategy's steady rate."""
    spec = strategies()[strategy]
    steps = ["--steps", str(args.batch_steps if spec.whole_batch else args.steps)]
    if any(o.name == "warmup_steps" for o in spec.options):
        steps += ["--warmup-steps", "0"]
    return steps


def computing(strategy: str, ranks: int) -> int:
    """The ranks of a run that compute, as the scaling model shares the cores among them:
    all of them, but with a coordinator (sandblaster) only the replicas (the coordinator
    and the shards wait for messages without computing)."""
    lay = layout(strategy, ranks)
    return lay["replicas"] if lay["coordinator"] else ranks


def calibrate(args, processes: int) -> dict:
    """What a step's CPU work costs on this machine right now (the scaling model's inputs:
    :func:`hpcps.tools.scaling.measure_compute` on the bench's data, and
    :func:`hpcps.tools.scaling.measure_together` with ``processes`` computing at once, at least one
    per core: the run's computing ranks, so that the co-run factor also holds what taking
    turns on a core does to a pass, its caches refilled after every switch: 1.3-1.5x with 4
    or 8 processes on the 2 cores, 1.0-1.1x with 2), measured just before a run: a shared
    machine's speed drifts over minutes, and the check of the model compares each run with
    what its own minute measured."""
    from hpcps.tools import scaling
    layers = [int(v) for v in args.layers.split(",")]
    m = scaling.measure_compute(layers, BATCH, data=args.data)
    processes = max(processes, os.cpu_count() or 1)
    together = scaling.measure_together(layers, BATCH, processes, data=args.data)
    return {**{k: v for k, v in m.items() if isinstance(v, float)},
            "co_run": together["slowdown"], "co_run_processes": processes, "path": m["path"]}


def other_load(seconds: float = 1.0, samples: int = 20) -> float:
    """Runnable threads of other jobs on this machine now: ``procs_running`` of /proc/stat
    sampled ``samples`` times over ``seconds``, less the sampler itself (running as it
    reads), averaged. The scaling model shares the cores with them (``Workload.background``).
    The load average is no measure of it here: it still holds the bench's own last run (and
    its calibration's processes) for minutes after they end."""
    seen = []
    for _ in range(samples):
        with open("/proc/stat") as fh:
            line = next(x for x in fh if x.startswith("procs_running"))
        seen.append(max(0, int(line.split()[1]) - 1))
        time.sleep(seconds / samples)
    return statistics.mean(seen)


def throughput(args, strategy: str, ranks: int, tmp: Path) -> dict:
    runs, compute, others = [], [], []
    for i in range(args.repeats):
        compute.append(calibrate(args, computing(strategy, ranks)))
        others.append(other_load())
        work = Path(tempfile.mkdtemp(prefix=f"tp-{strategy}-{ranks}-{i}-", dir=tmp))
        try:
            records = train(str(MPIEXEC), ranks, [
                "--strategy", strategy, *length(args, strategy), "--eval-every", "0",
                *common_args(args, PROGRESS_S)], work, args.timeout)
            s = {**summary_of(records), "steady_examples_per_s": steady_rate(records)}
        except RunError as exc:
            log(f"  {strategy:11} N={ranks}: failed: {str(exc)[:300]}")
            return {"strategy": strategy, **layout(strategy, ranks), "error": str(exc)[-2000:]}
        runs.append(s)
    entry = {"strategy": strategy, **layout(strategy, ranks),
             "steps_trained": runs[0]["steps_trained"]}
    # step_s, pass_s, pass_cpu_s, cpu_s: a replica's iteration, its gradient pass, the
    # pass's CPU time and its process's CPU time per iteration, as the run timed them
    for key in ("examples_per_s", "bytes_per_step", "train_s", "step_s", "pass_s",
                "pass_cpu_s", "cpu_s"):
        if key not in runs[0]:
            continue  # sandblaster: no mini-batch iterations
        values = [r[key] for r in runs]
        entry[key] = statistics.median(values)
        entry[key + "_all"] = values
    steady = [r["steady_examples_per_s"] for r in runs]
    if None not in steady:
        entry["steady_examples_per_s"] = statistics.median(steady)
        entry["steady_examples_per_s_all"] = steady
    entry["compute"] = {k: statistics.median(c[k] for c in compute) if k != "path" else
                        compute[0][k] for k in compute[0]}
    entry["background"] = statistics.mean(others)  # other jobs' runnable threads, just before
    log(f"  {strategy:11} N={ranks}: {entry['examples_per_s']:.0f} examples/s, "
        f"{entry['bytes_per_step']:.0f} bytes/step")
    return entry


def time_to_accuracy(args, strategy: str, ranks: int, tmp: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"tta-{strategy}-{ranks}-", dir=tmp))
    whole = strategies()[strategy].whole_batch
    run = ["--steps", str(args.tta_batch_steps), "--eval-every", "5"] if whole else \
        ["--epochs", str(args.epochs), "--eval-every", str(args.eval_every)]
    try:
        records = train(str(MPIEXEC), ranks, ["--strategy", strategy, *run,
                                              *common_args(args)], work, args.timeout)
    except RunError as exc:
        log(f"  {strategy:11} N={ranks}: failed: {str(exc)[:300]}")
        return {"strategy": strategy, **layout(strategy, ranks), "error": str(exc)[-2000:]}
    s = summary_of(records)
    evals = [r for r in records if r.get("kind") == "eval"]
    hit = next((r for r in evals if (r.get("test_accuracy") or 0.0) >= args.target), None)
    entry = {"strategy": strategy, **layout(strategy, ranks), "target": args.target,
             "time_to_target_s": hit["time_s"] if hit else None,
             "step_at_target": hit["step"] if hit else None,
             "final_test_accuracy": s["test_accuracy"], "epochs": s.get("epoch"),
             "examples_per_s": s["examples_per_s"], "bytes_per_step": s["bytes_per_step"],
             "train_s": s["train_s"], "wall_s": s["wall_s"],
             "evals": [[r["step"], r["time_s"], r["test_accuracy"]] for r in evals]}
    reached = (f"{args.target:.2f} at {hit['time_s']:.1f} s" if hit
               else f"never {args.target:.2f}")
    log(f"  {strategy:11} N={ranks}: {reached}, final {s['test_accuracy']:.4f}")
    return entry


def table(data: dict) -> str:
    """Markdown tables of a finished bench's JSON: throughput, then time to accuracy."""
    lines = []
    for net in data["networks"]:
        pp = net["pingpong"]
        lines.append(f"\n**{net['rate']}** (MPI between two hosts: alpha "
                     f"{pp['alpha_s'] * 1e6:.0f} us, {pp['bandwidth_gbit_s']:.2f} Gb/s)\n")
        lines.append("| strategy | N | layout | examples/s | bytes/step | t97 s | final acc |")
        lines.append("|---|---|---|---|---|---|---|")
        tta = {(r["strategy"], r["ranks"]): r for r in net.get("time_to_accuracy", [])}
        runs = list(net.get("throughput", []))
        seen = {(r["strategy"], r["ranks"]) for r in runs}
        # a time-to-accuracy run with no throughput run of its own (--only time_to_accuracy)
        # gives its own examples/s and bytes/step
        runs += [r for key, r in tta.items() if key not in seen]
        for r in runs:
            lay = f"S={r['servers']} R={r['replicas']}" + (" +coord" if r["coordinator"]
                                                           else "")
            t = tta.get((r["strategy"], r["ranks"]), {})
            t97 = t.get("time_to_target_s")
            t97 = f"{t97:.0f}" if t97 is not None else ("not reached" if t else "")
            acc = f"{t['final_test_accuracy']:.4f}" if t.get("final_test_accuracy") else ""
            eps = (f"{r['examples_per_s']:,.0f}" if "error" not in r else "failed")
            nb = f"{r['bytes_per_step']:,.0f}" if "error" not in r else ""
            lines.append(f"| {r['strategy']} | {r['ranks']} | {lay} | {eps} | {nb} | {t97} | "
                         f"{acc} |")
    return "\n".join(lines)


def check_model(args, names: list[str]) -> dict:
    """The scaling model against runs this machine can make (``--check-model``).

    Speed: every strategy that runs on 2 ranks, each rank a host with a core of its own, on
    each of ``--check-networks`` and each model of ``--check-layers``: the examples/s the
    model predicts (``hpcps.tools.scaling.validate.validate_cluster``: the link measured by
    a ping-pong, the compute calibrated just before each run) against the run's steady rate.
    Bytes: every strategy at each of ``--check-byte-ranks`` (oversubscribed: the cores do not
    enter bytes), the bytes per step the model predicts against those the run counted. One
    JSON object: ``runs``, ``within_15pct`` and ``bytes_within_5pct`` (counts of the rows
    that pass, over the rows judged), and every row."""
    from hpcps.tools.scaling.validate import validate_cluster

    rows: list[dict] = []
    base = {"bench": "cluster", "machine": {**machine(str(MPIEXEC)),
                                            "cpu_features": cpu_features()},
            "batch": BATCH, "data": args.data}

    def judged(bench: dict, tmp: Path, check: str) -> None:
        path = tmp / f"{check}-{len(rows)}.json"
        path.write_text(json.dumps(bench))
        for r in validate_cluster(str(path)):
            rows.append({"check": check, "layers": bench["layers"], **r})

    byte_ranks = [int(v) for v in args.check_byte_ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="check_model-") as tmp_s:
        tmp = Path(tmp_s)
        for layers in args.check_layers.split(";"):
            run = argparse.Namespace(**{**vars(args), "layers": layers})
            bench = {**base, "layers": layers, "networks": []}
            for rate in args.check_networks.split(","):
                hosts_up(2, rate)
                net = {"rate": rate, "hosts": 2, "pingpong": pingpong(tmp)}
                log(f"{layers} at {rate}: {links(net['pingpong'])}")
                net["throughput"] = [throughput(run, s, 2, tmp) for s in names if layout(s, 2)]
                bench["networks"].append(net)
                hosts_down()
            judged(bench, tmp, "speed")
        layers = args.check_layers.split(";")[0]
        run = argparse.Namespace(**{**vars(args), "layers": layers,
                                    "steps": args.check_byte_steps, "repeats": 1})
        rate = args.check_networks.split(",")[-1]
        hosts_up(max(byte_ranks), rate)
        net = {"rate": rate, "hosts": max(byte_ranks), "pingpong": pingpong(tmp)}
        net["throughput"] = [throughput(run, s, n, tmp) for s in names for n in byte_ranks
                             if layout(s, n)]
        hosts_down()
        judged({**base, "layers": layers, "networks": [net]}, tmp, "bytes")
    speed = [r for r in rows if r["check"] == "speed" and "predicted" in r]
    sized = [r for r in rows if "bytes_model" in r and r.get("bytes_measured")]
    for r in sized:
        r["bytes_relative_difference"] = round(r["bytes_model"] / r["bytes_measured"] - 1, 4)
    failed = [r for r in rows if "predicted" not in r]
    return {"runs": len(speed) + len([r for r in sized if r["check"] == "bytes"]),
            "within_15pct": {"passed": sum(abs(r["relative_difference"]) <= 0.15
                                           for r in speed), "of": len(speed)},
            "bytes_within_5pct": {"passed": sum(abs(r["bytes_relative_difference"]) <= 0.05
                                                for r in sized), "of": len(sized)},
            "not_judged": [{k: r.get(k) for k in ("check", "strategy", "ranks", "network",
                                                   "no_cost_model")} for r in failed],
            "rows": rows}


def _stop(signum, frame):  # SIGTERM: unwind through the finally that takes the hosts down
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default="1gbit,10gbit", help="tc rates, e.g. 1gbit,10gbit")
    p.add_argument("--strategies", default=",".join(strategies()))
    p.add_argument("--ranks", default="2,4,8", help="rank counts for the throughput runs")
    p.add_argument("--tta-ranks", type=int, default=4)
    p.add_argument("--only", choices=("throughput", "time_to_accuracy"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-steps", type=int, default=3,
                   help="throughput runs of a batch method (sandblaster): iterations")
    p.add_argument("--tta-batch-steps", type=int, default=10,
                   help="time-to-accuracy runs of a batch method: iterations")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--target", type=float, default=0.97)
    p.add_argument("--data", default=str(HERE.parents[1] / "data" / "mnist.h5"),
                   help="MNIST as HDF5 (default: the repository's data/mnist.h5; "
                        "python -m hpcps.data prepare mnist writes it)")
    p.add_argument("--layers", default="784,512,512,10")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--table", metavar="JSON", help="print the tables of a finished run's JSON")
    p.add_argument("--check-model", action="store_true",
                   help="check the scaling model against this machine: speed on 2 ranks "
                        "(a core each) on every --check-networks rate for every "
                        "--check-layers model, bytes per step at --check-byte-ranks; prints "
                        "one JSON line")
    p.add_argument("--check-networks", default="1gbit,10gbit,25gbit")
    p.add_argument("--check-layers", default="784,512,512,10;784,1024,1024,1024,10",
                   help="models of the speed check, separated by ';'")
    p.add_argument("--check-byte-ranks", default="4,8,16")
    p.add_argument("--check-byte-steps", type=int, default=100)
    args = p.parse_args(argv)
    if args.table:
        try:
            with open(args.table) as fh:
                data = json.load(fh)
            if not isinstance(data, dict) or data.get("bench") != "cluster":
                raise ValueError("no 'bench': 'cluster' record")
        except (OSError, ValueError) as exc:
            p.error(f"--table {args.table}: not this bench's JSON ({exc})")
        print(table(data))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("bench_cluster: network namespaces need root")
    if args.check_model:
        signal.signal(signal.SIGTERM, _stop)
        try:  # the model's workloads are MLPs: the strategies that train them
            result = check_model(args, [s for s in args.strategies.split(",")
                                        if strategies()[s].dense_models])
        finally:
            hosts_down()
        result = {"bench": "cluster_check_model", "command": " ".join(
            [Path(sys.executable).name, *sys.argv]), **result}
        save("bench_cluster_check", result)
        print(json.dumps(result))
        return 0
    rank_list = [int(v) for v in args.ranks.split(",")]
    names = args.strategies.split(",")
    k = max(rank_list + [args.tta_ranks, 2])
    out = {"bench": "cluster", "machine": {**machine(str(MPIEXEC)),
                                           "cpu_features": cpu_features()},
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "layers": args.layers, "batch": BATCH, "data": args.data, "networks": []}
    signal.signal(signal.SIGTERM, _stop)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_cluster-") as tmp:
            tmp = Path(tmp)
            for rate in args.networks.split(","):
                log(f"{rate}: {k} hosts")
                hosts_up(k, rate)
                net = {"rate": rate, "hosts": k, "pingpong": pingpong(tmp)}
                log(f"  MPI between hosts: {links(net['pingpong'])}")
                if args.only in (None, "throughput"):
                    net["pingpong_at"] = {str(n): pingpong(tmp, n) for n in rank_list if n > 2}
                    for n, pp in net["pingpong_at"].items():
                        log(f"  ... with {n} ranks running: {links(pp)}")
                    net["throughput"] = [throughput(args, s, n, tmp) for s in names
                                         for n in rank_list if layout(s, n)]
                if args.only in (None, "time_to_accuracy"):
                    net["time_to_accuracy"] = [time_to_accuracy(args, s, args.tta_ranks, tmp)
                                               for s in names if layout(s, args.tta_ranks)]
                out["networks"].append(net)
                hosts_down()
                print(json.dumps(out), file=sys.stderr, flush=True)  # partial, in case
    finally:
        hosts_down()
    started = time.strftime("%Y-%m-%d")
    out["date"] = started
    print(json.dumps(out, indent=1))
    save("bench_cluster", out)  # bench/results/, for bench/render.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
