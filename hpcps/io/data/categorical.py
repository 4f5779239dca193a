"""Categorical datasets (layout 2): click-through and recommendation data as integer ids.

The file layout is described in :mod:`hpcps.io.data.h5format` (its docstring, "Layout 2") and
in ``docs/formats.md``. This module writes it (:class:`CategoricalWriter`, in row blocks so a
file larger than memory can be made), checks a file against it (:func:`open_categorical`,
:class:`CategoricalInfo`), reads a rank's block of rows (:func:`load_block`, the counterpart of
``load_split``), says how its rows stream when a block does not fit in memory
(:class:`CategoricalRows`, for :mod:`hpcps.io.data.stream`) and summarises a file for
``python -m hpcps.data info`` (:func:`describe`).

Why a fixed-width block per multi-valued field and not an offsets array: a rank's rows are
then one rectangular read (``ids[lo:hi]``, the same ``block_range`` as dense x), a mini-batch
is a plain row gather, and pooling is a masked sum over a fixed axis, with no offsets to keep
consistent across shards and batches. The cost is the padding, small when the number of
values per row is bounded (MovieLens genres: at most 6, 1.7 on average). Fields with long,
heavy-tailed lists (a user's click history) would want offsets; none of ours has one.

No MPI here: callers pass the shard index and count they got from ``topology.py``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import DataError
from hpcps.io.data.h5format import (
    FORMAT,
    AtomicFile,
    _attr_str,
    _open_h5,
    check_finite_rows,
)
from hpcps.io.data.stream import Column, RowSource, chunks

CATEGORICAL_LAYOUT_VERSION = 2
KIND = "categorical"
PAD_ID = -1
LABEL_KINDS = ("binary",)
SPLITS = ("train", "test")

_FINGERPRINT_ROWS = 8
_SUMMARY_ROWS = 1 << 20


@dataclass(frozen=True)
class Field:
    """One categorical field: ``width`` id columns, ids in ``0 .. vocab-1`` (-1: no value)."""

    name: str
    width: int
    vocab: int

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise DataError(f"field name {self.name!r} must be non-empty and contain no '/'")
        for what in ("width", "vocab"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise DataError(f"field {self.name!r}: {what} must be a positive integer, "
                                f"got {value!r}")


def _columns(fields) -> np.ndarray:
    """Start column of each field in the id matrix, plus the total as the last entry."""
    return np.concatenate([[0], np.cumsum([f.width for f in fields])]).astype(np.int64)


def _vocab_per_column(fields) -> np.ndarray:
    return np.repeat(np.array([f.vocab for f in fields], dtype=np.int64),
                     [f.width for f in fields])


# --------------------------------------------------------------------------------------------
# Checks shared by the writer and the reader


def check_ids(ids: np.ndarray, fields, path, split: str, lo: int = 0,
              where: str | None = None) -> None:
    """Refuse ids a model cannot look up: not integers, below -1, or past the field's vocab.

    ``ids`` holds rows ``lo ..`` of ``/{split}/ids`` as stored (any dtype). Row numbers in the
    message count from the start of the split, so every rank names the same row. ``where``
    names the ids in the message instead of ``PATH: /SPLIT/ids``.

    Raises
    ------
    DataError
        With the number of bad values and the first bad row, column and field.
    """
    where = where or f"{path}: /{split}/ids"
    if not np.issubdtype(ids.dtype, np.integer):
        if np.issubdtype(ids.dtype, np.floating):
            with np.errstate(invalid="ignore"):
                frac = ~np.isfinite(ids) | (ids != np.floor(ids))
            count = int(np.count_nonzero(frac))
            span = f"rows {lo}..{lo + len(ids) - 1}"
            if count:
                row, col = (int(i) for i in np.argwhere(frac)[0])
                detail = (f"{count} of its {ids.size} values in {span} are not whole numbers, "
                          f"the first in row {lo + row}, column {col} ({ids[row, col]})")
            else:
                detail = f"all {ids.size} values in {span}, the first in row {lo}"
            raise DataError(f"{where} holds float ids ({ids.dtype}; {detail}); ids must be "
                            "stored as integers (int64): floats lose ids above 2**53")
        raise DataError(f"{where} has dtype {ids.dtype}; expected integer ids (int64)")
    if ids.size == 0:
        return
    vocab = _vocab_per_column(fields)
    bad = (ids < PAD_ID) | (ids >= vocab)
    count = int(np.count_nonzero(bad))
    if count == 0:
        return
    row, col = (int(i) for i in np.argwhere(bad)[0])
    starts = _columns(fields)
    field = fields[int(np.searchsorted(starts, col, side="right")) - 1]
    value = int(ids[row, col])
    rule = ("negative ids other than -1 (no value / padding)" if value < 0
            else f"ids beyond the field's range 0..{field.vocab - 1}")
    raise DataError(f"{where} holds {count} bad id(s) ({rule}); the first is row {lo + row}, "
                    f"column {col} (field {field.name!r}): {value}")


def check_labels(y: np.ndarray, path, split: str, label_kind: str, lo: int = 0) -> None:
    """Refuse labels outside {0, 1} in a binary (click-through) file, and non-integer labels."""
    where = f"{path}: /{split}/y"
    if not np.issubdtype(y.dtype, np.integer) and y.dtype != np.bool_:
        raise DataError(f"{where} has dtype {y.dtype}; expected integer labels 0/1")
    if label_kind == "binary":
        bad = (y != 0) & (y != 1)
        count = int(np.count_nonzero(bad))
        if count:
            row = int(np.argmax(bad))
            raise DataError(f"{where} holds {count} label(s) not in {{0, 1}} although the file "
                            f"says label_kind 'binary'; the first is row {lo + row}: {y[row]}")


# --------------------------------------------------------------------------------------------
# Writing


class CategoricalWriter(AtomicFile):
    """Write one categorical dataset file, a block of rows at a time, atomically.

    Each split's datasets are created at their full size up front (contiguous, unfiltered, as
    in layout 1) and filled with :meth:`write`, so memory holds one block, not the file. The
    file goes to ``out_path.tmp-<pid>`` and is renamed over ``out_path`` by :meth:`close` only
    when every row of every split has been written; leaving the ``with`` block by an exception
    removes it (use it in a ``with`` block), and a write the file system refuses is one
    DataError (:class:`~hpcps.io.data.h5format.AtomicFile`). Nothing in the file depends on
    the time or the path, so the same rows give the same bytes.

    Parameters
    ----------
    out_path : path
    name, description, source : str
        Root attributes (see the layout).
    split_note : str
        How train and test were split (root attribute ``split``).
    fields : sequence of Field
    n_rows : dict
        Rows per split, ``{"train": N, "test": M}``, each >= 1.
    dense_names : sequence of str, optional
        Names of the dense float features; none when omitted.
    label_description : str
        What a label of 1 means.
    """

    def __init__(self, out_path, *, name: str, description: str, source: str, split_note: str,
                 fields, n_rows: dict, dense_names=(), label_description: str):
        self.fields = tuple(fields)
        if not self.fields:
            raise DataError("a categorical dataset needs at least one field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise DataError(f"field names must be distinct, got {names}")
        if set(n_rows) != set(SPLITS) or any(int(n) < 1 for n in n_rows.values()):
            raise DataError(f"n_rows must give >= 1 rows for each of {SPLITS}, got {n_rows}")
        self.n_rows = {s: int(n_rows[s]) for s in SPLITS}
        self.n_dense = len(dense_names)
        self._written = {s: 0 for s in SPLITS}
        self._max_id = {s: np.full(len(self.fields), PAD_ID, np.int64) for s in SPLITS}
        self._positives = {s: 0 for s in SPLITS}
        n_cols = int(_columns(self.fields)[-1])
        super().__init__(out_path)
        try:
            self._create(name, description, source, split_note, dense_names,
                         label_description, n_cols)
        except BaseException as exc:
            self.fail(exc)
            raise

    def _create(self, name, description, source, split_note, dense_names, label_description,
                n_cols) -> None:
        """Root attributes and each split's datasets at full size."""
        names = [fl.name for fl in self.fields]
        f = self.f
        f.attrs["format"] = FORMAT
        f.attrs["layout_version"] = CATEGORICAL_LAYOUT_VERSION
        f.attrs["kind"] = KIND
        f.attrs["name"] = name
        f.attrs["description"] = description
        f.attrs["source"] = source
        f.attrs["split"] = split_note
        f.attrs["label_kind"] = "binary"
        f.attrs["n_classes"] = 2
        f.attrs["field_names"] = np.array([n.encode() for n in names])
        f.attrs["field_widths"] = np.array([fl.width for fl in self.fields], dtype=np.int64)
        f.attrs["field_vocab"] = np.array([fl.vocab for fl in self.fields], dtype=np.int64)
        if self.n_dense:
            f.attrs["dense_names"] = np.array([str(n).encode() for n in dense_names])
        for split in SPLITS:
            n = self.n_rows[split]
            group = f.create_group(split, track_order=False)
            group.attrs["description"] = f"{split} split of {name}"
            d = group.create_dataset("ids", (n, n_cols), dtype=np.int64, track_times=False)
            d.attrs["description"] = (
                f"{split} rows: one column per field, a field of width w as w columns; id -1 "
                "means no value (padding of a multi-valued field)")
            d = group.create_dataset("y", (n,), dtype=np.int64, track_times=False)
            d.attrs["description"] = f"label of each row of /{split}/ids: {label_description}"
            if self.n_dense:
                d = group.create_dataset("dense", (n, self.n_dense), dtype=np.float32,
                                         track_times=False)
                d.attrs["description"] = f"dense float features of each row of /{split}/ids"

    def write(self, split: str, ids: np.ndarray, y: np.ndarray, dense=None) -> None:
        """Append rows to ``split``: ids (rows, columns), labels (rows,), dense (rows, D)."""
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        lo = self._written[split]
        ids, y = np.asarray(ids), np.asarray(y)
        n = len(ids)
        n_cols = int(_columns(self.fields)[-1])
        if ids.ndim != 2 or ids.shape[1] != n_cols or y.shape != (n,):
            raise DataError(f"rows for {split}: ids {ids.shape} and labels {y.shape} do not "
                            f"match ({n}, {n_cols}) and ({n},)")
        if lo + n > self.n_rows[split]:
            raise DataError(f"{split} was declared with {self.n_rows[split]} rows; writing "
                            f"{n} more after {lo} would pass it")
        check_ids(ids, self.fields, self.out_path, split, lo)
        check_labels(y, self.out_path, split, "binary", lo)
        if (dense is None) != (self.n_dense == 0):
            raise DataError(f"dense features must be given exactly when dense_names are "
                            f"({self.n_dense} declared)")
        if dense is not None:
            dense = np.ascontiguousarray(dense, dtype=np.float32)
            if dense.shape != (n, self.n_dense):
                raise DataError(f"dense features {dense.shape}, expected ({n}, {self.n_dense})")
            check_finite_rows(dense, self.out_path, split, lo, dataset="dense")
        try:
            g = self.f[split]
            g["ids"][lo:lo + n] = ids
            g["y"][lo:lo + n] = y
            if dense is not None:
                g["dense"][lo:lo + n] = dense
            self.guard.check()  # a failed write HDF5 only reported as its objects were freed
        except BaseException as exc:
            self.fail(exc)
            raise
        if n:
            starts = _columns(self.fields)
            col_max = ids.max(axis=0)
            for i in range(len(self.fields)):
                seen = int(col_max[starts[i]:starts[i + 1]].max())
                self._max_id[split][i] = max(int(self._max_id[split][i]), seen)
        self._positives[split] += int(np.count_nonzero(y))
        self._written[split] = lo + n

    def set_vocab(self, field: str, values) -> None:
        """Store ``/vocab/<field>``: the raw value of each id (id i is ``values[i]``)."""
        spec = {f.name: f for f in self.fields}.get(field)
        if spec is None or len(values) != spec.vocab:
            raise DataError(f"vocab for {field!r}: {len(values)} values, field declares "
                            f"{getattr(spec, 'vocab', 'no such field')}")
        group = self.f.require_group("vocab")
        group.attrs["description"] = "raw value of each id, per field: /vocab/<field>[id]"
        group.create_dataset(field, data=np.array([str(v).encode() for v in values]),
                             track_times=False)

    def close(self) -> Path:
        """Check every row was written, record per-split statistics, fsync and rename."""
        short = {s: (w, self.n_rows[s]) for s, w in self._written.items() if w != self.n_rows[s]}
        if short:
            raise DataError(f"not every row was written (written, declared): {short}")
        try:
            for split in SPLITS:
                self.f[split]["ids"].attrs["field_max_id"] = self._max_id[split]
                self.f[split]["y"].attrs["positives"] = self._positives[split]
        except BaseException as exc:
            self.fail(exc)
            raise
        return self.commit()


