"""``python -m hpcps.data convert``: every input kind round-trips, bad input gives one clear
error, and the result does not depend on the batch size."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpcps.errors import ConfigError, DataError
from hpcps.io.data import convert as cv
from hpcps.io.data.h5format import load_split, open_dataset
from hpcps.io.data.sources import main


def quiet(_msg):
    pass


def rows_of(path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every split of a converted file, as (x, y)."""
    with h5py.File(path, "r") as f:
        return {s: (f[f"{s}/x"][()], f[f"{s}/y"][()]) for s in ("train", "test", "val")
                if s in f}


def all_rows(path) -> tuple[np.ndarray, np.ndarray]:
    """The rows of every split, sorted by their first features (the input's set of rows)."""
    parts = rows_of(path).values()
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    order = np.lexsort(x.T[::-1])
    return x[order], y[order]


def sorted_rows(x, y):
    order = np.lexsort(np.asarray(x, dtype=np.float32).T[::-1])
    return np.asarray(x, dtype=np.float32)[order], y[order]


@pytest.fixture
def table():
    rng = np.random.default_rng(1)
    return rng.random((300, 5)).astype(np.float32), rng.integers(0, 4, 300)


def write_csv(path, x, labels, label_at=2, label_name="class"):
    names = [f"f{i}" for i in range(x.shape[1])]
    names.insert(label_at, label_name)
    with open(path, "w") as f:
        f.write(",".join(names) + "\n")
        for row, lab in zip(x, labels):
            cells = [repr(float(v)) for v in row]
            cells.insert(label_at, str(lab))
            f.write(",".join(cells) + "\n")


def test_csv_round_trip_with_class_names_and_validation(tmp_path, table):
    x, y = table
    names = np.array(["ant", "bee", "cat", "dog"])
    write_csv(tmp_path / "t.csv", x, names[y])
    out = cv.convert(tmp_path / "t.csv", tmp_path / "t.h5", label="class", val_fraction=0.2,
                     log=quiet)
    info = open_dataset(out)
    assert (info.n_features, info.n_classes) == (5, 4)
    parts = rows_of(out)
    assert set(parts) == {"train", "test", "val"} and all(len(p[1]) for p in parts.values())
    assert sum(len(p[1]) for p in parts.values()) == 300
    gx, gy = all_rows(out)
    wx, wy = sorted_rows(x, y)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)  # names sorted: ant 0, bee 1, ...
    with h5py.File(out, "r") as f:
        assert [n.decode() for n in f.attrs["class_names"]] == list(names)
    xtr, ytr = load_split(out, "train")  # readers of train and test ignore /val
    assert len(ytr) == len(parts["train"][1])
    xv, yv = load_split(out, "val")
    np.testing.assert_array_equal(xv, parts["val"][0])
    np.testing.assert_array_equal(yv, parts["val"][1])


def test_load_split_of_val_in_a_file_without_one(tmp_path, table):
    x, y = table
    write_csv(tmp_path / "t.csv", x, y)
    out = cv.convert(tmp_path / "t.csv", tmp_path / "t.h5", label="class", log=quiet)
    with pytest.raises(DataError, match="has no validation split /val"):
        load_split(out, "val")


def test_csv_default_label_is_the_last_column_and_integer_labels_stay(tmp_path, table):
    x, y = table
    write_csv(tmp_path / "t.csv", x, y, label_at=5)
    out = cv.convert(tmp_path / "t.csv", tmp_path / "t.h5", log=quiet)
    gx, gy = all_rows(out)
    wx, wy = sorted_rows(x, y)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)
    with h5py.File(out, "r") as f:
        assert "class_names" not in f.attrs and "val" not in f


def test_tiny_chunks_equal_one_chunk(tmp_path, table):
    x, y = table
    write_csv(tmp_path / "t.csv", x, y)
    a = cv.convert(tmp_path / "t.csv", tmp_path / "a.h5", label="class", val_fraction=0.1,
                   chunk_rows=7, seed=3, log=quiet)
    b = cv.convert(tmp_path / "t.csv", tmp_path / "b.h5", label="class", val_fraction=0.1,
                   chunk_rows=10**6, seed=3, log=quiet)
    ra, rb = rows_of(a), rows_of(b)
    assert set(ra) == set(rb)
    for split in ra:
        np.testing.assert_array_equal(ra[split][0], rb[split][0])
        np.testing.assert_array_equal(ra[split][1], rb[split][1])
    assert open_dataset(a).fingerprint == open_dataset(b).fingerprint


