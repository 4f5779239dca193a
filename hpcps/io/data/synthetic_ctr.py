"""A synthetic click-through dataset (layout 2) of any size, for throughput and memory at scale.

``python -m hpcps.data prepare synthetic-ctr --rows N --fields F --vocab V --zipf A --seed S``
writes N rows of F single-valued fields. Every value is a pure function of (seed, row, field),
computed by hashing (SplitMix64's finaliser), so:

- the same arguments give the same bytes, whatever ``--chunk-rows`` (rows are written in
  blocks of that many, so a file larger than memory can be made);
- the hidden model needs no table: the weight of id k in field f is a hash of (seed, f, k),
  so a vocabulary of 10^8 or 10^12 ids costs no memory.

Ids: field f's id in row r is ``floor(X) - 1`` where X is drawn from the power law with
density proportional to x^-A on [1, V+1) (inverse CDF of the hash's uniform), so
P(id = k) = integral of x^-A over [k+1, k+2), close to Zipf's (k+1)^-A; id 0 is the most
frequent, ids are 0..V-1 (int64; V up to 2^62). A = 0 gives uniform ids.

Labels: a hidden logistic model, P(y = 1) = sigmoid(BIAS + sum over fields of w(f, id)),
with w(f, k) uniform on [-s, s], s = WEIGHT_SCALE * sqrt(3 / F) (so the sum's standard
deviation is WEIGHT_SCALE whatever F); y = 1 when a further hash of (seed, row) falls below
that probability. Frequent ids recur, so a model can learn their weights: there is signal.

The last ``test_rows`` rows (default 10% of N) are the test split; the rows are independent
draws, so this is a random split.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpcps.errors import DataError
from hpcps.io.data.categorical import CategoricalWriter, Field
from hpcps.io.data.wheels import Log

BIAS = -1.0
WEIGHT_SCALE = 2.0
DEFAULT_CHUNK_ROWS = 1 << 16
MAX_VOCAB = 1 << 62

# Streams: each quantity hashes its own constant first so no two share a hash.
_STREAM_ID, _STREAM_WEIGHT, _STREAM_LABEL = 1, 2, 3

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs look independent."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash64(*keys) -> np.ndarray:
    """Hash a sequence of uint64-convertible keys (arrays broadcast) to uint64."""
    with np.errstate(over="ignore"):
        h = np.zeros((), dtype=np.uint64)
        for key in keys:
            h = _mix(h ^ np.asarray(key).astype(np.uint64))
    return h


def uniform(h: np.ndarray) -> np.ndarray:
    """The top 53 bits of a hash as a float64 in [0, 1)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def zipf_ids(u: np.ndarray, vocab: int, a: float) -> np.ndarray:
    """Ids 0..vocab-1 from uniforms u: the power law x^-a on [1, vocab+1), floored, minus 1."""
    top = float(vocab) + 1.0
    if a == 1.0:
        x = np.exp(u * np.log(top))
    else:
        b = 1.0 - a
        x = (1.0 + u * (top ** b - 1.0)) ** (1.0 / b)
    # float64 rounding near the top may reach vocab; clamp so every id is in range
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1).clip(0)


def hidden_weight(seed: int, field: np.ndarray, ids: np.ndarray, n_fields: int) -> np.ndarray:
    """The hidden model's weight of each id in its field, from a hash (no table)."""
    s = WEIGHT_SCALE * np.sqrt(3.0 / n_fields)
    return (2.0 * uniform(hash64(_STREAM_WEIGHT, seed, field, ids)) - 1.0) * s