# --------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class CategoricalInfo:
    """What a categorical dataset file holds, checked; ``to_dict()`` is its identity.

    ``fingerprint`` covers the attributes, the shapes and the first and last rows of ids and
    labels of each split, so a checkpoint resumed on other data is caught cheaply.
    """

    path: str
    name: str
    n_train: int
    n_test: int
    fields: tuple[Field, ...]
    n_dense: int
    label_kind: str
    fingerprint: str

    @property
    def n_columns(self) -> int:
        return int(_columns(self.fields)[-1])

    @property
    def row_width(self) -> int:
        """A row's size in float32 numbers (an int64 id counts two), for memory plans and
        :class:`~hpcps.io.data.stream.RowSource`."""
        return 2 * self.n_columns + self.n_dense

    def to_dict(self) -> dict:
        return {"path": self.path, "name": self.name, "kind": KIND, "n_train": self.n_train,
                "n_test": self.n_test, "n_dense": self.n_dense, "label_kind": self.label_kind,
                "fields": [[f.name, f.width, f.vocab] for f in self.fields],
                "fingerprint": self.fingerprint}


def is_categorical(f: h5py.File) -> bool:
    """True when an open file says it is categorical, or holds ids where dense x would be."""
    kind = f.attrs.get("kind")
    if kind is not None:
        return _attr_str(kind) == KIND
    return "train/ids" in f and "train/x" not in f


