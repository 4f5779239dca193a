"""The HDF5 dataset layout: its constants, writing it, checking a file against it, reading shards.

Every rank of a job reads its own rows straight from one file, so the file format is the
contract between preparing a dataset (:mod:`hpcps.io.data.sources`, run once, on a machine with
network) and training (run on compute nodes that may have none). This module owns that
contract. It does no MPI: callers pass the shard index and shard count they got from
``topology.py``.

Layout (``layout_version`` 1)
-----------------------------
Root attributes::

    format          "hpcps-dataset"
    layout_version  1
    name            short name, e.g. "mnist"
    n_classes       number of classes; labels are 0 .. n_classes-1
    description     what the examples are
    source          where the data came from (package, file, checksum)
    image_shape     optional int64 [C, H, W]: each row of x is an image of C maps of H x W
                    pixels, flattened C, H, W row-major (C*H*W = D); conv models
                    (``--model``) need it. MNIST's is [1, 28, 28], digits' [1, 8, 8]

Datasets, each with a ``description`` attribute saying what it holds::

    /train/x   float32 (N, D)   one flattened example per row, features in [0, 1]
    /train/y   int64   (N,)     class label of each row of /train/x
    /test/x    float32 (M, D)
    /test/y    int64   (M,)
    /val/x     float32 (V, D)   optional: a validation split, written by ``python -m hpcps.data
    /val/y     int64   (V,)     convert --validation-fraction F`` or ``write_dataset(val=...)``;
                                the same checks as train and test when present. Readers that
                                do not know /val (:func:`open_dataset`, :func:`load_split`,
                                older hpcps) ignore it, so a file with /val is still layout 1

Optional root attributes written by the converter (:mod:`hpcps.io.data.convert`)::

    class_names     fixed-length UTF-8 [n_classes]: the name of each class, when the input's
                    labels were names (CSV text, image folder names) rather than 0..K-1
    split           how rows were assigned to train, test and val (seed and fractions)

Datasets are stored uncompressed, so any HDF5 reader can open the file without filter plugins.
:func:`write_dataset` stores them contiguous (reading rows ``lo:hi`` is one read);
:class:`DenseWriter`, which writes in row blocks without knowing the row count in advance,
stores them chunked in blocks of about 1 MiB of rows (reading ``lo:hi`` is still one call,
touching only the chunks that hold those rows).

Bring your own data: any HDF5 file with ``train/x``, ``train/y``, ``test/x``, ``test/y`` is
accepted when x is 2-D floating point, y is 1-D integer, x and y have the same number of
rows, train and test have the same D, and labels are >= 0. ``n_classes`` is optional (then
it is max label + 1); ``format`` and ``layout_version`` are optional for such files.
x is converted to float32 on read and must be finite: NaN or infinity in the rows a rank reads
is refused (:class:`DataError`, exit code 3) with the count and the first such row.

Layout 2: categorical features (click-through, recommendation)
---------------------------------------------------------------
Layout 2 adds a second kind of file; a dense file is unchanged by it and is still written as
``layout_version`` 1, so older hpcps reads it. A categorical file holds integer ids, one
column per field, instead of x. It is written, checked and read by
:mod:`hpcps.io.data.categorical`; :func:`open_dataset` and :func:`load_split` refuse it with
a message saying so. Root attributes::

    format          "hpcps-dataset"
    layout_version  2
    kind            "categorical"
    name, description, source   as in layout 1
    split           how train and test were drawn (seed, fractions)
    label_kind      "binary": labels are 0/1 (a click, a rating >= 4)
    n_classes       2
    field_names     fixed-length UTF-8 [F]: the fields, in column order
    field_widths    int64 [F]: id columns per field; 1 for a single-valued field, the
                    largest number of values per row for a multi-valued one
    field_vocab     int64 [F]: field i's ids are 0 .. field_vocab[i]-1
    dense_names     optional fixed-length UTF-8 [D]: names of the dense features

Datasets, each with a ``description`` attribute::

    /train/ids    int64   (N, C)  C = sum(field_widths); field i occupies the columns
                                  sum(field_widths[:i]) .. + field_widths[i]-1. -1 means no
                                  value: a multi-valued field's values come first, the rest of
                                  its block is -1. attr field_max_id int64 [F] (largest id seen
                                  per field, -1 for none)
    /train/y      int64   (N,)    0/1; attr positives (count of 1s)
    /train/dense  float32 (N, D)  optional dense features (finite)
    /test/...     the same with M rows
    /vocab/<field>  optional, fixed-length UTF-8 [field_vocab]: raw value of each id

A multi-valued field is a fixed-width block padded with -1 rather than values plus an offsets
array, so a rank's rows are one rectangular read, as for x (the reasons are in
:mod:`hpcps.io.data.categorical`). Ids below -1, ids past ``field_vocab``, float ids and
labels other than 0/1 are refused (:class:`DataError`) with their count and the first bad row,
by the writer and by each rank for the rows it reads.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import DataError
from hpcps.io.hdf5_writes import WriteGuard, release, write_failure

FORMAT = "hpcps-dataset"
LAYOUT_VERSION = 2  # the newest layout this module knows
DENSE_LAYOUT_VERSION = 1  # what a dense file is written as: layout 2 left dense files unchanged
SPLITS = ("train", "test")
VAL = "val"  # the optional validation split, ignored by the readers of train and test

_FINGERPRINT_ROWS = 8
_PREPARE_HINT = ("make it with python -m hpcps.data prepare NAME (mnist, digits, movielens, "
                 "synthetic-ctr) or, from your own files, python -m hpcps.data convert")


# --------------------------------------------------------------------------------------------
# Writing


def publish(tmp_path, out_path) -> None:
    """Make a fully written temporary file the dataset: fsync it, then rename it over
    ``out_path`` (a reader sees the old file or the new one, never a part). Raises OSError."""
    with open(tmp_path, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp_path, out_path)


class AtomicFile:
    """An HDF5 file written whole or not at all: at ``out_path.tmp-<pid>``, renamed onto
    ``out_path`` by :meth:`commit` (after an fsync) only when complete, so a crash or a full
    disk never leaves a half-written file where training would find it, and a file being
    read by a running job is never modified in place.

    Leaving a ``with`` block by an exception (or :meth:`abort`) removes the temporary file.
    A write the file system refuses (a full disk, a quota) becomes one :class:`DataError`
    with the system's reason; HDF5's own reports of it are kept off stderr
    (:class:`~hpcps.io.hdf5_writes.WriteGuard`) until the file is committed or removed.
    The dataset writers below build on it; ``f`` is the open ``h5py.File``."""

    def __init__(self, out_path: str | os.PathLike):
        self.out_path = Path(out_path)
        self.tmp_path = self.out_path.with_name(f"{self.out_path.name}.tmp-{os.getpid()}")
        self.ended = False
        self.guard = WriteGuard()
        try:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.f = h5py.File(self.tmp_path, "w")
        except OSError as exc:
            self.guard.close()
            why = write_failure(exc) or str(exc)
            hint = "" if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else \
                "; give a path in a directory you can write to"
            raise DataError(f"cannot write dataset {self.out_path}: {why}{hint}") from exc

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """Remove the temporary file after ``exc``; a write the file system refused becomes
        one DataError with its reason, without HDF5's tracebacks (else ``exc`` goes on)."""
        if self.ended:
            return  # (commit's own failure, leaving the with block)
        why = write_failure(exc)
        if why is not None:
            self.guard.failed.append(why)
            release(exc)
        self.abort()
        if why is not None:
            raise DataError(f"cannot write dataset {self.out_path}: {why}") from None

    def commit(self) -> Path:
        """Close the file, fsync it and rename it onto ``out_path``."""
        try:
            self.f.close()
            self.guard.check()  # a failed write HDF5 only reported as its objects were freed
            publish(self.tmp_path, self.out_path)
        except BaseException as exc:
            self.fail(exc)
            raise
        self.ended = True
        self.guard.close()
        return self.out_path

    def abort(self) -> None:
        """Close and remove the temporary file; ``out_path`` is left as it was."""
        self.ended = True
        try:
            self.f.close()
        except Exception:  # already closed, or the disk failed: the file goes anyway
            pass
        try:
            self.tmp_path.unlink(missing_ok=True)
        except OSError:
            pass  # nowhere to write means nothing was written
        self.guard.close()


