"""Benchmark the conv engine on Project Adam's MNIST network; print one JSON object to stdout.

Examples/s of :class:`hpcps.engine.conv_hogwild.ConvHogwild` training ``--model adam-mnist`` on
MNIST
(the dataset needs ``image_shape``; ``python -m hpcps.data prepare mnist`` writes it) with
T = 1 and 2 Hogwild threads of the compiled engine (``ext/convnet.pyx``), T = 1 of the NumPy
reference (``engine_numpy_T1``, what runs without the extension), mini-batch 128, plain SGD,
and PyTorch on the CPU with the same
layers (``nn.Conv2d``, ``nn.MaxPool2d``, ``nn.Linear``), batch, examples and thread count
(``torch.set_num_threads(T)``), in the same run, interleaved within each repeat so that load
from other jobs hits both alike. Reported, per configuration: median and best examples/s over
the repeats; ``machine.blas`` is the sgemm the compiled engine called (``HPCPS_BLAS``) and
why; ``gflops``, the engine's arithmetic rate (``ConvNet.flops_per_example``: forward,
weight-gradient and input-gradient GEMMs of the conv and fc layers) against ``sgemm_peak``,
a 1024^3 single-threaded sgemm timed in the same run (x T for T threads); and
``connections_per_s``, Project Adam's figure of merit (connections of one forward pass,
``ConvNet.connections``, times examples trained per second). ``paired_ratios_median`` is the
median over repeats of each repeat's own ratio (the two ran back to back).

Usage::

    python bench/bench_conv.py [--repeats 5] [--steps 10] [--data data/mnist.h5]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: each thread's sgemm is serial

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.engine import conv_hogwild  # noqa: E402

from hpcps.io import data
from hpcps.engine.conv_hogwild import ConvHogwild  # noqa: E402
from hpcps.model.convnet import ConvNet  # noqa: E402
from hpcps.kernels import blas  # noqa: E402
from checks import fail, loss_fell  # noqa: E402  (bench/checks.py)
from machine import cpu_features, cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    import torch
except ImportError:
    torch = None

BATCH, LR, SPEC = 128, 0.01, "adam-mnist"


# What each timed configuration must have learned before any figure prints: the loss on
# CHECK_ROWS training rows fell (at all: the smallest settings train a few mini-batches, and
# PyTorch's initialisation learns slowly at this lr: 2.301 -> 2.298 measured in 7 steps) and
# ended within LOSS_SPREAD times engine_T1's (the reference: the same examples, another order or
# library), finite. A gradient of zeros leaves the loss where it was and fails.
CHECK_ROWS, FELL_TO, LOSS_SPREAD = 1024, 1.0, 1.5


def sgemm_peak(n: int = 1024, repeats: int = 3) -> float:
    """GFLOP/s of one n^3 float32 GEMM through NumPy's BLAS on one thread (best of repeats)."""
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ a
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def engine_runner(model, threads, x, y, steps, compiled=None):
    engine = ConvHogwild(model, threads=threads, batch=BATCH, compiled=compiled)
    params = model.init_params(0)
    rng = np.random.default_rng(threads)

    def run(n_steps):
        order = rng.permutation(len(y))[:threads * n_steps * BATCH]
        t = time.perf_counter()
        _, n = engine.train(params, x, y, order, LR, steps_per_thread=n_steps)
        return n, time.perf_counter() - t

    def loss():
        return float(model.loss(params, x[:CHECK_ROWS], y[:CHECK_ROWS]))

    first = loss()
    run(1)
    return lambda: run(steps), first, loss


