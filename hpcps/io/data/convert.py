"""Convert a user's data into the dense dataset layout (``python -m hpcps.data convert``).

Inputs, recognised by what ``INPUT`` is:

``*.csv``
    A header row naming the columns, then one example per line. The label column is named by
    ``--label`` (default: the last column); every other column is a numeric feature. A cell
    that is not a number (an empty one included), NaN or infinity is refused with its line and
    column.
``*.npy``
    The features: 2-D (N, D), or images (N, H, W) or (N, C, H, W), flattened C, H, W (their
    shape becomes the file's ``image_shape``). The labels are the 1-D ``.npy`` named by
    ``--label``, else the sibling whose name has the last ``x`` of the stem replaced by ``y``
    (``x.npy`` -> ``y.npy``, ``train_x.npy`` -> ``train_y.npy``). Both are memory-mapped.
``*.npz``
    Arrays ``x`` and ``y`` (``--label`` names another array for y), shaped as for ``.npy``.
    An ``.npz`` is a zip: each array is read whole, so it must fit in memory.
a folder
    One subfolder per class (its name is the class name), each holding images Pillow reads.
    All images are grayscale (C = 1) or all RGB (C = 3), all one size; pixels are scaled to
    [0, 1]. Palette and 1-bit images are converted (to RGB, to grayscale); other modes, a
    second size or mode, a file Pillow cannot read, an empty folder or class are refused
    with the first odd file named (the files are checked, header only, before any is decoded).
``*.parquet`` / ``*.pq``
    As a CSV, with pyarrow (the optional extra ``parquet``: ``pip install 'hpcps[parquet]'``):
    feature columns must be numeric or boolean and hold no nulls.

Labels: when every label is a whole number >= 0 it is the class id; otherwise labels are class
names (CSV text, folder names, -1/+1), numbered in sorted order and stored in the root
attribute ``class_names``. Class numbers that leave more numbers without rows than the input
has rows (ids such as 0 and 10**12, not class numbers) are refused, naming the largest label
and its row (:meth:`Labels.finish`).

Larger than memory: CSV and Parquet are read in row batches (``chunk_rows``), ``.npy`` through
a memory map and images a batch of files at a time; each batch is written to the HDF5 file at
once (:class:`~hpcps.io.data.h5format.DenseWriter`). The split needs no shuffle of the whole
file: row ``i`` of the input goes to test, val or train by a hash of (``seed``, ``i``), so the
result does not depend on the batch size. Rows keep their input order within each split; an
image folder's files are first put in a seeded random order (a list of names, not the data),
as a folder is sorted by class. Each rank of a job reads a contiguous block of rows, so an
input whose rows come grouped by class trains badly: ``convert`` warns about such an input and
it should be shuffled first.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcps.errors import ConfigError, DataError
from hpcps.io.data.h5format import SPLITS, VAL, DenseWriter

DEFAULT_TEST_FRACTION = 0.2
DEFAULT_CHUNK_ROWS = 65536
PARQUET_SUFFIXES = (".parquet", ".pq")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

Log = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# which split each row goes to


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (array arithmetic wraps mod 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_of_rows(first: int, n: int, seed: int, test_fraction: float,
                  val_fraction: float = 0.0) -> np.ndarray:
    """The split of input rows ``first .. first+n-1``: 0 train, 1 test, 2 val (int8, (n,)).

    A pure function of (seed, row index): a uniform number u in [0, 1) per row from a
    counter-based hash; test when u < test_fraction, val when u < test_fraction +
    val_fraction, else train.
    """
    base = _mix(np.array([(int(seed) * _GOLDEN + 1) & _MASK64], dtype=np.uint64))
    idx = np.arange(first, first + n, dtype=np.uint64)
    u = (_mix(base + idx * np.uint64(_GOLDEN)) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    codes = np.zeros(n, dtype=np.int8)
    codes[u < test_fraction + val_fraction] = 2
    codes[u < test_fraction] = 1
    return codes


# --------------------------------------------------------------------------------------------
# labels


class Labels:
    """Numbers the labels of a file read in blocks: provisional ids in order of first sight,
    made final by :meth:`finish` (class ids as they are, or names in sorted order)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.first_rows: list[int] = []  # the input row where each provisional id first shows
        self.rows = 0  # rows numbered so far

    def number(self, values: np.ndarray, where: str, first: int = 0) -> np.ndarray:
        """Provisional int64 ids of ``values`` (numbers or strings), the labels of input rows
        ``first ..``; DataError on an empty or NaN label (``where`` says which rows)."""
        values = np.asarray(values)
        if values.size == 0:
            return np.zeros(0, dtype=np.int64)
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            raise DataError(f"{where}: a label is NaN or infinite")
        uniq, index, inverse = np.unique(values, return_index=True, return_inverse=True)
        local = np.empty(len(uniq), dtype=np.int64)
        for i, u in enumerate(uniq.tolist()):
            key = _label_key(u)
            if key == "":
                raise DataError(f"{where}: a label is empty")
            if key not in self.ids:
                self.ids[key] = len(self.ids)
                self.first_rows.append(first + int(index[i]))
            local[i] = self.ids[key]
        self.rows += values.size
        return local[inverse.reshape(-1)]

    def first(self) -> str:
        """The first label seen (for a message about a file of one class)."""
        return next(iter(self.ids))

    def finish(self, where: str = "the input", locate: Callable[[int], str] | None = None
               ) -> tuple[int, np.ndarray, list[str] | None]:
        """(n_classes, lookup from provisional to final ids, class names or None).

        Class numbers (every label a whole number >= 0) make ``largest + 1`` classes; when
        more of those numbers have no row than the input has rows, the labels are ids rather
        than class numbers (0 and 10**12 would make a model of 10**12 + 1 outputs) and they
        are refused: DataError naming the largest label and the first row that holds it
        (``where`` names the labels' file, ``locate(row)`` the row: ``row R`` by default).
        """
        keys = list(self.ids)
        if not keys:
            raise DataError("the input holds no rows")
        lut = np.empty(len(keys), dtype=np.int64)
        if all(re.fullmatch(r"\d+", k) for k in keys):
            numbers = [int(k) for k in keys]  # Python ints: a label may be beyond int64
            largest = max(numbers)
            empty = largest + 1 - len(numbers)
            if empty > self.rows:
                row = self.first_rows[numbers.index(largest)]
                at = locate(row) if locate is not None else f"row {row}"
                last = len(numbers) - 1
                raise DataError(
                    f"{where}, {at}: label {largest} would make {largest + 1} classes "
                    "(whole-number labels >= 0 are class numbers 0..K-1), "
                    f"{empty} of them without a row, more than the input's {self.rows} "
                    "rows: these labels look like ids, not class numbers. Remap them to "
                    f"0..{last} (their rank among the {len(numbers)} distinct labels), or "
                    f"make them class names by a non-numeric prefix ('id{largest}'), which "
                    f"convert numbers 0..{last} in sorted order and keeps in class_names")
            lut[:] = numbers
            return largest + 1, lut, None
        names = sorted(keys)
        rank = {k: r for r, k in enumerate(names)}
        for k, i in self.ids.items():
            lut[i] = rank[k]
        return len(names), lut, names


