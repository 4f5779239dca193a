"""Serial tests of the binary-label metrics (hpcps.model.metrics) against scikit-learn."""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.model import metrics


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
