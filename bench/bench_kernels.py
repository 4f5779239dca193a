"""Benchmark the Adagrad update kernels; print one JSON object to stdout.

Compares, on one shard-sized float32 vector, the compiled kernel (1 and 2 threads), the
blocked NumPy reference (the fallback when the extension is not built), and the naive NumPy
expression one would write first (``accum += g*g; w -= lr*g/(np.sqrt(accum)+eps)``, which
allocates full-size temporaries). The update is memory bound, so G params/s is the figure
to compare with the machine's memory bandwidth: each parameter moves 20 bytes.

Usage::

    python bench/bench_kernels.py [--n 10000000] [--repeats 7]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checks import close  # noqa: E402  (bench/checks.py)
from hpcps.kernels import reference  # noqa: E402
from machine import cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    from hpcps.kernels import _adagrad as compiled  # noqa: E402
except ImportError:
    compiled = None

LR, EPS = 0.01, 1e-8
# float32 kernels against the same update in float64: a few ulps of w after three updates
RTOL, ATOL = 1e-5, 1e-6


def check_update(name, update, n):
    """Three updates of ``update`` on random inputs must equal Adagrad in float64 within
    RTOL, ATOL (exits non-zero otherwise): what is timed is what is checked."""
    rng = np.random.default_rng(1)
    n = min(n, 1_000_003)  # odd: a tail past any blocking
    w = rng.standard_normal(n, dtype=np.float32)
    accum = rng.random(n, dtype=np.float32)
    w64, a64 = w.astype(np.float64), accum.astype(np.float64)
    for _ in range(3):
        g = rng.standard_normal(n, dtype=np.float32)
        update(w, g, accum)
        a64 += g.astype(np.float64) ** 2
        w64 -= LR * g / (np.sqrt(a64) + EPS)
    close(f"{name}: accumulator", accum, a64, RTOL, ATOL)
    close(f"{name}: weights", w, w64, RTOL, ATOL)


def naive_adagrad(w, g, accum, lr, eps):
    accum += g * g
    w -= lr * g / (np.sqrt(accum) + eps)


def time_update(update, n, repeats):
    """Median wall time of ``repeats`` calls of ``update(w, g, accum)`` after one warm-up.

    The warm-up call faults in the pages, so the timed calls measure the update alone.
    """
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32)
    accum = np.zeros(n, dtype=np.float32)
    update(w, g, accum)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        update(w, g, accum)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"seconds": seconds, "gparams_per_s": n / seconds / 1e9}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000, help="parameters per update")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is kept")
    args = parser.parse_args(argv)
    if args.n < 1 or args.repeats < 1:
        parser.error("--n and --repeats must be >= 1")

    updates = {}
    if compiled is not None:
        for threads in (1, 2):
            updates[f"compiled_t{threads}"] = (
                lambda w, g, a, t=threads: compiled.adagrad_update(w, g, a, LR, EPS, t))
    updates["numpy_reference"] = lambda w, g, a: reference.adagrad_update(w, g, a, LR, EPS)
    updates["numpy_naive"] = lambda w, g, a: naive_adagrad(w, g, a, LR, EPS)
    for name, update in updates.items():  # before any figure: each computes Adagrad
        check_update(name, update, args.n)
    results = {name: time_update(update, args.n, args.repeats)
               for name, update in updates.items()}

    # Speed-ups: time of the NumPy version divided by time of the compiled one.
    ratios = {}
    for key in ("compiled_t1", "compiled_t2"):
        if key in results:
            for base in ("numpy_reference", "numpy_naive"):
                ratios[f"{key}_over_{base}"] = (
                    results[base]["seconds"] / results[key]["seconds"]
                )

    report = {
        "benchmark": "adagrad_update",
        "machine": {
            "platform": platform.platform(),
            "cpu_model": cpu_model(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "n": args.n,
        "dtype": "float32",
        "repeats": args.repeats,
        "statistic": "median",
        "extension_built": compiled is not None,
        "results": results,
        "speedup": ratios,
    }
    print(json.dumps(report, indent=2))
    save("bench_kernels", report)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
