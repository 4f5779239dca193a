"""Every model out: ``hpcps.evaluate`` on conv checkpoints and unlabelled rows, and
``python -m hpcps.export`` to ONNX (run in onnxruntime) and .npz.

Two tiny real runs on digits under ``mpiexec -n 2``: an MLP (tanh) and a conv net (padding,
stride, pooling, an explicit flatten); and two embedding models trained by downpour on a small
categorical file (sum pooling with dense features; mean pooling, dot products and
``--admit-after``). The ONNX file must give evaluate's probabilities to 1e-5 on every test
row.
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
    wide = np.full((3, 64), 0.5, np.float32)
    np.savetxt(tmp_path / "headless.csv", wide, delimiter=",")  # its first row would be lost
    wide[1, 7] = np.nan
    np.save(tmp_path / "nan.npy", wide)
    cases = [
        (["--input", str(tmp_path / "headless.csv"), "--predict", str(tmp_path / "p.csv")], 3,
         "the first line is all numbers (5.000000000000000000e-01,"),
        (["--input", str(tmp_path / "nan.npy"), "--predict", str(tmp_path / "p.csv")], 3,
         "the array holds 1 non-finite value(s) (NaN or infinity) in rows 0..2; the first is "
         "row 1, column 7 (nan). Its predictions would be NaN"),
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


# -- embedding models ---------------------------------------------------------------------------
# Three fields: a (1 column), b (3 columns, a multi-valued field padded with -1; some rows have
# no value at all) and c (1 column); two dense features. The test split uses ids the training
# split never holds (a: 30..39, c: 25..29), which read as their initial rows (or as zeros with
# --admit-after 2): the exported tables must hold those rows too.
EMBED_RUNS = {
    "sum-dense": ["--model", "embed6,fc12,fc1"],
    "mean-dot-admit": ["--model", "embed4:mean,dot,fc8,fc1", "--admit-after", "2",
                       "--servers", "2"],
}


def embedding_file(path):
    from hpcps.io.data.categorical import CategoricalWriter, Field
    rng = np.random.default_rng(5)
    fields = [Field("a", 1, 40), Field("b", 3, 25), Field("c", 1, 30)]

    def rows(n, a_hi, c_hi):
        a = rng.integers(0, a_hi, n)
        b = rng.integers(-1, 25, (n, 3))
        b[::7] = -1  # no value in field b
        c = rng.integers(0, c_hi, n)
        dense = rng.normal(size=(n, 2)).astype(np.float32)
        y = ((a % 3 == 0) ^ (c % 2 == 0) ^ (dense[:, 0] > 0.5)).astype(np.int64)
        return np.column_stack([a, b, c]).astype(np.int64), y, dense

    train, test = rows(3000, 30, 25), rows(400, 40, 30)
    with CategoricalWriter(path, name="toy-ctr", description="toy", source="this test",
                           split_note="drawn apart", fields=fields,
                           n_rows={"train": 3000, "test": 400}, dense_names=["d0", "d1"],
                           label_description="a parity of a, c and d0") as w:
        w.write("train", train[0], train[1], train[2])
        w.write("test", test[0], test[1], test[2])
        w.close()
    return path


@pytest.fixture(scope="module", params=sorted(EMBED_RUNS))
def embedding_run(request, tmp_path_factory):
    """(kind, checkpoint, data file) of a downpour run of an embedding model on 3 ranks."""
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    path = embedding_file(root / "toy.h5")
    args = EMBED_RUNS[request.param]
    servers = [] if "--servers" in args else ["--servers", "1"]
    run = train(3 if servers else 4, *args, *servers, "--data", str(path), "--steps", "300",
                "--batch-size", "32", "--run-dir", str(root / "run"), "--timeout", "30",
                timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    return request.param, root / "run" / "checkpoint.h5", path


def evaluated(ckpt, path, tmp_path):
    """hpcps.evaluate's P(y = 0), P(y = 1) of every test row (its --predict file)."""
    out = tmp_path / "pred.npy"
    assert ev_tool.main([str(ckpt), "--data", str(path), "--predict", str(out)]) == 0
    return np.load(out)["probabilities"]


