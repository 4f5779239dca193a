"""Benchmark embedding models on the parameter server; print one JSON object.

Three parts, each run alone (nothing else on the machine):

``throughput``
    Downpour training of ``embed16,fc400,fc400,fc400,fc1`` on ``synthetic-ctr`` with 26
    fields, 10^8 possible ids per field, Zipf 1.1 (``python -m hpcps.data prepare
    synthetic-ctr``), as real ``mpiexec -n N python -m hpcps.train`` runs read back from
    their ``metrics.jsonl``. For each rank count: the job's training examples per second,
    and ``instances_per_s_per_core``, that rate over the cores the whole job used (replicas
    and server shards counted: min(N, cores)); bytes moved per step, against the dense
    equivalent (pulling and pushing every table whole, as a server of dense vectors would).
``movielens``
    The issue's accuracy target: ``mpiexec -n 4 python -m hpcps.train --model movielens
    --data movielens.h5`` with every other option at its default, and scikit-learn's
    ``LogisticRegression()`` on the same split, the fields one-hot (genres multi-hot); both
    test AUCs and their difference.
``memory``
    A table of ``--memory-rows`` (default 3 x 10^7) touched rows of 16 dimensions held by S =
    1, 2, 4 shards: S processes each create the rows that hash to it (the shard's own
    :class:`hpcps.ps.embedding_store.EmbeddingStore`, per-row Adagrad, no MPI: touching 3 x
    10^7 rows by training would take hours on two cores) and report the growth of their
    resident memory, against rows/S x the bytes per row of ``docs/ctr.md``.

Usage::

    python bench/bench_embeddings.py                    # all three parts
    python bench/bench_embeddings.py --only throughput --repeats 3
    python bench/bench_embeddings.py --quick            # smoke test, seconds, not saved
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from bench_train import find_mpiexec, log, machine, summary_of, train  # noqa: E402
from machine import cpu_features, save  # noqa: E402

SPEC = "embed16,fc400,fc400,fc400,fc1"
FIELDS, VOCAB, ZIPF, DIM = 26, 10**8, 1.1, 16


def prepare(path: Path, rows: int) -> None:
    from hpcps.io.data.synthetic_ctr import prepare_synthetic_ctr
    if not path.exists():
        prepare_synthetic_ctr(path, rows=rows, fields=FIELDS, vocab=VOCAB, zipf=ZIPF, seed=1,
                              log=lambda s: log(s))


def dense_equivalent_bytes(model_params: int, n_fields: int, vocab: int, dim: int) -> int:
    """Bytes a step would move if the tables were dense vectors: pull and push of every row
    of every table, and of the dense layers (float32)."""
    return 2 * 4 * (n_fields * vocab * dim + model_params)


# -- throughput --------------------------------------------------------------------------------
def bench_throughput(mpiexec, data: Path, tmp: Path, ranks_list, steps: int, batch: int,
                     repeats: int, timeout: float) -> list[dict]:
    from hpcps.io.data.categorical import open_categorical
    from hpcps.model.ctr import CtrModel
    info = open_categorical(data)
    model = CtrModel.for_fields(SPEC, info.fields, info.n_dense)
    cores = os.cpu_count() or 1
    out = []
    for ranks in ranks_list:
        runs = []
        for rep in range(repeats):
            work = tmp / f"tp-{ranks}-{rep}"
            work.mkdir()
            args = ["--model", SPEC, "--data", str(data), "--servers", "1",
                    "--steps", str(steps), "--batch-size", str(batch), "--warmup-steps", "0",
                    "--eval-every", "0", "--checkpoint-every", "0", "--timeout", "120"]
            s = summary_of(train(mpiexec, ranks, args, work, timeout))
            runs.append(s)
            log(f"throughput N={ranks} run {rep + 1}: {s['examples_per_s']:.0f} examples/s, "
                f"AUC {s['test_auc']:.4f}")
        rates = [r["examples_per_s"] for r in runs]
        used = min(ranks, cores)
        mid = statistics.median(rates)
        out.append({"ranks": ranks, "replicas": ranks - 1, "servers": 1, "cores_used": used,
                    "batch_size": batch, "steps": steps,
                    "examples_per_s": round(mid, 1), "examples_per_s_all": rates,
                    "instances_per_s_per_core": round(mid / used, 1),
                    "bytes_per_step": statistics.median(r["bytes_per_step"] for r in runs),
                    "dense_equivalent_bytes_per_step": dense_equivalent_bytes(
                        model.n_params, FIELDS, VOCAB, DIM),
                    "rows_per_step": statistics.median(r["rows_per_step"] for r in runs),
                    "test_auc": statistics.median(r["test_auc"] for r in runs)})
    return out


# -- movielens ---------------------------------------------------------------------------------
def logistic_baseline(path: Path) -> float:
    """Test AUC of scikit-learn's LogisticRegression() on the one-hot fields of ``path``."""
    import h5py
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    def onehot(ids, col_base, width):
        rows, cols = np.nonzero(ids >= 0)
        return sp.csr_matrix((np.ones(len(rows)), (rows, ids[rows, cols] + col_base[cols])),
                             shape=(ids.shape[0], width))

    with h5py.File(path, "r") as f:
        widths, vocab = f.attrs["field_widths"], f.attrs["field_vocab"]
        base = np.concatenate([[0], np.cumsum(vocab)])
        col_base = np.repeat(base[:-1], widths)
        x_tr = onehot(f["train/ids"][()], col_base, int(base[-1]))
        x_te = onehot(f["test/ids"][()], col_base, int(base[-1]))
        y_tr, y_te = f["train/y"][()], f["test/y"][()]
    model = LogisticRegression(max_iter=1000).fit(x_tr, y_tr)
    return float(roc_auc_score(y_te, model.decision_function(x_te)))