def _label_key(value: object) -> str:
    """A label as text: whole numbers without a fraction (3.0 -> "3"), text stripped."""
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, (bool, np.bool_)):
        return str(int(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    text = str(value).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return str(int(text))  # exactly, not through a float (12345678901234567)
    try:
        number = float(text)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() and re.fullmatch(r"[+-]?[\d.]+", text) \
        else text


# --------------------------------------------------------------------------------------------
# sources: each gives its width and blocks of (features, raw labels)


@dataclass
class Source:
    """An input opened for reading: what it is and a generator of row blocks.

    ``blocks()`` yields (x float (n, D), raw labels (n,) or None) in input order.
    """

    kind: str
    path: Path
    n_features: int
    blocks: Callable[[], Iterator[tuple[np.ndarray, np.ndarray | None]]]
    x_description: str
    image_shape: tuple[int, int, int] | None = None
    n_rows: int | None = None
    # the share of the input read so far, where its rows are not counted ahead (a CSV)
    read_fraction: Callable[[], float] | None = None
    # where the labels are, for messages about them (the labels .npy, an .npz's array), when
    # not ``path``
    labels_where: str | None = None
    # input row (from 0) -> where it is, for messages (a CSV's ``line L``); else ``row R``
    locate: Callable[[int], str] | None = None


def _finite(x: np.ndarray, where: str, first_row: int, columns: list[str] | None) -> np.ndarray:
    """``x`` as float32, refusing NaN, infinity and values beyond float32 with the first one's
    row and column."""
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = np.asarray(x, dtype=np.float32)
        ok = np.isfinite(x32)
    if not ok.all():
        r, c = (int(i) for i in np.argwhere(~ok)[0])
        col = columns[c] if columns else str(c)
        raise DataError(f"{where}: row {first_row + r}, column {col!r} holds {x[r, c]}: "
                        "features must be finite float32 numbers")
    return x32


def open_csv(path: Path, label: str | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
             labelled: bool = True) -> Source:
    """A CSV file with a header row; ``labelled=False``: every column is a feature."""
    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if not header:
        raise DataError(f"{path} is empty: a CSV needs a header row naming its columns")
    header = [h.strip() for h in header]
    if all(_is_number(h) for h in header):
        shown = ",".join(header[:4]) + (",..." if len(header) > 4 else "")
        raise DataError(f"{path}: the first line is all numbers ({shown}), a row of data, not "
                        "the header row naming the columns that a CSV needs here: add one "
                        f"({'f0,f1,...,label' if labelled else 'f0,f1,...'}), or rename "
                        "columns named by numbers")
    label_col = None
    if labelled:
        if label is None:
            label_col = len(header) - 1
        elif label in header:
            label_col = header.index(label)
        else:
            shown = ", ".join(header[:12]) + (", ..." if len(header) > 12 else "")
            raise DataError(f"{path}: no column named {label!r} for the labels (--label); "
                            f"the header has: {shown}")
    features = [i for i in range(len(header)) if i != label_col]
    if not features:
        sep = next((s for s in (";", "\t", "|") if s in header[0]), None)
        hint = (f" (its header is the one column {header[0]!r}: separated by {sep!r}? "
                "hpcps reads comma-separated files)") if len(header) == 1 and sep else ""
        what = (f"besides the label column {header[label_col]!r}" if label_col is not None
                else "at all")
        raise DataError(f"{path}: no feature column {what}{hint}")
    names = [header[i] for i in features]

    size = max(1, path.stat().st_size)
    raw: list = []  # the open binary file under the reader: its position is what was read

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        with open(path, "rb") as fb, io.TextIOWrapper(fb, newline="") as f:
            raw[:] = [fb]
            reader = csv.reader(f)
            next(reader)
            rows: list[list[str]] = []
            lines: list[int] = []
            for row in reader:
                if not row:
                    continue  # a blank line
                if len(row) != len(header):
                    raise DataError(f"{path}, line {reader.line_num}: {len(row)} fields, but "
                                    f"the header has {len(header)}")
                rows.append(row)
                lines.append(reader.line_num)
                if len(rows) == chunk_rows:
                    yield _csv_block(path, rows, lines, features, label_col, names)
                    rows, lines = [], []
            if rows:
                yield _csv_block(path, rows, lines, features, label_col, names)

    what = f"the {len(names)} feature columns of {path.name}: {', '.join(names[:8])}" + \
        (", ..." if len(names) > 8 else "")
    def read_fraction() -> float:
        return min(1.0, raw[0].tell() / size) if raw and not raw[0].closed else 1.0

    def locate(row: int) -> str:
        """``line L`` of input row ``row`` (blank lines are no rows): read again, for an error
        message only."""
        with open(path, newline="") as f:
            reader = csv.reader(f)
            next(reader, None)
            i = 0
            for cells in reader:
                if cells:
                    if i == row:
                        return f"line {reader.line_num}"
                    i += 1
        return f"row {row}"

    return Source("CSV", path, len(features), blocks, what, read_fraction=read_fraction,
                  locate=locate)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_block(path: Path, rows: list[list[str]], lines: list[int], features: list[int],
               label_col: int | None, names: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    table = np.array(rows, dtype=object)
    cells = table[:, features]
    try:
        x = cells.astype(np.float64)
    except ValueError:
        for r, row in enumerate(cells):
            for c, cell in enumerate(row):
                try:
                    float(cell)
                except ValueError:
                    raise DataError(f"{path}, line {lines[r]}, column {names[c]!r}: {cell!r} "
                                    "is not a number; every column but the label must be "
                                    "numeric") from None
        raise DataError(f"{path}, lines {lines[0]}..{lines[-1]}: a feature cell is not a "
                        "number") from None
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~np.isfinite(x.astype(np.float32))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{path}, line {lines[r]}, column {names[c]!r}: {cells[r, c]!r} is not "
                        "a finite float32 number")
    labels = None if label_col is None else table[:, label_col].astype(str)
    return x.astype(np.float32), labels


def _image_shape_of(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    if len(shape) == 3:
        return (1, int(shape[1]), int(shape[2]))
    if len(shape) == 4:
        return (int(shape[1]), int(shape[2]), int(shape[3]))
    return None


def _array_source(kind: str, path: Path, x, y, chunk_rows: int, where_y: str) -> Source:
    if x.dtype.kind not in "biuf" or x.ndim < 2 or x.ndim > 4:
        raise DataError(f"{path}: x has dtype {x.dtype} and shape {x.shape}; expected numbers "
                        "shaped (N, D), (N, H, W) or (N, C, H, W)")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{where_y}: the labels have shape {y.shape}; expected ({len(x)},), "
                        "one per row of x")
    if y.dtype.kind not in "biufUS":
        raise DataError(f"{where_y}: labels of dtype {y.dtype}; expected integers or names")
    d = int(np.prod(x.shape[1:]))
    if d == 0 or len(x) == 0:
        raise DataError(f"{path}: x has shape {x.shape}: no rows or no features")

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        for lo in range(0, len(x), chunk_rows):
            block = np.asarray(x[lo:lo + chunk_rows]).reshape(-1, d)
            yield _finite(block, str(path), lo, None), np.asarray(y[lo:lo + chunk_rows])

    shape = _image_shape_of(x.shape)
    what = (f"{'x'.join(map(str, shape))} images flattened C, H, W" if shape
            else f"{d} features") + f" from {path.name}"
    return Source(kind, path, d, blocks, what, shape, len(x), labels_where=where_y)


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path} not found") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path} as a NumPy .npy array: {exc}") from exc


