"""Elastic soak: a downpour job killed again and again, with nothing lost; one JSON object.

The job: ``--servers 3 --ps-copies 2 --spares K --joins J`` under ``mpiexec
-disable-auto-cleanup ... python -m hpcps.keeper`` on MNIST (784-64-10,
``--heartbeat-timeout 3``), long enough to outlast ``--duration``. Every ``--every`` seconds
the soak first keeps the pool of idle spares at 2 or more while joins are left: a second
launch, ``mpiexec -n 1 python -m hpcps.join RUN_DIR --as spare``, adds an idle spare to the
running job (a joined spare replaces replicas only; shards need one of the job's own). Then
it SIGKILLs one rank, chosen at random among the deaths the job can absorb, and only while
an idle spare is left to replace it, so the job never shrinks and every set can get back to
2 copies:

* a replica that trains (never rank 0, the chief, whose loss ends any run), the spares that
  replaced replicas included, joined ones too (killed in their own launch);
* a server shard (an original, or a spare that restored a dead shard's copies) whose every
  chunk set has another live copy that has held the set whole for a few seconds.

Rank 0's ``replacement`` records say which spare became which replica or shard (every rank
computes who holds which set the same way: a spare restoring dead shard d is appended to
the holders of d's sets). When nothing is left to kill the soak lets the run finish. Then
the same job runs without kills, and the JSON compares them:

``completed`` (exit 0 and a summary), ``kills`` (time, rank, role), ``replacements`` (the
summary's, with ``training_again_s``), ``replaced_median_s``/``replaced_max_s`` (from a
death's detection to the spare's first step), ``shard_failover_s`` (from a shard's last sign
of life to its sets served again, each), ``copies_again_median_s``/``copies_again_max_s``
(from a shard's death's detection to every set it held whole on a spare), ``joins`` (ranks
that joined the running job), ``join_exit_codes`` (of the join launches whose rank was not
killed: 0 each), ``sets_with_c_copies_at_end`` (the summary's),
``committed_equals_applied`` (each set applied exactly the pushes its copies counted from
every replica), ``accuracy`` and ``clean_accuracy``. Exit status 1 if the job did not
complete, a set's count is off, or the accuracy is more than 0.5 points under the clean
run's.

Usage::

    python bench/soak_elastic.py --data data/mnist.h5           # ~9 min on 2 cores
    python bench/soak_elastic.py --data data/mnist.h5 --quick   # a short smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from faultinject import kill_rank, records  # noqa: E402  (tests/: ranks and metrics)
from machine import save  # noqa: E402
from mpirun import end_launch, mpiexec, tagged_env  # noqa: E402

from hpcps.ps.replicated.placement import holders  # noqa: E402

S, C, R = 3, 2, 3  # shards, copies, replicas


def _env() -> tuple[dict, str]:
    return tagged_env(dict(os.environ, OPENBLAS_NUM_THREADS="1",
                           PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))


def launch(run_dir: Path, data: str, spares: int, steps: int, joins: int):
    env, tag = _env()
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(R + S + spares), sys.executable, "-m",
           "hpcps.keeper", "--layers", "784,64,10", "--steps", str(steps), "--batch-size", "32",
           "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "1",
           "--timeout", "60", "--heartbeat-timeout", "3", "--servers", str(S), "--ps-copies",
           str(C), "--spares", str(spares), "--joins", str(joins), "--data", data,
           "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    return proc, tag


JOIN_WAIT_S = 60.0


def join_spare(run_dir: Path):
    """One rank joins the running job as an idle spare; (its launch, tag, its rank in the
    job) once the chief recorded it, or (launch, tag, None) if it did not within
    JOIN_WAIT_S."""
    env, tag = _env()
    before = len(records(run_dir, "join"))
    proc = subprocess.Popen([mpiexec(), "-n", "1", sys.executable, "-m", "hpcps.join",
                             str(run_dir), "--as", "spare"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + JOIN_WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        got = records(run_dir, "join")
        if len(got) > before:
            return proc, tag, got[before]["rank"]
        time.sleep(0.1)
    return proc, tag, None


SETTLED_S = 3.0  # a spare restoring copies counts as a copy this long after its assignment


def idle_spares(spares: int, killed: set[int], run_dir: Path) -> tuple[list[int], list[int]]:
    """Ranks of the idle spares: the job's own, and those that joined."""
    reps = records(run_dir, "replacement")
    used = {r["spare_rank"] for r in reps if r["spare_rank"] is not None}
    own = [k for k in range(R + S, R + S + spares) if k not in used | killed]
    joined = [j["rank"] for j in records(run_dir, "join")
              if j["as_replica"] is None and j["rank"] not in used | killed]
    return own, joined


