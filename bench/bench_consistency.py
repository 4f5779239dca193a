"""Consistency models compared on MNIST: accuracy per epoch, time to accuracy, throughput.

The distributed-training overview this project started from lists the ways replicas can be
kept consistent (synchronous updates, parameter averaging, asynchronous SGD, bounded
staleness, soft synchronization, staleness-dependent rates, Strom's compressed peer-to-peer
updates) but has "no experimental comparisons". This script makes one: every method is a real
``mpiexec -n N python -m hpcps.train`` run on the same data, model (784,512,512,10), batch (32
per replica), seed and epoch budget, and its figures come from the run's ``metrics.jsonl``.

Methods (``--methods``; each a list of ``hpcps.train`` options)
-------------------------------------------------------------------
``sync``                       allreduce every step
``averaging-k1|k4|k16``        average parameters (and Adagrad state) every k iterations
``downpour``                   asynchronous replicas, one parameter-server shard
``downpour-ssp0|ssp2|ssp8``    downpour with ``--staleness-bound`` s (stale-synchronous)
``downpour-softsync2``         a shard applies the mean of every 2 pushes (2, not R: the same
                               rule at every R, and s = R at R = 2)
``downpour-stalelr``           ``--staleness-lr on``: an update of staleness tau steps lr/tau,
                               over groups of R/2 pushes (its default softsync)
``downpour-softsync2-stalelr`` both
``deadreckon``                 Strom's thresholded 1-bit deltas, peer to peer

Each method's own defaults apply otherwise (Adagrad lr 0.01; deadreckon SGD lr 0.1, a 100-step
warm start and ``--lr-scaling sum``; downpour's 200-step warm start). Strategies with server
shards (downpour) run on N = R + 1 ranks with one shard, the others on N = R.

What it records
---------------
``runs``: one record per (method, R) over ``--replicas`` (default 2 4 8): ``status``
(``completed``, ``failed``: non-zero exit or no summary, ``timeout``: killed after
``--timeout`` s with every process below mpiexec), test accuracy after each epoch (evaluated
every epoch's worth of global steps; the nearest evaluation to each whole epoch, the last one
being the final evaluation; a periodic evaluation is of replica 0's own copy, which for
averaging is between two averages and for deadreckon lacks the peers' deltas in flight, the
final one of the final model), the time of the first evaluation at ``--target`` (0.97) or more
(``time_s`` of the run's clock; null if never), examples/s and its ratio to sync's at the same
R, bytes per global step, mean and max staleness (where the strategy reports them), final
accuracy, training and wall seconds, every evaluation, and the strategy's own summary figures.

Two throughputs: ``examples_per_s`` is hpcps's own (global steps x batch over replica 0's
training seconds), ``examples_per_wall_s`` the same examples over the run's whole wall time
(the summary's ``wall_s``: start-up and final evaluation included). They differ when replica 0
finishes before the others: downpour's replicas each run a fixed share of the steps, so with a
straggler replica 0's clock stops while the straggler is still training, and only the second
counts its tail.

``many_replicas``: deadreckon, whose every replica applies every other replica's updates, also
at R = 12 and 16 (``--many-replicas``; oversubscribed on small machines).

``slow_replica``: R = 4 with world rank 1 (a replica for every strategy: replicas take the
first ranks) made 3x slower (``--inject-slow 1:3``) for sync, averaging-k4, downpour,
downpour-ssp2 and deadreckon, each with both throughputs relative to sync's and to its own
healthy R = 4 run (when that was run).

``problems`` lists every run that failed, timed out, or did not learn (final accuracy below
0.5), with the tail of its output. The JSON also records the machine (CPU, its avx2/fma/avx512f
flags, cores, MPI, date) and the command. Progress goes to stderr; only the JSON to stdout (and
to ``--out``, rewritten after every run). Exit status 1 if any run failed or timed out.

Usage::

    python bench/bench_consistency.py --data /path/mnist.h5 --out consistency.json
    python bench/bench_consistency.py --epochs 2 --replicas 2 4      # a reduced comparison
    python bench/bench_consistency.py --quick                        # digits, R = 2, a smoke test
    python bench/bench_consistency.py --set 'averaging-k4=--optimizer momentum --lr 0.05'

On a 2-core machine every R > 2 is oversubscribed (downpour already at R = 2), so examples/s
shows the cost of time-sharing cores, not scaling; oversubscription also makes asynchronous
methods staler than they would be with a core per rank. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_train  # noqa: E402  (sibling script: mpiexec, metrics records)
import soak_ranks  # noqa: E402  (sibling script: machine info, killing a run's process tree)

ROOT = HERE.parent

METHODS: dict[str, list[str]] = {
    "sync": ["--strategy", "sync"],
    "averaging-k1": ["--strategy", "averaging", "--average-every", "1"],
    "averaging-k4": ["--strategy", "averaging", "--average-every", "4"],
    "averaging-k16": ["--strategy", "averaging", "--average-every", "16"],
    "downpour": ["--strategy", "downpour"],
    "downpour-ssp0": ["--strategy", "downpour", "--staleness-bound", "0"],
    "downpour-ssp2": ["--strategy", "downpour", "--staleness-bound", "2"],
    "downpour-ssp8": ["--strategy", "downpour", "--staleness-bound", "8"],
    "downpour-softsync2": ["--strategy", "downpour", "--softsync", "2"],
    "downpour-stalelr": ["--strategy", "downpour", "--staleness-lr", "on"],
    "downpour-softsync2-stalelr": ["--strategy", "downpour", "--softsync", "2",
                                   "--staleness-lr", "on"],
    "deadreckon": ["--strategy", "deadreckon"],
}
SLOW_METHODS = ("sync", "averaging-k4", "downpour", "downpour-ssp2", "deadreckon")
SLOW_R, SLOW_RANK, SLOW_FACTOR = 4, 1, 3
# Deadreckon is the method whose every replica applies every other's updates: it alone is
# also run at the replica counts of --many-replicas.
MANY_METHODS = ("deadreckon",)
LEARN_FLOOR = 0.5   # final accuracy below this: "did not learn" (chance is 0.1)

FULL = {"data": ROOT / "data" / "mnist.h5", "layers": "784,512,512,10", "epochs": 4.0,
        "replicas": [2, 4, 8], "many_replicas": [12, 16], "target": 0.97, "timeout": 1800.0,
        "strategy_options": {}}
# --quick: scikit-learn's digits (1437 training images, an epoch is 45 steps) and a small
# model; 2 epochs at R = 2 only, plus the slowed R = 4 runs. Downpour's and deadreckon's warm
# starts are cut to 10 steps: their defaults (200, 100) are longer than the whole run, which
# would leave replica 0 alone and every downpour variant the same run.
QUICK = {"data": None, "layers": "64,64,10", "epochs": 2.0, "replicas": [2],
         "many_replicas": [], "target": 0.9, "timeout": 120.0,
         "strategy_options": {"downpour": ["--warmup-steps", "10"],
                              "deadreckon": ["--warmup-steps", "10"]}}
BATCH = 32
# Summary keys reported in every record; the rest of the summary goes to "figures".
COMMON = ("examples_per_s", "bytes_per_step", "mean_staleness", "max_staleness",
          "test_accuracy", "train_s", "wall_s", "steps_trained", "epoch")
DROP = ("kind", "time_s", "strategy", "ranks", "servers", "replicas", "partitions", "threads",
        "step", "checkpoint", "test_loss")


def log(text: str) -> None:
    print(f"[consistency] {text}", file=sys.stderr, flush=True)


# -- one run -----------------------------------------------------------------------------------
def launch(mpiexec: str, ranks: int, args: list[str], work: Path, timeout: float) -> dict:
    """Run ``hpcps.train`` on ``ranks`` ranks under a hard wall-clock limit.

    Returns ``status``, ``exit_code``, ``wall_s``, ``records`` (metrics.jsonl) and, unless it
    completed, ``tail`` (the end of its output). On a timeout, and on Ctrl-C, mpiexec and every
    process below it are killed: MPICH's hydra proxy puts the ranks in their own session.
    """
    run_dir = work / "run"
    cmd = bench_train.train_command(mpiexec, ranks, run_dir, args)
    out_path = work / "output.log"
    res: dict = {"status": None, "exit_code": None, "command": " ".join(cmd)}
    t0 = time.monotonic()
    with open(out_path, "wb") as out:
        proc = bench_train.start(cmd, out)
        try:
            res["exit_code"] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            res["status"] = "timeout"
        finally:
            if res["exit_code"] is None:
                soak_ranks.kill_tree(proc.pid)
                proc.wait()
    res["wall_s"] = round(time.monotonic() - t0, 1)
    metrics = run_dir / "metrics.jsonl"
    try:
        res["records"] = bench_train.read_metrics(metrics) if metrics.exists() else []
    except ValueError:  # a line cut short by the kill
        res["records"] = []
    if res["status"] is None:
        ok = res["exit_code"] == 0 and any(r.get("kind") == "summary" for r in res["records"])
        res["status"] = "completed" if ok else "failed"
    if res["status"] != "completed":
        res["tail"] = soak_ranks.tail(out_path, 25)
    return res


def accuracy_points(records: list[dict]) -> list[tuple[float, float, float]]:
    """(epoch, time_s, test accuracy) of every evaluation, the summary's final one last."""
    pts = [(r["epoch"], r["time_s"], r["test_accuracy"]) for r in records
           if r.get("kind") in ("eval", "summary") and r.get("test_accuracy") is not None]
    return sorted(pts, key=lambda p: (p[0], p[1]))


