"""Embedding models on the parameter server (hpcps.ps.rows, downpour's embedding replica):
placement, one replica and one shard against the single-process reference, several shards,
the table files and what is refused. Every launch has a hard timeout (tests/mpirun.py)."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from hpcps.io.data import Batches
from hpcps.io.runlog import LOCK_NAME
from hpcps.io.data.categorical import CategoricalRows, load_block, open_categorical
from hpcps.io.data.stream import RowSource, StreamBatches
from hpcps.model.ctr import CtrModel, LocalTrainer
from hpcps.model.optim import Adagrad
from hpcps.ps.embedding_store import EmbeddingStore
from hpcps.kernels.embedding import place

import mpirun

SPEC = "embed8,fc16,fc1"


summary = mpirun.last_summary


def read_tables(run_dir, n_tables, pattern="shard-*.h5"):
    """Every shard's rows, merged: per table {id: (row, accum)}."""
    tables = [{} for _ in range(n_tables)]
    for path in sorted((run_dir / "tables").glob(pattern)):
        with h5py.File(path, "r") as f:
            for t in range(n_tables):
                g = f[f"table{t}"]
                ids = g["ids"][()]
                assert np.all(np.diff(ids) > 0), "ids are stored sorted"
                for i, row, acc in zip(ids, g["rows"][()], g["accum"][()]):
                    assert i not in tables[t], f"id {i} of table {t} on two shards"
                    tables[t][int(i)] = (row, acc)
    return tables


def test_placement_spreads_and_is_stable():
    ids = np.arange(100_000, dtype=np.int64)
    for S in (1, 2, 3, 7):
        shard = place(np.zeros_like(ids), ids, S)
        counts = np.bincount(shard, minlength=S)
        assert counts.min() > 0.95 * len(ids) / S, counts
        assert np.array_equal(shard, place(np.zeros_like(ids), ids, S))
    # the same id of two tables lands independently
    a, b = place(np.zeros_like(ids), ids, 4), place(np.ones_like(ids), ids, 4)
    assert 0.2 < np.mean(a == b) < 0.3
    big = np.array([2**62, 2**63 - 1], dtype=np.int64)
    assert set(place(np.zeros(2, np.int64), big, 5)) <= set(range(5))


def test_store_peek_reads_initial_rows_without_storing():
    s, fresh = EmbeddingStore(4, table=1, seed=9), EmbeddingStore(4, table=1, seed=9)
    ids = np.array([3, 11, 2**40], dtype=np.int64)
    s.push(ids[:1], np.ones((1, 4), np.float32), 0.5)
    got = s.peek(ids)
    assert len(s) == 1
    np.testing.assert_array_equal(got[1:], fresh.pull(ids[1:]))
    assert not np.allclose(got[0], fresh.pull(ids[:1])[0])


@pytest.mark.parametrize("strategy,streams", [("downpour", False), ("hybrid", False),
                                              ("downpour", True), ("hybrid", True)])