def _int_attr_array(f, path, key, n) -> np.ndarray:
    raw = f.attrs.get(key)
    a = None if raw is None else np.asarray(raw)
    if a is None or a.shape != (n,) or not np.issubdtype(a.dtype, np.integer) or a.min() < 1:
        raise DataError(f"{path}: attribute {key} is {raw!r}; expected {n} positive integers, "
                        "one per field")
    return a.astype(np.int64)


def _check_categorical(f: h5py.File, path: Path) -> tuple:
    """Check attributes, shapes and dtypes (no row data); return (fields, splits, n_dense,
    label_kind), splits being {split: n_rows}."""
    fmt = f.attrs.get("format")
    if fmt is not None and _attr_str(fmt) != FORMAT:
        raise DataError(f"{path}: format attribute is {_attr_str(fmt)!r}, expected {FORMAT!r}")
    version = f.attrs.get("layout_version")
    if version is not None and (not np.issubdtype(np.asarray(version).dtype, np.integer)
                                or int(version) != CATEGORICAL_LAYOUT_VERSION):
        raise DataError(f"{path}: layout_version {version!r}; categorical files are layout "
                        f"{CATEGORICAL_LAYOUT_VERSION}")
    raw_names = f.attrs.get("field_names")
    if raw_names is None or np.asarray(raw_names).ndim != 1 or len(raw_names) == 0:
        raise DataError(f"{path}: attribute field_names is {raw_names!r}; a categorical file "
                        "names its fields (field_names, field_widths, field_vocab)")
    names = [_attr_str(n) for n in raw_names]
    widths = _int_attr_array(f, path, "field_widths", len(names))
    vocab = _int_attr_array(f, path, "field_vocab", len(names))
    fields = tuple(Field(n, int(w), int(v)) for n, w, v in zip(names, widths, vocab))
    label_kind = _attr_str(f.attrs.get("label_kind", "binary"))
    if label_kind not in LABEL_KINDS:
        raise DataError(f"{path}: label_kind {label_kind!r}; known: {', '.join(LABEL_KINDS)}")
    n_cols = int(widths.sum())
    splits, n_dense = {}, None
    for split in SPLITS:
        di = _categorical_dataset(f, path, f"{split}/ids")
        dy = _categorical_dataset(f, path, f"{split}/y")
        if di.ndim != 2 or di.shape[1] != n_cols or di.shape[0] == 0:
            raise DataError(f"{path}: /{split}/ids has shape {di.shape}; expected (N >= 1, "
                            f"{n_cols}): the field widths {list(widths)} add up to {n_cols}")
        if dy.shape != (di.shape[0],):
            raise DataError(f"{path}: /{split}/y has shape {dy.shape}; expected "
                            f"({di.shape[0]},), one label per row of /{split}/ids")
        if not np.issubdtype(dy.dtype, np.integer) and dy.dtype != np.bool_:
            raise DataError(f"{path}: /{split}/y has dtype {dy.dtype}; expected integer "
                            "labels 0/1")
        d = 0
        if f"{split}/dense" in f:
            dd = _categorical_dataset(f, path, f"{split}/dense")
            if dd.ndim != 2 or dd.shape[0] != di.shape[0] or \
                    not np.issubdtype(dd.dtype, np.floating):
                raise DataError(f"{path}: /{split}/dense has shape {dd.shape} and dtype "
                                f"{dd.dtype}; expected floating point ({di.shape[0]}, D)")
            d = dd.shape[1]
        if n_dense is not None and d != n_dense:
            raise DataError(f"{path}: /test has {d} dense features but /train has {n_dense}")
        n_dense = d
        splits[split] = di.shape[0]
    return fields, splits, n_dense, label_kind