def per_epoch(points: list[tuple], epochs: float) -> tuple[list, list]:
    """Accuracy at each whole epoch (and at ``epochs`` if fractional): the evaluation nearest
    to it within half an epoch (the later one of a tie, so the end of the run is the final
    evaluation), else None; also the epochs those evaluations were made at.

    Replica 0 evaluates every ``eval_every / R`` of its own mini-batches, so an evaluation
    lands near, not on, the epoch when replica 0 runs ahead of the others (downpour: replica 0
    trains the warm start alone, so its evaluations come early in global epochs)."""
    marks = list(range(1, int(epochs) + 1)) + ([epochs] if epochs != int(epochs) else [])
    accs, at = [], []
    for e in marks:
        near = min(points, key=lambda p: (abs(p[0] - e), -p[1]), default=None)
        hit = near is not None and abs(near[0] - e) <= 0.5
        accs.append(round(near[2], 4) if hit else None)
        at.append(round(near[0], 3) if hit else None)
    return accs, at


def describe(method: str, replicas: int, ranks: int, servers: int, res: dict,
             target: float, epochs: float) -> dict:
    """The JSON record of one run."""
    rec = {"method": method, "options": METHODS[method], "replicas": replicas, "ranks": ranks,
           "servers": servers, "status": res["status"], "exit_code": res["exit_code"],
           "wall_s": res["wall_s"]}
    summary = next((r for r in res["records"] if r.get("kind") == "summary"), {})
    points = accuracy_points(res["records"])
    accs, at = per_epoch(points, epochs)
    hit = next((p for p in points if p[2] >= target), None)
    rec.update({"accuracy_per_epoch": accs, "accuracy_measured_at_epoch": at,
                "time_to_target_s": hit[1] if hit else None,
                "epoch_at_target": round(hit[0], 3) if hit else None,
                "final_test_accuracy": summary.get("test_accuracy"),
                "examples_per_s": summary.get("examples_per_s"),
                "examples_per_s_vs_sync": None,
                "examples_per_wall_s": rate(summary, "wall_s"),
                "examples_per_wall_s_vs_sync": None,
                "bytes_per_step": summary.get("bytes_per_step"),
                "mean_staleness": summary.get("mean_staleness"),
                "max_staleness": summary.get("max_staleness"),
                "train_s": summary.get("train_s"), "run_wall_s": summary.get("wall_s"),
                "steps_trained": summary.get("steps_trained"),
                "epochs_trained": summary.get("epoch"),
                "evals": [[round(p[0], 3), p[1], round(p[2], 4)] for p in points],
                "figures": {k: v for k, v in summary.items() if k not in COMMON + DROP}})
    if res["status"] != "completed":
        rec["tail"] = res["tail"]
    return rec