def test_one_replica_one_shard_equals_the_reference(ctr_h5, tmp_path, strategy, streams):
    """50 steps with one replica and one shard = LocalTrainer, to 1e-5: downpour's dense
    layers on the shard, hybrid's on the replica; with the data in memory, or streamed from
    the file (``--data-memory``: the reference then draws the same streamed batches)."""
    steps, batch, seed, lr, row_lr, l2, scale = 50, 32, 4, 0.05, 0.1, 1e-3, 0.05
    run = mpirun.train(2, "--strategy", strategy, "--model", SPEC, "--data", str(ctr_h5),
                       *(["--data-memory", "0.01"] if streams else []),
                       "--servers", "1", "--steps", str(steps), "--batch-size", str(batch),
                       "--seed", str(seed),
                       "--lr", str(lr), "--row-lr", str(row_lr),
                       *(["--warmup-steps", "0"] if strategy == "downpour" else []),
                       "--row-l2", str(l2), "--row-init-scale", str(scale),
                       "--run-dir", str(tmp_path / "run"), "--timeout", "60", timeout=180)
    assert run.returncode == 0, run.output
    assert "final test AUC: 0." in run.stdout
    info = open_categorical(ctr_h5)
    model = CtrModel.for_fields(SPEC, info.fields, info.n_dense)
    tables = [EmbeddingStore(model.dim, table=t, seed=seed, init_scale=scale)
              for t in range(model.n_tables)]
    ref = LocalTrainer(model, tables, seed=seed, lr=lr, row_lr=row_lr,
                       optimizer=Adagrad(lr, 1e-8), row_l2=l2)
    rec = summary(tmp_path / "run")
    assert rec["data_streams"] is streams, rec
    if streams:
        source = RowSource(str(ctr_h5), "train", 2 * info.n_columns + info.n_dense, 0,
                           info.n_train, layout=CategoricalRows.of(info))
        batches = StreamBatches(source, batch, seed * 1_000_003, rec["stream_chunk_rows"],
                                rec["stream_window"])
    else:
        block = load_block(ctr_h5, "train")
        batches = Batches(block.features, block.y, batch, seed * 1_000_003)
    for _ in range(steps):
        (ids, dense), y = next(batches)
        ref.step(ids, y, dense)
    if streams:
        batches.close()
    with h5py.File(tmp_path / "run" / "checkpoint.h5", "r") as f:
        assert int(f.attrs["step"]) == steps
        got = model.flatten({name: f["params"][name][()] for name, _, _ in model.layout})
    np.testing.assert_allclose(got, ref.flat, atol=1e-5, rtol=0)
    held = read_tables(tmp_path / "run", model.n_tables)
    for t, store in enumerate(tables):
        assert set(held[t]) == set(int(i) for i in store.ids)
        for slot, i in enumerate(store.ids):
            row, acc = held[t][int(i)]
            np.testing.assert_allclose(row, store.rows[slot], atol=1e-5, rtol=0)
            np.testing.assert_allclose(acc, store.accum[slot], atol=1e-5, rtol=1e-5)
    assert rec["test_auc"] > 0.6
    assert rec["rows_held"] == sum(len(t) for t in tables)


