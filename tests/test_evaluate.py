"""``python -m hpcps.evaluate``: a checkpoint's figures on a dataset, on one process.

One real training run (model-parallel, so the checkpoint was gathered from partitions) on
digits; the evaluation must give exactly the accuracy the run's summary reported for its final
checkpoint, and refuse bad checkpoints, datasets and options with the documented exit codes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpirun import ROOT, train
from test_train import QUICK, records

from hpcps.io import checkpoint, data
from hpcps.tools import evaluate as ev_module
from hpcps.tools.evaluate import main
from hpcps.model.mlp import MLP


@pytest.fixture(scope="module")
def trained(digits_h5, tmp_path_factory):
    """(checkpoint path, final summary record) of a 1 replica x 2 partitions sync run."""
    run_dir = tmp_path_factory.mktemp("evaluate-run")
    run = train(2, "--strategy", "sync", "--partitions", "2", "--data", str(digits_h5),
                "--run-dir", str(run_dir), "--steps", "200", *QUICK)
    assert run.returncode == 0, run.output
    summary = records(run_dir, "summary")[-1]
    assert summary["partitions"] == 2, summary
    return run_dir / "checkpoint.h5", summary


def evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the command's ``main`` in a fresh Python (no mpiexec) and say on stderr whether
    mpi4py was imported."""
    code = ("import sys; from hpcps.tools.evaluate import main; rc = main(sys.argv[1:]); "
            "print('mpi4py imported:', 'mpi4py' in sys.modules, file=sys.stderr); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPIR_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_matches_the_training_summary_on_one_process(trained, digits_h5, tmp_path):
    ckpt, summary = trained
    out = tmp_path / "pred.csv"
    proc = evaluate_cli(str(ckpt), "--data", str(digits_h5), "--json", "--predict", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "mpi4py imported: False" in proc.stderr
    got = json.loads(proc.stdout)
    _, y = data.load_split(digits_h5, "test")
    assert got["n"] == len(y) == 360 and got["step"] == summary["step"] == 200
    assert got["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-12)
    assert got["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    confusion = np.array(got["confusion"])
    assert confusion.shape == (10, 10) and confusion.sum() == len(y)
    assert np.trace(confusion) / len(y) == pytest.approx(got["accuracy"], abs=1e-12)
    assert np.array_equal(confusion.sum(axis=1), np.bincount(y, minlength=10))

    with open(out) as f:
        header = f.readline().strip()
    assert header == "row,label,predicted," + ",".join(f"p_{c}" for c in range(10))
    table = np.loadtxt(out, delimiter=",", skiprows=1)
    assert table.shape == (360, 13)
    rows, labels, predicted = (table[:, i].astype(np.int64) for i in range(3))
    probs = table[:, 3:]
    assert np.array_equal(rows, np.arange(360)) and np.array_equal(labels, y)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    assert np.all(probs[np.arange(360), predicted] >= probs.max(axis=1) - 1e-6)
    from_file = np.zeros((10, 10), dtype=np.int64)
    np.add.at(from_file, (labels, predicted), 1)
    assert np.array_equal(from_file, confusion)


def test_text_report(trained, digits_h5, capsys):
    ckpt, summary = trained
    assert main([str(ckpt), "--data", str(digits_h5)]) == 0
    out = capsys.readouterr().out
    correct = round(summary["test_accuracy"] * 360)
    assert f"accuracy    {100 * summary['test_accuracy']:.2f}% ({correct} of 360)" in out
    assert f"loss        {summary['test_loss']:.4f}" in out
    assert "layers 64 -> 32 -> 10" in out and "test split: 360 examples" in out
    matrix = out.split("confusion matrix", 1)[1].splitlines()[2:]
    assert len(matrix) == 10
    counts = np.array([[int(v) for v in line.split()[1:11]] for line in matrix])
    assert counts.sum() == 360 and np.trace(counts) == correct


def test_hdf5_predictions_and_the_train_split(trained, digits_h5, tmp_path, capsys):
    ckpt, _ = trained
    out = tmp_path / "pred.h5"
    assert main([str(ckpt), "--data", str(digits_h5), "--split", "train", "--batch", "100",
                 "--predict", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    x, y = data.load_split(digits_h5, "train")
    # an independent forward pass of the checkpoint's weights
    loaded = checkpoint.load(ckpt)
    model = MLP((64, 32, 10))
    logits = model.forward(model.flatten(loaded.params), x)[-1]
    with h5py.File(out, "r") as f:
        assert f["probabilities"].shape == (1437, 10) and f["probabilities"].dtype == np.float32
        assert np.array_equal(f["label"][()], y)
        assert np.array_equal(f["predicted"][()], np.argmax(logits, axis=1))
        np.testing.assert_allclose(f["probabilities"][()].sum(axis=1), 1.0, rtol=1e-5)
        assert f.attrs["split"] == "train" and f.attrs["step"] == loaded.step
        assert f.attrs["accuracy"] == pytest.approx(got["accuracy"])
    assert got["n"] == 1437
    assert got["accuracy"] == pytest.approx(np.mean(np.argmax(logits, axis=1) == y), abs=1e-12)
    assert not list(tmp_path.glob("*.tmp-*"))


def small_dataset(path, n_features, n_classes, seed=0):
    rng = np.random.default_rng(seed)

    def split(n):
        return (rng.random((n, n_features), dtype=np.float32),
                np.arange(n, dtype=np.int64) % n_classes)

    data.write_dataset(path, name="random", description="random test data", source="a test",
                       n_classes=n_classes, x_description="uniform noise",
                       train=split(40), test=split(20))
    return path


def test_another_dataset_of_the_same_shape_is_evaluated_with_a_note(trained, tmp_path, capsys):
    ckpt, _ = trained
    other = small_dataset(tmp_path / "noise.h5", 64, 10)
    assert main([str(ckpt), "--data", str(other), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n"] == 20
    assert "trained on digits" in captured.err and "another dataset" in captured.err


def refusal_cases(ckpt, digits_h5, tmp):
    """(label, argv, exit code, words the message must hold)."""
    truncated = tmp / "truncated.h5"
    blob = ckpt.read_bytes()
    truncated.write_bytes(blob[:len(blob) // 2])
    nan = tmp / "nan.h5"
    state = checkpoint.load(ckpt)
    state.params["layer1/W"][3, 4] = np.nan
    checkpoint.save(nan, state)
    wide = small_dataset(tmp / "wide.h5", 10, 10)
    few = small_dataset(tmp / "few.h5", 64, 5)
    d = ["--data", str(digits_h5)]
    return [
        ("missing checkpoint", [str(tmp / "nope.h5"), *d], 4, ["checkpoint not found"]),
        ("truncated checkpoint", [str(truncated), *d], 4, ["truncated or corrupt"]),
        ("not a checkpoint", [str(digits_h5), *d], 4, ["not an hpcps checkpoint"]),
        ("non-finite checkpoint", [str(nan), *d], 4, ["1 NaN or infinite", "layer1/W"]),
        ("missing dataset", [str(ckpt), "--data", str(tmp / "none.h5")], 3,
         ["dataset not found"]),
        ("other features", [str(ckpt), "--data", str(wide)], 3, ["n_features = 10", "64 inputs"]),
        ("other classes", [str(ckpt), "--data", str(few)], 3, ["n_classes = 5", "10 outputs"]),
        ("predict suffix", [str(ckpt), *d, "--predict", str(tmp / "p.txt")], 2,
         [".csv, .npy, .h5, .hdf5"]),
        ("predict directory", [str(ckpt), *d, "--predict", str(tmp / "no" / "p.csv")], 2,
         ["does not exist"]),
    ]


def test_refusals(trained, digits_h5, tmp_path, capsys):
    ckpt, _ = trained
    for label, argv, code, words in refusal_cases(ckpt, digits_h5, tmp_path):
        assert main(argv) == code, label
        captured = capsys.readouterr()
        assert captured.out == "", label
        assert captured.err.startswith("hpcps.evaluate: error: "), (label, captured.err)
        for w in words:
            assert w in captured.err, (label, w, captured.err)
    assert not (tmp_path / "p.txt").exists()


def test_without_data_the_checkpoints_dataset_is_used(trained, digits_h5, tmp_path, capsys):
    ckpt, summary = trained
    assert main([str(ckpt), "--json"]) == 0  # the run named digits_h5 by its absolute path
    got = json.loads(capsys.readouterr().out)
    assert got["dataset"] == str(digits_h5)
    assert got["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-12)
    moved = tmp_path / "ckpt.h5"
    c = checkpoint.load(ckpt)
    c.config["data"] = "no-such-folder/digits.h5"  # as a run elsewhere named it
    checkpoint.save(moved, c)
    assert main([str(moved)]) == 3
    err = capsys.readouterr().err
    assert "no --data given" in err and "no-such-folder/digits.h5" in err
    assert "give --data PATH" in err



def test_a_long_evaluation_shows_its_progress_on_stderr(trained, digits_h5, monkeypatch,
                                                         capsys):
    """A line on stderr every PROGRESS_S seconds (here every piece): the rows scored of the
    split's; stdout keeps only the figures (--json stays one JSON object)."""
    ckpt, _ = trained
    monkeypatch.setattr(ev_module, "PROGRESS_S", 0.0)
    monkeypatch.setattr(ev_module, "EVAL_ROWS", 100)
    assert main([str(ckpt), "--data", str(digits_h5), "--json", "--batch", "50"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["n"] == 360
    assert [line for line in err.splitlines() if "scored" in line] == [
        f"hpcps.evaluate: scored {n} of 360 rows ({round(100 * n / 360)}%)"
        for n in (100, 200, 300, 360)]


# ---------------------------------------------------------------------------------------------
# --input on an embedding model's checkpoint: its rows are ids (and dense features), scored as
# --data scores a split


@pytest.fixture(scope="module", params=["ids-only", "dense-multivalued"])
def embedding_run(request, ctr_h5, tmp_path_factory):
    """(kind, checkpoint, data file) of a downpour run of an embedding model on 3 ranks: on
    the synthetic CTR file (5 single-valued fields, no dense features), or on a file with a
    multi-valued field, padding and 2 dense features."""
    from test_export import embedding_file
    root = tmp_path_factory.mktemp(f"evaluate-{request.param}")
    if request.param == "ids-only":
        path, model = ctr_h5, "embed8,fc16,fc1"
    else:
        path, model = embedding_file(root / "toy.h5"), "embed6,fc12,fc1"
    run = train(3, "--model", model, "--servers", "1", "--data", str(path), "--steps", "150",
                "--batch-size", "32", "--run-dir", str(root / "run"), "--timeout", "30",
                timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    return request.param, root / "run" / "checkpoint.h5", path


def test_embedding_input_is_scored_as_data_scores_the_same_rows(embedding_run, tmp_path,
                                                                  capsys):
    """--input of a split's ids (and dense features) gives each row's P(y = 0), P(y = 1)
    exactly as --data gives them for the split: from the dataset file itself (/SPLIT/ids),
    an HDF5 file of /ids (and /dense) in batches of 7, and an .npy of int32 ids."""
    from hpcps.io.data.categorical import load_block
    kind, ckpt, path = embedding_run
    assert main([str(ckpt), "--data", str(path), "--split", "train",
                 "--predict", str(tmp_path / "data.npy")]) == 0
    want = np.load(tmp_path / "data.npy")
    block = load_block(path, "train")
    rows = h5py.File(tmp_path / "rows.h5", "w")
    rows["ids"] = block.ids
    if block.dense is not None:
        rows["dense"] = block.dense
    rows.close()
    inputs = [[str(path), "--split", "train"], [str(tmp_path / "rows.h5"), "--batch", "7"]]
    if kind == "ids-only":
        np.save(tmp_path / "ids.npy", block.ids.astype(np.int32))
        inputs.append([str(tmp_path / "ids.npy")])
    capsys.readouterr()
    for i, given in enumerate(inputs):
        out = tmp_path / f"input{i}.npy"
        assert main([str(ckpt), "--input", *given, "--predict", str(out)]) == 0, given
        said = capsys.readouterr().out
        assert f"{len(want)} rows scored" in said and "model embed" in said, said
        got = np.load(out)
        assert got.dtype.names == ("row", "predicted", "probabilities")
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], rtol=0,
                                   atol=1e-6)
        assert np.array_equal(got["predicted"], want["predicted"])
    assert 0 < want["predicted"].sum() < len(want)  # not the one-output softmax's constant 0


def test_embedding_input_refusals(embedding_run, tmp_path, capsys):
    """Rows that are not the model's ids are refused with one line and exit code 3, nothing
    written: the 40 floats the first fc layer takes (once scored as an MLP's input), float
    ids, ids out of a field's range, a CSV, dense features missing or not finite."""
    kind, ckpt, path = embedding_run
    with h5py.File(path, "r") as f:
        ids = f["test/ids"][:50]
        dense = f["test/dense"][:50] if "test/dense" in f else None
    cols = ids.shape[1]

    def h5(name, **arrays):
        with h5py.File(tmp_path / name, "w") as f:
            for key, value in arrays.items():
                f[key] = value
        return tmp_path / name

    def npy(name, array):
        np.save(tmp_path / name, array)
        return tmp_path / name

    too_big, negative = ids.copy(), ids.copy()
    too_big[3, cols - 1] = 10 ** 6
    negative[4, 0] = -2
    with_dense = {} if dense is None else {"dense": dense}
    cases = [
        ("40 floats", npy("forty.npy", np.random.default_rng(0).random((7, 40), np.float32)),
         ["shape (7, 40)", f"ids (N, {cols})"] if dense is None else ["2 dense features"]),
        ("float ids", h5("float.h5", ids=ids.astype(np.float64), **with_dense),
         ["/ids holds float ids"]),
        ("id past the vocabulary", h5("big.h5", ids=too_big, **with_dense),
         ["bad id(s)", f"row 3, column {cols - 1}", "1000000"]),
        ("id below -1", h5("neg.h5", ids=negative, **with_dense),
         ["bad id(s)", "row 4, column 0", "-2"]),
        ("a CSV", tmp_path / "rows.csv", ["a .npy of ids", "HDF5"]),
        ("no ids", h5("x.h5", x=np.zeros((5, 40), np.float32)), ["neither /ids nor /test/ids"]),
    ]
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    if dense is None:
        cases.append(("dense the model lacks", h5("dense.h5", ids=ids, dense=np.zeros((50, 2))),
                      ["takes 0 dense features", "holds /dense"]))
    else:
        bad = dense.copy()
        bad[5, 1] = np.nan
        cases += [
            ("no dense", h5("nodense.h5", ids=ids), ["takes 2 dense features", "holds none"]),
            ("an .npy", npy("ids.npy", ids), ["2 dense features", "HDF5"]),
            ("NaN dense", h5("nan.h5", ids=ids, dense=bad), ["/dense", "row 5", "NaN"]),
            ("dense rows", h5("short.h5", ids=ids, dense=dense[:10]), ["(10, 2)"]),
        ]
    out = tmp_path / "pred.csv"
    for label, given, words in cases:
        assert main([str(ckpt), "--input", str(given), "--predict", str(out)]) == 3, label
        captured = capsys.readouterr()
        assert captured.out == "", label
        assert captured.err.startswith("hpcps.evaluate: error: "), (label, captured.err)
        assert str(given) in captured.err, (label, captured.err)
        assert captured.err.count("\n") == 1, (label, captured.err)
        for w in words:
            assert w in captured.err, (label, w, captured.err)
        assert not out.exists(), label