def rate(summary: dict, seconds_key: str) -> float | None:
    """Global steps x batch over the summary's ``seconds_key``, or None."""
    steps, seconds = summary.get("steps_trained"), summary.get(seconds_key)
    return round(steps * BATCH / seconds, 1) if steps is not None and seconds else None


def line(rec: dict) -> str:
    """One progress line for stderr."""
    accs = " ".join("-" if a is None else f"{a:.4f}" for a in rec["accuracy_per_epoch"])
    t97 = rec["time_to_target_s"]
    eps, stale = rec["examples_per_s"], rec["mean_staleness"]
    return (f"{rec['method']:27} R={rec['replicas']} N={rec['ranks']} {rec['status']:9} "
            f"acc/epoch [{accs}] t_target {'-' if t97 is None else f'{t97:.1f} s'} "
            f"{'-' if eps is None else f'{eps:.0f}'} ex/s staleness "
            f"{'-' if stale is None else f'{stale:.2f}'}/{rec['max_staleness']} "
            f"wall {rec['wall_s']:.1f} s")


# -- the comparison ----------------------------------------------------------------------------
def dataset_shape(path: Path) -> tuple[int, int]:
    """(training examples, features) of a dataset file."""
    import h5py

    with h5py.File(path, "r") as f:
        n, d = f["train/x"].shape
    return int(n), int(d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=float, help="epochs of every run (default 4; 2 --quick)")
    p.add_argument("--replicas", type=int, nargs="+",
                   help="replica counts R (default 2 4 8; 2 with --quick)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                   help=f"methods to run (default all): {', '.join(METHODS)}")
    p.add_argument("--many-replicas", type=int, nargs="*",
                   help=f"replica counts at which {', '.join(MANY_METHODS)} also runs "
                        "(default 12 16; none with --quick; give no value for none)")
    p.add_argument("--no-slow", action="store_true", help="skip the slowed-replica runs")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: digits (prepared in a temporary directory), layers "
                        "64,64,10, 2 epochs of 45 steps, R = 2 and the slowed R = 4 runs")
    p.add_argument("--data", type=Path, help="MNIST-shaped HDF5 dataset (default "
                   "data/mnist.h5; with --quick, a fresh digits file)")
    p.add_argument("--target", type=float, help="test accuracy for time-to-target "
                   "(default 0.97; 0.9 with --quick)")
    p.add_argument("--timeout", type=float, help="seconds one run may take before it is "
                   "killed and recorded as timeout (default 1800; 120 with --quick)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD=OPTIONS",
                   help="extra hpcps.train options of one method (repeatable), e.g. "
                        "'averaging-k4=--optimizer momentum --lr 0.05'; recorded with each "
                        "run")
    p.add_argument("--out", type=Path, help="also write the JSON here (after every run)")
    p.add_argument("--table", type=Path, metavar="JSON",
                   help="run nothing: print the markdown tables of a JSON this script wrote")
    return p


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _label(rec: dict) -> str:
    """Method name and the options --set gave it."""
    extra = rec["options"][len(METHODS[rec["method"]]):]
    return rec["method"] + (f" ({' '.join(extra)})" if extra else "")


