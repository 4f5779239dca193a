"""Time to accuracy against PyTorch, measured the same way in both; print one JSON object.

The same network (MLP 784-512-512-10, relu), the same data (MNIST's 60,000 training and
10,000 test rows, ``data/mnist.h5``), the same mini-batch (32 examples per replica or
process), the same optimizer and rate (Adagrad, 0.01: hpcps's default), and the same
evaluation: the whole test set every ``--eval-examples`` training examples (6,400 = 200
steps of 32, counted over all replicas or processes), for up to ``--epochs`` epochs. The
time of an evaluation is counted from the start of training (hpcps: from the run's
``start`` record, after MPI and the data are up; PyTorch: after the data and the model are
built), evaluations included in both.

Configurations:

- PyTorch, one process, 1 and 2 threads (``torch.set_num_threads``);
- PyTorch DDP, 2 processes of 1 thread each (gloo), gradients averaged every step;
- hpcps ``--strategy sync`` on 2 ranks (one per core: its best configuration on this
  machine), and hpcps's defaults (``mpiexec -n 4``: downpour, 3 replicas and a shard).

For each: the first evaluation at or above 97% and 98% (seconds and examples), the final
accuracy, the median of ``--repeats`` runs. ``time_to_97_ratio`` is hpcps's best median time
to 97% over PyTorch's best. PyTorch is optional: without it the bench says so and measures
hpcps alone.

Usage::

    python bench/bench_peers.py                 # about 5 minutes on 2 cores
    python bench/bench_peers.py --quick         # a smoke test on digits, not saved
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from bench_train import find_mpiexec, log, machine, train  # noqa: E402
from machine import cpu_features, save  # noqa: E402

LAYERS = (784, 512, 512, 10)
BATCH, LR, EPS = 32, 0.01, 1e-8
TARGETS = (0.97, 0.98)


def load(path: Path):
    from hpcps.io import data
    x, y = data.load_split(path, "train")
    tx, ty = data.load_split(path, "test")
    return x, y, tx, ty


def first_at(curve: list[tuple[float, int, float]], target: float) -> dict | None:
    """The first (seconds, examples, accuracy) of ``curve`` at or above ``target``."""
    for t, n, acc in curve:
        if acc >= target:
            return {"s": round(t, 3), "examples": n}
    return None


def outcome(curve) -> dict:
    return {"reached": {f"{int(100 * g)}": first_at(curve, g) for g in TARGETS},
            "final_accuracy": curve[-1][2] if curve else None,
            "evaluations": len(curve)}


# -- PyTorch -----------------------------------------------------------------------------------
def _torch_net(sizes, seed: int):
    import torch
    torch.manual_seed(seed)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _accuracy(net, tx, ty) -> float:
    import torch
    with torch.no_grad():
        return float((net(tx).argmax(1) == ty).float().mean())


def _steps(net, opt, X, Y, rng, steps: int):
    """Train ``steps`` mini-batches of BATCH rows (a fresh permutation each epoch), yielding
    the step number after each."""
    import torch
    loss_fn = torch.nn.CrossEntropyLoss()
    order, pos = torch.from_numpy(rng.permutation(len(Y))), 0
    for step in range(1, steps + 1):
        if pos + BATCH > len(Y):
            order, pos = torch.from_numpy(rng.permutation(len(Y))), 0
        idx = order[pos:pos + BATCH]
        pos += BATCH
        opt.zero_grad(set_to_none=True)
        loss_fn(net(X.index_select(0, idx)), Y.index_select(0, idx)).backward()
        opt.step()
        yield step


def torch_single(x, y, tx, ty, sizes, threads, epochs, eval_examples, seed) -> list:
    """One process: (seconds, examples, test accuracy) at every evaluation."""
    import torch
    torch.set_num_threads(threads)
    net = _torch_net(sizes, seed)
    opt = torch.optim.Adagrad(net.parameters(), lr=LR, eps=EPS)
    X, Y = torch.from_numpy(x), torch.from_numpy(y).long()
    TX, TY = torch.from_numpy(tx), torch.from_numpy(ty).long()
    steps = int(epochs * len(y) / BATCH)
    every = max(1, eval_examples // BATCH)
    curve = []
    t0 = time.perf_counter()
    for step in _steps(net, opt, X, Y, np.random.default_rng(seed), steps):
        if step % every == 0 or step == steps:
            curve.append((time.perf_counter() - t0, step * BATCH, _accuracy(net, TX, TY)))
            if curve[-1][2] >= TARGETS[-1]:
                break
    return curve


def _ddp_worker(rank, world, port, arrays, epochs, eval_examples, seed, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y, tx, ty = arrays
    lo, hi = rank * len(y) // world, (rank + 1) * len(y) // world
    net = torch.nn.parallel.DistributedDataParallel(_torch_net(LAYERS, seed))
    opt = torch.optim.Adagrad(net.parameters(), lr=LR, eps=EPS)
    X, Y = torch.from_numpy(x[lo:hi]), torch.from_numpy(y[lo:hi]).long()
    TX, TY = torch.from_numpy(tx), torch.from_numpy(ty).long()
    steps = int(epochs * len(y) / (BATCH * world))
    every = max(1, eval_examples // (BATCH * world))
    curve = []
    dist.barrier()
    t0 = time.perf_counter()
    stop = torch.zeros(1)
    for step in _steps(net, opt, X, Y, np.random.default_rng(seed + rank), steps):
        if step % every == 0 or step == steps:
            if rank == 0:
                curve.append((time.perf_counter() - t0, step * BATCH * world,
                              _accuracy(net.module, TX, TY)))
                stop[0] = float(curve[-1][2] >= TARGETS[-1])
            dist.broadcast(stop, 0)
            if stop[0]:
                break
    if rank == 0:
        out.put(curve)
    dist.destroy_process_group()


def torch_ddp(x, y, tx, ty, epochs, eval_examples, seed, world=2) -> list:
    import socket

    import torch.multiprocessing as tmp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, port, (x, y, tx, ty), epochs,
                                                    eval_examples, seed, out))
             for r in range(world)]
    for p in procs:
        p.start()
    curve = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return curve


# -- hpcps -------------------------------------------------------------------------------------
def hpcps_run(mpiexec, ranks, args, data, work: Path, epochs, eval_examples, timeout) -> list:
    every = eval_examples // BATCH
    work.mkdir(parents=True, exist_ok=True)
    recs = train(mpiexec, ranks, [*args, "--data", str(data), "--epochs", str(epochs),
                                  "--batch-size", str(BATCH), "--eval-every", str(every),
                                  "--checkpoint-every", "0"], work, timeout)
    t0 = next(r["time_s"] for r in recs if r["kind"] == "start")
    return [(r["time_s"] - t0, r["step"] * BATCH, r["test_accuracy"])
            for r in recs if r["kind"] == "eval"] + \
        [(r["time_s"] - t0, r["step"] * BATCH, r["test_accuracy"])
         for r in recs if r["kind"] == "summary"]


def summarize(runs: list) -> dict:
    outs = [outcome(c) for c in runs]
    med = {}
    for g in TARGETS:
        key = f"{int(100 * g)}"
        times = [o["reached"][key]["s"] for o in outs if o["reached"][key] is not None]
        med[f"time_to_{key}_s_median"] = statistics.median(times) if len(times) == len(outs) \
            else None
        med[f"time_to_{key}_s_all"] = [o["reached"][key]["s"] if o["reached"][key] else None
                                       for o in outs]
    med["final_accuracy_all"] = [o["final_accuracy"] for o in outs]
    return med


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--eval-examples", type=int, default=6400)
    p.add_argument("--data", default=str(ROOT / "data" / "mnist.h5"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="digits, one repeat, not saved")
    a = p.parse_args(argv)
    global LAYERS
    data = Path(a.data)
    if a.quick:
        data = Path(tempfile.mkdtemp()) / "digits.h5"
        from hpcps.io.data import prepare
        prepare("digits", data, log=lambda s: None)
        LAYERS, a.repeats, a.epochs, a.eval_examples = (64, 32, 10), 1, 2.0, 320
    elif not data.exists():
        from hpcps.io.data import prepare
        prepare("mnist", data, log=log)
    mpiexec = find_mpiexec()
    x, y, tx, ty = load(data)
    layers = ",".join(map(str, LAYERS))
    results: dict = {}
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        log("PyTorch is not installed: measuring hpcps alone (pip install torch for the peer)")
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmpdir:
        tmp = Path(tmpdir)
        plans = []
        if have_torch:
            for threads in (1, 2):
                plans.append((f"pytorch_1proc_{threads}thr", lambda s, t=threads:
                              torch_single(x, y, tx, ty, LAYERS, t, a.epochs, a.eval_examples,
                                           s)))
            if not a.quick:
                plans.append(("pytorch_ddp_2proc", lambda s: torch_ddp(
                    x, y, tx, ty, a.epochs, a.eval_examples, s)))
        plans.append(("hpcps_sync_2ranks", lambda s: hpcps_run(
            mpiexec, 2, ["--strategy", "sync", "--layers", layers, "--seed", str(s)], data,
            tmp / f"sync-{s}", a.epochs, a.eval_examples, a.timeout)))
        plans.append(("hpcps_defaults_4ranks", lambda s: hpcps_run(
            mpiexec, 4, ["--layers", layers, "--seed", str(s)], data, tmp / f"def-{s}",
            a.epochs, a.eval_examples, a.timeout)))
        for rep in range(a.repeats):  # interleaved: load drifts hit every configuration
            for name, run in plans:
                curve = run(rep)
                results.setdefault(name, []).append(curve)
                o = outcome(curve)
                log(f"{name} run {rep + 1}: 97% at {o['reached']['97']}, "
                    f"98% at {o['reached']['98']}, final {o['final_accuracy']:.4f}")
    figures = {"machine": {**machine(mpiexec), "cpu_features": cpu_features()},
               "model": layers, "batch": BATCH, "optimizer": f"adagrad lr={LR}",
               "eval_every_examples": a.eval_examples, "epochs": a.epochs,
               "torch": None if not have_torch else __import__("torch").__version__,
               "configs": {k: summarize(v) for k, v in results.items()},
               "curves": {k: [[list(map(lambda z: round(z, 4), pt)) for pt in c] for c in v]
                          for k, v in results.items()}}

    def best(prefix):
        meds = [c["time_to_97_s_median"] for k, c in figures["configs"].items()
                if k.startswith(prefix) and c["time_to_97_s_median"] is not None]
        return min(meds) if meds else None

    h, t = best("hpcps"), best("pytorch")
    figures["time_to_97_ratio"] = round(h / t, 3) if h and t else None
    print(json.dumps(figures, indent=1))
    if not a.quick:
        save("bench_peers", figures, sys.argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
