"""Benchmark the embedding-table kernels against their NumPy references; print one JSON object.

At the size of issue 35's target: a batch of 512 examples with 26 single-valued fields,
ids Zipf(1.1)-distributed over 10^8 possible values per field, rows of 16 float32. Each
kernel of ``hpcps.kernels._embedding`` is timed against the function of the same name in
``hpcps.kernels.reference`` (the fallback when the extension is not built), on the same
input, one thread; the results of the two are compared first, and the bench exits with
status 1 (printing nothing) if they differ. Times are medians of ``--repeats`` calls after
a warm-up; ``ratio`` is reference time / compiled time.

The kernels as one step runs them: the replica's ``unique_inverse`` of the batch,
``gather_pooled`` of the pulled rows, ``segment_sum`` of the gradients; the shard's
``lookup_insert`` of the unique ids (lookup only: the rows exist), the row updates
(``rowwise_adagrad_rows``, ``adagrad_rows``, ``sgd_rows``), and ``init_rows`` for as many
new rows as the batch has unique ids.

Usage::

    python bench/bench_embedding_kernels.py [--batch 512] [--fields 26] [--dim 16]
                                            [--repeats 51] [--quick]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcps.kernels import embedding, reference  # noqa: E402
from machine import cpu_features, cpu_model, save  # noqa: E402  (bench/machine.py)

try:
    from hpcps.kernels import _embedding as compiled  # noqa: E402
except ImportError:
    compiled = None

VOCAB = 10**8
RTOL, ATOL = 2e-6, 1e-7


def median_time(fn, setup, repeats):
    """Median seconds of ``fn(*setup())`` over ``repeats`` calls (setup not timed)."""
    args = setup()
    fn(*args)                                   # warm-up
    times = []
    for _ in range(repeats):
        args = setup()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def problem(batch, fields, dim, seed=0):
    rng = np.random.default_rng(seed)
    ranks = (rng.zipf(1.1, size=(batch, fields)) - 1) % VOCAB
    ids = np.ascontiguousarray(ranks + np.arange(fields) * VOCAB, dtype=np.int64)
    uniq, inverse = embedding.unique_ids(ids)
    m = uniq.shape[0]
    rows = rng.standard_normal((m, dim), dtype=np.float32)
    grad_out = rng.standard_normal((batch, fields, dim), dtype=np.float32)
    # a shard holding 16x the batch's rows, the batch's among them
    n = 16 * m
    keys = np.full(1 << (2 * n - 1).bit_length(), -1, dtype=np.int64)
    vals = np.empty_like(keys)
    by_slot = np.empty(n + ids.size, dtype=np.int64)
    others = rng.integers(0, fields * VOCAB, size=n - m, dtype=np.int64)
    slots = np.empty(n - m, dtype=np.int64)
    n_rows = compiled.lookup_insert(keys, vals, others, slots, by_slot, 0, True)
    slots = np.empty(m, dtype=np.int64)
    n_rows = compiled.lookup_insert(keys, vals, uniq, slots, by_slot, n_rows, True)
    table = rng.standard_normal((n_rows, dim), dtype=np.float32)
    return dict(ids=ids.reshape(-1), uniq=uniq, inverse=inverse, rows=rows, grad_out=grad_out,
                offsets=np.arange(fields + 1, dtype=np.int64), keys=keys, vals=vals,
                by_slot=by_slot, n_rows=n_rows, slots=slots, table=table,
                grads=rng.standard_normal((m, dim), dtype=np.float32),
                accum_row=rng.uniform(0, 1, n_rows).astype(np.float32),
                accum_el=rng.uniform(0, 1, (n_rows, dim)).astype(np.float32))


def fresh(p):
    """Copies of the arrays the updates write."""
    return {k: p[k].copy() for k in ("table", "accum_row", "accum_el")}


def cases(p, work):
    """name -> run(impl), returning the arrays to compare."""
    n, d = p["ids"].shape[0], p["rows"].shape[1]
    B, F = p["grad_out"].shape[:2]

    def unique(impl):
        uniq, inverse = np.empty(n, np.int64), np.empty(n, np.int64)
        m = impl.unique_inverse(p["ids"], uniq, inverse, False)
        return uniq[:m], inverse

    def gather(impl):
        out = np.empty((B, F, d), np.float32)
        impl.gather_pooled(p["rows"], p["inverse"], p["offsets"], False, out)
        return (out,)

    def segment(impl):
        out = np.empty_like(p["rows"])
        impl.segment_sum(p["grad_out"], p["inverse"], p["offsets"], False, out)
        return (out,)

    def lookup(impl):
        slots = np.empty(p["uniq"].shape[0], np.int64)
        impl.lookup_insert(p["keys"], p["vals"], p["uniq"], slots, p["by_slot"], p["n_rows"],
                           False)
        return (slots,)

    # the updates work in place on ``work``'s arrays: fresh copies for the comparison, the
    # same arrays call after call when timed (the values drift; the work does not change)
    def rowwise(impl):
        impl.rowwise_adagrad_rows(work["table"], work["accum_row"], p["slots"], p["grads"],
                                  0.05, 1e-8)
        return work["table"], work["accum_row"]

    def adagrad(impl):
        impl.adagrad_rows(work["table"], work["accum_el"], p["slots"], p["grads"], 0.05, 1e-8)
        return work["table"], work["accum_el"]

    def sgd(impl):
        impl.sgd_rows(work["table"], p["slots"], p["grads"], 0.05)
        return (work["table"],)

    def init(impl):
        rows = np.empty((p["uniq"].shape[0], d), np.float32)
        impl.init_rows(rows, p["uniq"], 0, rows.shape[0], 3, 42, 0.25)
        return (rows,)

    return {"unique_inverse": unique, "gather_pooled": gather, "segment_sum": segment,
            "lookup": lookup, "rowwise_adagrad_rows": rowwise, "adagrad_rows": adagrad,
            "sgd_rows": sgd, "init_rows": init}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--fields", type=int, default=26)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--quick", action="store_true", help="3 repeats; a smoke test")
    args = parser.parse_args(argv)
    if compiled is None:
        print("hpcps.kernels._embedding is not built: run `python setup.py build_ext "
              "--inplace`", file=sys.stderr)
        return 2
    repeats = 3 if args.quick else args.repeats
    p = problem(args.batch, args.fields, args.dim)
    mismatches = []
    check = [cases(p, fresh(p)) for _ in range(2)]
    for name in check[0]:
        for a, b in zip(check[0][name](compiled), check[1][name](reference)):
            if a.shape != b.shape or not np.allclose(a, b, rtol=RTOL, atol=ATOL):
                mismatches.append(name)
                break
    if mismatches:
        print(f"compiled and reference results differ: {', '.join(mismatches)}",
              file=sys.stderr)
        return 1
    kernels = {}
    timed = {impl: cases(p, fresh(p)) for impl in (compiled, reference)}
    for name in timed[compiled]:
        t_c = median_time(timed[compiled][name], lambda: (compiled,), repeats)
        t_r = median_time(timed[reference][name], lambda: (reference,), repeats)
        kernels[name] = {"compiled_us": round(t_c * 1e6, 2), "reference_us": round(t_r * 1e6, 2),
                         "ratio": round(t_r / t_c, 2)}
    figures = {
        "cpu": cpu_model(), "cpu_features": cpu_features(),
        "batch": args.batch, "fields": args.fields, "dim": args.dim, "vocab_per_field": VOCAB,
        "zipf": 1.1, "unique_ids": int(p["uniq"].shape[0]), "shard_rows": int(p["n_rows"]),
        "repeats": repeats, "threads": 1,
        "kernels": kernels,
    }
    print(json.dumps(figures, indent=1))
    save("bench_embedding_kernels", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