def tables(doc: dict) -> str:
    """Markdown tables of a comparison: the runs (and the many-replica runs), then the slowed
    replica's runs."""
    epochs = max(len(r["accuracy_per_epoch"]) for r in doc["runs"])
    columns = ["method", "R", *(f"acc {i + 1}" for i in range(epochs)), "t97 s",
               "examples/s", "vs sync", "bytes/step", "staleness mean / max"]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in doc["runs"] + doc.get("many_replicas", []):
        accs = " | ".join(_num(a, ".4f") for a in r["accuracy_per_epoch"])
        stale = _num(r["mean_staleness"], ".2f")
        if r["max_staleness"] is not None:
            stale += f" / {r['max_staleness']:.0f}"
        out.append(f"| {_label(r)} | {r['replicas']} | {accs} | "
                   f"{_num(r['time_to_target_s'], '.1f')} | {_num(r['examples_per_s'], ',.0f')} "
                   f"| {_num(r.get('examples_per_s_vs_sync'), '.2f')} | "
                   f"{_num(r['bytes_per_step'], ',.0f')} | {stale} |")
    if doc.get("slow_replica"):
        out += ["", "| method | final acc | examples/s of wall time | vs sync | "
                "vs the same method healthy |", "|---|---|---|---|---|"]
        for r in doc["slow_replica"]:
            out.append(f"| {_label(r)} | {_num(r['final_test_accuracy'], '.4f')} | "
                       f"{_num(r['examples_per_wall_s'], ',.0f')} | "
                       f"{_num(r.get('examples_per_wall_s_vs_sync'), '.2f')} | "
                       f"{_num(r.get('examples_per_wall_s_vs_healthy'), '.2f')} |")
    return "\n".join(out)