def _categorical_dataset(f, path, key):
    obj = f.get(key)
    if not isinstance(obj, h5py.Dataset):
        what = "missing" if obj is None else "not a dataset"
        raise DataError(f"{path}: /{key} is {what}; a categorical dataset file needs "
                        "/train/ids, /train/y, /test/ids, /test/y")
    return obj


def open_categorical(path: str | os.PathLike) -> CategoricalInfo:
    """Check that ``path`` is a usable categorical dataset and describe it.

    Reads attributes and the first and last rows of each split, never all rows, so every rank
    can call it before training; each rank's rows are checked when :func:`load_block` reads
    them.

    Raises
    ------
    DataError
        Missing, not HDF5, truncated, or not in layout 2 (the message names the dataset or
        attribute and what was found versus expected).
    """
    path = Path(path)
    with _open_h5(path) as f:
        try:
            if "train/x" in f and not is_categorical(f):
                raise DataError(f"{path} holds dense features (/train/x), not the categorical "
                                "ids an embedding model reads: train an MLP (--layers) or a "
                                "conv model on it, or an embedding model on a categorical "
                                "dataset (python -m hpcps.data prepare movielens|synthetic-ctr)")
            fields, splits, n_dense, label_kind = _check_categorical(f, path)
            digest = hashlib.sha256(repr([(x.name, x.width, x.vocab) for x in fields]).encode())
            for split in SPLITS:
                n = splits[split]
                digest.update(f"{split}:{n};".encode())
                for lo, hi in ((0, min(n, _FINGERPRINT_ROWS)), (max(0, n - _FINGERPRINT_ROWS), n)):
                    digest.update(np.asarray(f[f"{split}/ids"][lo:hi], "<i8").tobytes())
                    digest.update(np.asarray(f[f"{split}/y"][lo:hi], "<i8").tobytes())
            name = _attr_str(f.attrs.get("name", path.stem))
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    return CategoricalInfo(path=str(path), name=name, n_train=splits["train"],
                           n_test=splits["test"], fields=fields, n_dense=n_dense,
                           label_kind=label_kind, fingerprint=digest.hexdigest()[:16])


