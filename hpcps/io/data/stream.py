"""Data larger than memory: a rank's rows read from the dataset file in chunks while it trains.

:class:`RowSource` names the rows of one split a rank uses (its block, less rows held out for
validation, or an explicit list of rows) without reading them, and how a row is stored: dense
features ``x`` and a label ``y`` (:class:`DenseRows`), or a categorical file's ids, label and
dense features (:class:`~hpcps.io.data.categorical.CategoricalRows`). :class:`StreamBatches` is the
streaming twin of :class:`~hpcps.io.data.batches.Batches`: the same interface (an endless
iterator of ``(x, y)`` batches of exactly ``batch_size`` rows, ``epoch``, ``epochs_done``,
``close``; a categorical source's batches are ``((ids, dense), y)``, as
:class:`~hpcps.io.data.categorical.Features` gives them), with at most a few chunks of the
block in memory. :func:`chunks` reads a source in
order, for evaluations that stream. :func:`plan_stream` sizes chunks and the shuffle window to
a memory budget, and :func:`decide` says which splits stream. No MPI: the caller gathers what
the ranks need to agree on.

How an epoch is shuffled
------------------------
The source is cut into chunks of ``chunk_rows`` consecutive rows. Each epoch draws a
permutation of the chunks; they are taken ``window`` at a time, in that order, and the rows of
each group of ``window`` chunks are served in a fresh permutation. So every row is served
exactly once per epoch, a batch mixes rows of up to ``window`` chunks from anywhere in the
block, and the order is a function of the seed alone (the reading thread's timing does not
enter it). When an epoch runs out mid-batch, the batch is completed from the next epoch, as
:class:`Batches` does.

Reading ahead
-------------
A background thread reads the chunks in the order the epochs will use them, a window at a
time, into one of two window buffers allocated once: while the trainer draws batches from one
window, the next is read into the other (:func:`stream_bytes`). Contiguous datasets stored in
the dtype they are used in (float32 features, int64 ids and labels: what
:func:`~hpcps.io.data.h5format.write_dataset` and the converters write) are read with
``pread``, which releases the GIL; other layouts (chunked, float64, int32 ids) through h5py,
which holds its lock (and the GIL) during a read.
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hpcps.errors import DataError
from hpcps.io.data.h5format import _open_h5, check_finite_rows

MIB = 1 << 20
WINDOW = 8  # chunks shuffled together
CHUNK_BYTES = 4 * MIB  # the largest chunk: larger ones buy nothing once reads are this long
MIN_CHUNK_ROWS = 256  # the smallest: below it, per-read overheads dominate
EVAL_ROWS = 8192  # at most this many rows of an evaluation split in memory when it streams


@dataclass(frozen=True)
class Column:
    """One dataset of a split, read row by row: ``name`` under ``/<split>``, the ``dtype`` it is
    used in, and its ``width`` (values a row; 0: one value, a vector)."""

    name: str
    dtype: str
    width: int = 0

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.width) if self.width else (rows,)

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * max(1, self.width)


@dataclass(frozen=True)
class DenseRows:
    """A dense split's rows: features ``x`` (float32, ``n_features`` a row) and label ``y``
    (int64). A layout names the columns a row is read from, checks what was read, and makes
    a batch of the columns; :class:`~hpcps.io.data.categorical.CategoricalRows` is the
    categorical one."""

    n_features: int

    @property
    def columns(self) -> tuple[Column, ...]:
        return (Column("x", "<f4", self.n_features), Column("y", "<i8"))

    def check(self, raw: list, cast: list, path, split: str, lo: int) -> None:
        """Refuse NaN and infinity in rows ``lo ..`` (``raw``: as stored; ``cast``: as used)."""
        check_finite_rows(cast[0], path, split, lo, raw[0].dtype)

    def batch(self, arrays: list) -> tuple:
        """``(x, y)``."""
        return arrays[0], arrays[1]


@dataclass(frozen=True)
class RowSource:
    """Rows of ``split`` in the dataset file ``path``: rows ``lo .. hi-1`` less ``held``
    (sorted rows of the split, e.g. those held out for validation), or, when ``rows`` is
    given, exactly those (sorted, unique). ``n_features``: a row's size in float32 numbers
    (for the memory plan); ``layout``: how a row is stored (None: :class:`DenseRows` of
    ``n_features``). Nothing is read until a chunk is asked for."""

    path: str
    split: str
    n_features: int
    lo: int = 0
    hi: int = 0
    held: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    rows: np.ndarray | None = None
    layout: object = None

    @property
    def row_layout(self):
        """The layout rows are read by (DenseRows unless another was given)."""
        return self.layout if self.layout is not None else DenseRows(self.n_features)

    def __post_init__(self):
        held = np.asarray(self.held, dtype=np.int64)
        object.__setattr__(self, "held", held[(held >= self.lo) & (held < self.hi)])
        if self.rows is not None:
            object.__setattr__(self, "rows", np.asarray(self.rows, dtype=np.int64))

    def __len__(self) -> int:
        if self.rows is not None:
            return len(self.rows)
        return self.hi - self.lo - len(self.held)

    @property
    def row_bytes(self) -> int:
        return sum(c.row_bytes for c in self.row_layout.columns)

    @property
    def span(self) -> int:
        """Positions chunks are cut from: rows of the range, or entries of ``rows``."""
        return len(self.rows) if self.rows is not None else self.hi - self.lo

    def chunk(self, c: int, chunk_rows: int) -> np.ndarray:
        """The file rows of chunk ``c`` (sorted)."""
        a, b = c * chunk_rows, min((c + 1) * chunk_rows, self.span)
        if self.rows is not None:
            return self.rows[a:b]
        r = np.arange(self.lo + a, self.lo + b, dtype=np.int64)
        if len(self.held):
            r = r[~np.isin(r, self.held, assume_unique=True)]
        return r

    def n_chunks(self, chunk_rows: int) -> int:
        return max(1, -(-self.span // chunk_rows))


def row_bytes(n_features: int) -> int:
    """Bytes one example takes in memory: float32 features and an int64 label (a categorical
    row's size is given in float32 numbers: an int64 id counts two)."""
    return 4 * n_features + 8


def stream_bytes(chunk_rows: int, window: int, n_features: int) -> int:
    """What a :class:`StreamBatches` holds: the window being served and the window being
    read ahead (two buffers of ``window`` chunks)."""
    return 2 * window * chunk_rows * row_bytes(n_features)


def plan_stream(n_features: int, rows: int, budget: int,
                window: int = WINDOW) -> tuple[int, int]:
    """``(chunk_rows, window)`` for streaming ``rows`` rows of width ``n_features`` within
    ``budget`` bytes: chunks as large as the budget allows (:func:`stream_bytes`), at most
    :data:`CHUNK_BYTES` and at least :data:`MIN_CHUNK_ROWS` rows (so a very small budget is
    exceeded rather than read a few rows at a time), and no more than the rows there are."""
    rb = row_bytes(n_features)
    fit = budget // (2 * window * rb)
    chunk = max(MIN_CHUNK_ROWS, min(fit, max(1, CHUNK_BYTES // rb)))
    chunk = max(1, min(chunk, rows))
    window = max(1, min(window, -(-rows // chunk)))
    return int(chunk), int(window)


class Decision(NamedTuple):
    """Which of a rank's splits stream: ``train`` (its training block) and ``evaluation``
    (the test and validation splits, which only the chief holds)."""

    train: bool
    evaluation: bool


def decide(train_bytes: int, eval_bytes: int, budget: int, stream_cost: int,
           train_may_stream: bool = True) -> Decision:
    """Which of one rank's splits stream under ``budget`` bytes. All of them stay in memory
    when they fit together; otherwise the training block streams (costing ``stream_cost``),
    and the evaluation splits stream too when they do not fit beside it. A training block
    that may not stream stays (the caller refuses it if it does not fit alone), and the
    evaluation splits stream when they do not fit beside it."""
    if train_bytes + eval_bytes <= budget:
        return Decision(False, False)
    if not train_may_stream:
        return Decision(train_bytes > budget, eval_bytes > 0)
    train = train_bytes > 0
    left = budget - (min(stream_cost, train_bytes) if train else 0)
    return Decision(train, eval_bytes > 0 and eval_bytes > left)


# --------------------------------------------------------------------------------------------
# Reading


class _Reader:
    """Reads sets of rows of one split of one file (an h5py file kept open), every column of
    the source's layout: a contiguous dataset stored in the dtype it is used in by ``pread``
    (no lock held), others through h5py."""

    def __init__(self, source: RowSource, window_rows: int):
        self.source = source
        self.layout = source.row_layout
        self.columns = self.layout.columns
        self.window_rows = max(1, int(window_rows))
        self.path = source.path
        self.f = _open_h5(source.path)
        self._fd = -1
        try:
            self.ds = [self.f[f"{source.split}/{c.name}"] for c in self.columns]
            self.n = self.ds[0].shape[0]
            self._at: list[int | None] = []  # byte offset of a column read by pread
            for c, d in zip(self.columns, self.ds):
                at = d.id.get_offset()
                fits = d.dtype == np.dtype(c.dtype) and not d.compression and \
                    d.shape[1:] == c.shape(0)[1:]
                self._at.append(at if at is not None and fits else None)
            if any(at is not None for at in self._at):
                self._fd = os.open(source.path, os.O_RDONLY)
        except BaseException:
            self.f.close()
            raise

    def empty(self, rows: int) -> list[np.ndarray]:
        return [np.empty(c.shape(rows), c.dtype) for c in self.columns]

    def _check(self, raw: list, cast: list, lo: int) -> None:
        self.layout.check(raw, cast, self.path, self.source.split, lo)

    def _range(self, lo: int, hi: int, check: bool = True) -> list[np.ndarray]:
        raw, cast = [], []
        for c, d, at in zip(self.columns, self.ds, self._at):
            if at is not None:  # offsets of contiguous datasets: see __init__
                a = np.empty(c.shape(hi - lo), c.dtype)
                _pread_into(self._fd, a, at + lo * c.row_bytes)
                raw.append(a)
                cast.append(a)
            else:
                r = d[lo:hi]
                with np.errstate(over="ignore", invalid="ignore"):  # refused by the check
                    a = np.ascontiguousarray(r, dtype=c.dtype)
                raw.append(r)
                cast.append(a)
        if check:
            self._check(raw, cast, lo)
        return cast

    def read(self, rows: np.ndarray, check: bool = True) -> list[np.ndarray]:
        """Rows ``rows`` (sorted) of every column, read in ranges of at most ``window_rows``
        rows of the file that hold some of them; ``check``: refuse bad values in them (the
        layout's check)."""
        if not len(rows):
            return self.empty(0)
        if rows[0] < 0 or rows[-1] >= self.n:
            raise DataError(f"{self.path}: rows {rows[0]}..{rows[-1]} are outside "
                            f"/{self.source.split} ({self.n} rows)")
        if rows[-1] - rows[0] + 1 == len(rows) and len(rows) <= 2 * self.window_rows:
            return self._range(int(rows[0]), int(rows[-1]) + 1, check)  # consecutive: one read
        parts: list[list[np.ndarray]] = [[] for _ in self.columns]
        i = 0
        while i < len(rows):
            lo = int(rows[i])
            hi = min(lo + self.window_rows, self.n)
            j = int(np.searchsorted(rows, hi))
            got = self._range(lo, int(rows[j - 1]) + 1, check)
            for part, a in zip(parts, got):
                part.append(a[rows[i:j] - lo])
            i = j
        return [np.concatenate(part) for part in parts]

    def read_into(self, rows: np.ndarray, outs: list[np.ndarray], check: bool = True) -> int:
        """Rows ``rows`` (sorted) into the first ``len(rows)`` rows of ``outs`` (one array a
        column); consecutive rows of columns read by ``pread`` straight from the file.
        ``check``: refuse bad values in them. Returns their count."""
        k = len(rows)
        if k and self._fd >= 0 and all(at is not None for at in self._at) \
                and rows[-1] - rows[0] + 1 == k and rows[-1] < self.n and rows[0] >= 0:
            lo = int(rows[0])
            for c, at, out in zip(self.columns, self._at, outs):
                _pread_into(self._fd, out[:k], at + lo * c.row_bytes)
            if check:
                got = [out[:k] for out in outs]
                self._check(got, got, lo)
        elif k:
            for out, a in zip(outs, self.read(rows, check)):
                out[:k] = a
        return k

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.f.close()


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out.data).cast("B")  # type: ignore[arg-type]
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise DataError(f"short read at byte {offset + done} of the dataset file "
                            "(truncated?)")
        done += got


def chunks(source: RowSource, chunk_rows: int = EVAL_ROWS):
    """The rows of ``source`` in order, as ``(x, y)`` pieces of at most ``chunk_rows`` rows
    (``x`` as the layout makes it: ``(ids, dense)`` for a categorical file): an evaluation
    over a split that does not fit in memory."""
    try:
        reader = _Reader(source, chunk_rows)
    except OSError as exc:
        raise DataError(f"cannot read dataset {source.path}: {exc}") from exc
    try:
        for c in range(source.n_chunks(chunk_rows)):
            rows = source.chunk(c, chunk_rows)
            if len(rows):
                yield source.row_layout.batch(reader.read(rows))
    finally:
        reader.close()


# --------------------------------------------------------------------------------------------
# Training batches


READER_NICE = 5  # how far below the training threads the reading thread runs


def _below_training() -> None:
    """Lower the calling thread's CPU priority by :data:`READER_NICE` (Linux: a thread's own
    nice value). Where the cores are all taken (a rank per core, or more), the training
    threads then get the CPU first and the reading runs in what they leave: with 2 ranks on
    2 cores a reader at the same priority took its turns from training. Its buffers are
    read a window ahead, so it is rarely waited for. Where the OS refuses, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + READER_NICE)
    except (AttributeError, OSError):
        pass


class StreamBatches:
    """Endless iterator of fixed-size mini-batches over a :class:`RowSource`, read from the
    file in chunks by a background thread: :class:`~hpcps.io.data.batches.Batches`'s
    interface and guarantees (every row once per epoch, exactly ``batch_size`` rows per
    batch, reproducible from ``seed``) with at most :func:`stream_bytes` of the block in
    memory. The shuffle is described in the module docstring.

    Two window buffers are allocated once: the thread reads the next window's chunks into
    one (straight from the file when it can) while batches are drawn from the other, so no
    memory is allocated per chunk (fresh pages cost a fault each, as much as the read).

    Attributes
    ----------
    epoch : int
        Completed passes over the source.
    epochs_done : float
        Rows served / rows of the source.
    read_s, wait_s : float
        Seconds the thread spent reading; seconds :meth:`__next__` waited for a window.
    """

    _END = -1

    def __init__(self, source: RowSource, batch_size: int, seed: int, chunk_rows: int,
                 window: int = WINDOW):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(source) < batch_size:
            raise DataError(f"shard has {len(source)} examples, fewer than batch_size "
                            f"{batch_size}; use a smaller batch or fewer shards")
        if chunk_rows < 1 or window < 1:
            raise DataError(f"chunk_rows and window must be >= 1, got {chunk_rows}, {window}")
        self.source = source
        self.n = len(source)
        self.batch_size = int(batch_size)
        self.chunk_rows = int(chunk_rows)
        self.window = int(window)
        self.n_chunks = source.n_chunks(self.chunk_rows)
        rows = min(self.window, self.n_chunks) * self.chunk_rows
        self._reader = _Reader(source, self.chunk_rows)
        self._layout = self._reader.layout
        try:
            self._bufs = [self._reader.empty(rows) for _ in range(2)]  # a list per column
        except BaseException:
            self._reader.close()
            raise
        self._served = 0
        self._rng = np.random.default_rng([int(seed), 2])  # rows within a window
        self._slot = -1  # the buffer batches are drawn from (-1: none yet)
        self._cols = [a[:0] for a in self._bufs[0]]
        self._idx = np.empty(0, np.int64)
        self._pos = 0
        self._stop = threading.Event()
        self._free = threading.Semaphore(2)  # buffers the thread may fill
        self._ready: queue.Queue = queue.Queue()  # (slot, rows) of each window read
        self.read_s = 0.0
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._read, args=(int(seed),),
                                        name="hpcps-stream", daemon=True)
        self._thread.start()

    # -- the reading thread --------------------------------------------------------------------
    def _read(self, seed: int) -> None:
        _below_training()
        order_rng = np.random.default_rng([seed, 1])  # chunk order, epoch after epoch
        slot = 0
        checked = np.zeros(self.n_chunks, dtype=bool)  # each chunk is checked once
        try:
            while not self._stop.is_set():
                order = order_rng.permutation(self.n_chunks)
                for w0 in range(0, self.n_chunks, self.window):
                    while not self._free.acquire(timeout=0.1):
                        if self._stop.is_set():
                            return
                    t = time.perf_counter()
                    filled = 0
                    for c in order[w0:w0 + self.window]:
                        filled += self._reader.read_into(
                            self.source.chunk(int(c), self.chunk_rows),
                            [a[filled:] for a in self._bufs[slot]], not checked[c])
                        checked[c] = True
                    self.read_s += time.perf_counter() - t
                    self._ready.put((slot, filled))
                    slot ^= 1
        except BaseException as exc:  # handed to the consumer, not lost in the thread
            self._ready.put((self._END, exc))

    # -- the trainer's side --------------------------------------------------------------------
    def _next_window(self) -> None:
        """Hand the buffer served so far back to the thread, take the next window read and
        draw the order its rows are served in."""
        if self._slot >= 0:
            self._free.release()
        t = time.perf_counter()
        slot, filled = self._ready.get()
        self.wait_s += time.perf_counter() - t
        if slot == self._END:
            self._slot = -1
            self._free.release()  # (a stopped thread waits for nothing)
            raise filled
        self._slot = slot
        self._cols = self._bufs[slot]
        self._idx = self._rng.permutation(filled)
        self._pos = 0

    @property
    def epoch(self) -> int:
        return self._served // self.n

    @property
    def epochs_done(self) -> float:
        return self._served / self.n

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> tuple:
        need = self.batch_size
        parts: list[list[np.ndarray]] = [[] for _ in self._bufs[0]]
        while need:
            if self._pos == len(self._idx):
                self._next_window()
                continue
            take = self._idx[self._pos:self._pos + need]
            self._pos += len(take)
            need -= len(take)
            for part, a in zip(parts, self._cols):
                part.append(a[take])  # copies: the buffer is refilled once handed back
        self._served += self.batch_size
        return self._layout.batch([p[0] if len(p) == 1 else np.concatenate(p) for p in parts])

    def close(self) -> None:
        """Stop the reading thread and close the file."""
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._reader.close()


def describe_stream(chunk_rows: int, window: int, n_features: int) -> str:
    """The chunk plan in words, for the start line."""
    mib = chunk_rows * row_bytes(n_features) / MIB
    return (f"chunks of {chunk_rows} rows ({mib:.2g} MiB), shuffled {window} chunks at a "
            f"time, at most {math.ceil(stream_bytes(chunk_rows, window, n_features) / MIB)} "
            "MiB in memory")