def test_split_is_a_pure_function_of_seed_and_row():
    whole = cv.split_of_rows(0, 10000, 5, 0.2, 0.1)
    pieces = np.concatenate([cv.split_of_rows(lo, 333, 5, 0.2, 0.1)[:10000 - lo]
                             for lo in range(0, 10000, 333)])
    np.testing.assert_array_equal(whole, pieces)
    share = np.bincount(whole, minlength=3) / len(whole)
    np.testing.assert_allclose(share, [0.7, 0.2, 0.1], atol=0.02)
    assert not np.array_equal(whole, cv.split_of_rows(0, 10000, 6, 0.2, 0.1))


def test_npy_pair_and_npz_round_trip_with_image_shape(tmp_path, table):
    x, y = table
    images = x[:, :4].reshape(300, 1, 2, 2)
    np.save(tmp_path / "train_x.npy", images)
    np.save(tmp_path / "train_y.npy", y)
    out = cv.convert(tmp_path / "train_x.npy", tmp_path / "a.h5", log=quiet)
    assert open_dataset(out).image_shape == (1, 2, 2)
    gx, gy = all_rows(out)
    wx, wy = sorted_rows(images.reshape(300, 4), y)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)

    np.savez(tmp_path / "d.npz", x=x, labels=y)
    out = cv.convert(tmp_path / "d.npz", tmp_path / "b.h5", label="labels",
                     image_shape=(5, 1, 1), log=quiet)
    assert open_dataset(out).image_shape == (5, 1, 1)
    gx, gy = all_rows(out)
    wx, wy = sorted_rows(x, y)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)


def make_images(root, sizes, mode="L"):
    from PIL import Image
    rng = np.random.default_rng(0)
    made = []
    for cls, names in sizes.items():
        (root / cls).mkdir(parents=True)
        for name, (w, h) in names.items():
            shape = (h, w) if mode == "L" else (h, w, 3)
            a = rng.integers(0, 256, shape, dtype=np.uint8)
            Image.fromarray(a, mode).save(root / cls / name)
            made.append((cls, a))
    return made


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_image_folder_round_trip(tmp_path, mode):
    pytest.importorskip("PIL")
    sizes = {cls: {f"{i}.png": (4, 3) for i in range(12)} for cls in ("cats", "dogs", "eels")}
    made = make_images(tmp_path / "imgs", sizes, mode)
    out = cv.convert(tmp_path / "imgs", tmp_path / "i.h5", log=quiet)
    c = 1 if mode == "L" else 3
    info = open_dataset(out)
    assert info.image_shape == (c, 3, 4) and info.n_classes == 3
    classes = ["cats", "dogs", "eels"]
    want_x = np.stack([(a if a.ndim == 3 else a[:, :, None]).transpose(2, 0, 1).reshape(-1)
                       / 255.0 for _, a in made]).astype(np.float32)
    want_y = np.array([classes.index(cls) for cls, _ in made])
    gx, gy = all_rows(out)
    wx, wy = sorted_rows(want_x, want_y)
    np.testing.assert_allclose(gx, wx, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(gy, wy)
    with h5py.File(out, "r") as f:
        assert [n.decode() for n in f.attrs["class_names"]] == classes


def test_images_of_two_sizes_name_the_first_odd_file(tmp_path):
    pytest.importorskip("PIL")
    make_images(tmp_path / "imgs", {"a": {"1.png": (4, 4), "2.png": (4, 4)},
                                    "b": {"1.png": (4, 4), "2.png": (5, 4)}})
    with pytest.raises(DataError, match=r"b/2\.png: L 5x4 .*a/1\.png is L 4x4"):
        cv.convert(tmp_path / "imgs", tmp_path / "i.h5", log=quiet)
    assert not (tmp_path / "i.h5").exists()


@pytest.mark.parametrize("layout", ["empty", "empty class"])
def test_empty_folder_is_refused(tmp_path, layout):
    (tmp_path / "imgs").mkdir()
    if layout == "empty class":
        (tmp_path / "imgs" / "a").mkdir()
    with pytest.raises(DataError, match="holds no class subfolders|holds no images"):
        cv.convert(tmp_path / "imgs", tmp_path / "i.h5", log=quiet)


def test_parquet_round_trip_and_bad_column(tmp_path, table):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    x, y = table
    cols = {f"f{i}": x[:, i] for i in range(5)}
    pq.write_table(pa.table({**cols, "label": y}), tmp_path / "t.parquet", row_group_size=50)
    a = cv.convert(tmp_path / "t.parquet", tmp_path / "a.h5", chunk_rows=16, log=quiet)
    gx, gy = all_rows(a)
    wx, wy = sorted_rows(x, y)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)
    pq.write_table(pa.table({"f0": x[:, 0], "note": ["a"] * 300, "label": y}),
                   tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="column 'note' has type string"):
        cv.convert(tmp_path / "bad.parquet", tmp_path / "b.h5", log=quiet)