def write_dataset(
    out_path: str | os.PathLike,
    *,
    name: str,
    description: str,
    source: str,
    n_classes: int,
    x_description: str,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    image_shape: tuple[int, int, int] | None = None,
    val: tuple[np.ndarray, np.ndarray] | None = None,
) -> Path:
    """Write one dense dataset file (``layout_version`` 1), atomically (:class:`AtomicFile`):
    the Python way to bring your own data that is in memory (``python -m hpcps.data
    convert`` for files).

    Parameters
    ----------
    out_path : where to write.
    name, description, source : the root attributes of the same names.
    n_classes : labels are 0 .. n_classes-1.
    x_description : what one row of x is (goes into each x's ``description``).
    train, test : (x (N, D) floating, y (N,) integer) of each split.
    image_shape : (C, H, W) when each row is an image flattened C, H, W (conv models).
    val : optional validation split (x, y), written as /val.

    Raises
    ------
    DataError
        The file cannot be written (the system's reason).
    """
    with AtomicFile(out_path) as out:
        f = out.f
        f.attrs["format"] = FORMAT
        f.attrs["layout_version"] = DENSE_LAYOUT_VERSION
        f.attrs["name"] = name
        f.attrs["n_classes"] = int(n_classes)
        f.attrs["description"] = description
        f.attrs["source"] = source
        if image_shape is not None:
            f.attrs["image_shape"] = np.asarray(image_shape, dtype=np.int64)
        parts = [(SPLITS[0], train), (SPLITS[1], test)]
        if val is not None:
            parts.append((VAL, val))
        for split, (x, y) in parts:
            group = f.create_group(split)
            group.attrs["description"] = f"{split} split of {name}"
            dx = group.create_dataset("x", data=np.ascontiguousarray(x, dtype=np.float32))
            dx.attrs["description"] = f"{split} examples, one per row: {x_description}"
            dy = group.create_dataset("y", data=np.ascontiguousarray(y, dtype=np.int64))
            dy.attrs["description"] = f"class label (0..{n_classes - 1}) of each row of /{split}/x"
        return out.commit()