def labels_beside(path: Path) -> Path:
    """The labels file of ``x.npy``-style features: the last ``x`` of the stem made ``y``."""
    stem = path.stem
    i = stem.lower().rfind("x")
    if i < 0:
        raise DataError(f"{path}: cannot guess the labels file (no 'x' in the name to make "
                        "'y'); name it with --label Y.npy")
    return path.with_name(stem[:i] + ("Y" if stem[i] == "X" else "y") + stem[i + 1:] + ".npy")


def open_npy(path: Path, label: str | None, chunk_rows: int) -> Source:
    y_path = Path(label) if label else labels_beside(path)
    return _array_source(".npy", path, _load_npy(path), _load_npy(y_path), chunk_rows,
                         str(y_path))


def open_npz(path: Path, label: str | None, chunk_rows: int) -> Source:
    try:
        archive = np.load(path, allow_pickle=False)
        keys = list(archive.keys())
        y_key = label or "y"
        if "x" not in keys or y_key not in keys:
            raise DataError(f"{path} holds arrays {', '.join(keys) or 'none'}; it needs 'x' "
                            f"(features) and {y_key!r} (labels; --label names another array)")
        x, y = archive["x"], archive[y_key]
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path} as a NumPy .npz archive: {exc}") from exc
    return _array_source(".npz", path, x, y, chunk_rows, f"{path}[{y_key!r}]")


