"""Soak test: every training strategy at many ranks; print one JSON object saying which completed.

Hangs and deadlocks in MPI code show up at rank counts and grids that unit tests do not reach
(downpour's warm start with several shards and --partitions 2 hung once). This script runs
``mpiexec -n N python -m hpcps.train`` for every strategy at each N of ``--ranks`` (16 and 32 by
default, oversubscribed on a small machine) on scikit-learn's digits, with a hard wall-clock
limit per run, and records for each run its status, exit code, seconds and final test accuracy.

The strategies, and whether each has parameter-server shards, is a batch method and takes
``--partitions``, come from the strategy registry (``hpcps.strategies.registry``), so a new
strategy is soaked without editing this file. Layouts per (strategy, N), with S = N // 4:

* strategies with shards: ``--servers S --partitions 2`` (S rounded down to a multiple of 2;
  downpour N = 16: 4 shards + 6 replicas of 2 ranks) and ``--servers S --partitions 1``;
  strategies without model parallelism (sandblaster) only the latter;
* the others: ``--partitions 1`` and ``--partitions 2``, no shards.

Downpour runs with its default warm start. SGD strategies run ``--steps`` mini-batches of 16;
batch methods (sandblaster) run 10 whole-set evaluations.

Status of a run: ``completed`` (exit 0 and a summary record in its ``metrics.jsonl``),
``refused`` (exit 2 with hpcps's "cannot lay out ..." message: the layout does not fit N, not a
failure), ``failed`` (any other exit) or ``hung`` (past ``--limit`` seconds: mpiexec and every
process below it are killed). A table goes to stderr as runs finish; the exit status is 1 if
any run failed or hung.

Usage::

    python bench/soak_ranks.py                         # N = 16, 32: a few minutes on 2 cores
    python bench/soak_ranks.py --ranks 8 --strategies sync downpour --json soak.json
    HPCPS_MPIEXEC=/opt/mpi/bin/mpiexec python bench/soak_ranks.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model, save  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from mpirun import end_launch, tagged_env  # noqa: E402  (tests/mpirun.py: one way to kill)

BATCH_STEPS = 10                 # whole-set L-BFGS evaluations for batch methods
CPU_FLAGS = ("avx2", "fma", "avx512f")


def find_mpiexec() -> str:
    """$HPCPS_MPIEXEC, else the mpiexec beside this Python (a venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("HPCPS_MPIEXEC") or (str(beside) if beside.exists() else None) \
        or shutil.which("mpiexec")
    if not found:
        raise SystemExit("soak_ranks: no mpiexec beside the Python executable or on PATH; "
                         "set HPCPS_MPIEXEC")
    return found


TRAITS = """
import json
from hpcps.strategies.registry import strategies
print(json.dumps({name: {"shards": s.uses_servers, "batch": s.whole_batch,
                         "model_parallel": s.model_parallel}
                  for name, s in strategies().items()}))
"""


def strategy_traits() -> dict[str, dict]:
    """Strategy name -> {"shards", "batch", "model_parallel"}, from the strategy registry
    (read in a child process: importing mpi4py here would initialize MPI in the parent)."""
    out = subprocess.run([sys.executable, "-c", TRAITS], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def layouts(strategy: str, n: int, traits: dict) -> list[list[str]]:
    """The layout options to run ``strategy`` with on ``n`` ranks (see the module docstring)."""
    parts = (1,) if not traits["model_parallel"] else ((2, 1) if traits["shards"] else (1, 2))
    if not traits["shards"]:
        return [["--partitions", str(p)] for p in parts]
    # Each partition has its own shards, so S is a multiple of P.
    return [["--servers", str(max(p, n // 4 // p * p)), "--partitions", str(p)] for p in parts]


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_one(mpiexec: str, n: int, strategy: str, layout: list[str], traits: dict,
            a: argparse.Namespace, work: Path) -> dict:
    """Run one training job under a hard wall-clock limit; return its record."""
    run_dir = work / "run"
    steps = ["--steps", str(BATCH_STEPS)] if traits["batch"] else \
        ["--steps", str(a.steps), "--batch-size", "16"]
    partitions = int(layout[layout.index("--partitions") + 1])
    width = "64,32,10" if partitions <= 2 else "64,64,10"  # wider when P > 2
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "hpcps.train", "--strategy", strategy,
           *layout, "--data", str(a.data), "--layers", width, *steps, "--eval-every", "0",
           "--checkpoint-every", "0", "--timeout", "120", "--run-dir", str(run_dir)]
    env, tag = tagged_env(dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    rec = {"strategy": strategy, "ranks": n, "layout": layout, "status": None, "exit_code": None,
           "seconds": None, "replicas": None, "test_accuracy": None}
    t0 = time.monotonic()
    with open(work / "stdout.log", "wb") as out, open(work / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            rec["exit_code"] = proc.wait(timeout=a.limit)
        except subprocess.TimeoutExpired:
            rec["status"] = "hung"
        finally:  # on a hang, and on Ctrl-C: leave no rank behind
            if rec["exit_code"] is None:
                end_launch(proc.pid, tag)  # mpiexec, Hydra's proxies and every rank
                proc.wait()
    rec["seconds"] = round(time.monotonic() - t0, 1)
    stderr = (work / "stderr.log").read_text(errors="replace")
    summary = None
    try:
        with open(run_dir / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f if line.strip()]
        summary = next((r for r in records if r.get("kind") == "summary"), None)
    except (OSError, ValueError):
        pass
    if rec["status"] == "hung":  # killed by us: no exit code, no summary
        pass
    elif rec["exit_code"] == 0 and summary:
        rec.update(status="completed", test_accuracy=summary.get("test_accuracy"),
                   replicas=summary.get("replicas"))
    elif rec["exit_code"] == 2 and "cannot lay out" in stderr:
        rec.update(status="refused", message=next(
            line for line in stderr.splitlines() if "cannot lay out" in line).strip())
    else:
        rec["status"] = "failed"
    if rec["status"] in ("failed", "hung"):
        rec["stderr_tail"] = tail(work / "stderr.log")
        rec["stdout_tail"] = tail(work / "stdout.log", 5)
    rec["command"] = " ".join(cmd)
    return rec


def machine_info(mpiexec: str) -> dict:
    """What the figures depend on: CPU and its vector flags, cores, host, date, Python, MPI."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), ":").split(":")[1].split())
    except OSError:
        pass
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # Get_library_version needs no MPI_Init
    from mpi4py import MPI
    return {"cpu": cpu_model(), "cpu_flags": {f: f in flags for f in CPU_FLAGS},
            "cores": os.cpu_count(), "hostname": socket.gethostname(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0].strip(),
            "mpiexec": mpiexec}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 32], help="rank counts N")
    p.add_argument("--strategies", nargs="+",
                   help="strategies to run (default: every --strategy choice of hpcps.train)")
    p.add_argument("--limit", type=float, default=300.0,
                   help="wall-clock seconds per run before it counts as hung (default 300)")
    p.add_argument("--data", type=Path, help="digits HDF5 file (default: prepared into a "
                   "temporary directory)")
    p.add_argument("--steps", type=int, default=300,
                   help="global mini-batches per SGD run (default 300; batch methods: 10)")
    p.add_argument("--json", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    if min(a.ranks) < 1 or a.steps < 1 or a.limit <= 0:
        p.error("--ranks and --steps must be >= 1 and --limit > 0")
    if a.data is not None and not a.data.is_file():
        p.error(f"--data {a.data}: no such file")
    mpiexec = find_mpiexec()
    known = strategy_traits()
    unknown = [s for s in a.strategies or [] if s not in known]
    if unknown:
        p.error(f"unknown strategies {unknown}; hpcps.train offers {sorted(known)}")
    t_start = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        tmp = Path(tmp)
        if a.data is None:
            a.data = tmp / "digits.h5"
            subprocess.run([sys.executable, "-m", "hpcps.data", "prepare", "digits", "--out",
                            str(a.data)], cwd=ROOT, check=True, stdout=sys.stderr)
        print(f"{'strategy':12} {'N':>3}  {'layout':28} {'status':9} {'exit':>4} {'s':>6} "
              f"{'accuracy':>8}", file=sys.stderr, flush=True)
        for n in a.ranks:
            for strategy in a.strategies or list(known):
                for i, layout in enumerate(layouts(strategy, n, known[strategy])):
                    work = tmp / f"{strategy}-{n}-{i}"
                    work.mkdir()
                    r = run_one(mpiexec, n, strategy, layout, known[strategy], a, work)
                    runs.append(r)
                    acc = f"{r['test_accuracy']:.4f}" if r["test_accuracy"] is not None else "-"
                    print(f"{strategy:12} {n:>3}  {' '.join(layout):28} {r['status']:9} "
                          f"{r['exit_code'] if r['exit_code'] is not None else '-':>4} "
                          f"{r['seconds']:6.1f} {acc:>8}", file=sys.stderr, flush=True)
                    for line in (r.get("message") or r.get("stderr_tail") or "").splitlines():
                        print(f"    {line}", file=sys.stderr, flush=True)
    bad = [r for r in runs if r["status"] in ("failed", "hung")]
    doc = {"machine": machine_info(mpiexec), "command": [sys.executable, *sys.argv],
           "total_seconds": round(time.monotonic() - t_start, 1),
           "ok": not bad, "runs": runs}
    text = json.dumps(doc, indent=2)
    print(text)
    save("soak_ranks", doc)  # bench/results/, for bench/render.py
    if a.json:
        a.json.write_text(text + "\n")
    print(f"{len(runs)} runs in {doc['total_seconds']:.0f} s: "
          + ", ".join(f"{sum(r['status'] == s for r in runs)} {s}"
                      for s in ("completed", "refused", "failed", "hung")),
          file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
