"""Benchmark Strom's compressed updates (hpcps.compress.codec); print one JSON object to stdout.

For one worker's residual of ``--n`` float32 weights and a normal gradient whose standard
deviation puts the density after thresholding at ~1e-3 and ~1e-2 (from a zero residual), it
times, compiled kernel beside NumPy reference, each on one core (median of ``--repeats``):

- threshold: ``residual += grad`` and emit words (weights/s, updates/s, GB/s of the
  residual read+written, the gradient read and the words written: 12 bytes per weight + 4 per
  update);
- encode and decode with Golomb-Rice (updates/s; GB/s of words plus message bytes);
- apply to a weight vector (updates/s; GB/s counting 4 bytes of word and 8 bytes of weight
  read+written per update, though each scattered update really moves a 64-byte cache line);

and the message size in bits per update: Golomb-Rice, raw words, the plug-in entropy of the
gaps (+1 sign bit; biased low when updates are fewer than distinct gap values) and the
entropy of geometric gaps at the same density (what independent updates would need).

Usage::

    python bench/bench_compress.py [--n 10000000] [--repeats 7]
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.compress import codec as compress  # noqa: E402
from hpcps.compress.codec import reference  # noqa: E402
from machine import cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    from hpcps.kernels import _compress as compiled  # noqa: E402
except ImportError:
    compiled = None

TAU = 1.0
DENSITIES = {"1e-3": 3.2905, "1e-2": 2.5758}  # tau / std for P(|g| > tau) at a zero residual




def median_time(run, prepare, repeats):
    """Median wall time of ``run()`` over ``repeats`` timed calls, ``prepare()`` untimed first."""
    prepare()
    run()  # warm-up: page faults, caches
    times = []
    for _ in range(repeats):
        prepare()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def figures(seconds, weights=None, updates=None, nbytes=None):
    out = {"seconds": seconds}
    if weights is not None:
        out["weights_per_s"] = weights / seconds
    if updates is not None:
        out["updates_per_s"] = updates / seconds
    if nbytes is not None:
        out["gb_per_s"] = nbytes / seconds / 1e9
    return out


def geometric_entropy_bits(p):
    """Entropy of a geometric gap (success probability p) plus the sign bit."""
    if not 0 < p < 1:
        return float("nan")
    return (-(1 - p) * math.log2(1 - p) - p * math.log2(p)) / p + 1.0


def bench_density(n, ratio, repeats, rng):
    grad = (rng.standard_normal(n, dtype=np.float32) * np.float32(TAU / ratio))
    residual = np.zeros(n, dtype=np.float32)
    out = np.empty(n, dtype=np.uint32)
    backends = {"compiled": compiled, "numpy": reference} if compiled else {"numpy": reference}

    def reset():
        residual[:] = 0

    result = {}
    count = compiled.threshold(residual, grad, TAU, out) if compiled else reference.threshold(
        residual, grad, TAU, out)
    words = out[:count].copy()
    result["density"] = count / n
    result["updates"] = count

    res = {}
    for name, impl in backends.items():
        t = median_time(lambda impl=impl: impl.threshold(residual, grad, TAU, out), reset, repeats)
        res[name] = figures(t, weights=n, updates=count, nbytes=12 * n + 4 * count)
    result["threshold"] = res

    k, nbits = compress._best_k(words)
    nbytes = (nbits + 7) // 8
    payload = np.empty(nbytes, dtype=np.uint8)
    res = {}
    for name, impl in backends.items():
        t = median_time(lambda impl=impl: impl.rice_encode(words, k, payload), lambda: None,
                        repeats)
        res[name] = figures(t, updates=count, nbytes=4 * count + nbytes)
    t = median_time(lambda: compress.encode(words), lambda: None, repeats)
    res["public_encode_incl_k_choice"] = figures(t, updates=count, nbytes=4 * count + nbytes)
    result["encode_golomb"] = res
    result["k"] = k

    decoded = np.empty(count, dtype=np.uint32)
    info = np.zeros(3, dtype=np.int64)
    res = {}
    for name, impl in backends.items():
        t = median_time(lambda impl=impl: impl.rice_decode(payload, count, k, n, decoded, info),
                        lambda: None, repeats)
        res[name] = figures(t, updates=count, nbytes=4 * count + nbytes)
    if not np.array_equal(decoded, words):
        raise RuntimeError("decode did not return the encoded words")
    result["decode_golomb"] = res

    weights = np.zeros(n, dtype=np.float32)
    res = {}
    for name, impl in backends.items():
        t = median_time(lambda impl=impl: impl.apply(weights, words, TAU), lambda: None, repeats)
        res[name] = figures(t, updates=count, nbytes=12 * count)
    result["apply"] = res

    for op in ("threshold", "encode_golomb", "decode_golomb", "apply"):
        if "compiled" in result[op]:
            result[op]["speedup_compiled_over_numpy"] = (
                result[op]["numpy"]["seconds"] / result[op]["compiled"]["seconds"])

    result["bits_per_update"] = {
        "golomb_rice": compress.bits_per_update(compress.encode(words)),
        "raw": compress.bits_per_update(compress.encode(words, golomb=False)),
        "gap_entropy_plugin": compress.gap_entropy_bits(words),
        "geometric_entropy": geometric_entropy_bits(count / n),
    }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000, help="weights per worker")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is kept")
    args = parser.parse_args(argv)
    if args.n < 1 or args.repeats < 1:
        parser.error("--n and --repeats must be >= 1")
    rng = np.random.default_rng(0)
    results = {}
    for label, ratio in DENSITIES.items():
        print(f"density ~{label} ...", file=sys.stderr)
        results[label] = bench_density(args.n, ratio, args.repeats, rng)
    report = {
        "benchmark": "compress",
        "machine": {
            "platform": platform.platform(),
            "cpu_model": cpu_model(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "n": args.n,
        "tau": TAU,
        "threads": 1,
        "repeats": args.repeats,
        "statistic": "median",
        "extension_built": compiled is not None,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    save("bench_compress", report)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