def _pillow():
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError("converting a folder of images needs Pillow, the optional extra "
                        "'images': pip install 'hpcps[images]' (or pip install pillow)") \
            from exc
    return Image


_MODES = {"L": ("L", 1), "1": ("L", 1), "RGB": ("RGB", 3), "P": ("RGB", 3)}


def open_images(folder: Path, chunk_rows: int, seed: int) -> tuple[Source, list[str]]:
    """A folder of class subfolders; returns the source and the class names (sorted)."""
    Image = _pillow()
    classes = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} holds no class subfolders: put each class's images in a "
                        "subfolder named after it (e.g. cats/, dogs/)")
    files: list[tuple[Path, int]] = []
    first = None
    for c, sub in enumerate(classes):
        images = sorted(p for p in sub.iterdir() if p.is_file() and not p.name.startswith("."))
        if not images:
            raise DataError(f"class folder {sub} holds no images")
        for p in images:
            try:
                with Image.open(p) as im:
                    mode, size = im.mode, im.size
            except (OSError, ValueError) as exc:
                raise DataError(f"{p}: not an image Pillow can read ({exc})") from None
            if mode not in _MODES:
                raise DataError(f"{p}: image mode {mode}; grayscale (L) or RGB images are "
                                "taken: convert it (e.g. im.convert('RGB'))")
            if first is None:
                first = (p, _MODES[mode][0], size)
            elif (_MODES[mode][0], size) != first[1:]:
                raise DataError(
                    f"{p}: {_MODES[mode][0]} {size[0]}x{size[1]} (width x height), but {first[0]} "
                    f"is {first[1]} {first[2][0]}x{first[2][1]}: every image must have the "
                    "same size and be all grayscale or all RGB; resize or convert them first")
            files.append((p, c))
    assert first is not None  # every class folder holds an image
    mode, (w, h) = first[1], first[2]
    channels = _MODES[mode][1]
    order = np.random.default_rng(seed).permutation(len(files))

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        for lo in range(0, len(order), chunk_rows):
            part = [files[i] for i in order[lo:lo + chunk_rows]]
            x = np.empty((len(part), channels * h * w), dtype=np.float32)
            for r, (p, _) in enumerate(part):
                try:
                    with Image.open(p) as im:
                        a = np.asarray(im.convert(mode), dtype=np.float32)
                except (OSError, ValueError) as exc:
                    raise DataError(f"{p}: cannot decode the image ({exc})") from None
                if a.ndim == 2:
                    a = a[:, :, None]
                x[r] = a.transpose(2, 0, 1).reshape(-1) / 255.0
            yield x, np.array([c for _, c in part], dtype=np.int64)

    what = f"{channels}x{h}x{w} {mode} images flattened C, H, W, pixels / 255"
    src = Source("images", folder, channels * h * w, blocks, what, (channels, h, w), len(files))
    return src, [c.name for c in classes]