def bench_movielens(mpiexec, data: Path, tmp: Path, repeats: int, timeout: float) -> dict:
    runs = []
    for rep in range(repeats):
        work = tmp / f"ml-{rep}"
        work.mkdir()
        s = summary_of(train(mpiexec, 4, ["--model", "movielens", "--data", str(data),
                                          "--seed", str(rep)], work, timeout))
        runs.append(s["test_auc"])
        log(f"movielens run {rep + 1}: test AUC {s['test_auc']:.4f}")
    base = logistic_baseline(data)
    mid = statistics.median(runs)
    return {"command": "mpiexec -n 4 python -m hpcps.train --model movielens --data "
                       "movielens.h5 (--seed 0, 1, ...)",
            "test_auc": round(mid, 4), "test_auc_all": runs,
            "logistic_regression_auc": round(base, 4), "auc_gain": round(mid - base, 4),
            "target_gain": 0.01, "target_met": mid - base >= 0.01}


# -- memory ------------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fill_shard(shard: int, n_shards: int, rows: int, queue) -> None:
    from hpcps.ps.embedding_store import EmbeddingStore
    from hpcps.kernels.embedding import place
    store = EmbeddingStore(DIM, table=0, seed=1)
    before = _rss()
    chunk = 1 << 20
    for lo in range(0, rows, chunk):
        ids = np.arange(lo, min(rows, lo + chunk), dtype=np.int64) * 7919 + 13  # spread ids
        mine = ids[place(np.zeros_like(ids), ids, n_shards) == shard]
        store.pull(mine)
        del ids, mine
    queue.put({"shard": shard, "rows": len(store), "rss_growth_bytes": _rss() - before,
               "predicted_bytes": store.resident_bytes()})


def bench_memory(total_rows: int, shard_counts) -> list[dict]:
    from hpcps.ps.embedding_store import EmbeddingStore
    per_row = EmbeddingStore(DIM).row_bytes
    out = []
    ctx = mp.get_context("spawn")
    for S in shard_counts:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_fill_shard, args=(s, S, total_rows, queue))
                 for s in range(S)]
        for p in procs:
            p.start()
        got = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r["shard"])
        for p in procs:
            p.join()
        nominal = total_rows / S * per_row
        for r in got:
            r["nominal_bytes"] = round(nominal)
            r["growth_over_nominal"] = round(r["rss_growth_bytes"] / nominal, 3)
            r["growth_over_predicted"] = round(r["rss_growth_bytes"] / r["predicted_bytes"], 3)
        log(f"memory S={S}: " + ", ".join(f"shard {r['shard']} {r['rows']} rows "
                                          f"{r['rss_growth_bytes'] / 2**20:.0f} MiB "
                                          f"({r['growth_over_nominal']:.2f}x nominal)"
                                          for r in got))
        out.append({"shards": S, "rows": total_rows, "bytes_per_row": per_row,
                    "per_shard": got,
                    "within_20pct": all(abs(r["growth_over_nominal"] - 1) <= 0.2 for r in got)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("throughput", "movielens", "memory"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=400_000, help="synthetic-ctr rows")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--memory-rows", type=int, default=30_000_000)
    p.add_argument("--cache", default=str(ROOT / "data"),
                   help="where the prepared datasets are kept")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, not saved")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.steps, args.repeats, args.memory_rows = 20_000, 20, 1, 200_000
        args.batch_size = 128
    mpiexec = find_mpiexec()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    figures = {"machine": {**machine(mpiexec), "cpu_features": cpu_features()}}
    with tempfile.TemporaryDirectory(prefix="bench-emb-") as tmpdir:
        tmp = Path(tmpdir)
        if args.only in (None, "throughput"):
            data = cache / f"synthetic-ctr-26x1e8-{args.rows}.h5"
            prepare(data, args.rows)
            figures["throughput"] = {
                "model": SPEC, "data": f"synthetic-ctr --rows {args.rows} --fields {FIELDS} "
                                       f"--vocab {VOCAB} --zipf {ZIPF} --seed 1",
                "runs": bench_throughput(mpiexec, data, tmp,
                                         [int(n) for n in args.ranks.split(",")], args.steps,
                                         args.batch_size, args.repeats, args.timeout)}
        if args.only in (None, "movielens"):
            from hpcps.io.data import prepare as prepare_builtin
            data = cache / "movielens.h5"
            if not data.exists():
                prepare_builtin("movielens", data, log=log)
            figures["movielens"] = bench_movielens(mpiexec, data, tmp, args.repeats,
                                                   args.timeout)
        if args.only in (None, "memory"):
            figures["memory"] = bench_memory(args.memory_rows, (1, 2, 4))
    print(json.dumps(figures, indent=1))
    if not args.quick:
        save("bench_embeddings", figures, sys.argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