def absorbable(spares: int, killed: set[int], run_dir: Path) -> list[tuple[int, str]]:
    """(rank, role) of every rank whose death the job can absorb now, with a spare to spare
    (any for a replica; one of the job's own for a shard)."""
    reps = records(run_dir, "replacement")
    own, joined = idle_spares(spares, killed, run_dir)
    if not own and not joined:
        return []
    trainers = {r for r in range(1, R)}  # rank 0 is the chief
    trainers |= {r["spare_rank"] for r in reps if r.get("as_replica") is not None}
    out = [(r, "replica") for r in sorted(trainers - killed)]
    if not own:
        return out
    # who holds which set: the static ring, and each spare appended where the dead one was
    rank_of = {j: R + j for j in range(S)}
    hold = {h: holders(h, S, C) for h in range(S)}
    settled = set(range(S))
    now = time.time()
    for r in reps:
        if r.get("as_shard") is None:
            continue
        n = r["as_shard"]
        rank_of[n] = r["spare_rank"]
        for h in hold.values():
            if r["shard"] in h and n not in h:
                h.append(n)
        if now - r["assigned_at"] > SETTLED_S:
            settled.add(n)
    dead = {j for j, rank in rank_of.items() if rank in killed}
    for j, rank in sorted(rank_of.items()):
        if j in dead:
            continue
        mine = [h for h in hold.values() if j in h]
        if all(any(x not in dead and x != j and x in settled for x in h) for h in mine):
            out.append((rank, "shard"))
    return out


