"""Serial tests of categorical (click-through) datasets: layout 2, synthetic-ctr, movielens."""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcps.blocks import block_range
from hpcps.errors import DataError
from hpcps.io.data import movielens
from hpcps.io.data.categorical import (
    CategoricalWriter,
    Field,
    describe,
    load_block,
    open_categorical,
)
from hpcps.io.data.h5format import load_split, open_dataset
from hpcps.io.data.synthetic_ctr import prepare_synthetic_ctr, synthetic_rows

REPO = Path(__file__).resolve().parents[1]
FIELDS = (Field("user", 1, 50), Field("genres", 3, 7), Field("city", 1, 9))


def quiet(_msg):
    pass


def example_rows(n, seed=0, dense=True):
    """n rows over FIELDS: single ids in range, genres left-packed and padded with -1."""
    rng = np.random.default_rng(seed)
    ids = np.full((n, 5), -1, dtype=np.int64)
    ids[:, 0] = rng.integers(0, 50, n)
    counts = rng.integers(0, 4, n)
    for r, c in enumerate(counts):
        ids[r, 1:1 + c] = rng.choice(7, c, replace=False)
    ids[:, 4] = rng.integers(0, 9, n)
    y = rng.integers(0, 2, n)
    x = rng.random((n, 2), dtype=np.float32) if dense else None
    return ids, y, x


def write_example(path, n_train=23, n_test=7, block=10, dense=True):
    rows = {s: example_rows(n, seed=i, dense=dense)
            for i, (s, n) in enumerate((("train", n_train), ("test", n_test)))}
    with CategoricalWriter(path, name="toy", description="toy rows", source="this test",
                           split_note="by hand", fields=FIELDS,
                           n_rows={"train": n_train, "test": n_test},
                           dense_names=("price", "hour") if dense else (),
                           label_description="clicked") as w:
        for split, (ids, y, x) in rows.items():
            for lo in range(0, len(y), block):
                w.write(split, ids[lo:lo + block], y[lo:lo + block],
                        None if x is None else x[lo:lo + block])
        w.set_vocab("city", [f"c{i}" for i in range(9)])
        w.close()
    return rows


# ------------------------------------------------------------------------------ layout


def test_round_trip_in_blocks_and_shards(tmp_path):
    path = tmp_path / "toy.h5"
    rows = write_example(path)
    assert not list(tmp_path.glob("*.tmp-*"))
    info = open_categorical(path)
    assert (info.name, info.n_train, info.n_test, info.n_dense, info.n_columns) == \
        ("toy", 23, 7, 2, 5)
    assert info.fields == FIELDS and info.label_kind == "binary"
    assert info.to_dict()["fields"] == [["user", 1, 50], ["genres", 3, 7], ["city", 1, 9]]
    for split, (ids, y, x) in rows.items():
        for n_shards in (1, 2, 3):
            blocks = [load_block(path, split, s, n_shards) for s in range(n_shards)]
            assert [b.lo for b in blocks] == \
                [block_range(len(y), n_shards, s)[0] for s in range(n_shards)]
            np.testing.assert_array_equal(np.concatenate([b.ids for b in blocks]), ids)
            np.testing.assert_array_equal(np.concatenate([b.y for b in blocks]), y)
            np.testing.assert_array_equal(np.concatenate([b.dense for b in blocks]), x)
            assert all(b.ids.dtype == np.int64 and b.y.dtype == np.int64 for b in blocks)
    with h5py.File(path, "r") as f:
        assert f.attrs["layout_version"] == 2 and f.attrs["kind"] == "categorical"
        assert [n.decode() for n in f.attrs["field_names"]] == ["user", "genres", "city"]
        assert list(f.attrs["field_widths"]) == [1, 3, 1]
        assert list(f.attrs["field_vocab"]) == [50, 7, 9]
        assert f["train/ids"].dtype == np.int64 and f["train/ids"].attrs["description"]
        assert list(f["train/ids"].attrs["field_max_id"]) == \
            [rows["train"][0][:, 0].max(), rows["train"][0][:, 1:4].max(),
             rows["train"][0][:, 4].max()]
        assert f["train/y"].attrs["positives"] == rows["train"][1].sum()
        assert f["vocab/city"][3] == b"c3"
    text = "\n".join(describe(path))
    assert "genres" in text and "0..6" in text and "23 rows" in text and "positives" in text


