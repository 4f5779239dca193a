"""Benchmark Hogwild training inside one process; print one JSON object to stdout.

Examples/s of :class:`hpcps.engine.hogwild.HogwildEngine` on MNIST (``data/mnist.h5``) for the
default MLP 784-512-512-10 and for 784-1024-1024-10, mini-batch 128, with T = 1 and 2
threads (Python-thread backend; T = 2 also with the OpenMP backend and with ``delta``, the
accumulation a replica pushes), and, when ``torch`` imports, the same model trained by
PyTorch in the same run (``torch.set_num_threads(T)``, ``nn.Linear`` layers, plain SGD,
same batch, same gathered examples). ``hogwild_T*_no_zero_skip`` is the engine with
``zero_skip=0`` (BLAS for the first layer too), to show what skipping zeros is worth.
Every ``hogwild_*`` runs with OpenBLAS's sgemm except ``hogwild_T*_mkl``, the engine with
Intel MKL's (``hpcps.kernels.blas``; present when MKL loads; each run switches the
kernels' sgemm before its timer starts). ``blas_auto`` is what ``HPCPS_BLAS=auto`` chose
for the model (it times both at the model's shapes) and why, and the ``*_auto`` ratios are
the engine with that choice: the default configuration. ``hogwild_T*`` compute the first
layer the way the engine chose at its first call (``first_layer``: each instruction set's
zero-skipping kernels the CPU has, ``machine.zero_skip_isa``, and BLAS, timed);
``hogwild_T*_<isa>`` pin each instruction set.
Configurations are interleaved within each repeat so load from other jobs on the machine
hits all of them alike. ``examples_per_s`` is the
median over repeats, ``best_examples_per_s`` the fastest repeat (the one least disturbed by
other jobs); ratios are given for both and for examples per CPU-second, and
``paired_ratios_median`` is the median over repeats of each repeat's own ratio (the two
configurations ran back to back, so load that drifts between repeats cancels).

Besides wall-clock examples/s each entry gives examples per CPU-second of this process
(``time.process_time``, all threads), which shows efficiency even when other jobs take cores away.

Usage::

    python bench/bench_hogwild.py [--repeats 5] [--steps 30] [--data data/mnist.h5]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: each thread's sgemm is serial

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.engine import hogwild  # noqa: E402
from hpcps.kernels import blas, gemm  # noqa: E402
from hpcps.model.mlp import MLP  # noqa: E402
from checks import fail, loss_fell  # noqa: E402  (bench/checks.py)
from machine import cpu_features, cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    import torch
except ImportError:
    torch = None

BATCH, LR = 128, 0.01
# What each timed configuration must have learned before any figure prints: the loss on
# CHECK_ROWS training rows fell (at all: the smallest settings train a few mini-batches, and
# PyTorch's initialisation learns slowly at this lr: 2.301 -> 2.298 measured in 7 steps) and
# ended within LOSS_SPREAD times its reference: the engine's plain run at the same thread
# count (hogwild_T1, hogwild_T2: the same start and number of examples, in another order,
# library or kernel). T threads see T times the examples, and PyTorch's own initialisation
# learns far more slowly at this rate (2.07-2.18 against the engine's 0.63-0.77 after 7
# repeats of 40 steps on MNIST), so PyTorch's runs are held only to a loss that fell, and
# finite. A gradient of zeros leaves the loss where it was and fails.
CHECK_ROWS, FELL_TO, LOSS_SPREAD = 2048, 1.0, 1.5
MODELS = [(784, 512, 512, 10), (784, 1024, 1024, 10)]




def machine():
    info = {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "hogwild_compiled": hogwild.HAVE_EXTENSION,
        "zero_skip_kernels": hogwild.HogwildEngine((2, 2), batch=1).zero_skipping,
        "zero_skip_isa": hogwild.HogwildEngine((2, 2), batch=1).zero_skip_isa,
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        "torch": torch.__version__ if torch is not None else None,
        "mkl": {k: v for k, v in blas.info().items() if k != "blas"},
    }
    try:
        import scipy
        info["scipy"] = scipy.__version__
    except ImportError:
        pass
    return info


def load_mnist(path):
    import h5py
    with h5py.File(path, "r") as f:
        x = np.ascontiguousarray(f["train/x"][...], dtype=np.float32)
        y = np.ascontiguousarray(f["train/y"][...], dtype=np.int64)
    return x, y


class Timer:
    """Wall and process-CPU seconds (all threads) of a block."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.c0
        self.wall = time.perf_counter() - self.t0
        return False


