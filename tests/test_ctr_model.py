"""Serial tests of the click-through model (hpcps.model.ctr), its spec grammar and metrics.

Gradients by finite differences in float64 (dense layers and embedding rows, sum and mean
pooling, multi-valued fields with padding); the local trainer learns on synthetic-ctr and on
MovieLens-100k (skipped where the recbole wheel cannot be had), the latter against
scikit-learn's LogisticRegression on the same one-hot fields and split.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.errors import ConfigError
from hpcps.io.data.categorical import load_block, open_categorical
from hpcps.io.data.synthetic_ctr import BIAS, hidden_weight, prepare_synthetic_ctr
from hpcps.model import metrics
from hpcps.model.ctr import CtrModel, LocalTrainer
from hpcps.model.spec import (CTR_PRESETS, PRESETS, CtrSpec, is_embedding_spec, parse_ctr_spec,
                              parse_spec)
from hpcps.ps.embedding_store import EmbeddingStore


def quiet(*_args, **_kwargs):
    pass


# ------------------------------------------------------------------------------ spec grammar


@pytest.mark.parametrize("text", ["embed16,fc400,fc400,fc400,fc1", "embed4:mean,fc1",
                                  "embed1:sum,fc3,fc1", " EMBED8:Mean , fc64,fc1 ",
                                  "ctr-dnn", "movielens", "embed4:mean,dot,fc8,fc1",
                                  "embed2, DOT ,fc1"])
def test_spec_round_trips(text):
    spec = parse_ctr_spec(text)
    assert parse_ctr_spec(spec.text) == spec
    assert spec.fc[-1] == 1 and spec.pooling in ("sum", "mean")
    assert is_embedding_spec(text) and is_embedding_spec(spec.text)


def test_spec_presets():
    assert parse_ctr_spec("ctr-dnn") == CtrSpec(10, "sum", (400, 400, 400, 1))
    assert parse_ctr_spec("movielens") == CtrSpec(16, "mean", (64, 1), dot=True)
    assert parse_ctr_spec("embed16:sum,fc1").text == "embed16,fc1"
    assert not set(CTR_PRESETS) & set(PRESETS)
    assert not is_embedding_spec("adam-mnist") and not is_embedding_spec(None)


@pytest.mark.parametrize("bad, words", [
    ("", "an embedding model is embedD"),
    ("fc400,fc1", "an embedding model is embedD"),
    ("embed,fc1", "cannot read 'embed'"),
    ("embedx4,fc1", "cannot read 'embedx4'"),
    ("embed0,fc1", "D >= 1"),
    ("embed8:max,fc1", "pools by 'max'; multi-valued fields are pooled by sum or mean"),
    ("embed8:,fc1", "pools by ''"),
    ("embed8", "has no fc layer"),
    ("embed8,fc16", "ends with 'fc16'"),
    ("embed8,fc0,fc1", ">= 1 unit"),
    ("embed8,embed4,fc1", "a second embedding stage"),
    ("embed8,fc4,dot,fc1", "dot comes right after embed"),
    ("embed8,dot,dot,fc1", "dot comes right after embed"),
    ("embed8,dot", "has no fc layer"),
    ("embed8,conv3x3x4,fc1", "not an fc layer"),
    ("embed8,fc16,flatten,fc1", "not an fc layer"),
])
def test_spec_refuses_bad_specs_with_one_message(bad, words):
    with pytest.raises(ConfigError, match=words) as info:
        parse_ctr_spec(bad)
    assert "\n" not in str(info.value)


def test_conv_grammar_refuses_an_embedding_spec():
    with pytest.raises(ConfigError, match="embedding .* model: no strategy trains"):
        parse_spec("ctr-dnn")
    with pytest.raises(ConfigError, match="pools by 'max'"):   # a bad one: its own message
        parse_spec("embed8:max,fc1")
    assert [s.kind for s in parse_spec("adam-mnist")][-1] == "fc"


def test_preset_shapes():
    """ctr-dnn on Criteo's 26 categorical and 13 dense features: Paddle's 273-400-400-400."""
    m = CtrModel("ctr-dnn", [1] * 26, n_dense=13)
    assert m.sizes == (26 * 10 + 13, 400, 400, 400, 1) and m.pooling == "sum"
    assert m.n_params == 273 * 400 + 400 + 2 * (400 * 400 + 400) + 400 + 1
    m = CtrModel("movielens", [1] * 7 + [6])
    # 8 fields of 16 dimensions, then the 28 pairs' dot products
    assert m.sizes == (8 * 16 + 28, 64, 1) and m.pooling == "mean" and m.n_columns == 13


def test_model_refuses_bad_fields_and_ids():
    with pytest.raises(ConfigError, match="at least one field"):
        CtrModel("embed4,fc1", [])
    with pytest.raises(ConfigError, match="vocab must give"):
        CtrModel("embed4,fc1", [1, 2], vocab=[3])
    m = CtrModel("embed4,fc1", [1, 2], vocab=[3, 5])
    for ids, words in [(np.zeros((2, 2), np.int64), r"\(batch, 3\)"),
                       (np.zeros((2, 3)), "integers"),
                       (np.array([[0, 1, -2]]), "row 0, column 2 \\(field 1\\): -2"),
                       (np.array([[0, 1, 2], [3, 0, 0]]), "below 3.*row 1, column 0")]:
        with pytest.raises(ValueError, match=words):
            m.lookup(ids)
    b = m.lookup(np.array([[0, 1, 2]]))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        m.loss_and_grad(m.init_params(0), [np.zeros((1, 4), np.float32)] * 2, b, np.array([2]))
    with pytest.raises(ValueError, match=r"rows\[1\] must be \(2, 4\)"):
        m.loss_and_grad(m.init_params(0), [np.zeros((1, 4), np.float32)] * 2, b, np.array([1]))


# ------------------------------------------------------------------------------ gradients


def _problem(spec, activation="tanh", n_dense=3, seed=0, B=7):
    """A model with a single-valued field, a multi-valued field padded with -1 (some
    examples with no value at all) and dense features; float64 parameters and rows."""
    rng = np.random.default_rng(seed)
    widths, vocab = [1, 4, 1], [6, 9, 3]
    model = CtrModel(spec, widths, n_dense=n_dense, vocab=vocab, activation=activation)
    ids = np.concatenate([rng.integers(0, 6, (B, 1)), rng.integers(-1, 9, (B, 4)),
                          rng.integers(0, 3, (B, 1))], axis=1)
    ids[0, 1:5] = -1                    # a multi-valued field with no value
    ids[1, 1:5] = [2, 2, -1, 5]         # a repeated id within a field
    batch = model.lookup(ids)
    rows = [rng.standard_normal((u.shape[0], model.dim)) for u in batch.uniq]
    flat = model.init_params(seed).astype(np.float64)
    flat += 0.1 * rng.standard_normal(flat.shape)      # non-zero biases too
    y = rng.integers(0, 2, B)
    dense = rng.standard_normal((B, n_dense)) if n_dense else None
    return model, flat, rows, batch, y, dense


@pytest.mark.parametrize("spec", ["embed3,fc5,fc4,fc1", "embed3:mean,fc5,fc1", "embed2,fc1",
                                  "embed3:mean,dot,fc4,fc1", "embed2,dot,fc1"])
@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_gradients_match_finite_differences(spec, activation):
    model, flat, rows, batch, y, dense = _problem(spec, activation)
    loss, grad, row_grads = model.loss_and_grad(flat, rows, batch, y, dense)
    assert grad.dtype == np.float64 and np.isclose(loss, model.loss(flat, rows, batch, y, dense))
    h = 1e-6

    def f(w, r):
        return model.loss(w, r, batch, y, dense)

    num = np.empty_like(flat)
    for i in range(flat.size):
        e = np.zeros_like(flat)
        e[i] = h
        num[i] = (f(flat + e, rows) - f(flat - e, rows)) / (2 * h)
    np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-9)
    for t, r in enumerate(rows):
        assert row_grads[t].shape == r.shape and row_grads[t].flags.c_contiguous
        num_r = np.empty_like(r)
        for k in range(r.shape[0]):
            for j in range(r.shape[1]):
                plus = [x.copy() for x in rows]
                minus = [x.copy() for x in rows]
                plus[t][k, j] += h
                minus[t][k, j] -= h
                num_r[k, j] = (f(flat, plus) - f(flat, minus)) / (2 * h)
        np.testing.assert_allclose(row_grads[t], num_r, rtol=1e-6, atol=1e-9)


def test_pooling_of_padding_and_repeats():
    """Mean pooling divides by the field's valid positions; a field with none gives zeros;
    a row used twice in one field gets its gradient twice."""
    model = CtrModel("embed2:mean,fc1", [3], vocab=[4])
    ids = np.array([[1, 1, -1], [-1, -1, -1], [0, 2, 3]])
    batch = model.lookup(ids)
    (u,) = batch.uniq
    rows = [np.arange(2 * len(u), dtype=np.float64).reshape(-1, 2)]
    x = model._input(np.zeros(model.n_params), rows, batch, None)
    row = dict(zip(u.tolist(), rows[0]))
    np.testing.assert_allclose(x[0], row[1])
    np.testing.assert_allclose(x[1], 0.0)
    np.testing.assert_allclose(x[2], (row[0] + row[2] + row[3]) / 3)


def test_float32_kernels_agree_with_float64():
    for spec in ("embed3,fc5,fc1", "embed3:mean,fc5,fc1", "embed3:mean,dot,fc5,fc1"):
        model, flat, rows, batch, y, dense = _problem(spec, "relu", seed=3, B=33)
        l64, g64, r64 = model.loss_and_grad(flat, rows, batch, y, dense)
        l32, g32, r32 = model.loss_and_grad(flat.astype(np.float32),
                                            [r.astype(np.float32) for r in rows], batch, y,
                                            dense.astype(np.float32))
        assert g32.dtype == np.float32 and abs(l32 - l64) < 1e-5
        np.testing.assert_allclose(g32, g64, atol=1e-5)
        for a, b in zip(r32, r64):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------------------ metrics


def test_auc_and_log_loss_match_scikit_learn():
    from sklearn.metrics import log_loss, roc_auc_score
    rng = np.random.default_rng(5)
    for n in (2, 3, 17, 1000):
        y = rng.integers(0, 2, n)
        y[:2] = [0, 1]
        s = rng.standard_normal(n)
        for scores in (s, np.round(s, 1), np.zeros(n)):     # no ties, many ties, all tied
            assert metrics.auc(y, scores) == pytest.approx(roc_auc_score(y, scores), abs=1e-12)
        p = metrics.sigmoid(s)
        assert metrics.log_loss(y, p) == pytest.approx(log_loss(y, p, labels=[0, 1]), rel=1e-12)
        assert metrics.log_loss_from_logits(y, s) == pytest.approx(metrics.log_loss(y, p),
                                                                   rel=1e-9)
    y = np.array([0, 1, 1])
    assert metrics.log_loss(y, np.array([0.0, 1.0, 0.0])) == \
        pytest.approx(log_loss(y, [0.0, 1.0, 0.0]), rel=1e-9)     # clipped as sklearn does
    assert metrics.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert metrics.auc(np.array([True, False]), [2.0, 1.0]) == 1.0


@pytest.mark.parametrize("call, words", [
    (lambda: metrics.auc([1, 1, 1], [0.1, 0.2, 0.3]), "both classes"),
    (lambda: metrics.auc([0, 2], [0.1, 0.2]), "0 or 1; 1 are not, the first at index 1: 2"),
    (lambda: metrics.auc([0, 1], [0.1]), "2 labels for 1 scores"),
    (lambda: metrics.auc([0, 1], [0.1, np.nan]), "finite"),
    (lambda: metrics.auc([], []), "non-empty"),
    (lambda: metrics.log_loss([0, 1], [0.5, 1.5]), r"lie in \[0, 1\]"),
])
def test_metrics_refuse_bad_input(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ------------------------------------------------------------------------------ learning


def _train(trainer, block, steps, batch_size, seed=0):
    rng = np.random.default_rng(seed)
    n = block.y.shape[0]
    order = rng.permutation(n)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        idx = np.sort(order[pos:pos + batch_size])
        pos += batch_size
        trainer.step(block.ids[idx], block.y[idx],
                     None if block.dense is None else block.dense[idx])


def _stores(model, seed):
    return [EmbeddingStore(model.dim, table=t, seed=seed) for t in range(model.n_tables)]


def test_local_trainer_learns_synthetic_ctr(tmp_path):
    path = prepare_synthetic_ctr(tmp_path / "ctr.h5", rows=24_000, fields=8, vocab=200,
                                 zipf=1.1, seed=7, test_rows=4000, log=quiet)
    info = open_categorical(path)
    train, test = load_block(path, "train"), load_block(path, "test")
    model = CtrModel.for_fields("embed8,fc32,fc1", info.fields, info.n_dense)
    trainer = LocalTrainer(model, _stores(model, 1), seed=1, lr=0.05)
    before = trainer.evaluate(test.ids, test.y)
    _train(trainer, train, steps=400, batch_size=256)
    after = trainer.evaluate(test.ids, test.y)
    # the generator's own logits: the best AUC any model can reach on these labels
    cols = np.arange(test.ids.shape[1], dtype=np.uint64)[None, :]
    hidden = BIAS + hidden_weight(7, cols, test.ids, test.ids.shape[1]).sum(axis=1)
    print(f"\nsynthetic-ctr test AUC {before['auc']:.4f} -> {after['auc']:.4f} after 400 "
          f"steps of 256 (the hidden model's own: {metrics.auc(test.y, hidden):.4f}), log "
          f"loss {before['log_loss']:.4f} -> {after['log_loss']:.4f}")
    assert after["auc"] > 0.65 and after["auc"] > before["auc"] + 0.1
    assert after["log_loss"] < before["log_loss"]


def test_local_trainer_steps_are_deterministic():
    model = CtrModel("embed4:mean,fc8,fc1", [1, 3], n_dense=2, vocab=[50, 20])
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 50, (64, 1)), rng.integers(-1, 20, (64, 3))], 1)
    y, dense = rng.integers(0, 2, 64), rng.standard_normal((64, 2)).astype(np.float32)
    runs = []
    for _ in range(2):
        tr = LocalTrainer(model, _stores(model, 3), seed=3, lr=0.1)
        losses = [tr.step(ids, y, dense) for _ in range(20)]
        runs.append((losses, tr.flat.copy(), tr.tables[1].pull(np.arange(20, dtype=np.int64))))
    assert runs[0][0] == runs[1][0] and runs[0][0][-1] < runs[0][0][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    np.testing.assert_array_equal(runs[0][2], runs[1][2])


def _one_hot(ids, fields):
    """Sparse one-hot (multi-hot for multi-valued fields) columns of every field's ids."""
    from scipy.sparse import csr_matrix
    starts = np.cumsum([0] + [f.vocab for f in fields])
    col_base = np.repeat(starts[:-1], [f.width for f in fields])
    valid = ids >= 0
    rows = np.nonzero(valid)[0]
    cols = (ids + col_base)[valid]
    return csr_matrix((np.ones(rows.shape[0]), (rows, cols)), shape=(ids.shape[0], starts[-1]))


def test_movielens_against_logistic_regression(movielens_path):
    from sklearn.linear_model import LogisticRegression
    info = open_categorical(movielens_path)
    train, test = load_block(movielens_path, "train"), load_block(movielens_path, "test")
    lr = LogisticRegression(max_iter=1000, C=1.0)
    lr.fit(_one_hot(train.ids, info.fields), train.y)
    base = metrics.auc(test.y, lr.decision_function(_one_hot(test.ids, info.fields)))

    model = CtrModel.for_fields("movielens", info.fields, info.n_dense)
    trainer = LocalTrainer(model, _stores(model, 0), seed=0, lr=0.05, row_lr=0.1)
    epochs, batch_size = 3, 256
    _train(trainer, train, steps=epochs * len(train.y) // batch_size, batch_size=batch_size)
    got = trainer.evaluate(test.ids, test.y)
    print(f"\nMovieLens-100k test AUC: model {model.spec_text} {got['auc']:.4f} (log loss "
          f"{got['log_loss']:.4f}) after {epochs} epochs of batch {batch_size} (Adagrad 0.05, "
          f"per-row Adagrad 0.1); "
          f"scikit-learn LogisticRegression on one-hot fields {base:.4f}")
    assert base > 0.75 and got["auc"] > base