def test_bad_csv_cell_and_missing_label_column_exit_with_data_error(tmp_path, table, capsys):
    x, y = table
    write_csv(tmp_path / "t.csv", x, y)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    cells = lines[120].split(",")
    cells[3] = "n/a"
    lines[120] = ",".join(cells)
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "o.h5")
    assert main(["convert", str(tmp_path / "bad.csv"), "--out", out, "--label", "class",
                 "--chunk-rows", "50"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpcps.data: error: {tmp_path / 'bad.csv'}, line 121, column 'f2': 'n/a' "
                   "is not a number; every column but the label must be numeric"]
    assert not (tmp_path / "o.h5").exists()
    assert not list(tmp_path.glob("o.h5.tmp-*"))
    assert main(["convert", str(tmp_path / "t.csv"), "--out", out, "--label", "kind"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no column named 'kind'" in err[0] and "f0, f1, class" in err[0]


def test_unscaled_features_are_warned_about_and_kept(tmp_path):
    """8-bit pixels kept as 0-255 train poorly: convert says so (and how to scale), and
    writes the values as given; features within [-100, 100] pass without a word."""
    from hpcps.io.data.convert import convert
    x = np.arange(40 * 6, dtype=np.uint8).reshape(40, 6)
    np.savez(tmp_path / "p.npz", x=x, y=np.arange(40) % 2)
    said: list[str] = []
    out = convert(tmp_path / "p.npz", tmp_path / "p.h5", log=said.append)
    assert any("reach 239 in magnitude" in s and "x / 255" in s for s in said), said
    with h5py.File(out) as f:
        assert f["train/x"][:].max() <= 239 and f["train/x"][:].max() > 200
    np.savez(tmp_path / "q.npz", x=x / 255.0, y=np.arange(40) % 2)
    said.clear()
    convert(tmp_path / "q.npz", tmp_path / "q.h5", log=said.append)
    assert not any("magnitude" in s for s in said), said


def test_a_csv_not_separated_by_commas_is_named_so(tmp_path, capsys):
    """A semicolon-separated file reads as one column: the refusal names the column and the
    separator it seems to use, and a NaN feature is shown as the number it is."""
    (tmp_path / "s.csv").write_text("x1;x2;label\n1;2;0\n3;4;1\n")
    assert main(["convert", str(tmp_path / "s.csv"), "--out", str(tmp_path / "o.h5")]) == 3
    err = capsys.readouterr().err.strip()
    assert "no feature column besides the label column 'x1;x2;label'" in err, err
    assert "separated by ';'?" in err, err
    np.savez(tmp_path / "n.npz", x=np.array([[1.0, 2.0], [3.0, np.nan]]), y=np.array([0, 1]))
    assert main(["convert", str(tmp_path / "n.npz"), "--out", str(tmp_path / "o.h5")]) == 3
    err = capsys.readouterr().err.strip()
    assert "row 1, column '1' holds nan:" in err, err


@pytest.mark.parametrize("args, code, message", [
    (["--test-fraction", "0"], 2, "--test-fraction must be in"),
    (["--test-fraction", "0.5", "--validation-fraction", "0.5"], 2, "--validation-fraction"),
    (["--image-shape", "1,2"], 2, "three positive integers"),
    (["--image-shape", "1,2,2"], 3, "holds 4 values but each row"),
])
def test_bad_options(tmp_path, table, capsys, args, code, message):
    x, y = table
    write_csv(tmp_path / "t.csv", x, y)
    assert main(["convert", str(tmp_path / "t.csv"), "--out", str(tmp_path / "o.h5"),
                 *args]) == code
    assert message in capsys.readouterr().err


def test_too_few_rows_for_a_split_and_unknown_input(tmp_path):
    (tmp_path / "t.csv").write_text("a,b\n1,0\n2,1\n")
    with pytest.raises(DataError, match="split would be empty"):
        cv.convert(tmp_path / "t.csv", tmp_path / "o.h5", test_fraction=0.01, log=quiet)
    (tmp_path / "t.txt").write_text("1 2\n")
    with pytest.raises(DataError, match="unknown kind of input .txt"):
        cv.convert(tmp_path / "t.txt", tmp_path / "o.h5", log=quiet)
    with pytest.raises(ConfigError):
        cv.convert(tmp_path / "t.csv", tmp_path / "o.h5", chunk_rows=0, log=quiet)


def test_rows_grouped_by_class_are_warned_about(tmp_path):
    x = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.repeat([0, 1], 50)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    said = []
    cv.convert(tmp_path / "d.npz", tmp_path / "o.h5", log=said.append)
    assert any("grouped by class" in s for s in said)


def test_class_numbers_without_rows_are_warned_about_and_one_class_is_refused(tmp_path):
    """Labels counted from 1 leave class 0 without rows (the model's output for it is never
    right): convert writes the file and says so, naming the cause; numbers with gaps name
    the missing ones; a file of one class is refused (at conversion, and as a dataset)."""
    rng = np.random.default_rng(3)
    x = rng.random((60, 3)).astype(np.float32)
    said: list[str] = []
    np.savez(tmp_path / "one.npz", x=x, y=rng.integers(1, 3, 60))
    out = cv.convert(tmp_path / "one.npz", tmp_path / "one.h5", log=said.append)
    assert open_dataset(out).n_classes == 3
    assert any("no row has class 0" in s and "counted from 1" in s for s in said), said
    said.clear()
    np.savez(tmp_path / "gaps.npz", x=x, y=np.where(np.arange(60) % 2, 0, 4))
    cv.convert(tmp_path / "gaps.npz", tmp_path / "gaps.h5", log=said.append)
    assert any("no row has classes 1, 2, 3:" in s and "counted from 1" not in s
               for s in said), said
    said.clear()
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(60) % 3)  # 0..2 all present; names too
    cv.convert(tmp_path / "ok.npz", tmp_path / "ok.h5", log=said.append)
    write_csv(tmp_path / "n.csv", x, ["b" if i % 2 else "a" for i in range(60)])
    cv.convert(tmp_path / "n.csv", tmp_path / "n.h5", log=said.append, label="class")
    assert not any("no row has" in s for s in said), said
    np.savez(tmp_path / "single.npz", x=x, y=np.full(60, 7))
    with pytest.raises(DataError, match="every row has the label '7': a classifier needs"):
        cv.convert(tmp_path / "single.npz", tmp_path / "single.h5", log=quiet)
    assert not (tmp_path / "single.h5").exists()
    with h5py.File(tmp_path / "ok.h5", "r+") as f:  # a user's own file of one class
        for split in ("train", "test"):
            f[f"{split}/y"][...] = 0
        f.attrs["n_classes"] = 1
    with pytest.raises(DataError, match="every label is 0 .n_classes 1.: a classifier needs"):
        open_dataset(tmp_path / "ok.h5")


def test_a_csv_without_its_header_row_is_refused(tmp_path):
    """A CSV whose first line is data would lose that row to the header silently: refused,
    saying what to add; a header with a numeric feature name and a named label passes."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    np.savetxt(tmp_path / "h.csv", np.c_[x, [0, 1, 0, 1]], delimiter=",", fmt="%g")
    with pytest.raises(DataError, match=r"h.csv: the first line is all numbers \(0,0.1,0.2,0\), "
                       r"a row of data.*add one \(f0,f1,...,label\)"):
        cv.convert(tmp_path / "h.csv", tmp_path / "h.h5", log=quiet)
    (tmp_path / "ok.csv").write_text("1,2,3,label\n" + (tmp_path / "h.csv").read_text())
    out = cv.convert(tmp_path / "ok.csv", tmp_path / "ok.h5", log=quiet, test_fraction=0.5)
    assert sum(len(y) for _, y in rows_of(out).values()) == 4


def test_a_long_conversion_shows_its_progress(tmp_path, table, monkeypatch):
    """A line every PROGRESS_S seconds (here every block): the rows read so far, and how far
    along: of the rows an array counts ahead, or the share of a CSV file read."""
    x, y = table
    monkeypatch.setattr(cv, "PROGRESS_S", 0.0)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    said: list[str] = []
    cv.convert(tmp_path / "t.npz", tmp_path / "a.h5", chunk_rows=100, log=said.append)
    assert [s for s in said if s.startswith("converting")] == [
        "converting t.npz: 100 rows read of 300 (33%)",
        "converting t.npz: 200 rows read of 300 (67%)",
        "converting t.npz: 300 rows read of 300 (100%)"]
    big = np.tile(x, (40, 1))  # 12,000 rows: the file is read in pieces
    write_csv(tmp_path / "t.csv", big, np.tile(y, 40))
    said.clear()
    cv.convert(tmp_path / "t.csv", tmp_path / "b.h5", chunk_rows=3000, label="class",
               log=said.append)
    lines = [s for s in said if s.startswith("converting t.csv: ")]
    assert [int(s.split()[2].replace(",", "")) for s in lines] == [3000, 6000, 9000, 12000]
    shares = [int(s.split("(about ")[1].split("%")[0]) for s in lines]
    assert shares == sorted(shares) and shares[-1] == 100, lines
    assert 40 <= shares[1] <= 60, lines  # 6,000 of 12,000 rows read: about half of the file


def test_a_write_the_file_system_refuses_ends_the_conversion_with_one_line(tmp_path):
    """A full disk or a quota, here a file-size limit on the command: HDF5 fails writes as
    its objects are freed (tracebacks, never raised) and the process could crash at exit.
    The command says the reason in one line, exits 3, and leaves no file behind."""
    import subprocess
    import sys

    from fsize import limited_to

    x = np.random.default_rng(0).random((20000, 16)).astype(np.float32)  # 1.3 MB of x
    np.savez(tmp_path / "big.npz", x=x, y=np.arange(20000) % 3)
    run = subprocess.run([sys.executable, "-m", "hpcps.data", "convert", str(tmp_path / "big.npz"),
                          "--out", str(tmp_path / "out" / "big.h5"), "--chunk-rows", "1000"],
                         capture_output=True, text=True, preexec_fn=limited_to(300_000),
                         timeout=120)
    assert run.returncode == 3, (run.returncode, run.stderr[-3000:])
    assert run.stderr.splitlines() == [
        f"hpcps.data: error: cannot write dataset {tmp_path / 'out' / 'big.h5'}: File too large"]
    assert list((tmp_path / "out").iterdir()) == []


def convert_in_a_subprocess(tmp_path, *args):
    """``python -m hpcps.data convert ARGS`` under a 3 GB address-space limit (``ulimit -v``),
    so a conversion that tried to hold one entry per class number fails fast instead of
    taking the machine's memory."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "hpcps.data", "convert", *map(str, args)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=120,
                          cwd=tmp_path)


def test_a_csv_whose_class_numbers_are_mostly_gaps_is_refused_and_nothing_written(tmp_path):
    """Labels 0 and 10**12 (ids, not class numbers) would make 10**12 + 1 classes, all but 2
    without rows: refused before the file appears, in one line naming the label, its line and
    what to do, with the exit code of bad data; no file is left behind."""
    rng = np.random.default_rng(0)
    with open(tmp_path / "big.csv", "w") as f:
        f.write("a,b,label\n")
        for i in range(300):
            f.write(f"{rng.normal():.3f},{rng.normal():.3f},{[0, 10**12][i % 2]}\n")
    run = convert_in_a_subprocess(tmp_path, "big.csv", "--out", "big.h5")
    assert run.returncode == 3, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    err = run.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith("hpcps.data: error: big.csv, line 3: label "
                                               "1000000000000 would make 1000000000001 "
                                               "classes"), err
    assert "Remap them to 0..1" in err[0] and "class names by a non-numeric prefix " \
        "('id1000000000000')" in err[0], err
    assert "wrote" not in run.stdout, run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.csv"]


@pytest.mark.parametrize("dtype, values, shown", [
    (np.int64, [0, 10**12], "1000000000000"),
    (np.int64, [3, 2**40, 3, 2**40 + 1], str(2**40 + 1)),
    (np.uint64, [0, 2**64 - 1], str(2**64 - 1)),  # beyond int64
    (np.float64, [0.0, 1e20], str(10**20)),
])
def test_npy_labels_far_beyond_the_rows_are_refused_naming_the_row(tmp_path, dtype, values,
                                                                      shown):
    """The same for a .npy pair (and an .npz): whole numbers >= 0 are class numbers, and one
    that would leave more class numbers without rows than the input has rows is refused,
    naming the largest label and the first row (counted from 0) that holds it."""
    x = np.random.default_rng(0).random((300, 3)).astype(np.float32)
    y = np.resize(np.array(values, dtype=dtype), 300)
    row = int(np.flatnonzero(y == y.max())[0])
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    run = convert_in_a_subprocess(tmp_path, "x.npy", "--out", "o.h5")
    assert run.returncode == 3, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    err = run.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"hpcps.data: error: y.npy, row {row}: label {shown} would make "
        f"{int(shown) + 1} classes"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy", "y.npy"]
    np.savez(tmp_path / "a.npz", x=x, y=y)
    run = convert_in_a_subprocess(tmp_path, "a.npz", "--out", "a.h5")
    assert run.returncode == 3, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert run.stderr.startswith(f"hpcps.data: error: a.npz['y'], row {row}: label {shown} "
                                 "would make"), run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "x.npy", "y.npy"]