def test_dense_readers_refuse_a_categorical_file_and_back(tmp_path):
    path = tmp_path / "toy.h5"
    write_example(path, dense=False)
    assert load_block(path, "test").dense is None
    for read in (open_dataset, lambda p: load_split(p, "train")):
        with pytest.raises(DataError, match="is a categorical dataset"):
            read(path)
    dense = tmp_path / "dense.h5"
    with h5py.File(dense, "w") as f:
        for split in ("train", "test"):
            f[f"{split}/x"] = np.zeros((4, 2), np.float32)
            f[f"{split}/y"] = np.arange(4, dtype=np.int64) % 2  # two classes
    assert open_dataset(dense).n_train == 4
    with pytest.raises(DataError, match="holds dense features"):
        open_categorical(dense)


def edit(path, key, value):
    """Replace a dataset (or a root attribute when key has no '/') of a written file."""
    with h5py.File(path, "a") as f:
        if "/" in key:
            del f[key]
            f[key] = value
        else:
            f.attrs[key] = value


def with_cell(ids, row, col, value, dtype=np.int64):
    ids = ids.astype(dtype)
    ids[row, col] = value
    return ids


BAD = {
    "negative id": (lambda r: ("train/ids", with_cell(r["train"][0], 14, 4, -3)),
                    r"/train/ids holds 1 bad id\(s\) \(negative ids other than -1.*\); the "
                    r"first is row 14, column 4 \(field 'city'\): -3"),
    "id past vocab": (lambda r: ("train/ids", with_cell(r["train"][0], 3, 2, 7)),
                      r"1 bad id\(s\) \(ids beyond the field's range 0..6\); the first is "
                      r"row 3, column 2 \(field 'genres'\): 7"),
    "float ids": (lambda r: ("test/ids", with_cell(r["test"][0], 5, 0, 2.5, np.float64)),
                  r"/test/ids holds float ids \(float64; 1 of its 35 values in rows 0..6 are "
                  r"not whole numbers, the first in row 5, column 0 \(2.5\)\)"),
    "label 2": (lambda r: ("train/y", with_cell(r["train"][1][:, None], 20, 0, 2)[:, 0]),
                r"/train/y holds 1 label\(s\) not in \{0, 1\}.*binary'; the first is row 20"),
    "float labels": (lambda r: ("test/y", r["test"][1].astype(np.float32)),
                     r"/test/y has dtype float32; expected integer labels 0/1"),
    "widths do not add up": (lambda r: ("field_widths", np.array([1, 2, 1])),
                             r"/train/ids has shape \(23, 5\); expected \(N >= 1, 4\)"),
    "field names and widths differ": (lambda r: ("field_names", np.array([b"a", b"b"])),
                       r"attribute field_widths is .*expected 2 positive integers"),
    "non-finite dense": (lambda r: ("train/dense", with_cell(r["train"][2], 9, 1, np.nan,
                                                             np.float32)),
                         r"/train/dense holds 1 non-finite value\(s\).*first is row 9, column 1"),
    "missing labels": (lambda r: ("test/y", None),
                       r"/test/y is missing; a categorical dataset file needs"),
    "label kind": (lambda r: ("label_kind", "ordinal"),
                   r"label_kind 'ordinal'; known: binary"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_refused_with_one_clear_message(tmp_path, case):
    path = tmp_path / "bad.h5"
    rows = write_example(path)
    key, value = BAD[case][0](rows)
    if value is None:
        with h5py.File(path, "a") as f:
            del f[key]
    else:
        edit(path, key, value)
    split = key.split("/")[0] if "/" in key else "train"
    # row contents are checked by each rank as it reads its rows; structure on opening
    in_rows = case in ("negative id", "id past vocab", "float ids", "label 2", "non-finite dense")
    if in_rows:
        open_categorical(path)
    readers = [lambda: load_block(path, split)]
    if not in_rows:
        readers.append(lambda: open_categorical(path))
    for read in readers:
        with pytest.raises(DataError, match=BAD[case][1]) as caught:
            read()
        assert "\n" not in str(caught.value)


def test_bad_rows_are_numbered_from_the_start_of_the_split(tmp_path):
    path = tmp_path / "bad.h5"
    rows = write_example(path)
    edit(path, "train/ids", with_cell(rows["train"][0], 21, 0, -7))
    load_block(path, "train", 0, 2)  # rows 0..11 are fine: each rank checks its own rows
    with pytest.raises(DataError, match=r"first is row 21, column 0"):
        load_block(path, "train", 1, 2)


def test_writer_refuses_bad_rows_and_leaves_nothing(tmp_path):
    out = tmp_path / "w.h5"
    ids, y, _ = example_rows(5, dense=False)
    kw = dict(name="w", description="d", source="s", split_note="n", fields=FIELDS,
              n_rows={"train": 5, "test": 5}, label_description="l")
    with pytest.raises(DataError, match=r"bad id.*row 2, column 0 \(field 'user'\): 50"):
        with CategoricalWriter(out, **kw) as w:
            w.write("train", with_cell(ids, 2, 0, 50), y)
    with pytest.raises(DataError, match=r"not every row was written.*'test': \(0, 5\)"):
        with CategoricalWriter(out, **kw) as w:
            w.write("train", ids, y)
            w.close()
    with pytest.raises(DataError, match=r"declared with 5 rows; writing 5 more after 5"):
        with CategoricalWriter(out, **kw) as w:
            w.write("train", ids, y)
            w.write("train", ids, y)
    with pytest.raises(DataError, match=r"field 'x': width must be a positive integer"):
        Field("x", 0, 3)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------ synthetic-ctr


SMALL = dict(rows=3000, fields=3, vocab=10**8, zipf=1.1, seed=5)


def test_synthetic_is_deterministic_whatever_the_chunk_size(tmp_path):
    a = prepare_synthetic_ctr(tmp_path / "a.h5", **SMALL, chunk_rows=37, log=quiet)
    b = prepare_synthetic_ctr(tmp_path / "b.h5", **SMALL, log=quiet)
    assert a.read_bytes() == b.read_bytes()
    c = prepare_synthetic_ctr(tmp_path / "c.h5", **(SMALL | {"seed": 6}), log=quiet)
    assert a.read_bytes() != c.read_bytes()
    ids, y = synthetic_rows(0, 3000, fields=3, vocab=10**8, zipf=1.1, seed=5)
    train, test = load_block(a, "train"), load_block(a, "test")
    assert (len(train.y), len(test.y)) == (2700, 300)
    np.testing.assert_array_equal(np.concatenate([train.ids, test.ids]), ids)
    np.testing.assert_array_equal(np.concatenate([train.y, test.y]), y)
    # any block of rows on its own is the same as within the whole
    part, _ = synthetic_rows(1234, 1300, fields=3, vocab=10**8, zipf=1.1, seed=5)
    np.testing.assert_array_equal(part, ids[1234:1300])


def test_synthetic_ids_follow_the_power_law_and_reach_huge_vocabularies():
    ids, _ = synthetic_rows(0, 200_000, fields=1, vocab=10, zipf=1.0, seed=1)
    top = np.log(11.0)  # P(k) = (log(k+2) - log(k+1)) / log(V+1) for A = 1
    expected = (np.log(np.arange(2, 12)) - np.log(np.arange(1, 11))) / top
    np.testing.assert_allclose(np.bincount(ids[:, 0], minlength=10) / 200_000, expected,
                               atol=0.004)
    uniform_ids, _ = synthetic_rows(0, 50_000, fields=2, vocab=4, zipf=0.0, seed=1)
    np.testing.assert_allclose(np.bincount(uniform_ids.ravel()) / 100_000, 0.25, atol=0.01)
    big, y = synthetic_rows(0, 50_000, fields=4, vocab=10**12, zipf=1.1, seed=2)
    assert big.dtype == np.int64 and big.min() >= 0 and big.max() < 10**12
    assert big.max() > 2**31  # beyond int32: the tail of a 10^12 vocabulary is reached
    assert 0.2 < y.mean() < 0.5


def test_synthetic_labels_carry_signal(tmp_path):
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    path = prepare_synthetic_ctr(tmp_path / "s.h5", rows=30_000, fields=4, vocab=200,
                                 zipf=1.1, seed=0, log=quiet)
    train, test = load_block(path, "train"), load_block(path, "test")

    def one_hot(ids):
        cols = ids + 200 * np.arange(ids.shape[1])
        rows = np.repeat(np.arange(len(ids)), ids.shape[1])
        return sparse.csr_matrix((np.ones(ids.size), (rows, cols.ravel())),
                                 shape=(len(ids), 200 * ids.shape[1]))

    model = LogisticRegression(C=1.0, max_iter=500).fit(one_hot(train.ids), train.y)
    p = model.predict_proba(one_hot(test.ids))[:, 1]
    base = np.full(len(test.y), train.y.mean())
    assert log_loss(test.y, p) < log_loss(test.y, base) - 0.05
    majority = max(test.y.mean(), 1 - test.y.mean())
    assert ((p > 0.5) == test.y).mean() > majority + 0.03


@pytest.mark.parametrize("bad, message", [
    ({"rows": 1}, r"--rows must be an integer >= 2, got 1"),
    ({"fields": 0}, r"--fields must be an integer >= 1, got 0"),
    ({"vocab": 2**63}, r"--vocab must be an integer 1..4611686018427387904"),
    ({"zipf": float("nan")}, r"--zipf must be a finite number >= 0, got nan"),
    ({"seed": -1}, r"--seed must be an integer 0..9223372036854775807, got -1"),
    ({"test_rows": 3000}, r"--test-rows must be an integer 1..2999, got 3000"),
    ({"chunk_rows": 0}, r"--chunk-rows must be an integer >= 1, got 0"),
])
def test_synthetic_refuses_bad_arguments(tmp_path, bad, message):
    with pytest.raises(DataError, match=message):
        prepare_synthetic_ctr(tmp_path / "s.h5", **(SMALL | bad), log=quiet)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------ CLI


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcps.data", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO)})


def test_cli_synthetic_ctr_and_info(tmp_path):
    out = tmp_path / "ctr.h5"
    result = run_cli("prepare", "synthetic-ctr", "--rows", "2e3", "--fields", "3", "--vocab",
                     "10**9", "--zipf", "1.1", "--seed", "7", "--chunk-rows", "100", "--out",
                     str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1,800 train / 200 test rows" in result.stdout
    result = run_cli("info", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in ("synthetic-ctr", "categorical", "f2", "0..999,999,999", "1,800 rows",
                 "positives", "largest seen"):
        assert text in result.stdout, result.stdout
    for args, message in [
        (("prepare", "synthetic-ctr", "--rows", "ten"), "--rows must be an integer"),
        (("prepare", "synthetic-ctr"), "synthetic-ctr needs --rows"),
        (("prepare", "synthetic-ctr", "--rows", "100", "--zipf", "-1"), "--zipf must be"),
        (("prepare", "digits", "--rows", "100"), "--rows only applies to synthetic-ctr"),
    ]:
        result = run_cli(*args, "--out", str(tmp_path / "x.h5"), cwd=tmp_path)
        assert result.returncode == DataError.exit_code, result.stderr
        assert result.stderr.startswith("hpcps.data: error: ") and message in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.h5").exists()


# ------------------------------------------------------------------------------ movielens


def test_movielens_counts_fields_and_split(movielens_path):
    info = open_categorical(movielens_path)
    assert (info.n_train, info.n_test) == (80_000, 20_000)
    assert [(f.name, f.width, f.vocab) for f in info.fields] == [
        ("user", 1, 943), ("item", 1, 1682), ("age", 1, 61), ("gender", 1, 2),
        ("occupation", 1, 21), ("zip_code", 1, 795), ("release_year", 1, 71),
        ("genres", 6, 19)]
    train, test = load_block(movielens_path, "train"), load_block(movielens_path, "test")
    ids = np.concatenate([train.ids, test.ids])
    y = np.concatenate([train.y, test.y])
    assert len(np.unique(ids[:, 0])) == 943 and len(np.unique(ids[:, 1])) == 1682
    assert 0.55 < y.mean() < 0.56 and abs(test.y.mean() - train.y.mean()) < 0.01
    assert (ids[:, 7] >= 0).all()  # every item has a genre
    assert (ids[:, :6] >= 0).all() and (ids[:, 6] == -1).sum() > 0  # two items lack a year
    with h5py.File(movielens_path, "r") as f:
        assert "80,000 train" in f.attrs["split"] and "default_rng(0)" in f.attrs["split"]
        assert f["vocab/gender"][:].tolist() == [b"F", b"M"]
        assert f["vocab/user"][0] == b"1"  # user_id 1 is id 0
        genres = [g.decode() for g in f["vocab/genres"][:]]
    assert "Drama" in genres and len(genres) == 19


def test_movielens_wrong_sha256_is_refused_before_reading(tmp_path):
    fake = tmp_path / movielens.MOVIELENS_WHEEL_NAME
    fake.write_bytes(b"not a wheel")
    with pytest.raises(DataError, match=r"sha256 mismatch for recbole-1.2.1-py3-none-any.whl"):
        movielens.prepare_movielens(tmp_path / "m.h5", wheel=fake, log=quiet)
    assert not (tmp_path / "m.h5").exists()