def test_embedding_onnx_matches_evaluate(embedding_run, tmp_path, capsys, monkeypatch):
    """The exported graph (tables gathered by id, pooled over the ids that are not -1, the
    dense features and dot products, the fc layers) gives evaluate's probabilities to 1e-5
    on every test row, ids never trained among them; with the tables past the inline limit,
    they go to OUT.onnx.data and the model loads them from there."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed "
                              "(pip install 'hpcps[test]')")
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'hpcps[export]')")
    from hpcps.io.data.categorical import load_block
    from hpcps.tools import export as export_tool
    kind, ckpt, path = embedding_run
    want = evaluated(ckpt, path, tmp_path)
    block = load_block(path, "test")
    assert (block.ids[:, 1:4] == -1).all(axis=1).any()  # rows with no value in field b
    feeds = {"ids": block.ids, "dense": block.dense}
    for inline in (True, False):
        if not inline:
            monkeypatch.setattr(export_tool, "INLINE_BYTES", 0)
        out = tmp_path / f"model-{inline}.onnx"
        assert main([str(ckpt), "--onnx", str(out)]) == 0
        said = capsys.readouterr().out
        assert "inputs ids (N, 5) and dense (N, 2)" in said, said
        assert (out.with_name(out.name + ".data").exists()) != inline, said
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        logits, probs = session.run(["logits", "probabilities"], feeds)
        assert logits.shape == (400, 1) and probs.shape == (400, 2)
        diff = float(np.abs(probs - want).max())
        print(f"{kind} (inline {inline}): largest |onnxruntime - evaluate| {diff:.3g}")
        assert diff <= 1e-5
    # one row alone: the batch dimension is free
    one = session.run(["probabilities"], {"ids": block.ids[:1], "dense": block.dense[:1]})[0]
    np.testing.assert_allclose(one, want[:1], rtol=0, atol=1e-5)


def test_embedding_npz_holds_whole_tables_and_the_architecture(embedding_run, tmp_path):
    """The .npz holds every field's whole table (V_f x d: trained rows as the table files
    hold them, the others as the run would read them) and the fc layers; its JSON is enough
    to compute evaluate's probabilities with NumPy alone."""
    from hpcps.io import tables
    from hpcps.io.data.categorical import load_block
    kind, ckpt, path = embedding_run
    out = tmp_path / "model.npz"
    assert main([str(ckpt), "--npz", str(out)]) == 0
    with np.load(out) as z:
        arch = json.loads(str(z["architecture"]))
        arrays = {k: z[k] for k in z.files if k != "architecture"}
    assert arch["kind"] == "embedding" and [f["vocab"] for f in arch["fields"]] == [40, 25, 30]
    d = arch["dim"]
    assert [arrays[f["table"]].shape for f in arch["fields"]] == [(40, d), (25, d), (30, d)]
    # the trained rows are the table files' rows
    c = checkpoint.load(ckpt)
    files = tables.table_files(ckpt.parent / tables.TABLES_DIR, c.step, 3, d)
    for t in range(3):
        ids, rows, _, _ = tables.read(files, t)
        assert len(ids) > 0
        np.testing.assert_array_equal(arrays[f"table{t}"][ids], rows)
        never = np.setdiff1d(np.arange(arrays[f"table{t}"].shape[0]), ids)
        if kind == "mean-dot-admit" and len(never):  # not admitted: zeros, as the shards read
            assert not arrays[f"table{t}"][never].any()
    # NumPy alone, from the JSON
    block = load_block(path, "test")
    pooled = []
    for f in arch["fields"]:
        ids = block.ids[:, f["columns"][0]:f["columns"][1]]
        rows = arrays[f["table"]][np.maximum(ids, 0)] * (ids >= 0)[:, :, None]
        total = rows.sum(axis=1)
        if arch["pooling"] == "mean":
            total = total / np.maximum((ids >= 0).sum(axis=1), 1)[:, None]
        pooled.append(total)
    parts = [np.concatenate(pooled, axis=1), block.dense]
    if arch["dot"]:
        i, j = np.triu_indices(len(pooled), 1)
        stack = np.stack(pooled, axis=1)
        parts.append(np.einsum("nid,njd->nij", stack, stack)[:, i, j])
    h = np.concatenate(parts, axis=1)
    for layer in arch["layers"]:
        h = h @ arrays[f"{layer['name']}/W"] + arrays[f"{layer['name']}/b"]
        if layer["activation"]:
            assert layer["activation"] == "relu"
            h = np.maximum(h, 0)
    p = 1 / (1 + np.exp(-h[:, 0]))
    np.testing.assert_allclose(p, evaluated(ckpt, path, tmp_path)[:, 1], rtol=0, atol=1e-5)


def test_an_embedding_checkpoint_without_its_table_files_is_refused(embedding_run, tmp_path,
                                                                    capsys):
    """The checkpoint alone (copied away from tables/) cannot be exported: exit code 4, one
    message naming the table files, nothing written."""
    import shutil
    _, ckpt, _ = embedding_run
    alone = tmp_path / "alone" / "checkpoint.h5"
    alone.parent.mkdir()
    shutil.copy(ckpt, alone)
    assert main([str(alone), "--npz", str(tmp_path / "m.npz")]) == 4
    err = capsys.readouterr().err
    assert err.startswith("hpcps.export: error: ") and "table" in err, err
    assert not list(tmp_path.glob("m.*"))