def open_parquet(path: Path, label: str | None, chunk_rows: int) -> Source:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DataError("reading Parquet needs pyarrow, the optional extra 'parquet': "
                        "pip install 'hpcps[parquet]' (or pip install pyarrow)") from exc
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read {path} as Parquet: {exc}") from exc
    schema = pf.schema_arrow
    names = list(schema.names)
    if not names:
        raise DataError(f"{path} has no columns")
    label = names[-1] if label is None else label
    if label not in names:
        raise DataError(f"{path}: no column named {label!r} for the labels (--label); it has: "
                        + ", ".join(names[:12]) + (", ..." if len(names) > 12 else ""))
    features = [n for n in names if n != label]
    if not features:
        raise DataError(f"{path}: no feature column besides the label column {label!r}")
    for n in features:
        t = schema.field(n).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise DataError(f"{path}: column {n!r} has type {t}; every column but the label "
                            "must be numeric")

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        first = 0
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=features + [label]):
            cols = []
            for n in features + [label]:
                col = batch.column(n)
                if col.null_count:
                    r = int(np.flatnonzero(np.asarray(col.is_null()))[0])
                    raise DataError(f"{path}: row {first + r}, column {n!r} is null")
                cols.append(col.to_numpy(zero_copy_only=False))
            x = np.column_stack([np.asarray(c, dtype=np.float64) for c in cols[:-1]])
            yield _finite(x, str(path), first, features), np.asarray(cols[-1])
            first += batch.num_rows

    what = f"the {len(features)} feature columns of {path.name}: {', '.join(features[:8])}" + \
        (", ..." if len(features) > 8 else "")
    return Source("Parquet", path, len(features), blocks, what, None, pf.metadata.num_rows)