class DenseWriter(AtomicFile):
    """Write a dense dataset file (layout 1) in row blocks, atomically, without knowing how many
    rows each split will get: what :mod:`hpcps.io.data.convert` uses for inputs larger than
    memory.

    Datasets are chunked and grown as blocks arrive (``append``); labels may be provisional
    ids that :meth:`finish` maps through a lookup table, so a converter can number class names
    in one pass and sort them at the end. Nothing appears at ``out_path`` until
    :meth:`finish` renames the complete file onto it; :meth:`abort` (or leaving a ``with``
    block by an exception) removes the temporary file.

    Parameters
    ----------
    out_path : where the file goes.
    n_features : D, the width of every row.
    splits : the splits to write (train and test always; ``val`` when asked for).
    name, description, source, x_description : as for :func:`write_dataset`.
    image_shape : (C, H, W) or None.
    attrs : further root attributes (``split``: how rows were assigned).
    """

    def __init__(self, out_path: str | os.PathLike, *, n_features: int,
                 splits: tuple[str, ...] = SPLITS, name: str, description: str, source: str,
                 x_description: str, image_shape: tuple[int, int, int] | None = None,
                 attrs: dict | None = None):
        self.n_features = int(n_features)
        self.splits = tuple(splits)
        self.name = name
        self.rows = dict.fromkeys(self.splits, 0)
        if image_shape is not None and int(np.prod(image_shape)) != self.n_features:
            raise DataError(f"image shape {list(image_shape)} holds {int(np.prod(image_shape))} "
                            f"values but each row has {self.n_features}")
        chunk_rows = max(1, (1 << 20) // (4 * max(1, self.n_features)))
        super().__init__(out_path)
        try:
            f = self.f
            f.attrs["format"] = FORMAT
            f.attrs["layout_version"] = DENSE_LAYOUT_VERSION
            f.attrs["name"] = name
            f.attrs["description"] = description
            f.attrs["source"] = source
            if image_shape is not None:
                f.attrs["image_shape"] = np.asarray(image_shape, dtype=np.int64)
            for key, value in (attrs or {}).items():
                f.attrs[key] = value
            for split in self.splits:
                group = f.create_group(split)
                group.attrs["description"] = f"{split} split of {name}"
                dx = group.create_dataset("x", shape=(0, self.n_features), dtype=np.float32,
                                          maxshape=(None, self.n_features),
                                          chunks=(chunk_rows, self.n_features))
                dx.attrs["description"] = f"{split} examples, one per row: {x_description}"
                group.create_dataset("y", shape=(0,), dtype=np.int64, maxshape=(None,),
                                     chunks=(max(chunk_rows, 1 << 14),))
        except BaseException as exc:
            self.fail(exc)
            raise

    def append(self, split: str, x: np.ndarray, y: np.ndarray) -> None:
        """Add rows ``x`` (n, D) with labels ``y`` (n,) at the end of ``split``."""
        n = len(y)
        if n == 0:
            return
        lo = self.rows[split]
        dx, dy = self.f[f"{split}/x"], self.f[f"{split}/y"]
        dx.resize(lo + n, axis=0)
        dy.resize(lo + n, axis=0)
        dx[lo:] = np.asarray(x, dtype=np.float32)
        dy[lo:] = np.asarray(y, dtype=np.int64)
        self.rows[split] = lo + n
        self.guard.check()  # a failed write HDF5 only reported as its objects were freed

    def finish(self, n_classes: int, relabel: np.ndarray | None = None,
               class_names: list[str] | None = None) -> Path:
        """Map the labels through ``relabel`` (``y = relabel[y]``) if given, set
        ``n_classes`` (and ``class_names``), check every split has rows, and rename the file
        onto ``out_path``.

        Raises
        ------
        DataError
            A split holds no row (too few rows for its fraction), or the file cannot be written.
        """
        try:
            empty = [s for s in self.splits if self.rows[s] == 0]
            if empty:
                raise DataError(
                    f"{self.out_path}: the {' and '.join(empty)} split would be empty "
                    f"({', '.join(f'{s} {n}' for s, n in self.rows.items())} rows): too few "
                    "rows for the fractions asked; give more rows or larger fractions")
            for split in self.splits:
                dy = self.f[f"{split}/y"]
                if relabel is not None:
                    for lo in range(0, len(dy), 1 << 20):
                        dy[lo:lo + (1 << 20)] = relabel[dy[lo:lo + (1 << 20)]]
                dy.attrs["description"] = (f"class label (0..{n_classes - 1}) of each row of "
                                           f"/{split}/x")
            self.f.attrs["n_classes"] = int(n_classes)
            if class_names is not None:
                self.f.attrs["class_names"] = np.array(
                    [n.encode() for n in class_names],
                    dtype=h5py.string_dtype("utf-8", max(1, *(len(n.encode())
                                                              for n in class_names))))
        except BaseException as exc:
            self.fail(exc)
            raise
        return self.commit()


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
    image_shape: tuple[int, int, int] | None = None

    def to_dict(self) -> dict:
        """Plain JSON-able dict of the fields (``image_shape`` as a list, left out when the
        dataset has none)."""
        d = asdict(self)
        if self.image_shape is None:
            del d["image_shape"]
        else:
            d["image_shape"] = list(self.image_shape)
        return d


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
    kind = f.attrs.get("kind")
    if (kind is not None and _attr_str(kind) == "categorical") or \
            (kind is None and "train/ids" in f and "train/x" not in f):
        raise DataError(f"{path} is a categorical dataset (ids per field, layout 2), not dense "
                        "features: models with dense inputs cannot read it; train an embedding "
                        "model on it (--model movielens, ctr-dnn or embed...: docs/ctr.md; "
                        "`python -m hpcps.data info` shows its fields)")
    if kind is not None and _attr_str(kind) != "dense":
        raise DataError(f"{path}: kind attribute is {_attr_str(kind)!r}; known: dense, "
                        "categorical")
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
    if n_classes < 2:
        raise DataError(f"{path}: every label is 0 (n_classes {n_classes}): a classifier needs "
                        "rows of at least 2 classes")
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
            image_shape = _image_shape(f, path, splits["train"][0][1])
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
        image_shape=image_shape,
    )