class Features:
    """A block's inputs as rows: ``len()`` and ``[rows]`` -> ``(ids, dense)`` (dense None
    without dense features), so mini-batches are drawn from them as from a dense x
    (:class:`hpcps.io.data.batches.Batches`)."""

    def __init__(self, ids: np.ndarray, dense: np.ndarray | None):
        self.ids, self.dense = ids, dense

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, rows) -> tuple[np.ndarray, np.ndarray | None]:
        return self.ids[rows], None if self.dense is None else self.dense[rows]


@dataclass(frozen=True)
class CategoricalRows:
    """How a categorical split's rows are read when they stream
    (:class:`hpcps.io.data.stream.RowSource`'s ``layout``): columns ``ids`` (int64, one per
    id column), ``y`` (int64) and ``dense`` (float32, when the file has dense features);
    each piece read is checked as :func:`load_block` checks a block, and a batch is
    ``((ids, dense), y)``, as :class:`Features` gives it."""

    fields: tuple
    n_dense: int
    label_kind: str

    @classmethod
    def of(cls, info: "CategoricalInfo") -> "CategoricalRows":
        return cls(tuple(info.fields), info.n_dense, info.label_kind)

    @property
    def columns(self) -> tuple:
        cols = (Column("ids", "<i8", int(_columns(self.fields)[-1])), Column("y", "<i8"))
        return cols + ((Column("dense", "<f4", self.n_dense),) if self.n_dense else ())

    def check(self, raw: list, cast: list, path, split: str, lo: int) -> None:
        check_ids(raw[0], self.fields, path, split, lo)
        check_labels(raw[1], path, split, self.label_kind, lo)
        if self.n_dense:
            check_finite_rows(cast[2], path, split, lo, raw[2].dtype, dataset="dense")

    def batch(self, arrays: list) -> tuple:
        return (arrays[0], arrays[2] if self.n_dense else None), arrays[1]


