"""The validation split (issue 38): periodic evaluations on /val or on the rows
``--validation-fraction`` holds out of /train, the test set scored once at the end, and every
figure naming its split."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mpirun import train

from hpcps import config
from hpcps.blocks import block_range
from hpcps.errors import ConfigError
from hpcps.io.data import holdout_rows, load_rows, load_split, open_dataset, write_dataset
from hpcps.strategies.context import without

QUICK = ["--layers", "64,32,10", "--batch-size", "16", "--progress-every", "0.2",
         "--eval-every", "200", "--checkpoint-every", "0"]


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def val_h5(digits_h5, tmp_path_factory):
    """digits with its last 300 training rows written as /val."""
    x, y = load_split(digits_h5, "train")
    tx, ty = load_split(digits_h5, "test")
    path = tmp_path_factory.mktemp("val") / "digits-val.h5"
    write_dataset(path, name="digits-val", description="digits with a validation split",
                  source="tests", n_classes=10, x_description="8x8 pixels",
                  train=(x[:-300], y[:-300]), test=(tx, ty), val=(x[-300:], y[-300:]))
    return path


# -- the rows held out -------------------------------------------------------------------------
def test_held_out_rows_are_seeded_and_sized():
    a = holdout_rows(1437, 0.2, 0)
    assert len(a) == round(0.2 * 1437) and np.array_equal(a, np.unique(a))
    assert np.array_equal(a, holdout_rows(1437, 0.2, 0))  # every rank computes the same
    assert not np.array_equal(a, holdout_rows(1437, 0.2, 1))
    assert len(holdout_rows(10, 0.01, 0)) == 1 and len(holdout_rows(10, 0.99, 0)) == 9
    assert len(holdout_rows(1437, 0.0, 0)) == 0


@pytest.mark.parametrize("replicas", [1, 2, 3, 7])
def test_the_replicas_shards_leave_out_exactly_the_held_rows(replicas):
    """Every training row is in one replica's shard, except the held-out ones, in none."""
    n, held = 1000, holdout_rows(1000, 0.2, 5)
    rows = np.arange(n)
    kept = []
    for r in range(replicas):
        lo, hi = block_range(n, replicas, r)
        x, _ = without((rows[lo:hi, None].astype(np.float32), rows[lo:hi]), lo, held)
        kept.append(x[:, 0].astype(int))
    kept_all = np.concatenate(kept)
    assert len(kept_all) == n - len(held)
    assert np.array_equal(np.sort(np.concatenate([kept_all, held])), rows)


def test_load_rows_reads_the_rows_asked_for(digits_h5):
    x, y = load_split(digits_h5, "train")
    rows = holdout_rows(len(x), 0.3, 2)
    vx, vy = load_rows(digits_h5, "train", rows, block=100)  # windows of the file
    assert np.array_equal(vx, x[rows]) and np.array_equal(vy, y[rows])
    assert vx.flags.c_contiguous and vx.dtype == np.float32 and vy.dtype == np.int64


# -- the option ------------------------------------------------------------------------------
def test_the_option_is_a_fraction_below_one():
    assert config.parse([]).validation_fraction == 0.0
    assert config.parse(["--validation-fraction", "0.2"]).validation_fraction == 0.2
    for bad in ("-0.1", "1", "1.5"):
        with pytest.raises(ConfigError) as e:
            config.parse(["--validation-fraction", bad])
        assert e.value.exit_code == 2 and "--validation-fraction" in str(e.value)


@pytest.mark.parametrize("bad", ["-0.2", "1", "3"])
def test_a_run_refuses_bad_fractions_with_exit_code_2(bad, digits_h5, tmp_path):
    run = train(1, "--data", str(digits_h5), "--run-dir", str(tmp_path), "--steps", "10",
                "--validation-fraction", bad, *QUICK)
    assert run.returncode == 2, run.output
    assert "--validation-fraction must be >= 0 and below 1" in run.stderr, run.output


def test_sandblaster_refuses_the_fraction_and_names_the_way_out(digits_h5, tmp_path):
    run = train(4, "--strategy", "sandblaster", "--data", str(digits_h5), "--run-dir",
                str(tmp_path), "--steps", "5", "--layers", "64,32,10",
                "--validation-fraction", "0.2")
    assert run.returncode == 2, run.output
    assert "--validation-fraction 0.2 does not apply to --strategy sandblaster" in run.stderr
    assert "/val" in run.stderr