def test_class_numbers_without_rows_may_reach_the_row_count(tmp_path):
    """The bound: as many class numbers without rows as the input has rows is written (with
    the warning, which names a few and counts the rest), one more is refused."""
    x = np.random.default_rng(0).random((60, 3)).astype(np.float32)
    said: list[str] = []
    np.savez(tmp_path / "edge.npz", x=x, y=np.where(np.arange(60) % 2, 0, 61))
    out = cv.convert(tmp_path / "edge.npz", tmp_path / "edge.h5", log=said.append)
    assert open_dataset(out).n_classes == 62
    assert any("class numbers 0..61, but no row has classes 1, 2, 3, 4, 5 and 55 more:" in s
               for s in said), said
    np.savez(tmp_path / "over.npz", x=x, y=np.where(np.arange(60) % 2, 0, 62))
    with pytest.raises(DataError, match=r"over.npz\['y'\], row 0: label 62 would make 63 "
                       r"classes .*, 61 of them without a row, more than the input's 60 rows"):
        cv.convert(tmp_path / "over.npz", tmp_path / "over.h5", log=quiet)
    assert not (tmp_path / "over.h5").exists() and not list(tmp_path.glob("over.h5.tmp-*"))


def test_negative_or_huge_labels_among_names_are_class_names_kept_exactly(tmp_path):
    """Labels that are not all whole numbers >= 0 are class names, however large: numbered
    0..K-1 in sorted order, each kept as written (a long number is not rounded through a
    float)."""
    x = np.random.default_rng(0).random((90, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.resize(np.array([-1, 10**12, 2**40]), 90))
    out = cv.convert(tmp_path / "x.npy", tmp_path / "n.h5", log=quiet)
    with h5py.File(out, "r") as f:
        assert [n.decode() for n in f.attrs["class_names"]] == \
            ["-1", "1000000000000", str(2**40)]
        assert f.attrs["n_classes"] == 3
    write_csv(tmp_path / "n.csv", x, np.resize(["-1", "12345678901234567"], 90))
    out = cv.convert(tmp_path / "n.csv", tmp_path / "c.h5", label="class", log=quiet)
    with h5py.File(out, "r") as f:
        assert [n.decode() for n in f.attrs["class_names"]] == ["-1", "12345678901234567"]


def test_parquet_labels_far_beyond_the_rows_are_refused(tmp_path):
    """A Parquet label column of ids is refused as a CSV's is, naming its row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    x = np.random.default_rng(0).random((300, 2))
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1],
                             "label": np.resize(np.array([0, 10**12]), 300)}),
                   tmp_path / "t.parquet")
    run = convert_in_a_subprocess(tmp_path, "t.parquet", "--out", "t.h5")
    assert run.returncode == 3, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert run.stderr.startswith("hpcps.data: error: t.parquet, row 1: label 1000000000000 "
                                 "would make"), run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]
