"""Serial tests of the click-through model's spec grammar (hpcps.model.spec) and of the
binary-label metrics (hpcps.model.metrics) against scikit-learn."""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.errors import ConfigError
from hpcps.model import metrics
from hpcps.model.spec import (CTR_PRESETS, PRESETS, CtrSpec, is_embedding_spec, parse_ctr_spec,
                              parse_spec)


# ------------------------------------------------------------------------------ spec grammar


@pytest.mark.parametrize("text", ["embed16,fc400,fc400,fc400,fc1", "embed4:mean,fc1",
                                  "embed1:sum,fc3,fc1", " EMBED8:Mean , fc64,fc1 ",
                                  "ctr-dnn", "movielens"])
def test_spec_round_trips(text):
    spec = parse_ctr_spec(text)
    assert parse_ctr_spec(spec.text) == spec
    assert spec.fc[-1] == 1 and spec.pooling in ("sum", "mean")
    assert is_embedding_spec(text) and is_embedding_spec(spec.text)


def test_spec_presets():
    assert parse_ctr_spec("ctr-dnn") == CtrSpec(10, "sum", (400, 400, 400, 1))
    assert parse_ctr_spec("movielens") == CtrSpec(8, "mean", (64, 32, 1))
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