# -- runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,n", [("sync", 2), ("downpour", 3)])
def test_a_held_out_fraction_is_what_the_evaluations_score(strategy, n, digits_h5, tmp_path,
                                                           capsys):
    run = train(n, "--strategy", strategy, "--data", str(digits_h5), "--run-dir",
                str(tmp_path), "--steps", "800", "--validation-fraction", "0.2", *QUICK)
    assert run.returncode == 0, run.output
    n_train = open_dataset(digits_h5).n_train
    n_val = len(holdout_rows(n_train, 0.2, 0))
    evals = records(tmp_path, "eval")
    assert len(evals) >= 2, run.output
    for e in evals:
        assert e["split"] == "val" and 0 <= e["val_accuracy"] <= 1, e
        assert "test_accuracy" not in e and "test_loss" not in e, e
    s = records(tmp_path, "summary")[-1]
    assert s["eval_split"] == "val" and s["val_source"] == "held-out"
    assert s["test_accuracy"] > 0.7 and s["val_accuracy"] > 0.7, s
    assert s["val_loss"] > 0 and s["test_loss"] > 0
    assert s["val_rows"] == n_val
    # the held-out rows are not trained on: the replicas' shards add up to the rest
    assert s["train_rows"] == n_train - n_val, s
    assert f"validation split: {n_val} rows (--validation-fraction 0.2)" in run.stdout
    assert "final validation accuracy" in run.stdout and "final test accuracy" in run.stdout
    # epochs count passes over the rows trained on
    assert abs(s["epoch"] - s["step"] * 16 / (n_train - n_val)) < 1e-2, s
    # hpcps.evaluate --split val scores the same held-out rows (the file has no /val)
    from hpcps.tools import evaluate
    assert evaluate.main([str(tmp_path / "checkpoint.h5"), "--split", "val", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == n_val and got["split"].startswith(f"val ({n_val} rows held out"), got
    assert got["accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-9), (got, s)


def test_a_file_with_val_is_evaluated_on_it(val_h5, tmp_path):
    """The file's /val wins over --validation-fraction; nothing of /train is held out."""
    run = train(2, "--strategy", "sync", "--data", str(val_h5), "--run-dir", str(tmp_path),
                "--steps", "600", "--validation-fraction", "0.3", *QUICK)
    assert run.returncode == 0, run.output
    assert "/val of" in run.stdout and "--validation-fraction 0.3 not used" in run.stdout
    evals = records(tmp_path, "eval")
    assert evals and all(e["split"] == "val" and "val_accuracy" in e for e in evals), evals
    s = records(tmp_path, "summary")[-1]
    assert s["val_source"] == "file" and s["val_rows"] == 300
    assert s["train_rows"] == open_dataset(val_h5).n_train
    assert s["test_accuracy"] is not None and s["val_accuracy"] is not None


def test_sandblaster_evaluates_on_the_files_val(val_h5, tmp_path):
    run = train(4, "--strategy", "sandblaster", "--data", str(val_h5), "--run-dir",
                str(tmp_path), "--steps", "12", "--eval-every", "5", "--layers", "64,32,10",
                "--checkpoint-every", "0")
    assert run.returncode == 0, run.output
    evals = records(tmp_path, "eval")
    assert evals and all(e["split"] == "val" for e in evals), evals
    s = records(tmp_path, "summary")[-1]
    assert s["eval_split"] == "val" and s["val_accuracy"] > 0.5 and s["test_accuracy"] > 0.5


def test_without_a_validation_split_evaluations_stay_on_the_test_set(digits_h5, tmp_path):
    run = train(1, "--strategy", "sync", "--data", str(digits_h5), "--run-dir",
                str(tmp_path), "--steps", "450", *QUICK)
    assert run.returncode == 0, run.output
    assert "evaluations on the test set (no validation split" in run.stdout
    evals = records(tmp_path, "eval")
    assert evals and all(e["split"] == "test" and "test_accuracy" in e for e in evals)
    s = records(tmp_path, "summary")[-1]
    assert s["eval_split"] == "test" and s["val_source"] is None and "val_accuracy" not in s
    assert s["train_rows"] == open_dataset(digits_h5).n_train
    assert "final validation accuracy" not in run.stdout


def test_a_resume_that_validates_on_rows_trained_before_is_warned(digits_h5):
    """Another --validation-fraction or --seed on --resume holds out other rows of /train,
    some of which the checkpoint's run trained on: warned at start with how many; the same
    split, or no fraction now, says nothing."""
    from types import SimpleNamespace

    from hpcps.job import _split_warning
    info = open_dataset(digits_h5)
    ckpt = SimpleNamespace(config={"validation_fraction": 0.1, "seed": 0},
                           dataset={"n_train": info.n_train})

    def warning(*argv):
        return _split_warning(config.parse(["--data", str(digits_h5), *argv]), ckpt, info)

    old = set(holdout_rows(info.n_train, 0.1, 0).tolist())
    wider = len(set(holdout_rows(info.n_train, 0.2, 0).tolist()) - old)
    assert wider > 0 and f"{wider} of the rows this run validates on were trained on" in \
        warning("--validation-fraction", "0.2")
    other = len(set(holdout_rows(info.n_train, 0.1, 3).tolist()) - old)
    said = warning("--validation-fraction", "0.1", "--seed", "3")
    assert other > 0 and f"{other} of the rows" in said and "--seed 0 to keep" in said, said
    assert warning("--validation-fraction", "0.1") is None
    assert warning() is None
    ckpt.config = {"seed": 0}  # trained on every row: each one held out now was trained on
    assert f"{len(old)} of the rows" in warning("--validation-fraction", "0.1")
