"""Every model out: ``hpcps.evaluate`` on conv checkpoints and unlabelled rows, and
``python -m hpcps.export`` to ONNX (run in onnxruntime) and .npz.

Two tiny real runs on digits under ``mpiexec -n 2``: an MLP (tanh) and a conv net (padding,
stride, pooling, an explicit flatten). The ONNX file must give evaluate's probabilities to
1e-5 on every test row.
"""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from mpirun import train
from test_train import records

from hpcps.__main__ import COMMANDS
from hpcps.io import checkpoint, data
from hpcps.tools import evaluate as ev_tool
from hpcps.tools.export import architecture, main

CONV = "conv3x3x4p1,pool2,conv2x2x6s2,flatten,fc16,fc10"
RUNS = {
    "mlp": ["--layers", "64,24,16,10", "--activation", "tanh"],
    "conv": ["--model", CONV],
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, digits_h5, tmp_path_factory):
    """(kind, checkpoint path, final summary) of a 2-rank sync run of 150 steps."""
    run_dir = tmp_path_factory.mktemp(f"export-{request.param}")
    proc = train(2, "--strategy", "sync", "--data", str(digits_h5), "--run-dir", str(run_dir),
                 "--steps", "150", "--batch-size", "16", "--eval-every", "150",
                 "--checkpoint-every", "0", *RUNS[request.param])
    assert proc.returncode == 0, proc.output
    return request.param, run_dir / "checkpoint.h5", records(run_dir, "summary")[-1]


def evaluation(ckpt, digits_h5):
    c = checkpoint.load(ckpt)
    model, flat = ev_tool.model_of(c)
    x, y = data.load_split(digits_h5, "test")
    return c, model, flat, x, ev_tool.evaluate(model, flat, x, y)