def _image_shape(f: h5py.File, path: Path, n_features: int) -> tuple[int, int, int] | None:
    """The ``image_shape`` attribute, checked: three positive integers whose product is D."""
    raw = f.attrs.get("image_shape")
    if raw is None:
        return None
    a = np.asarray(raw)
    if a.shape != (3,) or not np.issubdtype(a.dtype, np.integer) or a.min() < 1:
        raise DataError(f"{path}: image_shape attribute {raw!r} is not three positive integers "
                        "[C, H, W]")
    shape = (int(a[0]), int(a[1]), int(a[2]))
    if shape[0] * shape[1] * shape[2] != n_features:
        raise DataError(f"{path}: image_shape {list(shape)} holds {int(np.prod(shape))} values "
                        f"but each row of x has {n_features}")
    return shape


def load_split(
    path: str | os.PathLike, split: str, shard: int = 0, n_shards: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Read shard ``shard`` of ``n_shards`` of a split: rows ``block_range(N, n_shards, shard)``.

    ``split`` is train or test, or ``val`` in a file that has the optional /val (checked as
    train and test are: 2-D floating x of the same D, one integer label per row, labels in
    0 .. n_classes-1).

    Only those rows are read from disk, so each rank holds 1/n_shards of the data. They are
checked once for NaN and infinity (:func:`check_finite_rows`), so each rank checks what it
reads and no rank reads the whole file to check it.

    Returns
    -------
    x : ndarray, float32, C-contiguous, shape (rows, D)
    y : ndarray, int64, shape (rows,)

    Raises
    ------
    DataError
        Unknown split, a bad file (see :func:`open_dataset`), more shards than rows (a
        rank with no data would have nothing to train on), or non-finite features.
    """
    path = Path(path)
    with _open_h5(path) as f:
        try:
            x_shape, y = _checked_split(f, path, split)
            n = x_shape[0]
            lo, hi = block_range(n, n_shards, shard)
            if lo == hi:
                raise DataError(f"{path}: /{split} has {n} rows, too few for {n_shards} shards "
                                f"(shard {shard} would be empty)")
            dx = f[f"{split}/x"]
            with np.errstate(over="ignore"):  # float64 beyond float32: inf, refused below
                x = np.ascontiguousarray(dx[lo:hi], dtype=np.float32)
            stored = dx.dtype
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    check_finite_rows(x, path, split, lo, stored)
    return x, np.ascontiguousarray(y[lo:hi])


def _checked_split(f: h5py.File, path: Path, split: str) -> tuple:
    """(x shape, labels) of ``split`` (train, test or val), the file's layout checked."""
    if split not in SPLITS + (VAL,):
        raise DataError(f"unknown split {split!r}; known: {', '.join(SPLITS + (VAL,))}")
    splits, n_classes = _check_layout(f, path)
    if split == VAL:
        return _check_val(f, path, splits["train"][0][1], n_classes)
    return splits[split]


def _check_val(f: h5py.File, path: Path, n_features: int, n_classes: int) -> tuple:
    """(x shape, labels) of the optional /val, held to the rules of train and test."""
    if VAL not in f:
        raise DataError(f"{path} has no validation split /val (write one with python -m "
                        "hpcps.data convert --validation-fraction F)")
    dx, dy = _dataset(f, path, f"{VAL}/x"), _dataset(f, path, f"{VAL}/y")
    if dx.ndim != 2 or dx.shape[1] != n_features or dx.shape[0] == 0 or \
            not np.issubdtype(dx.dtype, np.floating):
        raise DataError(f"{path}: /{VAL}/x has shape {dx.shape} and dtype {dx.dtype}; expected "
                        f"floating (V, {n_features}) with V >= 1, the D of /train/x")
    if dy.shape != (dx.shape[0],) or not np.issubdtype(dy.dtype, np.integer):
        raise DataError(f"{path}: /{VAL}/y has shape {dy.shape} and dtype {dy.dtype}; expected "
                        f"integer labels ({dx.shape[0]},), one per row of /{VAL}/x")
    y = dy[()].astype(np.int64, copy=False)
    if y.min() < 0 or y.max() >= n_classes:
        raise DataError(f"{path}: /{VAL}/y has labels {y.min()}..{y.max()}; expected "
                        f"0 .. {n_classes - 1}")
    return dx.shape, y


def check_finite_rows(x: np.ndarray, path, split: str | None, lo: int = 0,
                      stored=np.float32, dataset: str = "x") -> None:
    """Refuse features holding NaN or infinity: they would make every loss NaN.

    ``x`` holds rows ``lo ..`` of ``/{split}/{dataset}`` as read (float32); ``split`` None:
    rows to score (``hpcps.evaluate --input``), whose predictions they would make NaN;
    ``stored`` is the dtype
    in the file (a float64 value beyond float32's range becomes infinite on reading). One
    pass, no temporary: the sum of all values is finite exactly when no value is NaN or
    infinite, unless finite values overflow the sum, in which case the rows are looked at
    one by one before anything is refused.

    Raises
    ------
    DataError
        With the number of non-finite values and the first row and column holding one
        (row numbers count from the start of the split, not of this rank's rows).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if x.size == 0 or np.isfinite(np.sum(x, dtype=np.float32)):
            return
    bad = ~np.isfinite(x)
    count = int(np.count_nonzero(bad))
    if count == 0:
        return  # the sum overflowed; every value is finite
    row, col = (int(i) for i in np.argwhere(bad)[0])
    value = x[row, col]
    why = ""
    if np.dtype(stored).itemsize > 4 and not np.isnan(value):
        why = f" (the file stores {np.dtype(stored)}; values beyond float32's range " \
              "become infinite when read)"
    if split is None:
        where, use = f"{dataset}", "Its predictions would be NaN: replace or drop those values"
    elif split == "train":
        where, use = (f"/{split}/{dataset}", "Training on it would make every loss NaN: "
                      "replace or drop those values before training")
    else:  # test or val: the rows the run scores
        where, use = (f"/{split}/{dataset}", "Every evaluation on it would be NaN: replace or "
                      "drop those values before training")
    raise DataError(f"{path}: {where} holds {count} non-finite value(s) (NaN or infinity) in "
                    f"rows {lo}..{lo + len(x) - 1}; the first is row {lo + row}, column {col} "
                    f"({value}){why}. {use}")


# --------------------------------------------------------------------------------------------
# The validation split


def split_rows(path: str | os.PathLike, split: str) -> int:
    """Rows of ``split`` (train, test or val), the file and split checked as
    :func:`load_split` checks them (layout, shapes, labels), without reading x: what an
    evaluation that reads the split in chunks needs first."""
    path = Path(path)
    with _open_h5(path) as f:
        try:
            x_shape, _ = _checked_split(f, path, split)
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    return int(x_shape[0])


def val_rows(path: str | os.PathLike) -> int:
    """Rows of the optional validation split /val in the dataset file, 0 when it has none
    (its contents are checked only when read: :func:`load_split` with ``split="val"``)."""
    with _open_h5(path) as f:
        if VAL not in f:
            return 0
        dx = f.get(f"{VAL}/x")
        return int(dx.shape[0]) if isinstance(dx, h5py.Dataset) and dx.ndim >= 1 else 0


def more_facts(path: str | os.PathLike) -> dict[str, Any]:
    """What ``python -m hpcps.data info`` prints beside :class:`DatasetInfo`: ``n_val`` when
    the file has the optional /val (checked as :func:`load_split` checks it), and ``split``
    (how its rows were assigned to train, test and val) when the file says."""
    path = Path(path)
    out: dict[str, Any] = {}
    with _open_h5(path) as f:
        if VAL in f:
            out["n_val"] = int(_checked_split(f, path, VAL)[0][0])
        if "split" in f.attrs:
            out["split"] = _attr_str(f.attrs["split"])
    return out


def holdout_rows(n: int, fraction: float, seed: int) -> np.ndarray:
    """The rows of a training set of ``n`` rows that ``--validation-fraction fraction`` holds
    out, sorted: the last ``round(fraction * n)`` (at least 1, at most ``n - 1``) of a
    permutation drawn from ``seed``, so every rank computes the same rows. Empty when
    ``fraction`` is 0."""
    if fraction <= 0 or n < 2:
        return np.empty(0, dtype=np.int64)
    k = min(n - 1, max(1, int(round(fraction * n))))
    perm = np.random.default_rng([int(seed), 0x7A1]).permutation(n)
    return np.sort(perm[n - k:]).astype(np.int64)


def load_rows(path: str | os.PathLike, split: str, rows: np.ndarray,
              block: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` (sorted, unique) of ``split``, read in windows of ``block`` rows of the
    file (never the whole split at once) and checked for NaN and infinity as
    :func:`load_split` checks its rows."""
    path = Path(path)
    rows = np.asarray(rows, dtype=np.int64)
    xs, ys = [], []
    with _open_h5(path) as f:
        dx, dy = _dataset(f, path, f"{split}/x"), _dataset(f, path, f"{split}/y")
        n = dx.shape[0]
        if len(rows) and (rows[0] < 0 or rows[-1] >= n):
            raise DataError(f"{path}: rows {rows[0]}..{rows[-1]} are outside /{split} "
                            f"({n} rows)")
        starts = range(int(rows[0]), int(rows[-1]) + 1, block) if len(rows) else range(0)
        for lo in starts:  # windows of ``block`` rows of the file, each read once
            hi = min(lo + block, n)
            want = rows[np.searchsorted(rows, lo):np.searchsorted(rows, hi)]
            if not len(want):
                continue
            with np.errstate(over="ignore"):  # float64 beyond float32: inf, refused below
                raw = np.asarray(dx[lo:hi], dtype=np.float32)
            check_finite_rows(raw, path, split, lo, dx.dtype)
            xs.append(raw[want - lo])
            ys.append(np.asarray(dy[lo:hi])[want - lo])
        width = dx.shape[1]
    x = np.ascontiguousarray(np.concatenate(xs) if xs else np.empty((0, width), np.float32))
    y = np.ascontiguousarray(np.concatenate(ys) if ys else np.empty(0, np.int64),
                             dtype=np.int64)
    return x, y
