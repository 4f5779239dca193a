"""Is ``HPCPS_BLAS=auto`` right on this CPU? Print one JSON object to stdout.

For each model, ``--choices`` times auto's own measurement (``hpcps.kernels.blas``: the
engine's sgemm calls per step, each library, alternating rounds) and compares its verdicts
with the Hogwild engine itself trained on MNIST with MKL and with OpenBLAS, alternating,
``--rounds`` times (T = 1, batch 128, ``--steps`` mini-batches each): auto is right when it
picks the library the engine ran faster with. Needs MKL (``pip install mkl``).

Usage::

    python bench/bench_blas_auto.py [--data data/mnist.h5] [--choices 5] [--rounds 9]
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: each sgemm is serial

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.engine import hogwild  # noqa: E402
from hpcps.kernels import blas  # noqa: E402
from hpcps.model.mlp import MLP  # noqa: E402
from checks import close, loss_fell  # noqa: E402  (bench/checks.py)
from machine import cpu_features, cpu_model, save  # noqa: E402  (bench/machine.py)

MODELS = [(784, 512, 512, 10), (784, 1024, 1024, 10)]
BATCH = 128
# the engine's float32 gradient with either library against NumPy's MLP (float64 inputs):
# sums of 128 rows of 784-1024 products in float32 round at about 1e-6 relative
RTOL, ATOL = 1e-3, 1e-5


def check_engine(engine, sizes, x, y, params):
    """With each library, the engine's loss and gradient on one mini-batch equal NumPy's
    reference model's within RTOL, ATOL (exits non-zero otherwise)."""
    ref = MLP(sizes)
    p64 = params.astype(np.float64)
    want_loss, want = ref.loss_and_grad(p64, x[:BATCH].astype(np.float64), y[:BATCH])
    for name in ("openblas", "mkl"):
        blas.use(name)
        grad = np.empty_like(params)
        loss = engine.loss_and_grad(params, x[:BATCH], y[:BATCH], grad=grad)
        loss = loss[0] if isinstance(loss, tuple) else loss
        close(f"{'-'.join(map(str, sizes))} with {name}: loss", loss, want_loss, RTOL, ATOL)
        close(f"{'-'.join(map(str, sizes))} with {name}: gradient", grad, want, RTOL, ATOL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data/mnist.h5"))
    ap.add_argument("--choices", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    import h5py
    with h5py.File(args.data, "r") as f:
        x = np.ascontiguousarray(f["train/x"][:20000], dtype=np.float32)
        y = np.ascontiguousarray(f["train/y"][:20000], dtype=np.int64)
    mkl = blas._load_mkl()
    out = {"machine": {"cpu": cpu_model(), "cpu_features": cpu_features(),
                       "loadavg_start": os.getloadavg(), "mkl": blas.info()["mkl_version"]},
           "models": {}}
    for sizes in MODELS:
        engine = hogwild.HogwildEngine(sizes, threads=1, batch=BATCH)
        shapes = blas.mlp_shapes(sizes, BATCH, first_layer=engine.zero_skip_isa is None)
        verdicts = [blas.decide(blas.time_sgemm({"openblas": 0, "mkl": mkl}, shapes)["rounds"])
                    for _ in range(args.choices)]
        params = MLP(sizes).init_params(0)
        check_engine(engine, sizes, x, y, params)
        first = MLP(sizes).loss_and_grad(params, x[:2048], y[:2048])[0]
        rng = np.random.default_rng(0)
        ratios = []
        for r in range(args.rounds):
            t = {}
            for name in ("openblas", "mkl") if r % 2 == 0 else ("mkl", "openblas"):
                blas.use(name)
                order = rng.permutation(len(y))[:args.steps * BATCH]
                t0 = time.perf_counter()
                engine.train(params, x, y, order, 0.01, steps_per_thread=args.steps)
                t[name] = time.perf_counter() - t0
            ratios.append(t["openblas"] / t["mkl"])
        # what was timed trained: the loss on 2,048 training rows fell and stayed finite
        loss_fell(f"{'-'.join(map(str, sizes))} training", first,
                  MLP(sizes).loss_and_grad(params, x[:2048], y[:2048])[0], 0.95)
        engine_speed = statistics.median(ratios)
        faster = "mkl" if engine_speed > 1.0 else "openblas"
        out["models"]["-".join(map(str, sizes))] = {
            "auto_mkl_speed": [round(s, 3) for _, s in verdicts],
            "auto_choices": [n for n, _ in verdicts],
            "engine_mkl_speed_paired_median": round(engine_speed, 3),
            "engine_mkl_speed_rounds": [round(s, 3) for s in ratios],
            "auto_right": sum(n == faster for n, _ in verdicts), "of": len(verdicts)}
    out["machine"]["loadavg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    save("bench_blas_auto", out)  # bench/results/, for bench/render.py


if __name__ == "__main__":
    main()
