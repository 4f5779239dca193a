"""Benchmark end-to-end training: throughput and time to accuracy; print one JSON object.

Every measurement is a real training run, ``mpiexec -n N python -m hpcps.train ...``, started
with :mod:`subprocess` in its own temporary ``--run-dir``; the figures come from the run's
``metrics.jsonl`` (the ``summary`` record and the ``eval`` records), so they are exactly what a
user of ``hpcps.train`` sees.

What it measures
----------------
``throughput``
    A fixed, short run (``--steps 1500`` global mini-batches of 32, no periodic evaluation or
    checkpoint) of the default MNIST model 784,512,512,10 for ``--strategy sync`` on N = 1, 2, 4
    ranks and ``--strategy downpour`` on N = 2, 3, 4 ranks. Downpour spends one rank on the
    parameter server, so it trains with N-1 replicas. Reported per configuration: training
    examples/s, bytes moved per global step, mean staleness (downpour) and training seconds,
    the median over ``--repeats`` runs and every value.
``time_to_accuracy``
    sync and downpour on N = 4 ranks, the default 3 epochs, test accuracy evaluated every 500
    steps: the first evaluation reaching ``--target`` (default 0.97), its time and step (null if
    never reached), the final test accuracy and the run's wall time.

The JSON also records the machine (CPU, cores, Python, NumPy, mpi4py and MPI versions, date).
Progress goes to stderr; only the JSON goes to stdout.

Caveat: the reference machine has 2 cores, so N = 3 and N = 4 are oversubscribed (more ranks
than cores, ranks time-share). Those figures show the cost of oversubscription, not scaling;
each rank runs one BLAS thread (``hpcps.train`` sets it), so N = 2 already uses both cores.
Results are also sensitive to other load on the machine: run it on an idle one.

Usage::

    python bench/bench_train.py                      # full bench, about 5 minutes on 2 cores
    python bench/bench_train.py --quick              # smoke test on digits, about 30 s
    python bench/bench_train.py --only throughput --repeats 3 --out bench.json
    HPCPS_MPIEXEC=/opt/mpi/bin/mpiexec python bench/bench_train.py

Exit status is non-zero if any run fails or exceeds ``--timeout`` (its process group is
killed and the tail of its output shown).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from machine import cpu_model, save  # noqa: E402  (bench/machine.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from mpirun import end_launch, tagged_env  # noqa: E402  (tests/mpirun.py: one way to kill)

# (strategy, ranks) of each measurement. Downpour uses one server rank: replicas = ranks - 1.
THROUGHPUT_CONFIGS = [("sync", 1), ("sync", 2), ("sync", 4),
                      ("downpour", 2), ("downpour", 3), ("downpour", 4)]
ACCURACY_CONFIGS = [("sync", 4), ("downpour", 4)]
SUMMARY_FIELDS = ("examples_per_s", "bytes_per_step", "mean_staleness", "train_s")

FULL = {"data": ROOT / "data" / "mnist.h5", "layers": "784,512,512,10", "steps": 1500,
        "epochs": None, "eval_every": 500, "target": 0.97}
# --quick: scikit-learn's 8x8 digits (1437 training images) and a small model; 10 epochs
# (450 steps) for the accuracy runs, since 3 epochs of digits are only 135 steps.
QUICK = {"data": ROOT / "data" / "digits.h5", "layers": "64,64,10", "steps": 2000,
         "epochs": 10.0, "eval_every": 50, "target": 0.9}


# A throughput figure is printed only for a run that learned: its final test accuracy at
# least this (chance is 10%; a diverged run ends there). Quick: digits, 64-64-10, 2,000 steps
# reach 0.9 and more (the time-to-accuracy target); full: MNIST, 784-512-512-10, 1,500 steps
# reach about 0.95. Each bar leaves about 0.1 below what runs reach.
LEARNED = {"quick": 0.8, "full": 0.85}


class RunError(RuntimeError):
    """A training run failed or timed out."""


def log(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


# -- machine -----------------------------------------------------------------------------------


def machine(mpiexec: str) -> dict:
    import numpy
    import mpi4py

    # MPI_Get_library_version may be called before MPI_Init: this process stays out of MPI.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return {"platform": platform.platform(), "cpu": cpu_model(), "nproc": os.cpu_count(),
            "load_average": os.getloadavg()[0],
            "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0].strip(),
            "mpiexec": mpiexec,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


# -- running one training job ------------------------------------------------------------------
def find_mpiexec() -> str:
    """HPCPS_MPIEXEC, else mpiexec next to this Python (a venv's), else mpiexec on PATH."""
    env = os.environ.get("HPCPS_MPIEXEC")
    if env:
        return env
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise SystemExit("bench_train: mpiexec not found next to the Python executable or on PATH; "
                     "set HPCPS_MPIEXEC")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_command(mpiexec: str, ranks: int, run_dir: Path, args: list[str]) -> list[str]:
    """``mpiexec -n ranks python -m hpcps.train --run-dir run_dir args...``."""
    return [mpiexec, "-n", str(ranks), sys.executable, "-m", "hpcps.train",
            "--run-dir", str(run_dir), *args]


def start(cmd: list[str], out) -> subprocess.Popen:
    """Start ``cmd`` in the checkout (this tree's hpcps first on the path), output to ``out``,
    in a session of its own so that the whole process tree can be killed."""
    env, tag = tagged_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.tag = tag
    return proc


def train(mpiexec: str, ranks: int, args: list[str], workdir: Path, timeout: float) -> list[dict]:
    """Run ``hpcps.train`` on ``ranks`` ranks; return its metrics records.

    Output goes to ``workdir/output.log``; raises :class:`RunError` with its tail if the run
    exits non-zero, writes no summary, or takes longer than ``timeout`` seconds (then the whole
    process group, mpiexec and every rank, is killed first).
    """
    run_dir = workdir / "run"
    cmd = train_command(mpiexec, ranks, run_dir, args)
    out_path = workdir / "output.log"
    with open(out_path, "wb") as out:
        proc = start(cmd, out)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise RunError(f"timed out after {timeout:g} s (process group killed): "
                           f"{' '.join(cmd)}\n{_tail(out_path)}")
        except BaseException:  # Ctrl-C: leave no ranks behind
            _kill_group(proc)
            raise
    if code != 0:
        raise RunError(f"exit status {code}: {' '.join(cmd)}\n{_tail(out_path)}")
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    if not any(r.get("kind") == "summary" for r in records):
        raise RunError(f"no summary record in {metrics}: {' '.join(cmd)}\n{_tail(out_path)}")
    return records


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM mpiexec (it forwards it to the ranks), then after 5 s SIGKILL whatever is
    left of the launch's tree, Hydra's proxies and the ranks included (tests/mpirun.py)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    end_launch(proc.pid, proc.tag)
    proc.wait()


def summary_of(records: list[dict]) -> dict:
    return next(r for r in records if r.get("kind") == "summary")


# -- the two measurements ----------------------------------------------------------------------
def layout_of(strategy: str, ranks: int) -> dict:
    if strategy == "downpour":
        return {"ranks": ranks, "servers": 1, "replicas": ranks - 1}
    return {"ranks": ranks, "servers": 0, "replicas": ranks}


def check_learned(s: dict, bar: float, what: str) -> None:
    """Raise RunError unless the run's loss stayed finite and its final test accuracy
    reached ``bar``: examples/s of a run that diverged is no figure."""
    acc = s.get("test_accuracy")
    if acc is None or not acc >= bar:
        raise RunError(f"{what}: final test accuracy {acc}, expected at least {bar} "
                       "(diverged or did not learn): no figure printed")


def bench_throughput(mpiexec: str, p: dict, tmp: Path, repeats: int, timeout: float) -> list:
    common = ["--data", str(p["data"]), "--layers", p["layers"], "--steps", str(p["steps"]),
              "--eval-every", "0", "--checkpoint-every", "0", "--progress-every", "1000"]
    results = []
    for strategy, ranks in THROUGHPUT_CONFIGS:
        runs = []
        for i in range(repeats):
            work = Path(tempfile.mkdtemp(prefix=f"tp-{strategy}-{ranks}-{i}-", dir=tmp))
            t0 = time.perf_counter()
            s = summary_of(train(mpiexec, ranks, ["--strategy", strategy, *common], work,
                                 timeout))
            check_learned(s, p["learned"], f"throughput {strategy} N={ranks} run {i + 1}")
            runs.append(s)
            log(f"throughput {strategy:8} N={ranks} run {i + 1}/{repeats}: "
                f"{s['examples_per_s']:.0f} examples/s, {s['bytes_per_step']} bytes/step, "
                f"staleness {s['mean_staleness']}, train {s['train_s']:.1f} s "
                f"(wall {time.perf_counter() - t0:.1f} s)")
        entry = {"strategy": strategy, **layout_of(strategy, ranks),
                 "steps_trained": runs[0]["steps_trained"]}
        for key in SUMMARY_FIELDS:
            values = [r[key] for r in runs]
            entry[key] = statistics.median(values)
            entry[key + "_all"] = values
        results.append(entry)
    return results


def bench_accuracy(mpiexec: str, p: dict, tmp: Path, target: float, timeout: float) -> list:
    common = ["--data", str(p["data"]), "--layers", p["layers"],
              "--eval-every", str(p["eval_every"]), "--checkpoint-every", "0"]
    if p["epochs"] is not None:
        common += ["--epochs", str(p["epochs"])]
    results = []
    for strategy, ranks in ACCURACY_CONFIGS:
        work = Path(tempfile.mkdtemp(prefix=f"tta-{strategy}-{ranks}-", dir=tmp))
        records = train(mpiexec, ranks, ["--strategy", strategy, *common], work, timeout)
        s = summary_of(records)
        evals = [r for r in records if r.get("kind") == "eval"]
        hit = next((r for r in evals if (r.get("test_accuracy") or 0.0) >= target), None)
        entry = {"strategy": strategy, **layout_of(strategy, ranks),
                 "target": target,
                 "time_to_target_s": hit["time_s"] if hit else None,
                 "step_at_target": hit["step"] if hit else None,
                 "final_test_accuracy": s["test_accuracy"],
                 "steps_trained": s["steps_trained"], "epochs": s.get("epoch"),
                 "train_s": s["train_s"], "wall_s": s["wall_s"],
                 "evals": [[r["step"], r["time_s"], r["test_accuracy"]] for r in evals]}
        results.append(entry)
        reached = (f"reached {target:.3f} at step {hit['step']} after {hit['time_s']:.1f} s"
                   if hit else f"never reached {target:.3f}")
        log(f"time-to-accuracy {strategy:8} N={ranks}: {reached}; final accuracy "
            f"{s['test_accuracy']:.4f}, wall {s['wall_s']:.1f} s")
    return results


# -- main --------------------------------------------------------------------------------------
def ensure_digits(path: Path) -> None:
    """Prepare data/digits.h5 (scikit-learn's bundled digits) for --quick if missing."""
    if path.exists():
        return
    log(f"{path} not found: python -m hpcps.data prepare digits")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-m", "hpcps.data", "prepare", "digits", "--out",
                    str(path)], cwd=ROOT, env=env, check=True, stdout=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test: digits dataset, layers 64,64,10, few steps (~30 s)")
    p.add_argument("--data", help="HDF5 dataset (default data/mnist.h5, or data/digits.h5 "
                   "with --quick); --layers must fit it")
    p.add_argument("--layers", help="model widths (default 784,512,512,10; 64,64,10 --quick)")
    p.add_argument("--steps", type=int, help="global steps of each throughput run "
                   "(default 1500; 2000 with --quick)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each throughput configuration; the median is reported")
    p.add_argument("--target", type=float, help="test accuracy for time-to-accuracy "
                   "(default 0.97; 0.9 with --quick)")
    p.add_argument("--only", choices=("throughput", "accuracy"), help="run one part only")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one training run may take before it is killed (default 900)")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        raise SystemExit("bench_train: --repeats and --steps must be >= 1")
    p = dict(QUICK if args.quick else FULL)
    p["learned"] = LEARNED["quick" if args.quick else "full"]
    for key in ("data", "layers", "steps", "target"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    p["data"] = Path(p["data"]).resolve()
    if args.quick:
        ensure_digits(p["data"])
    if not p["data"].exists():
        raise SystemExit(f"bench_train: dataset {p['data']} not found "
                         "(python -m hpcps.data prepare mnist)")
    mpiexec = find_mpiexec()
    out: dict = {"machine": machine(mpiexec),
                 "settings": {"quick": args.quick, "data": str(p["data"]), "layers": p["layers"],
                              "batch_size": 32, "repeats": args.repeats,
                              "note": "downpour uses 1 server rank: replicas = ranks - 1; "
                                      f"ranks beyond nproc={os.cpu_count()} are oversubscribed"}}
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
            if args.only in (None, "throughput"):
                out["throughput"] = {"steps": p["steps"], "configs": bench_throughput(
                    mpiexec, p, Path(tmp), args.repeats, args.timeout)}
            if args.only in (None, "accuracy"):
                out["time_to_accuracy"] = {
                    "epochs": p["epochs"] if p["epochs"] is not None else 3.0,
                    "eval_every": p["eval_every"],
                    "configs": bench_accuracy(mpiexec, p, Path(tmp), p["target"], args.timeout)}
    except RunError as exc:
        print(f"bench_train: training run failed: {exc}", file=sys.stderr, flush=True)
        return 1
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=2)
    print(text)
    save("bench_train", out)  # bench/results/, for bench/render.py
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