@pytest.mark.parametrize("n,servers", [(4, 2), (5, 3)])
def test_several_shards_hold_each_row_once_and_learn(ctr_h5, tmp_path, capsys, monkeypatch, n,
                                                        servers):
    run = mpirun.train(n, "--model", SPEC, "--data", str(ctr_h5), "--servers", str(servers),
                       "--epochs", "2", "--warmup-steps", "20", "--eval-every", "20",
                       "--run-dir", str(tmp_path / "run"), "--timeout", "60", timeout=240)
    assert run.returncode == 0, run.output
    rec = summary(tmp_path / "run")
    assert rec["test_auc"] > 0.7, rec["test_auc"]
    held = read_tables(tmp_path / "run", 5)  # asserts that no id is on two shards
    for t, rows in enumerate(held):
        ids = np.array(sorted(rows), dtype=np.int64)
        shard_files = sorted((tmp_path / "run" / "tables").glob("shard-*.h5"))
        assert len(shard_files) == servers
        for s, path in enumerate(shard_files):
            with h5py.File(path, "r") as f:
                mine = f[f"table{t}/ids"][()]
            assert np.all(place(np.full(len(mine), t), mine, servers) == s)
        assert len(ids) == rec["rows_held_by_table"][t]
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(0.0 < r["test_auc"] <= 1.0 for r in evals)
    # hpcps.evaluate reads checkpoint.h5 and the shards' table files: training's figures
    from hpcps.tools import evaluate
    assert evaluate.main([str(tmp_path / "run" / "checkpoint.h5"), "--data", str(ctr_h5),
                          "--json", "--predict", str(tmp_path / "p.npy")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["auc"] == pytest.approx(rec["test_auc"], abs=1e-6)
    assert got["log_loss"] == pytest.approx(rec["test_loss"], abs=1e-6)
    p = np.load(tmp_path / "p.npy")
    assert len(p) == 1000 and np.allclose(p["probabilities"].sum(axis=1), 1.0)
    # read in blocks of 300 rows (4 blocks), scored 128 at a time: the same figures and rows
    monkeypatch.setattr(evaluate, "EVAL_ROWS", 300)
    assert evaluate.main([str(tmp_path / "run" / "checkpoint.h5"), "--data", str(ctr_h5),
                          "--json", "--batch", "128", "--predict", str(tmp_path / "q.npy")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["auc"] == pytest.approx(got["auc"], abs=1e-6)
    assert again["log_loss"] == pytest.approx(got["log_loss"], abs=1e-6)
    q = np.load(tmp_path / "q.npy")
    assert np.array_equal(q["label"], p["label"])
    assert np.allclose(q["probabilities"], p["probabilities"], atol=1e-6)
    # hpcps.inspect counts the rows of every table over the shards' files
    from hpcps.tools import inspect
    facts = inspect.summarize(tmp_path / "run" / "checkpoint.h5")["tables"]
    assert facts["files"] == servers
    assert [r["rows"] for r in facts["per_table"]] == rec["rows_held_by_table"]


@pytest.mark.parametrize("strategy", ["downpour",
                                      pytest.param("hybrid", marks=pytest.mark.openmpi)])
def test_resume_on_another_shard_count(ctr_h5, tmp_path, strategy):
    """Rows written by 2 shards are re-hashed onto 3 on resume: the same rows (a resume with
    no step left holds exactly them, and scores the same), then training goes on."""
    run_dir = tmp_path / "run"
    args = ["--strategy", strategy, "--model", SPEC, "--data", str(ctr_h5), "--run-dir",
            str(run_dir), "--timeout", "60", "--checkpoint-every", "50",
            *(["--warmup-steps", "10"] if strategy == "downpour" else [])]
    first = mpirun.train(4, *args, "--servers", "2", "--steps", "40", timeout=180)
    assert first.returncode == 0, first.output
    before = read_tables(run_dir, 5, "shard-*-of-2.step-*.h5")
    auc = summary(run_dir)["test_auc"]
    if strategy == "downpour":  # the rows' optimizer is the checkpoint's, as the layers' is
        other = mpirun.train(3, "--model", SPEC, "--data", str(ctr_h5), "--run-dir",
                             str(tmp_path / "other"), "--resume", str(run_dir / "checkpoint.h5"),
                             "--row-optimizer", "adagrad", timeout=180)
        assert other.returncode == 4, other.output
        assert "trained with --row-optimizer rowwise_adagrad but this run asks for adagrad" \
            in other.stderr and "Traceback" not in other.output, other.output
    again = mpirun.train(5, *args, "--servers", "3", "--steps", "40", "--resume", "auto",
                         timeout=180)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.output
    after = read_tables(run_dir, 5, "shard-*-of-3.step-*.h5")
    for t in range(5):
        assert set(before[t]) == set(after[t])
        for i, (row, acc) in before[t].items():
            np.testing.assert_array_equal(after[t][i][0], row)
            np.testing.assert_array_equal(after[t][i][1], acc)
        for s in range(3):
            (path,) = (run_dir / "tables").glob(f"shard-{s}-of-3.step-*.h5")
            with h5py.File(path, "r") as f:
                ids = f[f"table{t}/ids"][()]
            assert np.all(place(np.full(len(ids), t), ids, 3) == s)
    assert summary(run_dir)["test_auc"] == pytest.approx(auc, abs=1e-6)
    more = mpirun.train(5, *args, "--servers", "3", "--steps", "120", "--resume", "auto",
                        timeout=180)
    assert more.returncode == 0, more.output
    s = summary(run_dir)
    assert s["step"] >= 120 and s["test_auc"] > 0.7
    # the rows on disk are those of the final checkpoint's step, on every shard: the files of
    # the earlier checkpoints (of 2 shards and of 3) were removed once a newer one was written
    steps = set()
    for path in (run_dir / "tables").glob("shard-*-of-3.step-*.h5"):
        with h5py.File(path, "r") as f:
            steps.add(int(f.attrs["step"]))
    assert steps == {s["step"]}, steps
    assert sorted(p.name for p in (run_dir / "tables").iterdir()) == \
        [f"shard-{k}-of-3.step-{s['step']}.h5" for k in range(3)]
    # hpcps.report shows the AUC of the run (its two segments)
    import subprocess
    import sys
    rep = subprocess.run([sys.executable, "-m", "hpcps.report", str(run_dir)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(mpirun.ROOT)})
    assert rep.returncode == 0, rep.stderr
    head, _, row = rep.stdout.splitlines()[:3]
    assert "final AUC" in head and "final accuracy" not in head
    assert f"{s['test_auc']:.4f}" in row


@pytest.mark.parametrize("strategy", ["downpour", "hybrid"])
def test_a_shard_that_cannot_write_its_table_file_leaves_the_checkpoint_before_whole(
        tmp_path, strategy):
    """2 shards, a checkpoint every 20 steps; at step 40 shard 1's file system refuses its
    table file (a file-size limit on that rank alone, a full disk's stand-in) after shard 0
    has written its own. The job ends with exit code 4 and one line naming the file and the
    reason; the checkpoint of step 20 and both its table files are still there (hybrid's
    chief writes checkpoint.h5 only once every shard's file is in), and ``--resume auto``
    continues from it; once the checkpoint of 40 is written, only its files are left."""
    from hpcps.io.checkpoint import peek_step
    from hpcps.io.data.synthetic_ctr import prepare_synthetic_ctr
    from hpcps.mpi.topology import Layout

    data = tmp_path / "ctr.h5"  # many distinct ids: each checkpoint's files are larger
    prepare_synthetic_ctr(data, rows=30000, fields=8, vocab=10**6, zipf=0.0, seed=1,
                          log=lambda *_: None)
    run_dir = tmp_path / "run"
    args = ["--strategy", strategy, "--model", SPEC, "--data", str(data), "--servers", "2",
            "--steps", "40", "--batch-size", "64", "--checkpoint-every", "20",
            "--run-dir", str(run_dir), "--timeout", "60",
            *(["--warmup-steps", "10"] if strategy == "downpour" else [])]
    shard1 = Layout.plan(4, servers=2).server_ranks[1]
    run = mpirun.run_mpi(4, [str(mpirun.ROOT / "tests" / "scripts" / "limited_train.py"),
                             *args], timeout=180,
                         env={"HPCPS_TEST_FSIZE": "400000",
                              "HPCPS_TEST_FSIZE_RANK": str(shard1)})
    assert run.returncode == 4, run.output[-3000:]
    failed = [line for line in run.stderr.splitlines() if "failed:" in line]
    assert len(failed) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert (f"(server) failed: cannot write embedding table file "
            f"{run_dir / 'tables' / 'shard-1-of-2.step-40.h5'}: ") in failed[0], failed
    assert "the checkpoint before and its table files are unchanged" in failed[0], failed
    assert peek_step(run_dir / "checkpoint.h5") == 20
    names = sorted(p.name for p in (run_dir / "tables").iterdir())
    assert names == ["shard-0-of-2.step-20.h5", "shard-0-of-2.step-40.h5",
                     "shard-1-of-2.step-20.h5"], names
    again = mpirun.train(4, *args, "--resume", "auto", timeout=180)
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed from" in again.stdout and "at step 20" in again.stdout, again.stdout
    assert sorted(p.name for p in (run_dir / "tables").iterdir()) == \
        ["shard-0-of-2.step-40.h5", "shard-1-of-2.step-40.h5"]


def test_resume_without_the_tables_is_refused(ctr_h5, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--model", SPEC, "--data", str(ctr_h5), "--run-dir", str(run_dir), "--servers", "1"]
    assert mpirun.train(2, *args, "--steps", "20", timeout=120).returncode == 0
    for path in (run_dir / "tables").glob("*.h5"):
        path.unlink()
    run = mpirun.train(2, *args, "--steps", "40", "--resume", "auto", timeout=120)
    assert run.returncode == 4, run.output
    assert "no complete set of embedding table files" in run.stderr


@pytest.mark.parametrize("extra,words", [
    (["--strategy", "sync"], "does not train"),
    (["--push", "activations"], "--push activations"),
    (["--compress", "threshold"], "--compress threshold"),
    (["--ps-copies", "2", "--servers", "2"], "--ps-copies > 1"),
])
def test_refused_at_start(ctr_h5, tmp_path, extra, words):
    run = mpirun.train(3, "--model", SPEC, "--data", str(ctr_h5), *extra,
                       "--run-dir", str(tmp_path / "run"), timeout=60)
    assert run.returncode == 2, run.output
    assert words in run.stderr
    assert not (tmp_path / "run" / "checkpoint.h5").exists()


def test_dense_model_on_categorical_data_and_back(ctr_h5, digits_h5, tmp_path):
    run = mpirun.train(2, "--data", str(ctr_h5), "--servers", "1",
                       "--run-dir", str(tmp_path / "a"), timeout=60)
    assert run.returncode == 3 and "--model movielens" in run.stderr, run.output
    run = mpirun.train(2, "--model", SPEC, "--data", str(digits_h5), "--servers", "1",
                       "--run-dir", str(tmp_path / "b"), timeout=60)
    assert run.returncode == 3, run.output
    assert "holds dense features" in run.stderr and "--layers" in run.stderr


# -- combinations: an embedding model against every strategy, layout and downpour option -------
# Each row is judged first as every rank judges it at start (config.parse, the layout plan);
# accepted rows must train and learn (test AUC over COMBO_MIN_AUC: 0.5 is chance, a run of
# this size measured 0.74-0.80), refused ones must end with code 2 and one message.
COMBO_MIN_AUC = 0.65
EMBEDDING_DIMS = [
    [1, 2, 3],                                                   # S
    [1, 2, 3],                                                   # R
    [[], ["--trace"], ["--wire-dtype", "bf16"]],  # the dense layers' values as bfloat16
    [[], ["--threads", "2"]],
    [[], ["--data-memory", "0.01"],  # every replica's block streams, the test split too
     ["--validation-fraction", "0.1"]],  # rows held out of /train score the evaluations
    ["downpour", "hybrid"],
    [[], ["--n-fetch", "2", "--n-push", "2"], ["--staleness-bound", "1"],
     ["--warmup-steps", "0", "--row-optimizer", "sgd", "--row-lr", "1"],
     ["--row-optimizer", "adagrad", "--row-l2", "1e-4"],
     ["--optimizer", "momentum", "--model", "embed4:mean,dot,fc8,fc1"],
     ["--table-capacity", "128", "--admit-after", "2"],  # 2 threads x 64 rows: the least
     ["--lr-rule", "linear"]],  # hybrid's dense rate for R replicas, its default warm-up
]
# what no embedding run takes, each with a message of its own (the options downpour refuses
# with embeddings are listed in _validate_embeddings; tests/test_config.py-style checks below)
EMBEDDING_REFUSED = [["--weight-decay", "1e-4"], ["--strategy", "sync"],
                     ["--strategy", "hybrid", "--dropout", "0.1"],
                     ["--strategy", "averaging"], ["--strategy", "deadreckon"],
                     ["--strategy", "sandblaster"], ["--push", "activations"],
                     ["--epoch-quorum", "0.75"], ["--softsync", "2"]]


def _embedding_verdict(n, argv):
    from hpcps import config
    from hpcps.errors import ConfigError
    try:
        config.plan(config.parse(argv), n)
    except ConfigError as exc:
        return str(exc)
    return None


def _embedding_cases():
    from pairwise import pairwise
    rows = [(S, R, [*trace, *threads, *data], ["--strategy", strategy], own)
            for S, R, trace, threads, data, strategy, own in pairwise(EMBEDDING_DIMS)]
    rows += [(1, 2, [], other, []) for other in EMBEDDING_REFUSED]
    rows += [(1, 2, [], ["--strategy", "hybrid"], ["--model", "fc32,fc10"])]  # not embedding
    cases = []
    for S, R, trace, strategy, own in rows:
        name = strategy[1] if strategy[:1] == ["--strategy"] else "downpour"
        servers = ["--servers", str(S)] if name in ("downpour", "sandblaster", "hybrid") else []
        warm = ["--warmup-steps", "20"] if name == "downpour" and "--warmup-steps" not in own \
            else []
        n = R + (S if servers else 0) + (name == "sandblaster")
        cases.append((n, ["--model", SPEC, *servers, *trace, *strategy, *warm, *own]))
    return cases


@pytest.mark.parametrize("n,argv", _embedding_cases(),
                         ids=[f"N{n} " + " ".join(a) for n, a in _embedding_cases()])
def test_embedding_combination(n, argv, ctr_h5, tmp_path):
    common = ["--data", str(ctr_h5), "--steps", "120", "--batch-size", "64",
              "--eval-every", "0", "--timeout", "60"]
    refused = _embedding_verdict(n, [*argv, *common])
    run = mpirun.train(n, *argv, *common, "--run-dir", str(tmp_path), timeout=180)
    if refused is not None:
        assert run.returncode == 2, (refused, run.output[-3000:])
        errors = [ln for ln in run.stderr.splitlines() if ln.startswith("hpcps: error")]
        assert len(errors) == 1 and refused.splitlines()[0] in errors[0], run.stderr
        assert not (tmp_path / "checkpoint.h5").exists()
        return
    assert run.returncode == 0, run.output[-4000:]
    s = summary(tmp_path)
    assert s["step"] >= 120 and s["test_auc"] >= COMBO_MIN_AUC, s
    assert s["data_streams"] is ("--data-memory" in argv), s
    if "--validation-fraction" in argv:
        assert s["eval_split"] == "val" and s["val_auc"] >= COMBO_MIN_AUC, s
    if "--trace" in argv:
        events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(n))


@pytest.mark.parametrize("bad,words", [
    ("negative", "negative ids other than -1"),
    ("float", "float ids"),
    ("label", "not in {0, 1}"),
])
def test_bad_categorical_data_is_refused_at_start(ctr_h5, tmp_path, bad, words):
    """One message, exit code 3, nothing written in the run directory."""
    import shutil
    path = tmp_path / f"{bad}.h5"
    shutil.copy(ctr_h5, path)
    with h5py.File(path, "r+") as f:
        if bad == "negative":
            f["train/ids"][7, 1] = -5
        elif bad == "label":
            f["train/y"][3] = 2
        else:
            ids = f["train/ids"][()].astype(np.float64)
            del f["train/ids"]
            f["train/ids"] = ids
    run = mpirun.train(3, "--model", SPEC, "--data", str(path), "--run-dir",
                       str(tmp_path / "run"), timeout=60)
    assert run.returncode == 3, run.output
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("hpcps: error")]
    assert len(errors) == 1 and words in errors[0], run.stderr
    assert "Traceback" not in run.output
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != LOCK_NAME]
    assert not written, written  # (the lock of the run directory is not output)


@pytest.mark.parametrize("strategy,streams", [("downpour", False), ("hybrid", True)])
def test_a_held_out_fraction_scores_the_evaluations_of_an_embedding_model(
        ctr_h5, tmp_path, capsys, strategy, streams):
    """--validation-fraction with an embedding model: the held-out rows of /train are not
    trained on, the periodic evaluations score them (val_auc), the test split is scored at
    the end, in memory or streamed."""
    from hpcps.io.data import holdout_rows
    run = mpirun.train(3, "--strategy", strategy, "--model", SPEC, "--data", str(ctr_h5),
                       "--servers", "1", "--steps", "120", "--eval-every", "60",
                       "--validation-fraction", "0.2",
                       *(["--data-memory", "0.01"] if streams else []),
                       "--run-dir", str(tmp_path), "--timeout", "60", timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    n_train = open_categorical(ctr_h5).n_train
    n_val = len(holdout_rows(n_train, 0.2, 0))
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(e["split"] == "val" and 0.5 < e["val_auc"] <= 1 for e in evals), evals
    assert all("test_auc" not in e for e in evals), evals
    s = summary(tmp_path)
    assert s["data_streams"] is streams and s["eval_streams"] is streams, s
    assert s["eval_split"] == "val" and s["val_source"] == "held-out", s
    assert s["val_rows"] == n_val and s["train_rows"] == n_train - n_val, s
    assert s["val_auc"] > 0.7 and s["test_auc"] > 0.7, s
    assert f"final validation AUC: {s['val_auc']:.4f}" in run.stdout, run.stdout[-2000:]
    assert "final test AUC" in run.stdout
    # hpcps.report draws the AUC against step: the validation curve from the evaluations,
    # the test point from the summary (an MLP's accuracy figure has nothing to draw)
    from hpcps.tools.report import load_run, plan_figures
    plans = {fig.name: panels for fig, panels in plan_figures([load_run(tmp_path)])}
    assert "auc" in plans and "accuracy" not in plans, sorted(plans)
    by_step = plans["auc"][0]
    lines = {line.curve.field: line for line in by_step.lines}
    assert lines["val_auc"].ys == [e["val_auc"] for e in evals] + [s["val_auc"]], lines
    assert lines["test_auc"].xs == [s["step"]] and lines["test_auc"].ys == [s["test_auc"]]
    # hpcps.evaluate --split val scores the same held-out rows of /train
    from hpcps.tools import evaluate
    assert evaluate.main([str(tmp_path / "checkpoint.h5"), "--split", "val", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == n_val and got["auc"] == pytest.approx(s["val_auc"], abs=1e-6), got
