"""Benchmark the fault-tolerant parameter server; print one JSON object.

What it measures (``docs/fault-tolerance.md`` has the figures and what they mean)
----------------------------------------------------------------------------------
``chunk_balance``
    Pure, no MPI: for models of 1.86M (MNIST 784-1024-1024-10), 100M and 1G float32
    parameters cut into 1 MiB chunks over S = 2, 4, 8, 16 shards: the largest shard over the
    mean (1.0 is perfect), the fraction of chunks that move when one shard leaves (the
    largest over which shard leaves; 1/S is the least possible), and the time to compute
    the plan.
``heartbeats``
    Downpour on N = 4 ranks (1 shard, 3 replicas), MNIST's default model, ``--steps`` global
    steps, with and without ``--heartbeat-timeout`` (ranks started through
    ``python -m hpcps.keeper`` with ``mpiexec -disable-auto-cleanup`` in both): training
    examples/s, median and every value over ``--repeats`` runs.
``replica_loss``
    The same run with ``--heartbeat-timeout`` in which rank 2 (replica 2) is SIGKILLed once
    the run passes a third of its steps: whether it completes, the lost ranks the summary
    names, how long the shards went without hearing from the dead replica before dropping it
    (``lost_detected_s``), test accuracy against the healthy runs', examples/s.

``quorum``
    Project Adam's end of epoch: downpour on N = 5 ranks (1 shard, 4 replicas), the
    adam-mnist conv model (compute-bound, so a slow replica shows), ``--epochs`` 2, replica 3
    made 3x slower (``--inject-slow 3:3``); without ``--epoch-quorum`` (no epoch barrier),
    with ``--epoch-quorum 1`` (every replica finishes every epoch) and with ``0.75``: the
    time of each epoch as server shard 0 ended it, the run's wall time, global steps taken,
    mini-batches the straggler left, and test accuracy, over ``--repeats`` runs. Needs MNIST
    with its image shape (``python -m hpcps.data prepare mnist`` writes it).

``persist``
    Downpour on N = 4 ranks (1 shard, 3 replicas), MNIST 784-1024-1024-10 (1.86M parameters,
    Adagrad: 14.9 MB of state per shard), ``--steps``: examples/s without persistence and
    with ``--persist-every`` 1 s and 0.1 s (median over ``--repeats``, alternated), and from
    the shard: flushes, rounds skipped while the writer was busy, seconds spent copying
    snapshots (the only pause of service) and writing, the largest window of steps applied
    and not yet on disk.

``copies``
    Replicated shards: downpour on N = 6 ranks (3 shards, 3 replicas), MNIST's default model,
    ``--steps``, ``--heartbeat-timeout 5``, with ``--ps-copies`` 1, 2 and 3 (alternated):
    examples/s, median over ``--repeats``. Then ``failover``: ``--ps-copies 2`` with server
    shard 0 (rank 3, the primary of set 0) SIGKILLed a third of the way in: whether the run
    completes, pushes committed against pushes each set applied, uncommitted pushes sent
    again, how long the successor went without hearing from the dead shard before taking
    over (``silent_s``), the seconds from the kill to the first request the successor served
    for the set (``kill_to_served_s``), and test accuracy against the healthy 2-copy runs'.

Usage::

    python bench/bench_ps.py                  # everything (several minutes on 2 cores)
    python bench/bench_ps.py --only chunks    # the pure part, seconds
    python bench/bench_ps.py --only quorum --repeats 2
    python bench/bench_ps.py --only persist --repeats 3
    python bench/bench_ps.py --only copies --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "tests")]

from bench_train import (RunError, _kill_group, find_mpiexec, log, machine,  # noqa: E402
                         read_metrics, start, summary_of)
from machine import cpu_features, save  # noqa: E402

MIB = 1 << 18  # float32 elements per 1 MiB chunk


def bench_chunks() -> list[dict]:
    from hpcps.ps.chunks import ChunkPlan, moved_fraction
    out = []
    for n in (1_863_690, 100_000_000, 1_000_000_000):
        for S in (2, 4, 8, 16):
            if -(-n // MIB) < S:
                continue
            t = time.perf_counter()
            plan = ChunkPlan(n, MIB, S)
            plan_s = time.perf_counter() - t
            moved = max(moved_fraction(plan, ChunkPlan(n, MIB, S, alive=[s for s in range(S)
                                                                         if s != gone]))
                        for gone in range(S))
            out.append({"params": n, "chunks": plan.n_chunks, "shards": S,
                        "largest_over_mean": round(plan.balance(), 4),
                        "moved_when_one_leaves": round(moved, 4), "least_possible": round(1 / S, 4),
                        "plan_s": round(plan_s, 4)})
            log(f"chunks: {out[-1]}")
    return out


def command(mpiexec: str, run_dir: Path, args: list[str], n: int = 4) -> list[str]:
    return [mpiexec, "-disable-auto-cleanup", "-n", str(n), sys.executable, "-m",
            "hpcps.keeper", "--run-dir", str(run_dir), *args]


def run(mpiexec: str, workdir: Path, args: list[str], timeout: float,
        kill_at: int | None = None, n: int = 4, victim: int = 2, killed: list | None = None
        ) -> dict:
    """One run; with ``kill_at``, SIGKILL rank ``victim`` once the run reaches that global
    step (and append the time of the kill to ``killed``)."""
    from faultinject import kill_rank, wait_for_step
    run_dir = workdir / "run"
    with open(workdir / "output.log", "wb") as out:
        proc = start(command(mpiexec, run_dir, args, n), out)
        try:
            if kill_at is not None:
                wait_for_step(run_dir / "metrics.jsonl", kill_at, timeout)
                kill_rank(proc.pid, victim)
                if killed is not None:
                    killed.append(time.time())
            code = proc.wait(timeout=timeout)
        except BaseException:
            _kill_group(proc)
            raise
    if code != 0:
        raise RunError(f"exit status {code}; see {workdir / 'output.log'}")
    return summary_of(read_metrics(run_dir / "metrics.jsonl"))


def bench_faults(mpiexec: str, tmp: Path, data: str, steps: int, repeats: int,
                 timeout: float) -> dict:
    base = ["--data", data, "--steps", str(steps), "--eval-every", "0",
            "--checkpoint-every", "0", "--progress-every", "1", "--timeout", "60"]
    beat = ["--heartbeat-timeout", "5"]
    rates: dict[str, list] = {"without": [], "with": []}
    accuracy = []
    for i in range(repeats):
        for name, extra in (("without", []), ("with", beat)):
            d = tmp / f"hb-{name}-{i}"
            d.mkdir()
            s = run(mpiexec, d, base + extra, timeout)
            rates[name].append(s["examples_per_s"])
            if name == "with":
                accuracy.append(s["test_accuracy"])
            log(f"heartbeats {name} #{i}: {s['examples_per_s']} examples/s")
    heartbeats = {k: {"examples_per_s_median": statistics.median(v), "examples_per_s": v}
                  for k, v in rates.items()}
    heartbeats["ratio_with_over_without"] = round(
        heartbeats["with"]["examples_per_s_median"] /
        heartbeats["without"]["examples_per_s_median"], 3)
    losses = []
    for i in range(repeats):
        d = tmp / f"loss-{i}"
        d.mkdir()
        s = run(mpiexec, d, base + beat, timeout, kill_at=steps // 3)
        losses.append({"lost_ranks": s["lost_ranks"], "lost_why": s["lost_why"],
                       "lost_detected_s": s["lost_detected_s"],
                       "step": s["step"], "test_accuracy": s["test_accuracy"],
                       "examples_per_s": s["examples_per_s"]})
        log(f"replica loss #{i}: {losses[-1]}")
    return {"heartbeats": heartbeats,
            "replica_loss": {"runs": losses,
                             "healthy_test_accuracy": accuracy,
                             "lost_detected_s_median": statistics.median(
                                 v for r in losses for v in r["lost_detected_s"].values())}}


def alternated(mpiexec: str, tmp: Path, kind: str, settings, base: list[str], repeats: int,
               timeout: float, keys: tuple[str, ...], n: int = 4) -> dict[str, dict]:
    """Run every setting ``(name, extra options)`` ``repeats`` times, alternating them so
    that drifts of load hit each alike; per setting, each run's summary figures ``keys``
    (those it has) and its wall time."""
    out: dict[str, dict] = {name: {"runs": []} for name, _ in settings}
    for i in range(repeats):
        for name, extra in settings:
            d = tmp / f"{kind}-{name}-{i}"
            d.mkdir()
            t = time.perf_counter()
            s = run(mpiexec, d, base + extra, timeout, n=n)
            got = {"wall_s": round(time.perf_counter() - t, 2),
                   **{k: s[k] for k in keys if k in s}}
            out[name]["runs"].append(got)
            log(f"{kind} {name} #{i}: {got}")
    return out


QUORUMS = (("no_barrier", []), ("quorum_1", ["--epoch-quorum", "1"]),
           ("quorum_0.75", ["--epoch-quorum", "0.75"]))


def bench_quorum(mpiexec: str, tmp: Path, data: str, epochs: float, repeats: int,
                 timeout: float) -> dict:
    base = ["--data", data, "--model", "adam-mnist", "--epochs", str(epochs),
            "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "5",
            "--inject-slow", "3:3", "--timeout", "120"]
    out = alternated(mpiexec, tmp, "quorum", QUORUMS, base, repeats, timeout,
                     ("train_s", "step", "test_accuracy", "epoch_s", "epoch_left_steps",
                      "epoch_finished"), n=5)
    for name, doc in out.items():
        runs = doc["runs"]
        doc["train_s_median"] = statistics.median(r["train_s"] for r in runs)
        epoch_s = [t for r in runs for t in r.get("epoch_s", [])]
        doc["epoch_s_median"] = statistics.median(epoch_s) if epoch_s else \
            round(doc["train_s_median"] / epochs, 3)  # no barrier: the run's mean epoch
    out["epoch_time_ratio_0.75_over_1"] = round(out["quorum_0.75"]["epoch_s_median"] /
                                                out["quorum_1"]["epoch_s_median"], 3)
    return out


PERSIST = (("none", []), ("every_1s", ["--persist-every", "1"]),
           ("every_0.1s", ["--persist-every", "0.1"]))


def bench_persist(mpiexec: str, tmp: Path, data: str, steps: int, repeats: int,
                  timeout: float) -> dict:
    base = ["--data", data, "--layers", "784,1024,1024,10", "--steps", str(steps),
            "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "5",
            "--timeout", "120"]
    out = alternated(mpiexec, tmp, "persist", PERSIST, base, repeats, timeout,
                     ("examples_per_s", "step", "train_s", "persist_flushes",
                      "persist_skipped_rounds", "persist_bytes", "persist_write_s",
                      "persist_copy_s", "persist_max_window_steps"))
    for doc in out.values():
        doc["examples_per_s_median"] = statistics.median(r["examples_per_s"]
                                                         for r in doc["runs"])
    for name in ("every_1s", "every_0.1s"):
        out[f"ratio_{name}_over_none"] = round(out[name]["examples_per_s_median"] /
                                               out["none"]["examples_per_s_median"], 3)
    return out


COPIES = tuple((f"copies_{c}", ["--ps-copies", str(c)]) for c in (1, 2, 3))


def bench_copies(mpiexec: str, tmp: Path, data: str, steps: int, repeats: int,
                 timeout: float) -> dict:
    base = ["--data", data, "--steps", str(steps), "--servers", "3", "--eval-every", "0",
            "--checkpoint-every", "0", "--progress-every", "1", "--timeout", "60",
            "--heartbeat-timeout", "5"]
    out = alternated(mpiexec, tmp, "copies", COPIES, base, repeats, timeout,
                     ("examples_per_s", "step", "test_accuracy", "pushes_committed",
                      "ps_applied"), n=6)
    for doc in out.values():
        doc["examples_per_s_median"] = statistics.median(r["examples_per_s"]
                                                         for r in doc["runs"])
    for c in (2, 3):
        out[f"ratio_copies_{c}_over_1"] = round(out[f"copies_{c}"]["examples_per_s_median"] /
                                                out["copies_1"]["examples_per_s_median"], 3)
    runs = []
    for i in range(repeats):
        d = tmp / f"failover-{i}"
        d.mkdir()
        killed: list[float] = []
        s = run(mpiexec, d, base + ["--ps-copies", "2"], timeout, kill_at=steps // 3, n=6,
                victim=3, killed=killed)
        took = [t for t in s["takeovers"] if t["from_shard"] == 0]
        runs.append({"lost_ranks": s["lost_ranks"], "step": s["step"],
                     "pushes_committed": s["pushes_committed"], "ps_applied": s["ps_applied"],
                     "resent_pushes": s["resent_pushes"], "takeovers": s["takeovers"],
                     "silent_s": [t["silent_s"] for t in took],
                     "kill_to_served_s": [round(t["first_served_at"] - killed[0], 3)
                                          for t in took if t["first_served_at"]],
                     "test_accuracy": s["test_accuracy"],
                     "examples_per_s": s["examples_per_s"]})
        log(f"failover #{i}: {runs[-1]}")
    out["failover"] = {"runs": runs, "kill_to_served_s_median": statistics.median(
        v for r in runs for v in r["kill_to_served_s"]) if any(
        r["kill_to_served_s"] for r in runs) else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("chunks", "faults", "quorum", "persist", "copies"))
    ap.add_argument("--data", default=str(ROOT / "data" / "mnist.h5"))
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=2, help="quorum: epochs per run")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    mpiexec = find_mpiexec()
    out = {"bench": "bench_ps", "machine": {**machine(mpiexec), "cpu_features": cpu_features()},
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    if args.only in (None, "chunks"):
        out["chunk_balance"] = bench_chunks()
    if args.only in (None, "faults"):
        with tempfile.TemporaryDirectory(prefix="bench_ps-") as tmp:
            out.update(bench_faults(mpiexec, Path(tmp), args.data, args.steps, args.repeats,
                                    args.timeout))
    if args.only in (None, "persist"):
        with tempfile.TemporaryDirectory(prefix="bench_ps-") as tmp:
            out["persist"] = bench_persist(mpiexec, Path(tmp), args.data, args.steps,
                                           args.repeats, args.timeout)
    if args.only in (None, "copies"):
        with tempfile.TemporaryDirectory(prefix="bench_ps-") as tmp:
            out["copies"] = bench_copies(mpiexec, Path(tmp), args.data, args.steps,
                                         args.repeats, args.timeout)
    if args.only in (None, "quorum"):
        with tempfile.TemporaryDirectory(prefix="bench_ps-") as tmp:
            out["quorum"] = bench_quorum(mpiexec, Path(tmp), args.data, args.epochs,
                                         args.repeats, args.timeout)
    print(json.dumps(out, indent=1))
    save("bench_ps", out)  # bench/results/, for bench/render.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