def hogwild_runner(sizes, threads, x, y, steps, backend="threads", with_delta=False,
                   zero_skip=hogwild.ZERO_SKIP, blas_name="openblas", first_layer="auto"):
    engine = hogwild.HogwildEngine(sizes, "relu", threads=threads, batch=BATCH,
                                   backend=backend, zero_skip=zero_skip,
                                   first_layer=first_layer)
    params = MLP(sizes, "relu").init_params(0)
    delta = np.zeros_like(params) if with_delta else None
    rng = np.random.default_rng(threads)

    def run(n_steps):
        order = rng.permutation(len(y))[:threads * n_steps * BATCH]
        blas.use(blas_name)
        with Timer() as t:
            _, n = engine.train(params, x, y, order, LR, steps_per_thread=n_steps, delta=delta)
        return n, t

    def loss():
        return float(MLP(sizes, "relu").loss_and_grad(params, x[:CHECK_ROWS],
                                                      y[:CHECK_ROWS])[0])

    first = loss()
    run(2)  # warm-up: page in contexts, BLAS buffers (and the first layer's timed way)
    if first_layer == "auto" and zero_skip and backend == "threads" and not with_delta:
        FIRST_LAYER[(tuple(sizes), threads)] = engine.first_layer
    return lambda: run(steps), first, loss


FIRST_LAYER: dict = {}  # the engines' first layer (timed at their first call): the JSON's


def torch_runner(sizes, threads, x, y, steps):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    X, Y = torch.from_numpy(x), torch.from_numpy(y)
    rng = np.random.default_rng(threads)

    def run(n_steps):
        torch.set_num_threads(threads)
        order = torch.from_numpy(rng.permutation(len(y))[:n_steps * threads * BATCH])
        n_batches = n_steps * threads  # the same examples as T Hogwild threads x n_steps
        with Timer() as t:
            for k in range(n_batches):
                idx = order[k * BATCH:(k + 1) * BATCH]
                xb, yb = X.index_select(0, idx), Y.index_select(0, idx)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(xb), yb)
                loss.backward()
                opt.step()
        return n_batches * BATCH, t

    def loss():
        with torch.no_grad():
            return float(loss_fn(net(X[:CHECK_ROWS]), Y[:CHECK_ROWS]))

    first = loss()
    run(2)
    return lambda: run(steps), first, loss


