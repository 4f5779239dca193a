"""Mini-batches over one shard: :class:`Batches` (reproducible epochs) and :class:`Prefetcher`
(the next batches prepared in a background thread, Project Adam's data serving inside a rank).

:class:`Batches` works on arrays already in memory (a shard from
:func:`hpcps.io.data.h5format.load_split`) and knows nothing of files or MPI; its streaming twin,
for blocks larger than memory, is :class:`hpcps.io.data.stream.StreamBatches`.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from hpcps.errors import DataError


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
            # make room, so that a thread waiting to put into a full queue puts at once and
            # sees the stop, instead of when its put times out (up to 0.1 s later)
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=5)
        inner = getattr(self.batches, "close", None)
        if inner is not None:  # a streaming iterator: its reading thread and file
            inner()