def open_source(path: str | os.PathLike, label: str | None = None,
                chunk_rows: int = DEFAULT_CHUNK_ROWS, seed: int = 0
                ) -> tuple[Source, list[str] | None]:
    """The reader of ``path`` by its kind; (source, class names of an image folder or None)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} not found")
    if path.is_dir():
        if label is not None:
            raise ConfigError("--label does not apply to a folder of images (the subfolders "
                              "are the classes)")
        return open_images(path, chunk_rows, seed)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return open_csv(path, label, chunk_rows), None
    if suffix == ".npy":
        return open_npy(path, label, chunk_rows), None
    if suffix == ".npz":
        return open_npz(path, label, chunk_rows), None
    if suffix in PARQUET_SUFFIXES:
        return open_parquet(path, label, chunk_rows), None
    raise DataError(f"{path}: unknown kind of input {suffix or '(no suffix)'}; convert takes "
                    ".csv, .npy, .npz, .parquet or a folder of images in class subfolders")


# --------------------------------------------------------------------------------------------
# converting


def parse_image_shape(text: str | None) -> tuple[int, int, int] | None:
    """``--image-shape C,H,W`` as three positive integers; ConfigError otherwise."""
    if text is None:
        return None
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"--image-shape must be three positive integers C,H,W (e.g. 1,28,28), "
                          f"got {text!r}")
    return shape  # type: ignore[return-value]


def check_fractions(test_fraction: float, val_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    if not 0.0 <= val_fraction < 1.0 or test_fraction + val_fraction >= 1.0:
        raise ConfigError(f"--validation-fraction must be in [0, 1) and leave rows for training "
                          f"(test {test_fraction} + validation {val_fraction} < 1)")


def convert(input_path: str | os.PathLike, out_path: str | os.PathLike, *,
            label: str | None = None, test_fraction: float = DEFAULT_TEST_FRACTION,
            val_fraction: float = 0.0, image_shape: tuple[int, int, int] | None = None,
            seed: int = 0, chunk_rows: int = DEFAULT_CHUNK_ROWS, name: str | None = None,
            log: Log = print) -> Path:
    """Convert ``input_path`` (see the module docstring) into a dense dataset file.

    Parameters
    ----------
    input_path, out_path : the input and the HDF5 file to write (atomically).
    label : the label column (CSV, Parquet; default the last), labels file (.npy) or array
        (.npz).
    test_fraction, val_fraction : the expected share of rows in test and in /val (none when 0).
    image_shape : (C, H, W) of each row; taken from the input when it has one (images, 3-D
        or 4-D arrays), and then must agree with it.
    seed : of the split (and of an image folder's order).
    chunk_rows : rows read and written at a time.

    Raises
    ------
    DataError
        The input cannot be read or holds something that is not data (with the file, line or
        row and column); a split would be empty.
    ConfigError
        Bad fractions, image shape or chunk size.
    """
    check_fractions(test_fraction, val_fraction)
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    source, class_names = open_source(input_path, label, chunk_rows, seed)
    if image_shape is not None:
        if source.image_shape is not None and tuple(image_shape) != source.image_shape:
            raise DataError(f"--image-shape {','.join(map(str, image_shape))} does not match the "
                            f"input's images, {','.join(map(str, source.image_shape))}")
        if int(np.prod(image_shape)) != source.n_features:
            raise DataError(f"--image-shape {','.join(map(str, image_shape))} holds "
                            f"{int(np.prod(image_shape))} values but each row of "
                            f"{source.path} has {source.n_features} features")
        source.image_shape = tuple(image_shape)  # type: ignore[assignment]
    splits = SPLITS + ((VAL,) if val_fraction > 0 else ())
    how = {"seed": seed, "test_fraction": test_fraction, "validation_fraction": val_fraction,
           "rule": "row i goes to test when u(seed, i) < test_fraction, to val when below "
                   "test_fraction + validation_fraction, else to train (hpcps.io.data.convert)"}
    labels = Labels()
    stem = Path(input_path).stem
    writer = DenseWriter(
        out_path, n_features=source.n_features, splits=splits, name=name or stem,
        description=f"{stem}, converted from {source.kind} by python -m hpcps.data convert",
        source=f"{source.kind} {Path(input_path).resolve()}",
        x_description=source.x_description, image_shape=source.image_shape,
        attrs={"split": json.dumps(how)})
    runs = RunCounter()
    largest = 0.0  # the largest |feature|: a hint when the input was not scaled
    shown = time.monotonic()
    with writer:
        first = 0
        for x, raw in source.blocks():
            n = len(x)
            if n:
                largest = max(largest, float(np.abs(x).max()))
            if raw is None:
                raise DataError(f"{source.path}: no labels")
            y = labels.number(raw, f"{source.path}, rows {first}..{first + n - 1}", first)
            codes = split_of_rows(first, n, seed, test_fraction, val_fraction)
            for code, split in enumerate(splits):
                keep = codes == code
                writer.append(split, x[keep], y[keep])
                if code == 0:
                    runs.add(y[keep])
            first += n
            if time.monotonic() - shown >= PROGRESS_S:
                log(progress_line(source, first))
                shown = time.monotonic()
        if len(labels.ids) == 1:
            raise DataError(f"{input_path}: every row has the label {labels.first()!r}: a "
                            "classifier needs rows of at least 2 classes")
        n_classes, lut, names = labels.finish(source.labels_where or str(source.path),
                                              source.locate)
        if class_names is not None:
            names = class_names  # every folder is a class, sorted: the lookup keeps that order
        grouped = runs.grouped()
        rows = dict(writer.rows)
        out = writer.finish(n_classes, lut, names)
    log(f"wrote {out}: " + " / ".join(f"{rows[s]} {s}" for s in splits) +
        f" rows, {source.n_features} features, {n_classes} classes")
    unused, n_unused = _missing(lut, n_classes) if names is None else ([], 0)
    if n_unused:
        log(f"warning: the labels of {input_path} are class numbers 0..{n_classes - 1}, but "
            f"no row has {_some(unused, n_unused)}: the model keeps an output for every "
            "number, and those outputs are never the right answer" +
            (" (labels counted from 1? subtract 1 from them before converting)"
             if unused == [0] and n_unused == 1 else ""))
    if grouped:
        log(f"warning: the rows of {input_path} come grouped by class: each rank reads a "
            "contiguous block of rows, so most ranks would see few classes; shuffle the input's "
            "rows before converting")
    if largest > UNSCALED:
        log(f"warning: features of {input_path} reach {largest:g} in magnitude; the networks "
            "train poorly (or diverge) on inputs far from [-1, 1]: scale them before "
            "converting (8-bit pixels: x / 255; other columns: standardize each)")
    return out


PROGRESS_S = 5.0  # seconds between two lines of progress of a long conversion


def progress_line(source: Source, rows: int) -> str:
    """``converting big.csv: 1,310,720 rows read (about 41% of the file)``, or ``of N rows``
    where the input counts them ahead."""
    if source.n_rows:
        done = f" of {source.n_rows:,} ({100 * rows / source.n_rows:.0f}%)"
    elif source.read_fraction is not None:
        done = f" (about {100 * source.read_fraction():.0f}% of the file)"
    else:
        done = ""
    return f"converting {source.path.name}: {rows:,} rows read{done}"


def _missing(present: np.ndarray, n_classes: int, shown: int = 5) -> tuple[list[int], int]:
    """The first ``shown`` of the numbers 0..n_classes-1 not in ``present``, and how many
    there are: from the sorted distinct labels, never a set of n_classes numbers."""
    have = np.unique(np.asarray(present, dtype=np.int64))
    first: list[int] = []
    expect = 0  # the smallest number not yet accounted for
    for v in have.tolist() + [n_classes]:
        first.extend(range(expect, min(v, expect + shown - len(first))))
        expect = v + 1
        if len(first) >= shown:
            break
    return first, n_classes - len(have)


def _some(classes: list[int], total: int | None = None) -> str:
    """``class 0``, ``classes 3, 5``, or the first few of many and how many more (of
    ``total``, the count of which ``classes`` are the first)."""
    total = len(classes) if total is None else total
    if total == 1:
        return f"class {classes[0]}"
    shown = ", ".join(map(str, classes[:5]))
    return f"classes {shown}" + (f" and {total - 5} more" if total > 5 else "")


UNSCALED = 100.0  # convert warns when a feature's magnitude passes this


class RunCounter:
    """Counts the runs of equal labels in a stream of blocks: as many runs as classes (and
    more than one) means the rows come grouped by class. Nothing but counts is kept."""

    def __init__(self) -> None:
        self.runs = 0
        self.last: int | None = None
        self.seen: set[int] = set()

    def add(self, y: np.ndarray) -> None:
        if len(y) == 0:
            return
        self.runs += 1 + int(np.count_nonzero(y[1:] != y[:-1]))
        if self.last is not None and int(y[0]) == self.last:
            self.runs -= 1
        self.last = int(y[-1])
        self.seen.update(np.unique(y).tolist())

    def grouped(self) -> bool:
        return 1 < self.runs <= len(self.seen)


def read_unlabelled_csv(path: str | os.PathLike,
                        chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[np.ndarray]:
    """Blocks of the rows of a CSV whose every column is a feature (header row first), for
    scoring new examples (``python -m hpcps.evaluate --input``)."""
    source = open_csv(Path(path), chunk_rows=chunk_rows, labelled=False)
    for x, _ in source.blocks():
        yield x
