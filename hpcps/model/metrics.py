"""Metrics of a binary (click-through) classifier: AUC and log loss. Pure NumPy, no MPI.

AUC is computed exactly, by ranks (the Mann-Whitney U statistic): sort the scores, give
tied scores their average rank, and ``AUC = (R+ - n+ (n+ + 1) / 2) / (n+ n-)`` with R+ the
sum of the positives' ranks. A tie between a positive and a negative counts one half, as
the area under the ROC curve drawn through every distinct threshold does, so the result
equals scikit-learn's ``roc_auc_score`` (not an approximation over a fixed number of
thresholds, as Paddle's ``auc`` op with its 4096 buckets is). O(n log n) for the sort.

Log loss is the mean binary cross-entropy. From probabilities it clips them to
``[eps, 1 - eps]`` with eps the float64 machine epsilon, as scikit-learn's ``log_loss``
does for float64 input; from logits (:func:`log_loss_from_logits`) it needs no clipping:
``log(1 + exp(z)) - y z``, computed stably.
"""
from __future__ import annotations

import numpy as np

_EPS = float(np.finfo(np.float64).eps)


def binary_labels(y, n: int | None = None) -> np.ndarray:
    """``y`` as a 1-D bool array of 0/1 labels; ValueError otherwise."""
    a = np.asarray(y)
    if a.ndim != 1 or a.shape[0] == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{a.shape[0]} labels for {n} scores")
    if a.dtype == np.bool_:
        return a
    if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"labels must be 0/1 numbers, got dtype {a.dtype}")
    bad = (a != 0) & (a != 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"labels must be 0 or 1; {int(bad.sum())} are not, the first at "
                         f"index {i}: {a[i]}")
    return a.astype(bool)


def _scores(s, name: str) -> np.ndarray:
    a = np.asarray(s, dtype=np.float64)
    if a.ndim != 1 or a.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite; {int((~np.isfinite(a)).sum())} are not")
    return a


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x`` (float64), tied values sharing the mean of their ranks (as
    ``scipy.stats.rankdata(method="average")``)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    sx = x[order]
    # start of each run of equal values in sorted order, and the run's mean rank
    starts = np.flatnonzero(np.concatenate([[True], sx[1:] != sx[:-1]]))
    ends = np.concatenate([starts[1:], [x.shape[0]]])
    mean_rank = (starts + 1 + ends) / 2.0          # ranks starts+1 .. ends
    ranks = np.empty(x.shape[0], dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def auc(y, score) -> float:
    """Area under the ROC curve of ``score`` (any monotone score: probability or logit) for
    0/1 labels ``y``, exact, ties counting one half.

    Raises
    ------
    ValueError
        Empty or mismatched inputs, labels other than 0/1, scores not finite, or labels of
        one class only (the AUC is then undefined).
    """
    s = _scores(score, "scores")
    pos = binary_labels(y, s.shape[0])
    n_pos = int(pos.sum())
    n_neg = pos.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes; the {pos.shape[0]} labels are all "
                         f"{int(n_pos > 0)}")
    r_pos = float(average_ranks(s)[pos].sum())
    return (r_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def log_loss(y, p) -> float:
    """Mean binary cross-entropy of probabilities ``p`` of label 1, clipped to
    ``[eps, 1 - eps]`` (eps: float64's machine epsilon)."""
    q = _scores(p, "probabilities")
    t = binary_labels(y, q.shape[0])
    if q.min() < 0.0 or q.max() > 1.0:
        raise ValueError(f"probabilities must lie in [0, 1], got [{q.min()}, {q.max()}]")
    q = np.clip(q, _EPS, 1.0 - _EPS)
    return float(-np.mean(np.where(t, np.log(q), np.log1p(-q))))


def log_loss_from_logits(y, z) -> float:
    """Mean binary cross-entropy of logits ``z`` (P(y = 1) = sigmoid(z)), without
    clipping: ``mean(log(1 + exp(z)) - y z)``."""
    z = _scores(z, "logits")
    t = binary_labels(y, z.shape[0])
    return float(np.mean(np.logaddexp(0.0, z) - t * z))


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` without overflow warnings, in ``z``'s float dtype."""
    z = np.asarray(z)
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def binary_metrics(y, z) -> dict[str, float]:
    """``{"auc", "log_loss"}`` of logits ``z`` for labels ``y`` (what evaluations report)."""
    return {"auc": auc(y, z), "log_loss": log_loss_from_logits(y, z)}
