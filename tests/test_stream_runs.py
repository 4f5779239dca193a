"""Training on data streamed from the file (issue 38, larger than memory): runs that stream
learn as runs in memory do, evaluations in chunks give the in-memory figures, a dataset larger
than the ranks' address-space limit trains and is evaluated, categorical (embedding) data
stream as dense data do, and a strategy that cannot stream refuses with the options that
help."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
from faultinject import kill_rank, wait_for_step
from mpirun import ROOT, end_launch, run_mpi, train
from test_faults import finish, launch, output

from hpcps.io.data import RowSource, load_split
from hpcps.model.mlp import MLP
from hpcps.strategies.feed import score

QUICK = ["--layers", "64,32,10", "--batch-size", "16", "--progress-every", "0.5",
         "--checkpoint-every", "0", "--timeout", "30"]
FORCE = ["--data-memory", "0.01"]  # 10 KiB: every replica's block of digits streams


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_evaluation_in_chunks_gives_the_figures_in_memory(digits_h5):
    x, y = load_split(digits_h5, "test")
    model = MLP([64, 32, 10], "relu")
    params = model.init_params(3)
    whole = score(model, params, x, y)
    source = RowSource(str(digits_h5), "test", 64, 0, len(y))
    for rows in (1, 7, 100, 1000):
        loss, acc = score(model, params, None, None, source, rows)
        assert acc == whole[1] and loss == pytest.approx(whole[0], rel=1e-5), rows


@pytest.mark.parametrize("strategy,n", [("sync", 3), ("downpour", 3), ("averaging", 2)])
def test_streaming_learns_as_in_memory(strategy, n, digits_h5, tmp_path):
    acc = {}
    for how, extra in (("memory", []), ("stream", FORCE)):
        run_dir = tmp_path / how
        run = train(n, "--strategy", strategy, "--data", str(digits_h5), "--run-dir",
                    str(run_dir), "--steps", "600", "--eval-every", "300",
                    "--validation-fraction", "0.1", *QUICK, *extra, timeout=60)
        assert run.returncode == 0, run.output[-3000:]
        s = records(run_dir, "summary")[-1]
        assert s["data_streams"] is (how == "stream"), s
        assert s["eval_streams"] is (how == "stream"), s
        acc[how] = s["test_accuracy"]
        if how == "stream":
            assert "training data stream from the file in chunks of 256 rows" in run.stdout
            assert "evaluations read 256 rows at a time" in run.stdout
            assert s["stream_chunk_rows"] == 256 and s["stream_window"] >= 1
            # every replica's block less the held-out rows, as in memory
            assert s["train_rows"] == records(tmp_path / "memory", "summary")[-1]["train_rows"]
            assert [e["split"] for e in records(run_dir, "eval")].count("val") >= 2
        else:
            assert "data in memory" in run.stdout
    assert acc["stream"] > 0.85 and abs(acc["stream"] - acc["memory"]) < 0.05, acc


def test_a_model_parallel_replica_streams_the_same_batches_on_its_partitions(digits_h5,
                                                                             tmp_path):
    # P = 2: both partitions of a replica must draw the same rows, else the run diverges
    run = train(4, "--strategy", "sync", "--partitions", "2", "--data", str(digits_h5),
                "--run-dir", str(tmp_path), "--steps", "400", "--eval-every", "0", *QUICK,
                *FORCE, timeout=60)
    assert run.returncode == 0, run.output[-3000:]
    s = records(tmp_path, "summary")[-1]
    assert s["data_streams"] and s["test_accuracy"] > 0.8, s


def test_sandblaster_refuses_a_training_set_over_the_budget(digits_h5, tmp_path):
    run = train(4, "--strategy", "sandblaster", "--layers", "64,32,10", "--data",
                str(digits_h5), "--run-dir", str(tmp_path), "--steps", "5", *FORCE,
                "--timeout", "30", timeout=60)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("hpcps: error")]
    assert len(errors) == 1 and "Traceback" not in run.output, run.stderr
    for words in ("--strategy sandblaster holds the whole training set", "cannot stream",
                  "--data-memory 0.4 or more", "downpour", "sync"):
        assert words in errors[0], errors[0]
    assert not (tmp_path / "metrics.jsonl").exists() or not records(tmp_path, "progress")


def test_sandblaster_streams_its_evaluations_when_only_they_do_not_fit(digits_h5, tmp_path):
    # the training set (0.36 MiB) fits 0.4 MiB, the test set beside it does not
    run = train(4, "--strategy", "sandblaster", "--layers", "64,32,10", "--data",
                str(digits_h5), "--run-dir", str(tmp_path), "--steps", "5", "--portions",
                "8", "--data-memory", "0.4", "--timeout", "30", timeout=60)
    assert run.returncode == 0, run.output[-3000:]
    s = records(tmp_path, "summary")[-1]
    assert not s["data_streams"] and s["eval_streams"] and s["test_accuracy"] > 0.5, s


# -- larger than the ranks' memory -----------------------------------------------------------
AS_LIMIT_MIB = 768  # a rank's address space: ~500 MiB at its peak with MALLOC_ARENA_MAX=2
D = 256
TRAIN, TEST = 800_000, 200_000  # 826 + 206 MB: the file is 1.03 GB, over the limit


@pytest.fixture(scope="module")
def big_h5(tmp_path_factory):
    """A learnable dense file larger than AS_LIMIT_MIB: each row is its class's template
    plus noise, written contiguous (as write_dataset does) a block at a time."""
    path = tmp_path_factory.mktemp("big") / "big.h5"
    rng = np.random.default_rng(0)
    templates = rng.random((10, D), dtype=np.float32)
    block = 100_000  # rows written at a time; one block of noise serves all (2.7 s, not 10)
    noise = rng.random((block, D), dtype=np.float32)
    x = np.empty_like(noise)
    with h5py.File(path, "w") as f:
        f.attrs.update(format="hpcps-dataset", layout_version=1, name="big", n_classes=10,
                       description="templates plus noise", source="tests")
        for split, n in (("train", TRAIN), ("test", TEST)):
            dx = f.create_dataset(f"{split}/x", (n, D), np.float32)
            dy = f.create_dataset(f"{split}/y", (n,), np.int64)
            for lo in range(0, n, block):
                y = rng.integers(0, 10, block)
                np.take(templates, y, axis=0, out=x)
                x += noise
                x *= 0.5
                dx[lo:lo + block] = x
                dy[lo:lo + block] = y
    assert path.stat().st_size > AS_LIMIT_MIB << 20
    yield path
    path.unlink()  # pytest keeps the last runs' temporary directories: not 1 GB each


def limited(n, args, tmp_path):
    return run_mpi(n, [str(ROOT / "tests" / "scripts" / "limited_train.py"), *args],
                   timeout=90, env={"HPCPS_TEST_AS_MIB": str(AS_LIMIT_MIB),
                                    "MALLOC_ARENA_MAX": "2"})


def test_a_dataset_larger_than_the_ranks_memory_trains_and_is_evaluated(big_h5, tmp_path):
    args = ["--strategy", "sync", "--data", str(big_h5), "--layers", f"{D},32,10",
            "--steps", "300", "--batch-size", "32", "--eval-every", "0",
            "--checkpoint-every", "0", "--timeout", "60", "--run-dir"]
    # in memory it cannot load: a replica's block (413 MB) and the chief's test set (206 MB)
    # are past what the limit leaves
    run = limited(2, [*args, str(tmp_path / "memory"), "--data-memory", "100000"], tmp_path)
    assert run.returncode != 0, run.output[-3000:]
    assert "MemoryError" in run.output or "Unable to allocate" in run.output, run.output[-3000:]
    # the default budget follows RLIMIT_AS: training blocks and the test set stream
    run = limited(2, [*args, str(tmp_path / "stream")], tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    assert "RLIMIT_AS 768 MiB" in run.stdout and "training data stream" in run.stdout
    s = records(tmp_path / "stream", "summary")[-1]
    assert s["data_streams"] and s["eval_streams"], s
    assert s["test_accuracy"] > 0.9, s  # scored over all 200,000 test rows
    assert max(s["peak_rss_mib"].values()) < AS_LIMIT_MIB, s
    # hpcps.evaluate reads a split in chunks: the training split (826 MB) under the same limit
    ckpt = tmp_path / "stream" / "checkpoint.h5"
    ev = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "limited_train.py"),
                         "-m", "hpcps.evaluate", str(ckpt), "--split", "train", "--json"],
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "HPCPS_TEST_AS_MIB": str(AS_LIMIT_MIB),
                             "MALLOC_ARENA_MAX": "2"})
    assert ev.returncode == 0, ev.stderr[-3000:]
    figures = json.loads(ev.stdout)
    assert figures["n"] == TRAIN and figures["accuracy"] > 0.9, figures


def test_a_spare_streams_the_data_shard_it_takes_over(digits_h5, tmp_path):
    """downpour, 1 shard, 2 replicas, 1 spare (rank 3), data streamed: replica 1 leaves on
    SIGTERM, the spare takes its data shard and streams it as replica 2 to the end."""
    run = ["--layers", "64,32,10", "--steps", "6000", "--batch-size", "16", "--eval-every",
           "0", "--checkpoint-every", "0", "--progress-every", "0.1", "--timeout", "30",
           "--heartbeat-timeout", "2", "--spares", "1", *FORCE]
    proc = launch(tmp_path, digits_h5, n=4, run=run)
    try:
        wait_for_step(tmp_path / "metrics.jsonl", 600, 60)
        kill_rank(proc.pid, 1, signal.SIGTERM)
    except BaseException:
        end_launch(proc.pid, proc.tag)
        output(proc)
        raise
    out = finish(proc, "streamed run with a spare")
    assert proc.returncode == 0, out[-4000:]
    s = records(tmp_path, "summary")[-1]
    reps = s["replacements"]
    assert [(r["replica"], r["spare"], r["data_shard"]) for r in reps] == [(1, 0, 1)], reps
    assert reps[0]["training_again_s"] is not None, reps
    assert s["data_streams"] and s["test_accuracy"] > 0.85, s


def test_categorical_data_stream_and_are_scored_in_chunks(ctr_h5, tmp_path, capsys):
    """An embedding model on a categorical file over the budget: every replica streams its
    block of ids, labels and dense features, the chief scores the test split in chunks, the
    model learns, and its final AUC is what hpcps.evaluate computes from the checkpoint
    (the split in memory)."""
    run_dir = tmp_path / "run"
    run = train(3, "--model", "embed8,fc16,fc1", "--data", str(ctr_h5), "--servers", "1",
                "--steps", "300", "--eval-every", "150", "--warmup-steps", "20",
                "--data-memory", "0.01", "--timeout", "30", "--run-dir", str(run_dir),
                timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    s = records(run_dir, "summary")[-1]
    assert s["data_streams"] and s["eval_streams"], s
    assert s["stream_chunk_rows"] == 256, s  # 10 KiB allows less: the smallest chunk
    assert "training data stream from the file in chunks of 256 rows" in run.stdout
    assert s["test_auc"] > 0.7, s
    assert len(records(run_dir, "eval")) >= 2
    from hpcps.tools import evaluate
    assert evaluate.main([str(run_dir / "checkpoint.h5"), "--data", str(ctr_h5),
                          "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["auc"] == pytest.approx(s["test_auc"], abs=1e-6)
    assert got["log_loss"] == pytest.approx(s["test_loss"], abs=1e-6)


CTR_FIELDS, CTR_VOCAB = 26, 1000  # Criteo's field count
CTR_TRAIN, CTR_TEST = 3_000_000, 1_500_000  # 216 bytes a row: 648 + 324 MB, over the limit


@pytest.fixture(scope="module")
def big_ctr_h5(tmp_path_factory):
    """A learnable categorical file larger than AS_LIMIT_MIB: 26 fields of 1,000 ids, the
    label set by field 0's id (even: a click) with 10% of labels flipped."""
    from hpcps.io.data.categorical import CategoricalWriter, Field
    path = tmp_path_factory.mktemp("bigctr") / "ctr.h5"
    rng = np.random.default_rng(1)
    fields = [Field(f"f{i}", 1, CTR_VOCAB) for i in range(CTR_FIELDS)]
    block = 250_000
    with CategoricalWriter(path, name="bigctr", description="synthetic", source="tests",
                           split_note="random", fields=fields,
                           n_rows={"train": CTR_TRAIN, "test": CTR_TEST},
                           label_description="field 0's id is even") as w:
        for split, n in (("train", CTR_TRAIN), ("test", CTR_TEST)):
            for _ in range(0, n, block):
                ids = rng.integers(0, CTR_VOCAB, (block, CTR_FIELDS))
                y = (ids[:, 0] % 2 == 0) ^ (rng.random(block) < 0.1)
                w.write(split, ids, y.astype(np.int64))
        w.close()
    assert path.stat().st_size > AS_LIMIT_MIB << 20
    yield path
    path.unlink()


def test_a_categorical_dataset_larger_than_the_ranks_memory_trains_and_is_evaluated(
        big_ctr_h5, tmp_path):
    """An embedding model (downpour, 1 shard, 2 replicas) on a categorical file larger than
    each rank's address-space limit: the default budget streams the replicas' blocks and the
    test split, and the model learns the rule over all 1,500,000 test rows."""
    run = limited(3, ["--model", "embed8,fc16,fc1", "--data", str(big_ctr_h5), "--servers",
                      "1", "--steps", "300", "--eval-every", "0", "--warmup-steps", "20",
                      "--checkpoint-every", "0", "--timeout", "60", "--run-dir",
                      str(tmp_path / "run")], tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    assert "RLIMIT_AS 768 MiB" in run.stdout and "training data stream" in run.stdout
    s = records(tmp_path / "run", "summary")[-1]
    assert s["data_streams"] and s["eval_streams"], s
    assert s["test_auc"] > 0.8, s
    assert max(s["peak_rss_mib"].values()) < AS_LIMIT_MIB, s