def torch_runner(model, threads, x, y, steps):
    nn = torch.nn
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layers, shape = [], model.input_shape
    for op in model.ops:   # the same layers as the ConvNet
        s = op.spec
        if s.kind == "conv":
            layers += [nn.Conv2d(op.in_shape[0], s.out, (s.kh, s.kw), s.stride, s.pad), nn.ReLU()]
        elif s.kind == "pool":
            layers.append(nn.MaxPool2d(s.kh, s.stride))
        elif s.kind == "fc":
            if len(op.in_shape) == 3:
                layers.append(nn.Flatten())
            layers.append(nn.Linear(int(np.prod(op.in_shape)), s.out))
            if not op.last:
                layers.append(nn.ReLU())
    net = nn.Sequential(*layers)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    X, Y = torch.from_numpy(x).reshape(-1, *shape), torch.from_numpy(y)
    rng = np.random.default_rng(threads)

    def run(n_steps):
        torch.set_num_threads(threads)
        n_batches = n_steps * threads   # the examples T Hogwild threads x n_steps train
        order = torch.from_numpy(rng.permutation(len(y))[:n_batches * BATCH])
        t = time.perf_counter()
        for k in range(n_batches):
            idx = order[k * BATCH:(k + 1) * BATCH]
            opt.zero_grad(set_to_none=True)
            loss_fn(net(X.index_select(0, idx)), Y.index_select(0, idx)).backward()
            opt.step()
        return n_batches * BATCH, time.perf_counter() - t

    def loss():
        with torch.no_grad():
            return float(loss_fn(net(X[:CHECK_ROWS]), Y[:CHECK_ROWS]))

    first = loss()
    run(1)
    return lambda: run(steps), first, loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data/mnist.h5"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="mini-batches per thread per run")
    args = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    info = data.open_dataset(args.data)
    if info.image_shape is None:
        sys.exit(f"{args.data} has no image_shape attribute: prepare it again with "
                 "python -m hpcps.data prepare mnist")
    x, y = data.load_split(args.data, "train")
    model = ConvNet(SPEC, info.image_shape)
    runners = {"engine_T1": engine_runner(model, 1, x, y, args.steps),
               "engine_T2": engine_runner(model, 2, x, y, args.steps),
               "engine_numpy_T1": engine_runner(model, 1, x, y, args.steps, compiled=False)}
    if torch is not None:
        runners["torch_T1"] = torch_runner(model, 1, x, y, args.steps)
        runners["torch_T2"] = torch_runner(model, 2, x, y, args.steps)
    peak = sgemm_peak()
    samples = {k: [] for k in runners}
    for r in range(args.repeats):
        for name, (run, _, _) in runners.items():
            n, s = run()
            samples[name].append(n / s)
            log(f"  repeat {r} {name}: {n / s:,.0f} ex/s")
    losses = {name: (first, loss()) for name, (_, first, loss) in runners.items()}
    for name, (first, last) in losses.items():
        loss_fell(name, first, last, FELL_TO)
    ref = losses["engine_T1"][1]
    for name, (_, last) in losses.items():
        if not ref / LOSS_SPREAD <= last <= ref * LOSS_SPREAD:
            fail(f"{name}: final loss {last:.4g}, engine_T1's {ref:.4g} "
                 f"(allowed: within {LOSS_SPREAD}x)")
    flops, conns = model.flops_per_example(), model.connections()
    res = {}
    for name, v in samples.items():
        T = int(name[-1])
        med = statistics.median(v)
        res[name] = {"examples_per_s": round(med, 1), "best_examples_per_s": round(max(v), 1),
                     "samples_examples_per_s": [round(e, 1) for e in v],
                     "gflops": round(med * flops / 1e9, 2),
                     "fraction_of_sgemm_peak": round(med * flops / 1e9 / (peak * T), 3),
                     "connections_per_s": round(med * conns)}

    def pair(a, b):
        return round(statistics.median(p / q for p, q in zip(samples[a], samples[b])), 3)

    paired = {"engine_T2_over_T1": pair("engine_T2", "engine_T1"),
              "compiled_over_numpy_T1": pair("engine_T1", "engine_numpy_T1")}
    if torch is not None:
        paired.update(engine_over_torch_T1=pair("engine_T1", "torch_T1"),
                      engine_over_torch_T2=pair("engine_T2", "torch_T2"),
                      torch_T2_over_T1=pair("torch_T2", "torch_T1"))
    out = {"machine": {"cpu": cpu_model(), "cpu_features": cpu_features(),
                       "cores": os.cpu_count(), "loadavg_end": os.getloadavg(),
                       "numpy": np.__version__, "compiled_engine": conv_hogwild.HAVE_EXTENSION,
                       "blas": {k: v for k, v in blas.info().items() if k in ("blas", "reason")},
                       "torch": torch.__version__ if torch is not None else None},
           "model": SPEC, "n_params": model.n_params, "batch": BATCH, "lr": LR,
           "repeats": args.repeats, "steps_per_thread": args.steps,
           "flops_per_example": flops, "connections_per_example": conns,
           "sgemm_peak_gflops_1_thread": round(peak, 1), "results": res,
           "paired_ratios_median": paired,
           "loss_first_last": {k: [round(a, 4), round(b, 4)] for k, (a, b) in losses.items()},
           "targets": {"engine_over_torch_T1": 1.0, "engine_over_torch_T2": 1.3}}
    print(json.dumps(out, indent=1))
    save("bench_conv", out)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
