"""Admission of new embedding rows (``--admit-after c``): a row is created only once its id
has been seen in c training pulls.

Click-through ids follow a long tail: most ids are seen once or twice in a whole run, and a
row created for each of them costs its memory and optimizer state for nothing it can learn.
Admission holds the tail back, and so must count sightings of ids that have no row yet,
which is most ids: an exact map of counts would grow with every distinct id ever seen, the
very memory admission is there to save. Counts are kept instead in a **count-min sketch**
(Cormode and Muthukrishnan 2005) of fixed size, shared by all tables of one server shard
(its key is the pair (table, id)): ``depth`` rows of ``width`` saturating uint16 counters,
by default 4 x 2**20, 8 MiB per shard whatever the number of ids.

A sighting adds one to the key's counter in every row with the *conservative update*
(Estan and Varghese 2002): only the counters at the key's current minimum rise, to the
minimum plus one. The estimate, the minimum over the rows, never falls below the true count,
so an id is never admitted late; colliding ids can make it early (with 4 x 2**20 counters and
a few million distinct ids, rarely: each row's counter of a key is shared with
n / 2**20 other keys on average, and all four must be inflated at once). Counters saturate
at :data:`COUNTER_MAX`, hence the largest ``c``.

The sketch is not written to checkpoints: after ``--resume`` the rows held are held, and
ids without a row count their sightings from zero again. Pure NumPy; one thread at a time.
"""
from __future__ import annotations

import numpy as np

DEPTH = 4  # rows of the sketch: independent hashes of (table, id)
WIDTH = 1 << 20  # counters per row (a power of two)
COUNTER_MAX = int(np.iinfo(np.uint16).max)  # counters saturate here: the largest --admit-after

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# one salt per row, so that the rows hash independently of each other and of the shard
# placement (hpcps.kernels.embedding.place, the same finaliser unsalted)
_SALTS = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0xD1B54A32D192ED03,
          0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array (a bijection of 64-bit words)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


class CountMinSketch:
    """Approximate counts of (table, id) keys in fixed memory; estimates never below the
    true count.

    Parameters
    ----------
    depth : int, optional
        Rows (independent hashes), 1 to 8; default :data:`DEPTH`.
    width : int, optional
        Counters per row, a power of two; default :data:`WIDTH`.

    Attributes
    ----------
    counts : numpy.ndarray
        (depth, width) uint16, saturating at :data:`COUNTER_MAX`.
    """

    def __init__(self, depth: int = DEPTH, width: int = WIDTH):
        depth, width = int(depth), int(width)
        if not 1 <= depth <= len(_SALTS):
            raise ValueError(f"depth must lie in [1, {len(_SALTS)}], got {depth}")
        if width < 2 or width & (width - 1):
            raise ValueError(f"width must be a power of two >= 2, got {width}")
        self.depth, self.width = depth, width
        self._shift = np.uint64(64 - (width.bit_length() - 1))
        # zeros: the pages are mapped as sightings first touch them
        self.counts = np.zeros((depth, width), dtype=np.uint16)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def _cells(self, table: int, ids: np.ndarray) -> np.ndarray:
        """(depth, k) flat indices into ``counts`` of each key's counter in each row."""
        with np.errstate(over="ignore"):
            key = _mix(np.asarray(ids, dtype=np.int64).astype(np.uint64)
                       + np.uint64(int(table) + 1) * _GOLDEN)
            cells = np.empty((self.depth, len(key)), dtype=np.int64)
            for r in range(self.depth):
                col = _mix(key ^ np.uint64(_SALTS[r])) >> self._shift  # the top bits
                cells[r] = col.astype(np.int64) + r * self.width
        return cells

    def estimate(self, table: int, ids: np.ndarray) -> np.ndarray:
        """(k,) int64: the count of each (table, id), never below the true one."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        return self.counts.reshape(-1)[self._cells(table, ids)].min(axis=0).astype(np.int64)

    def add(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Count one sighting of each (table, id) (``ids`` distinct: a repeated id counts
        once) and return the estimates after it, (k,) int64."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        flat = self.counts.reshape(-1)
        cells = self._cells(table, ids)
        new = np.minimum(flat[cells].min(axis=0).astype(np.int64) + 1, COUNTER_MAX)
        # conservative update: raise each counter to the key's new estimate, never lower it
        # (maximum.at: two keys that share a counter in this call both get their due)
        np.maximum.at(flat, cells.reshape(-1),
                      np.broadcast_to(new.astype(np.uint16), cells.shape).reshape(-1))
        return new


class Admission:
    """Admit an id's row once its (table, id) has been seen in ``after`` training pulls.

    Parameters
    ----------
    after : int
        c of ``--admit-after``, 1 to :data:`COUNTER_MAX` (1: every id at first sight; no
        sketch is needed then, and callers pass no Admission at all).
    sketch : CountMinSketch, optional
        Where sightings are counted; one per server shard, shared by its tables. Default: a
        new one of the default size.
    """

    def __init__(self, after: int, sketch: CountMinSketch | None = None):
        after = int(after)
        if not 1 <= after <= COUNTER_MAX:
            raise ValueError(f"after must lie in [1, {COUNTER_MAX}], got {after}")
        self.after = after
        self.sketch = CountMinSketch() if sketch is None else sketch

    def admit(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Count a sighting of each id (distinct, of ``table``, none held yet) and return
        which are admitted now: (k,) bool."""
        return self.sketch.add(table, ids) >= self.after
