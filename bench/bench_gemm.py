"""Benchmark the GEMM kernels against OpenBLAS through NumPy; print one JSON object to stdout.

At the training shapes (MLP 784-1024-1024-10, batch 128), on one core (OpenBLAS limited to
one thread with threadpoolctl, or OPENBLAS_NUM_THREADS=1 set before NumPy is imported):

- sgemm GFLOP/s: NumPy (``np.matmul``), ``scipy.linalg.cython_blas.sgemm`` through
  ``hpcps.kernels.gemm.sgemm``, the same with Intel MKL's sgemm (``mkl``, when MKL loads:
  ``hpcps.kernels.blas``), and the packed Cython sgemm if the build still has it;
  forward layouts ``X @ W`` and weight-gradient layouts ``X.T @ D``;
- ``act(X @ W + b)``: NumPy, the compiled pass for every activation, the public API;
- the zero-skipping first-layer kernels (``zero_skip_matmul``, ``zero_skip_update``), with
  every instruction set this CPU runs them with (AVX-512F, AVX2 + FMA), on
  128 real MNIST images when ``data/mnist.h5`` exists (else random inputs with MNIST's
  19% density, which is harder: real strokes cluster, so blocks share their zeros) and on
  dense inputs, against OpenBLAS's sgemm for the same product (for the update OpenBLAS
  only forms ``X.T @ D``; the kernel also adds it into W), as time and dense-equivalent
  GFLOP/s (2*B*K*N over the time), the speed-ups as medians of paired, alternating calls;
- the server update ``G = A.T @ E`` then Adagrad: NumPy's two steps, NumPy's GEMM followed by
  the compiled Adagrad kernel, and the fused kernel (threads 1 and 2, a few tiles), as weight
  updates per second (M*N per call) and per core.

Every figure is a median over ``--repeats`` calls after one warm-up; ``frac_of_150`` is the
fraction of 150 GFLOP/s, this machine's single-core sgemm when idle. The machine is shared,
so compare figures of one run. Everything but the sgemm section's ``mkl`` column runs with
OpenBLAS (``hpcps.kernels.blas.use("openblas")``), whatever ``HPCPS_BLAS`` says.

Usage::

    python bench/bench_gemm.py [--repeats 9]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # fallback when threadpoolctl is missing

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.kernels import blas, gemm  # noqa: E402
from checks import close  # noqa: E402  (bench/checks.py)
from machine import cpu_features, cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    from hpcps.kernels import _gemm  # noqa: E402
except ImportError:
    _gemm = None
try:
    from hpcps.kernels import _adagrad  # noqa: E402
except ImportError:
    _adagrad = None
try:  # after every BLAS-linking import: threadpoolctl limits only loaded libraries
    from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402
    _LIMIT = threadpool_limits(1)
except ImportError:
    threadpool_info = None

try:
    blas.use("mkl")
    HAVE_MKL = True
except blas.ConfigError:   # hpcps.errors.ConfigError
    HAVE_MKL = False
blas.use("openblas")    # every figure but the sgemm section's mkl column is OpenBLAS's

PEAK = 150e9
LR, EPS = 0.01, 1e-8
GEMM_SHAPES = [  # (M, K, N, trans_a, what)
    (128, 784, 1024, False, "forward layer 1: X(128x784) @ W(784x1024)"),
    (128, 1024, 1024, False, "forward layer 2: X(128x1024) @ W(1024x1024)"),
    (128, 1024, 10, False, "forward layer 3: X(128x1024) @ W(1024x10)"),
    (784, 128, 1024, True, "weight gradient 1: X.T(784x128) @ D(128x1024)"),
    (1024, 128, 1024, True, "weight gradient 2: X.T(1024x128) @ D(128x1024)"),
]
UPDATE_SHAPES = [(784, 1024, 128), (1024, 1024, 128), (1024, 1024, 32)]
TILES = [(64, 1024), (256, 256), (512, 512), (1024, 1024)]  # 1024x1024 = whole G: unfused




# Checked before any figure prints (bench/checks.py): float32 products against float64 NumPy.
# A sum of K products of unit normals is about sqrt(K) in size and its float32 rounding
# error about 1e-7 * K; RTOL, ATOL_PER_K leave two orders of magnitude above that.
RTOL, ATOL_PER_K = 1e-4, 1e-5


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_times(fn, repeats):
    """``fn`` timed with OpenBLAS and with MKL in alternation, one call each per round (the
    switch is outside the timed call): medians of both, and the median over rounds of
    OpenBLAS's time over MKL's (MKL's speedup; load that drifts between rounds cancels)."""
    t = {"openblas": [], "mkl": []}
    for r in range(repeats + 1):
        for name in ("openblas", "mkl") if r % 2 else ("mkl", "openblas"):
            blas.use(name)
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    blas.use("openblas")
    ob, mk = t["openblas"][1:], t["mkl"][1:]   # the first round warms up
    return (statistics.median(ob), statistics.median(mk),
            statistics.median(a / b for a, b in zip(ob, mk)))


def bench_sgemm(repeats, rng):
    rows = []
    for M, K, N, trans_a, what in GEMM_SHAPES:
        A = rng.standard_normal((K, M) if trans_a else (M, K), dtype=np.float32)
        B = rng.standard_normal((K, N), dtype=np.float32)
        out = np.empty((M, N), dtype=np.float32)
        opA = A.T if trans_a else A
        flops = 2.0 * M * N * K
        impls = {"numpy": lambda: np.matmul(opA, B, out=out)}
        if _gemm is not None:
            impls["cython_blas"] = lambda: gemm.sgemm(A, B, out, trans_a)
            if HAVE_MKL:   # timed with cython_blas, interleaved: see paired_times
                impls["mkl"] = None
            if hasattr(_gemm, "sgemm_blocked"):
                impls["blocked_cython"] = lambda: _gemm.sgemm_blocked(A, B, out, trans_a)
        want = opA.astype(np.float64) @ B.astype(np.float64)
        for name, fn in impls.items():  # what is timed computes A @ B
            out.fill(np.nan)
            if fn is None:  # MKL's sgemm through the same call
                blas.use("mkl")
                impls["cython_blas"]()
                blas.use("openblas")
            else:
                fn()
            close(f"sgemm {what} {name}", out, want, RTOL, ATOL_PER_K * K)
        row = {"shape": what, "M": M, "K": K, "N": N, "trans_a": trans_a}
        times = {}
        if "mkl" in impls:
            times["cython_blas"], times["mkl"], ratio = paired_times(impls["cython_blas"],
                                                                     repeats)
            row["mkl_over_cython_blas"] = round(ratio, 3)
        for name, fn in impls.items():
            t = times[name] if name in times else median_time(fn, repeats)
            row[name] = {"ms": round(t * 1e3, 4), "gflops": round(flops / t / 1e9, 2),
                         "frac_of_150": round(flops / t / PEAK, 3)}
        rows.append(row)
        print(f"sgemm {what}: done", file=sys.stderr)
    return rows


def numpy_bias_act(X, W, b, act):
    z = X @ W + b
    if act == "relu":
        return np.maximum(z, 0)
    if act == "tanh":
        return np.tanh(z)
    if act == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    return z


def bench_bias_act(repeats, rng):
    rows = []
    for M, K, N, trans_a, what in GEMM_SHAPES:
        if trans_a:
            continue
        X = rng.standard_normal((M, K), dtype=np.float32)
        W = (rng.standard_normal((K, N), dtype=np.float32) / np.sqrt(K)).astype(np.float32)
        b = rng.standard_normal(N, dtype=np.float32)
        out = np.empty((M, N), dtype=np.float32)
        flops = 2.0 * M * N * K
        for act in gemm.ACTIVATIONS:
            impls = {"numpy": lambda: numpy_bias_act(X, W, b, act),
                     "api": lambda: gemm.gemm_bias_act(X, W, b, act, out)}
            if _gemm is not None:
                impls["fused_compiled_pass"] = lambda: _gemm.gemm_bias_act(X, W, b, act, out)
                impls["fused_row_blocks_32"] = (
                    lambda: _gemm.gemm_bias_act(X, W, b, act, out, 32))
            want = numpy_bias_act(X.astype(np.float64), W.astype(np.float64), b, act)
            for name, fn in impls.items():  # what is timed computes act(X @ W + b)
                out.fill(np.nan)
                got = fn() if name == "numpy" else (fn(), out)[1]
                close(f"bias+act {what} {act} {name}", got, want, RTOL, ATOL_PER_K * K)
            row = {"shape": what, "act": act}
            for name, fn in impls.items():
                t = median_time(fn, repeats)
                row[name] = {"us": round(t * 1e6, 1), "gflops": round(flops / t / 1e9, 2)}
            row["speedup_api_vs_numpy"] = round(row["numpy"]["us"] / row["api"]["us"], 3)
            rows.append(row)
        print(f"bias+act {what}: done", file=sys.stderr)
    return rows


def bench_update(repeats, rng):
    rows = []
    for M, N, k in UPDATE_SHAPES:
        W0 = rng.standard_normal((M, N), dtype=np.float32)
        acc0 = rng.uniform(0.5, 2.0, (M, N)).astype(np.float32)
        A = rng.standard_normal((k, M), dtype=np.float32)
        E = rng.standard_normal((k, N), dtype=np.float32)
        W, acc = W0.copy(), acc0.copy()
        G = np.empty((M, N), dtype=np.float32)

        def numpy_two_steps():
            G = A.T @ E
            acc.__iadd__(G * G)
            W.__isub__(LR * G / (np.sqrt(acc) + EPS))

        impls = {"numpy_two_steps": numpy_two_steps}
        if _adagrad is not None:
            def numpy_gemm_compiled_adagrad():
                np.matmul(A.T, E, out=G)
                _adagrad.adagrad_update(W.reshape(-1), G.reshape(-1), acc.reshape(-1),
                                        LR, EPS, 1)
            impls["numpy_gemm_then_compiled_adagrad"] = numpy_gemm_compiled_adagrad
        if _gemm is not None:
            for tm, tn in TILES:
                impls[f"fused_t1_{tm}x{tn}"] = (
                    lambda tm=tm, tn=tn: gemm.fused_outer_adagrad(W, acc, A, E, LR, EPS, 1,
                                                                  tm, tn))
            impls["fused_t1_default"] = lambda: gemm.fused_outer_adagrad(W, acc, A, E, LR, EPS)
            impls["fused_t2_default"] = (
                lambda: gemm.fused_outer_adagrad(W, acc, A, E, LR, EPS, threads=2))
        G64 = A.T.astype(np.float64) @ E.astype(np.float64)
        acc64 = acc0 + G64 * G64
        W64 = W0 - LR * G64 / (np.sqrt(acc64) + EPS)
        for name, fn in impls.items():  # from the same start, each takes the same step
            W[...], acc[...] = W0, acc0
            fn()
            close(f"update {M}x{N} k={k} {name}: accumulator", acc, acc64, RTOL,
                  ATOL_PER_K * k * k)
            close(f"update {M}x{N} k={k} {name}: weights", W, W64, RTOL, ATOL_PER_K)
        flops = 2.0 * M * N * k
        row = {"M": M, "N": N, "k": k}
        for name, fn in impls.items():
            t = median_time(fn, repeats)
            cores = 2 if "_t2_" in name else 1
            row[name] = {"ms": round(t * 1e3, 3),
                         "G_updates_per_s": round(M * N / t / 1e9, 3),
                         "G_updates_per_s_per_core": round(M * N / t / 1e9 / cores, 3),
                         "gemm_gflops": round(flops / t / 1e9, 2),
                         "frac_of_150_per_core": round(flops / t / PEAK / cores, 3)}
        base = row["numpy_two_steps"]["ms"]
        if "fused_t1_default" in row:
            fused = row["fused_t1_default"]["ms"]
            row["speedup_fused_t1_vs_numpy_two_steps"] = round(base / fused, 3)
            if "numpy_gemm_then_compiled_adagrad" in row:
                row["speedup_fused_t1_vs_numpy_gemm_compiled_adagrad"] = round(
                    row["numpy_gemm_then_compiled_adagrad"]["ms"] / fused, 3)
        rows.append(row)
        print(f"update {M}x{N} k={k}: done", file=sys.stderr)
    return rows


def mnist_batch(B, rng):
    path = Path(__file__).resolve().parents[1] / "data/mnist.h5"
    if path.exists():
        import h5py
        with h5py.File(path, "r") as f:
            rows = np.sort(rng.choice(len(f["train/x"]), B, replace=False))
            return np.ascontiguousarray(f["train/x"][rows], dtype=np.float32), "mnist"
    X = rng.random((B, 784), dtype=np.float32)
    X[rng.random((B, 784)) >= 0.19] = 0.0
    return X, "random, 19% nonzero"


def paired_ratio(fn_a, fn_b, repeats):
    """Median seconds of ``fn_a`` and ``fn_b`` called in alternation (one warm-up each), and
    the median over rounds of each round's ``a / b``: load that drifts cancels."""
    fn_a()
    fn_b()
    ta, tb = [], []
    for r in range(repeats):
        for fn, out in ((fn_a, ta), (fn_b, tb)) if r % 2 == 0 else ((fn_b, tb), (fn_a, ta)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return (statistics.median(ta), statistics.median(tb),
            statistics.median(a / b for a, b in zip(ta, tb)))


def bench_zero_skip(repeats, rng):
    """Every instruction set the kernels have on this CPU, against OpenBLAS, paired."""
    if not gemm.ZERO_SKIP_COMPILED:
        return {"available": False, "cpu_isa": gemm.ZERO_SKIP_CPU_ISA}
    B, K = 128, 784
    Xm, source = mnist_batch(B, rng)
    out = {"available": True, "isas": list(gemm.ZERO_SKIP_ISAS), "inputs": source,
           "shapes": []}
    for name, X in (("mnist_like", Xm), ("dense", rng.standard_normal((B, K),
                                                                       dtype=np.float32))):
        for N in (512, 1024):
            W = rng.standard_normal((K, N), dtype=np.float32)
            D = rng.standard_normal((B, N), dtype=np.float32) * np.float32(0.01)
            Z = np.empty((B, N), np.float32)
            G = np.empty((K, N), np.float32)
            flops = 2.0 * B * K * N
            fwd64 = X.astype(np.float64) @ W.astype(np.float64)
            step64 = -1e-3 * (X.T.astype(np.float64) @ D.astype(np.float64))
            for isa in gemm.ZERO_SKIP_ISAS:  # the kernels compute what OpenBLAS does
                Z.fill(np.nan)
                gemm.zero_skip_matmul(X, W, Z, isa=isa)
                close(f"zero_skip_matmul {isa} {name} N={N}", Z, fwd64, RTOL, ATOL_PER_K * K)
                W1 = W.copy()
                gemm.zero_skip_update(W1, X, D, -1e-3, isa=isa)
                close(f"zero_skip_update {isa} {name} N={N}", W1 - W, step64, RTOL, 1e-6)
            for isa in gemm.ZERO_SKIP_ISAS:
                t_fwd_blas, t_fwd_skip, r_fwd = paired_ratio(
                    lambda: gemm.sgemm(X, W, Z),
                    lambda: gemm.zero_skip_matmul(X, W, Z, isa=isa), repeats)
                t_upd_blas, t_upd_skip, r_upd = paired_ratio(
                    lambda: gemm.sgemm(X, D, G, trans_a=True),
                    lambda: gemm.zero_skip_update(W, X, D, -1e-3, isa=isa), repeats)
                out["shapes"].append({
                    "isa": isa, "inputs": name, "B": B, "K": K, "N": N,
                    "nonzero_fraction": round(float(np.count_nonzero(X)) / X.size, 3),
                    "forward_blas_ms": round(t_fwd_blas * 1e3, 3),
                    "forward_zero_skip_ms": round(t_fwd_skip * 1e3, 3),
                    "forward_speedup": round(r_fwd, 2),
                    "forward_zero_skip_dense_equiv_gflops": round(flops / t_fwd_skip / 1e9, 1),
                    "forward_blas_gflops": round(flops / t_fwd_blas / 1e9, 1),
                    "update_blas_gradient_only_ms": round(t_upd_blas * 1e3, 3),
                    "update_zero_skip_ms": round(t_upd_skip * 1e3, 3),
                    "update_speedup": round(r_upd, 2),
                    "update_zero_skip_dense_equiv_gflops": round(flops / t_upd_skip / 1e9, 1),
                })
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    result = {
        "machine": {
            "cpu": cpu_model(), "cpu_features": cpu_features(), "cores": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "blas": ([{k: d.get(k) for k in ("filepath", "version", "architecture",
                                            "num_threads")}
                      for d in threadpool_info()] if threadpool_info else None),
            "load_avg_at_start": os.getloadavg(),
            "mkl": ({k: v for k, v in blas.info().items() if k != "blas"} if HAVE_MKL
                    else {"mkl_error": blas.mkl_error}),
        },
        "have_extension": gemm.HAVE_EXTENSION,
        "blocked_cython_sgemm_built": _gemm is not None and hasattr(_gemm, "sgemm_blocked"),
        "repeats": args.repeats,
        "peak_assumed_gflops_per_core": PEAK / 1e9,
        "sgemm": bench_sgemm(args.repeats, rng),
        "gemm_bias_act": bench_bias_act(args.repeats, rng),
        "outer_adagrad": bench_update(args.repeats, rng),
        "zero_skip": bench_zero_skip(args.repeats, rng),
    }
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    json.dump(result, sys.stdout, indent=1)
    print()
    save("bench_gemm", result)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