def synthetic_rows(lo: int, hi: int, *, fields: int, vocab: int, zipf: float,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows lo..hi-1 of the generator: ids int64 (hi-lo, fields), labels int64 (hi-lo,).

    A pure function of its arguments, so any block of rows can be made on its own.
    """
    rows = np.arange(lo, hi, dtype=np.uint64)[:, None]
    cols = np.arange(fields, dtype=np.uint64)[None, :]
    ids = zipf_ids(uniform(hash64(_STREAM_ID, seed, cols, rows)), vocab, zipf)
    logit = BIAS + hidden_weight(seed, cols, ids, fields).sum(axis=1)
    p = 1.0 / (1.0 + np.exp(-logit))
    y = (uniform(hash64(_STREAM_LABEL, seed, rows[:, 0])) < p).astype(np.int64)
    return ids, y


def _positive_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise DataError(f"synthetic-ctr: {name} must be an integer {bound}, got {value!r}")
    return int(value)


def prepare_synthetic_ctr(out_path: str | os.PathLike, *, rows: int, fields: int, vocab: int,
                          zipf: float, seed: int, test_rows: int | None = None,
                          chunk_rows: int = DEFAULT_CHUNK_ROWS, log: Log = print) -> Path:
    """Write the synthetic click-through dataset (see the module docstring) to ``out_path``.

    Parameters
    ----------
    rows : int
        Rows in all (train + test), >= 2.
    fields, vocab : int
        Fields per row; possible ids per field (ids 0..vocab-1).
    zipf : float
        The power law's exponent A >= 0 (0: uniform ids; 1.1: Criteo-like skew).
    seed : int
        Everything is a function of it (0 .. 2^63-1).
    test_rows : int, optional
        The last rows held out as the test split; default 10% of rows (at least 1).
    chunk_rows : int
        Rows generated and written at a time: memory is about chunk_rows x fields x 40 bytes.

    Raises
    ------
    DataError
        An argument out of range (one message naming it), or the file cannot be written.
    """
    rows = _positive_int("--rows", rows, 2)
    fields = _positive_int("--fields", fields)
    vocab = _positive_int("--vocab", vocab, 1, MAX_VOCAB)
    seed = _positive_int("--seed", seed, 0, (1 << 63) - 1)
    chunk_rows = _positive_int("--chunk-rows", chunk_rows)
    if isinstance(zipf, bool) or not isinstance(zipf, (int, float)) or not np.isfinite(zipf) \
            or zipf < 0:
        raise DataError(f"synthetic-ctr: --zipf must be a finite number >= 0, got {zipf!r}")
    zipf = float(zipf)
    if test_rows is None:
        test_rows = max(1, rows // 10)
    test_rows = _positive_int("--test-rows", test_rows, 1, rows - 1)
    n_train = rows - test_rows
    args = f"--rows {rows} --fields {fields} --vocab {vocab} --zipf {zipf} --seed {seed}"
    with CategoricalWriter(
        out_path, name="synthetic-ctr",
        description=f"synthetic click-through rows: {fields} fields of {vocab:,} possible ids, "
                    f"Zipf {zipf}, labels from a hidden logistic model over the ids",
        source=f"hpcps.io.data.synthetic_ctr {args} --test-rows {test_rows} (hashing "
               f"generator: SplitMix64 of (seed, row, field); bias {BIAS}, weight scale "
               f"{WEIGHT_SCALE})",
        split_note=f"rows 0..{n_train - 1} train, the last {test_rows:,} test (independent draws)",
        fields=[Field(f"f{i}", 1, vocab) for i in range(fields)],
        n_rows={"train": n_train, "test": test_rows},
        label_description="1 with the hidden logistic model's probability of the row's ids",
    ) as writer:
        for split, start, stop in (("train", 0, n_train), ("test", n_train, rows)):
            for lo in range(start, stop, chunk_rows):
                hi = min(stop, lo + chunk_rows)
                ids, y = synthetic_rows(lo, hi, fields=fields, vocab=vocab, zipf=zipf,
                                        seed=seed)
                writer.write(split, ids, y)
        path = writer.close()
    log(f"wrote {out_path}: {n_train:,} train / {test_rows:,} test rows, {fields} fields, "
        f"vocab {vocab:,}, {Path(path).stat().st_size / 1e6:.1f} MB")
    return path