def run(data: str, spares: int, steps: int, duration: float, every: float, limit: float,
        seed: int, kills_on: bool, joins: int = 0) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="hpcps-soak-elastic-"))
    rng = random.Random(seed)
    proc, tag = launch(run_dir, data, spares, steps, joins)
    t0 = time.monotonic()
    kills: list[dict] = []
    killed: set[int] = set()
    launches: dict = {}  # a joined rank -> (its launch, tag)
    tries = 0
    try:
        while kills_on and proc.poll() is None and time.monotonic() - t0 < duration:
            time.sleep(every)
            if not records(run_dir, "progress"):
                continue  # not training yet
            while tries < joins and sum(map(len, idle_spares(spares, killed, run_dir))) < 2 \
                    and proc.poll() is None:
                tries += 1
                jp, jtag, rank = join_spare(run_dir)
                launches[rank if rank is not None else f"failed-{tries}"] = (jp, jtag)
                print(f"[soak] join {tries}: rank {rank}", file=sys.stderr, flush=True)
            choices = absorbable(spares, killed, run_dir)
            if not choices or proc.poll() is not None:
                continue
            rank, role = rng.choice(choices)
            if rank in launches:  # a joined rank: rank 0 of its own launch
                kill_rank(launches[rank][0].pid, 0)
            else:
                kill_rank(proc.pid, rank)
            killed.add(rank)
            kills.append({"t_s": round(time.monotonic() - t0, 1), "rank": rank, "role": role})
            print(f"[soak] {kills[-1]}", file=sys.stderr, flush=True)
        out, _ = proc.communicate(timeout=max(10.0, limit - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        end_launch(proc.pid, tag)
        out, _ = proc.communicate()
        for p, t in launches.values():
            end_launch(p.pid, t)
            p.communicate()
        (run_dir / "output.log").write_text(out)
        return {"completed": False, "why": "hung", "kills": kills, "output": out[-3000:],
                "log": str(run_dir / "output.log")}
    except BaseException:
        for p, t in [(proc, tag), *launches.values()]:
            end_launch(p.pid, t)
            p.communicate()
        raise
    join_codes = {}
    for rank, (p, t) in launches.items():  # the joined ranks end with the job
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            end_launch(p.pid, t)
            p.communicate()
        if rank not in killed:
            join_codes[str(rank)] = p.returncode
    (run_dir / "output.log").write_text(out)  # the whole of every rank's output, kept
    summ = records(run_dir, "summary")
    s = summ[0] if summ else {}
    return {"completed": proc.returncode == 0 and bool(summ), "exit_code": proc.returncode,
            "wall_s": round(time.monotonic() - t0, 1), "kills": kills, "summary": s,
            "join_exit_codes": join_codes,
            "output": out[-3000:] if proc.returncode else "", "log": str(run_dir / "output.log")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/mnist.h5")
    ap.add_argument("--spares", type=int, default=8)
    ap.add_argument("--joins", type=int, default=6, help="ranks that may join the running "
                    "job as spares (one launch each)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of kills")
    ap.add_argument("--every", type=float, default=15.0, help="seconds between kills")
    ap.add_argument("--steps", type=int, default=150000, help="the job's --steps (long "
                    "enough to outlast --duration)")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds before a run is hung")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a short smoke run, not saved")
    args = ap.parse_args(argv)
    if args.quick:
        args.spares, args.joins, args.duration, args.every, args.steps = 3, 2, 30.0, 6.0, 8000
    soak = run(args.data, args.spares, args.steps, args.duration, args.every, args.limit,
               args.seed, True, args.joins)
    clean = run(args.data, args.spares, args.steps, 0.0, 0.0, args.limit, args.seed, False)
    s, c = soak.get("summary", {}), clean.get("summary", {})
    reps = s.get("replacements", [])
    again = [r["training_again_s"] for r in reps if r.get("training_again_s") is not None]
    failover = [t["served_after_s"] for t in s.get("takeovers", [])
                if t.get("served_after_s") is not None]
    sets_c = s.get("sets_with_c_copies_at_end")
    healed = s.get("shard_replacements", [])
    restored = [r["copies_again_s"] for r in healed if r.get("copies_again_s") is not None]
    acc, clean_acc = s.get("test_accuracy"), c.get("test_accuracy")
    fig = {"completed": soak["completed"], "clean_completed": clean["completed"],
           "soak_wall_s": soak.get("wall_s"), "clean_wall_s": clean.get("wall_s"),
           "kills": soak["kills"], "replacements": reps,
           "replaced_median_s": statistics.median(again) if again else None,
           "replaced_max_s": max(again) if again else None,
           "shard_failover_s": failover, "shard_replacements": healed,
           "copies_again_median_s": statistics.median(restored) if restored else None,
           "copies_again_max_s": max(restored) if restored else None,
           "joins": len(s.get("joins", [])), "join_records": s.get("joins", []),
           "join_exit_codes": soak.get("join_exit_codes"), "spares": args.spares,
           "sets": S, "copies": C, "sets_with_c_copies_at_end": sets_c,
           "copies_at_end": s.get("copies_at_end"),
           "committed_equals_applied": s.get("committed_equals_applied"),
           "pushes_committed_by_set": s.get("pushes_committed_by_set"),
           "ps_applied": s.get("ps_applied"), "lost_ranks": s.get("lost_ranks"),
           "accuracy": acc, "clean_accuracy": clean_acc,
           "accuracy_diff_points": None if acc is None or clean_acc is None
           else round(100 * (acc - clean_acc), 2)}
    for name, r in (("soak", soak), ("clean", clean)):
        if not r["completed"]:
            fig[f"{name}_output"] = r.get("output")
            fig[f"{name}_log"] = r.get("log")
    print(json.dumps(fig, indent=1))
    lost = (not soak["completed"] or not clean["completed"]
            or not s.get("committed_equals_applied") or sets_c != S
            or any(soak.get("join_exit_codes", {}).values())
            or fig["accuracy_diff_points"] is None or fig["accuracy_diff_points"] < -0.5)
    if not lost:
        save("soak_elastic", {k: v for k, v in fig.items() if not k.endswith("_output")})
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