def test_evaluate_reads_the_checkpoint_and_matches_the_run(run, digits_h5, capsys):
    kind, ckpt, summary = run
    assert ev_tool.main([str(ckpt), "--json"]) == 0  # the data path comes from the checkpoint
    got = json.loads(capsys.readouterr().out)
    assert got["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-12)
    assert got["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    assert got.get("model") == (CONV if kind == "conv" else None)


def test_evaluate_on_a_validation_split(run, digits_h5, tmp_path, capsys):
    _, ckpt, summary = run
    tr, te = data.load_split(digits_h5, "train"), data.load_split(digits_h5, "test")
    path = data.write_dataset(tmp_path / "d.h5", name="digits", description="d", source="t",
                              n_classes=10, x_description="8x8", train=tr, test=tr, val=te,
                              image_shape=(1, 8, 8))
    assert ev_tool.main([str(ckpt), "--data", str(path), "--split", "val", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["split"] == "val" and got["n"] == 360
    assert got["accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-12)


def test_unlabelled_rows_are_scored_as_evaluate_scores_them(run, digits_h5, tmp_path, capsys):
    _, ckpt, _ = run
    _, _, _, x, ev = evaluation(ckpt, digits_h5)
    with open(tmp_path / "new.csv", "w") as f:
        f.write(",".join(f"px{i}" for i in range(64)) + "\n")
        for row in x:
            f.write(",".join(repr(float(v)) for v in row) + "\n")
    with h5py.File(tmp_path / "new.h5", "w") as f:
        f["x"] = x
    for source, out in (("new.csv", "p.npy"), ("new.h5", "p.csv")):
        assert ev_tool.main([str(ckpt), "--input", str(tmp_path / source), "--predict",
                             str(tmp_path / out), "--batch", "100"]) == 0, capsys.readouterr()
    capsys.readouterr()
    rows = np.load(tmp_path / "p.npy")
    assert rows.dtype.names == ("row", "predicted", "probabilities")
    np.testing.assert_array_equal(rows["predicted"], ev.predicted)
    np.testing.assert_allclose(rows["probabilities"], ev.probabilities, rtol=0, atol=1e-6)
    table = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)
    assert (tmp_path / "p.csv").read_text().startswith("row,predicted,p_0,")
    np.testing.assert_array_equal(table[:, 1].astype(int), ev.predicted)
    np.testing.assert_allclose(table[:, 2:], ev.probabilities, rtol=0, atol=1e-5)


def test_unlabelled_input_refusals(run, tmp_path, capsys):
    _, ckpt, _ = run
    (tmp_path / "narrow.csv").write_text("a,b\n1,2\n")
    cases = [
        (["--input", str(tmp_path / "narrow.csv"), "--predict", str(tmp_path / "p.csv")], 3,
         "has 2 columns; the model takes 64 features"),
        (["--input", str(tmp_path / "narrow.csv")], 2, "--input FILE needs --predict OUT"),
        (["--input", str(tmp_path / "none.h5"), "--predict", str(tmp_path / "p.csv")], 3,
         "not found"),
    ]
    for argv, code, words in cases:
        assert ev_tool.main([str(ckpt), *argv]) == code
        err = capsys.readouterr().err
        assert err.startswith("hpcps.evaluate: error: ") and words in err, err
        assert len(err.strip().splitlines()) == 1


def test_onnx_matches_evaluate(run, digits_h5, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed "
                              "(pip install 'hpcps[test]')")
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'hpcps[export]')")
    kind, ckpt, _ = run
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), "--onnx", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    _, _, _, x, ev = evaluation(ckpt, digits_h5)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    logits, probs = session.run(["logits", "probabilities"], {"x": x})
    diff = float(np.abs(probs - ev.probabilities).max())
    print(f"{kind}: largest |onnxruntime - evaluate| probability difference {diff:.3g}")
    assert diff <= 1e-5
    np.testing.assert_array_equal(np.argmax(logits, axis=1), ev.predicted)
    # one row alone, and an odd batch: the batch dimension is free
    one = session.run(["probabilities"], {"x": x[:1]})[0]
    np.testing.assert_allclose(one, ev.probabilities[:1], rtol=0, atol=1e-5)


def test_npz_holds_every_weight_and_the_architecture(run, digits_h5, tmp_path):
    kind, ckpt, _ = run
    out = tmp_path / "model.npz"
    assert main([str(ckpt), "--npz", str(out)]) == 0
    c, model, flat, x, ev = evaluation(ckpt, digits_h5)
    with np.load(out) as z:  # no pickle needed
        arch = json.loads(str(z["architecture"]))
        weights = {k: z[k] for k in z.files if k != "architecture"}
    assert set(weights) == set(c.params)
    for name, value in c.params.items():
        np.testing.assert_array_equal(weights[name], value)
    assert arch == json.loads(json.dumps(architecture(model, c)))
    assert arch["kind"] == kind and arch["n_features"] == 64 and arch["n_classes"] == 10
    if kind == "mlp":  # the JSON is enough to run the model with NumPy alone
        h = x
        for layer in arch["layers"]:
            h = h @ weights[f"{layer['name']}/W"] + weights[f"{layer['name']}/b"]
            if layer["activation"]:
                h = getattr(np, layer["activation"])(h)
        np.testing.assert_array_equal(np.argmax(h, axis=1), ev.predicted)
    else:
        assert arch["spec"] == CONV and arch["input_shape"] == [1, 8, 8]
        assert [layer["op"] for layer in arch["layers"]] == \
            ["conv", "pool", "conv", "flatten", "fc", "fc"]


def test_command_and_refusals(run, tmp_path, capsys):
    _, ckpt, _ = run
    assert COMMANDS["export"][0] == "hpcps.tools.export"
    for argv, code, words in (
            ([str(ckpt)], 2, "name an output"),
            ([str(ckpt), "--onnx", str(tmp_path / "m.txt")], 2, "must end in .onnx"),
            ([str(ckpt), "--npz", str(tmp_path / "no" / "m.npz")], 2, "does not exist"),
            ([str(tmp_path / "none.h5"), "--npz", str(tmp_path / "m.npz")], 4, "none.h5")):
        assert main(argv) == code
        err = capsys.readouterr().err
        assert err.startswith("hpcps.export: error: ") and words in err, err
    assert not list(tmp_path.glob("m.*"))


def test_an_embedding_checkpoint_is_refused_with_the_way_to_score_it(ctr_h5, tmp_path, capsys):
    """Export writes MLPs and conv nets: an embedding model's checkpoint (its dense layers
    alone would pass for a 1-class MLP) is refused, naming where its rows are and what
    scores it, and nothing is written."""
    run = train(2, "--model", "embed8,fc16,fc1", "--data", str(ctr_h5), "--servers", "1",
                "--steps", "40", "--run-dir", str(tmp_path / "run"), "--timeout", "30",
                timeout=90)
    assert run.returncode == 0, run.output[-3000:]
    ckpt = tmp_path / "run" / "checkpoint.h5"
    for out in (["--onnx", str(tmp_path / "m.onnx")], ["--npz", str(tmp_path / "m.npz")]):
        assert main([str(ckpt), *out]) == 2
        err = capsys.readouterr().err
        assert "holds an embedding model (--model embed8,fc16,fc1)" in err, err
        assert "tables/shard-" in err and "hpcps.evaluate" in err and "--predict" in err, err
    assert not list(tmp_path.glob("m.*"))