def measure(runners, repeats, log):
    """Run every configuration once per repeat, interleaved; medians per configuration."""
    samples = {name: [] for name in runners}
    for r in range(repeats):
        for name, (run, _, _) in runners.items():
            n, t = run()
            samples[name].append((n / t.wall, n / max(t.cpu, 1e-9)))
            log(f"  repeat {r} {name}: {n / t.wall:,.0f} ex/s")
    return {name: {"examples_per_s": round(statistics.median(s[0] for s in v), 1),
                   "best_examples_per_s": round(max(s[0] for s in v), 1),
                   "examples_per_cpu_s": round(statistics.median(s[1] for s in v), 1),
                   "samples_examples_per_s": [round(s[0], 1) for s in v]}
            for name, v in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data/mnist.h5"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="mini-batches per thread per run")
    args = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    x, y = load_mnist(args.data)
    try:   # after `import torch` (top of this file): see hpcps.kernels.blas, "PyTorch"
        blas.use("mkl")
        have_mkl = True
    except blas.ConfigError:   # hpcps.errors.ConfigError
        have_mkl = False
    blas.use("openblas")
    out = {"machine": machine(), "batch": BATCH, "lr": LR, "repeats": args.repeats,
           "steps_per_thread": args.steps, "models": {}}
    for sizes in MODELS:
        key = "-".join(map(str, sizes))
        log(f"model {key}")
        runners = {
            "hogwild_T1": hogwild_runner(sizes, 1, x, y, args.steps),
            "hogwild_T2": hogwild_runner(sizes, 2, x, y, args.steps),
            "hogwild_T2_openmp": hogwild_runner(sizes, 2, x, y, args.steps, backend="openmp"),
            "hogwild_T1_delta": hogwild_runner(sizes, 1, x, y, args.steps, with_delta=True),
            "hogwild_T2_delta": hogwild_runner(sizes, 2, x, y, args.steps, with_delta=True),
            # BLAS for every layer: what zero skipping in the first layer is worth
            "hogwild_T1_no_zero_skip": hogwild_runner(sizes, 1, x, y, args.steps, zero_skip=0),
            "hogwild_T2_no_zero_skip": hogwild_runner(sizes, 2, x, y, args.steps, zero_skip=0),
        }
        for isa in gemm.ZERO_SKIP_ISAS:  # each instruction set pinned: what the timing chose from
            for t in (1, 2):
                runners[f"hogwild_T{t}_{isa}"] = hogwild_runner(sizes, t, x, y, args.steps,
                                                                first_layer=isa)
        if have_mkl:
            runners["hogwild_T1_mkl"] = hogwild_runner(sizes, 1, x, y, args.steps,
                                                       blas_name="mkl")
            runners["hogwild_T2_mkl"] = hogwild_runner(sizes, 2, x, y, args.steps,
                                                       blas_name="mkl")
        if torch is not None:
            runners["torch_T1"] = torch_runner(sizes, 1, x, y, args.steps)
            runners["torch_T2"] = torch_runner(sizes, 2, x, y, args.steps)
        auto = None
        if have_mkl:   # what HPCPS_BLAS=auto picks for this model, and why
            skips = hogwild.HogwildEngine(sizes, batch=BATCH).zero_skip_isa is not None
            auto = blas.use("auto", blas.mlp_shapes(sizes, BATCH, first_layer=not skips),
                            "HPCPS_BLAS=auto")
            auto_info = {k: blas.info()[k] for k in ("blas", "reason", "timing")}
            blas.use("openblas")
            log(f"  auto: {auto_info['reason']}")
        else:
            auto_info = {"blas": "openblas", "reason": "MKL not loadable", "timing": None}
        res = measure(runners, args.repeats, log)
        losses = {name: (first, loss()) for name, (_, first, loss) in runners.items()}
        for name, (first, last) in losses.items():
            loss_fell(f"{key} {name}", first, last, FELL_TO)
        for name, (_, last) in losses.items():
            family = f"{name.split('_')[0]}_{name.split('_')[1]}"  # hogwild_T2, torch_T1, ...
            ref = losses[family][1]
            if not ref / LOSS_SPREAD <= last <= ref * LOSS_SPREAD:
                fail(f"{key} {name}: final loss {last:.4g}, {family}'s {ref:.4g} "
                     f"(allowed: within {LOSS_SPREAD}x)")
        ratios = {}
        for tag, field in (("", "examples_per_s"), ("_best", "best_examples_per_s"),
                           ("_per_cpu_s", "examples_per_cpu_s")):
            eps = {k: v[field] for k, v in res.items()}
            ratios["hogwild_T2_over_T1" + tag] = round(eps["hogwild_T2"] / eps["hogwild_T1"], 3)
            for t in ("T1", "T2"):
                ratios[f"zero_skip_gain_{t}{tag}"] = round(
                    eps[f"hogwild_{t}"] / eps[f"hogwild_{t}_no_zero_skip"], 3)
            if torch is not None:
                for t in ("T1", "T2"):
                    ratios[f"hogwild_over_torch_{t}{tag}"] = round(
                        eps[f"hogwild_{t}"] / eps[f"torch_{t}"], 3)
                ratios["torch_T2_over_T1" + tag] = round(eps["torch_T2"] / eps["torch_T1"], 3)
        # per-repeat ratios: the two configurations of a ratio ran back to back in the same
        # repeat, so load that drifts between repeats cancels; their median is the most
        # robust figure on a shared machine
        paired = {}
        samples = {k: v["samples_examples_per_s"] for k, v in res.items()}

        def pair(a, b):
            return round(statistics.median(x / y for x, y in zip(samples[a], samples[b])), 3)

        paired["hogwild_T2_over_T1"] = pair("hogwild_T2", "hogwild_T1")
        for t in ("T1", "T2"):
            paired[f"zero_skip_gain_{t}"] = pair(f"hogwild_{t}", f"hogwild_{t}_no_zero_skip")
            if torch is not None:
                paired[f"hogwild_over_torch_{t}"] = pair(f"hogwild_{t}", f"torch_{t}")
            if have_mkl:
                paired[f"mkl_gain_{t}"] = pair(f"hogwild_{t}_mkl", f"hogwild_{t}")
                if torch is not None:
                    paired[f"hogwild_mkl_over_torch_{t}"] = pair(f"hogwild_{t}_mkl",
                                                                 f"torch_{t}")
        if torch is not None:   # the default configuration: auto's library
            suffix = "_mkl" if auto == "mkl" else ""
            for t in ("T1", "T2"):
                paired[f"hogwild_auto_over_torch_{t}"] = pair(f"hogwild_{t}{suffix}",
                                                              f"torch_{t}")
        out["models"][key] = {"results": res, "ratios": ratios, "blas_auto": auto_info,
                              "first_layer": {f"T{t}": FIRST_LAYER.get((tuple(sizes), t))
                                              for t in (1, 2)},
                              "loss_first_last": {k: [round(a, 4), round(b, 4)]
                                                  for k, (a, b) in losses.items()},
                              "paired_ratios_median": paired}
    out["machine"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    save("bench_hogwild", out)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