@dataclass
class CategoricalBlock:
    """A rank's rows of one split: ``ids`` int64 (rows, columns), ``y`` int64 (rows,),
    ``dense`` float32 (rows, D) or None; ``lo`` is the first row's number in the split."""

    ids: np.ndarray
    y: np.ndarray
    dense: np.ndarray | None
    lo: int

    @property
    def features(self) -> Features:
        return Features(self.ids, self.dense)

    def without(self, held: np.ndarray) -> "CategoricalBlock":
        """This block less the rows ``held`` (numbers in the split, sorted) that fall in it:
        the rows held out for validation."""
        mine = held[(held >= self.lo) & (held < self.lo + len(self.y))] - self.lo
        if not len(mine):
            return self
        keep = np.ones(len(self.y), dtype=bool)
        keep[mine] = False
        return CategoricalBlock(ids=np.ascontiguousarray(self.ids[keep]),
                                y=np.ascontiguousarray(self.y[keep]),
                                dense=None if self.dense is None
                                else np.ascontiguousarray(self.dense[keep]), lo=self.lo)


def load_block(path: str | os.PathLike, split: str, shard: int = 0,
               n_shards: int = 1) -> CategoricalBlock:
    """Read rows ``block_range(N, n_shards, shard)`` of a split and check them.

    Only those rows are read, and only they are checked (:func:`check_ids`,
    :func:`check_labels`, finite dense features), so no rank reads the whole file.

    Raises
    ------
    DataError
        Unknown split, a bad file (see :func:`open_categorical`), more shards than rows, or
        bad rows (the count and the first bad row, numbered from the start of the split).
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    path = Path(path)
    with _open_h5(path) as f:
        try:
            fields, splits, n_dense, label_kind = _check_categorical(f, path)
            n = splits[split]
            lo, hi = block_range(n, n_shards, shard)
            if lo == hi:
                raise DataError(f"{path}: /{split} has {n} rows, too few for {n_shards} shards "
                                f"(shard {shard} would be empty)")
            ids = f[f"{split}/ids"][lo:hi]
            y = f[f"{split}/y"][lo:hi]
            dense = None
            if n_dense:
                dd = f[f"{split}/dense"]
                with np.errstate(over="ignore"):
                    dense = np.ascontiguousarray(dd[lo:hi], dtype=np.float32)
                stored = dd.dtype
        except OSError as exc:
            raise DataError(f"cannot read dataset {path}: {exc} (truncated or corrupt?)") from exc
    check_ids(ids, fields, path, split, lo)
    check_labels(y, path, split, label_kind, lo)
    if dense is not None:
        check_finite_rows(dense, path, split, lo, stored, dataset="dense")
    return CategoricalBlock(ids=np.ascontiguousarray(ids, dtype=np.int64),
                            y=np.ascontiguousarray(y, dtype=np.int64), dense=dense, lo=lo)


def load_categorical_rows(path: str | os.PathLike, split: str, rows: np.ndarray,
                          block: int = 8192) -> CategoricalBlock:
    """Rows ``rows`` (sorted, unique) of a split, read ``block`` rows of the file at a time and
    checked as :func:`load_block` checks its rows (the rows held out for validation)."""
    info = open_categorical(path)
    source = RowSource(str(path), split, info.row_width,
                       rows=np.asarray(rows, dtype=np.int64), layout=CategoricalRows.of(info))
    ids, dense, y = [], [], []
    for (i, d), t in chunks(source, block):
        ids.append(i)
        y.append(t)
        if d is not None:
            dense.append(d)
    if not ids:
        raise DataError(f"{path}: no rows of /{split} asked for")
    return CategoricalBlock(ids=np.concatenate(ids), y=np.concatenate(y),
                            dense=np.concatenate(dense) if dense else None, lo=-1)


def describe(path: str | os.PathLike) -> list[str]:
    """Lines for ``python -m hpcps.data info``: fields, widths, id ranges, rows, positives.

    Positives are counted by reading the labels in blocks of rows (the file may not fit in
    memory); the largest id seen per field comes from the writer's ``field_max_id``.
    """
    info = open_categorical(path)
    lines = [f"{'name':12s} {info.name}", f"{'kind':12s} {KIND} (layout "
             f"{CATEGORICAL_LAYOUT_VERSION}), labels {info.label_kind}",
             f"{'dense':12s} {info.n_dense} feature(s)",
             f"{'fingerprint':12s} {info.fingerprint}"]
    with _open_h5(path) as f:
        for key in ("description", "source", "split"):
            if key in f.attrs:
                lines.append(f"{key:12s} {_attr_str(f.attrs[key])}")
        seen: dict[int, int] = {}
        for split, n in (("train", info.n_train), ("test", info.n_test)):
            dy = f[f"{split}/y"]
            positives = sum(int(np.count_nonzero(dy[lo:lo + _SUMMARY_ROWS]))
                            for lo in range(0, n, _SUMMARY_ROWS))
            lines.append(f"{split:12s} {n:,} rows, positives {positives / n:.2%}")
            max_id = f[f"{split}/ids"].attrs.get("field_max_id")
            if max_id is not None and len(max_id) == len(info.fields):
                for i, m in enumerate(max_id):
                    seen[i] = max(seen.get(i, -1), int(m))
    lines.append(f"{'fields':12s} {len(info.fields)} ({info.n_columns} id columns)")
    lines.append(f"  {'field':16s} {'width':>5s} {'ids':>24s} {'largest seen':>14s}")
    for i, fl in enumerate(info.fields):
        largest = f"{seen[i]:,}" if i in seen else "-"
        lines.append(f"  {fl.name:16s} {fl.width:5d} {'0..' + format(fl.vocab - 1, ','):>24s} "
                     f"{largest:>14s}")
    return lines