def method_options(items: list[str], p: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``METHOD=OPTIONS`` arguments as {method: [option, ...]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        method, _, options = item.partition("=")
        if method not in METHODS or not options.strip():
            p.error(f"--set wants METHOD=OPTIONS with a method of {', '.join(METHODS)}, "
                    f"got {item!r}")
        out[method] = out.get(method, []) + shlex.split(options)
    return out


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.table:
        print(tables(json.loads(a.table.read_text())))
        return 0
    prof = dict(QUICK if a.quick else FULL)
    for key in ("epochs", "replicas", "many_replicas", "target", "timeout", "data"):
        if getattr(a, key) is not None:
            prof[key] = getattr(a, key)
    if (prof["epochs"] <= 0 or min(prof["replicas"] + prof["many_replicas"]) < 1
            or prof["timeout"] <= 0):
        p.error("--epochs and --timeout must be > 0, --replicas and --many-replicas >= 1")
    methods = a.methods or list(METHODS)
    extra_opts = method_options(a.set, p)
    mpiexec = bench_train.find_mpiexec()
    shards = {name: t["shards"] for name, t in soak_ranks.strategy_traits().items()}
    t_start = time.monotonic()
    doc: dict = {"machine": soak_ranks.machine_info(mpiexec),
                 "command": [sys.executable, *sys.argv], "complete": False}
    bad = 0
    with tempfile.TemporaryDirectory(prefix="consistency-") as tmp:
        tmp = Path(tmp)
        if prof["data"] is None:
            prof["data"] = tmp / "digits.h5"
            subprocess.run([sys.executable, "-m", "hpcps.data", "prepare", "digits", "--out",
                            str(prof["data"])], cwd=ROOT, check=True, stdout=sys.stderr)
        data = Path(prof["data"]).resolve()
        if not data.is_file():
            p.error(f"dataset {data} not found (python -m hpcps.data prepare mnist)")
        n_train, n_features = dataset_shape(data)
        if int(prof["layers"].split(",")[0]) != n_features:
            p.error(f"{data} has {n_features} features; this bench's model is {prof['layers']}")
        eval_every = math.ceil(n_train / BATCH)  # one epoch's global steps
        doc["settings"] = {"quick": a.quick, "data": str(data), "n_train": n_train,
                           "layers": prof["layers"], "batch_size": BATCH,
                           "epochs": prof["epochs"], "eval_every": eval_every,
                           "target": prof["target"], "timeout_s": prof["timeout"],
                           "strategy_options": prof["strategy_options"],
                           "method_options": extra_opts,
                           "slow": None if a.no_slow else
                           {"replicas": SLOW_R, "inject_slow": f"{SLOW_RANK}:{SLOW_FACTOR}"},
                           "nproc": os.cpu_count()}
        doc["settings"]["many_replicas"] = {"replicas": prof["many_replicas"],
                                            "methods": list(MANY_METHODS)}
        doc["runs"], doc["slow_replica"], doc["many_replicas"] = [], [], []
        common = ["--data", str(data), "--layers", prof["layers"], "--batch-size", str(BATCH),
                  "--epochs", str(prof["epochs"]), "--eval-every", str(eval_every),
                  "--checkpoint-every", "0", "--progress-every", "60"]

        def run(method: str, R: int, extra: list[str]) -> dict:
            nonlocal bad
            strategy = METHODS[method][1]
            servers = 1 if shards[strategy] else 0
            opts = [*METHODS[method], *(["--servers", "1"] if servers else []), *common,
                    *prof["strategy_options"].get(strategy, []),
                    *extra_opts.get(method, []), *extra]
            work = Path(tempfile.mkdtemp(prefix=f"{method}-{R}-", dir=tmp))
            res = launch(mpiexec, R + servers, opts, work, prof["timeout"])
            rec = describe(method, R, R + servers, servers, res, prof["target"],
                           prof["epochs"])
            rec["options"] = [*rec["options"], *extra_opts.get(method, [])]
            bad += rec["status"] != "completed"
            log(line(rec))
            return rec

        def save() -> None:
            if a.out:
                a.out.write_text(json.dumps(doc, indent=2) + "\n")

        for R in prof["replicas"]:
            for method in methods:
                doc["runs"].append(run(method, R, []))
                save()
        for R in prof["many_replicas"]:
            for method in (m for m in MANY_METHODS if m in methods):
                doc["many_replicas"].append(run(method, R, []))
                save()
        slow = [] if a.no_slow else [m for m in SLOW_METHODS if m in methods]
        for method in slow:
            doc["slow_replica"].append(run(method, SLOW_R, ["--inject-slow",
                                                            f"{SLOW_RANK}:{SLOW_FACTOR}"]))
            save()

    def ratio(x, y):
        return round(x / y, 3) if x is not None and y else None

    for key in ("examples_per_s", "examples_per_wall_s"):
        sync_at = {r["replicas"]: r[key] for r in doc["runs"] if r["method"] == "sync"}
        for r in doc["runs"]:
            r[key + "_vs_sync"] = ratio(r[key], sync_at.get(r["replicas"]))
        healthy = {r["method"]: r[key] for r in doc["runs"] if r["replicas"] == SLOW_R}
        slow_sync = next((r[key] for r in doc["slow_replica"] if r["method"] == "sync"), None)
        for r in doc["slow_replica"]:
            r[key + "_vs_sync"] = ratio(r[key], slow_sync)
            r[key + "_vs_healthy"] = ratio(r[key], healthy.get(r["method"]))
    doc["problems"] = [
        {"method": r["method"], "replicas": r["replicas"], "slowed": slowed,
         "problem": r["status"] if r["status"] != "completed" else
         f"did not learn (final accuracy {r['final_test_accuracy']})",
         "tail": r.get("tail")}
        for slowed, part in ((False, doc["runs"]), (False, doc["many_replicas"]),
                             (True, doc["slow_replica"])) for r in part
        if r["status"] != "completed" or (r["final_test_accuracy"] or 0.0) < LEARN_FLOOR]
    doc["total_s"] = round(time.monotonic() - t_start, 1)
    doc["complete"] = True
    text = json.dumps(doc, indent=2)
    print(text)
    from machine import save  # bench/machine.py
    save("bench_consistency", doc)  # bench/results/, for bench/render.py
    if a.out:
        a.out.write_text(text + "\n")
    n_runs = len(doc["runs"]) + len(doc["many_replicas"]) + len(doc["slow_replica"])
    log(f"{n_runs} runs in {doc['total_s']:.0f} s, "
        f"{bad} failed or timed out, {len(doc['problems'])} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
