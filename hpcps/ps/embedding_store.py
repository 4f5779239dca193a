"""The rows of one embedding table that one parameter-server shard holds.

Ids are unbounded 64-bit values (>= 0), and a shard holds whichever of them hash to it, so
rows cannot be addressed by id: an open-addressing hash map (linear probing, at most half
full) maps each id to a *slot*, and slot s is row s of dense arrays (rows, optimizer
state, ``ids[s]``). Slots are handed out in the order ids are first seen, so the arrays
fill from the front; the map and the arrays grow by doubling when a batch would not fit.
``numpy.empty`` of a large array maps pages lazily, so the untouched half of a doubled
array costs no resident memory: what is resident grows with the rows touched.

A row is created on first touch from an initialiser that depends only on (table, id, seed)
(``hpcps.kernels.embedding.init_rows``): a row starts the same whichever shard holds it and
however many shards there are, so a job resumed on another shard count, or a test against
a single-process reference, sees the same initial rows.

Threads: :meth:`EmbeddingStore.slots` (and :meth:`pull` / :meth:`push`, which call it)
changes the map and may reallocate, so one thread at a time; :meth:`apply` on slots already
looked up may run in several threads at once (Hogwild: the kernels release the GIL, rows
that two threads touch at once may lose an update).

:meth:`peek` reads rows without storing any (an evaluation's ids).

Not here yet, and where it goes: a capacity with eviction (``--table-capacity``) and
admission after c sightings (``--admit-after``). Both decide in :meth:`_reserve` and
:meth:`slots` whether a new id gets a slot; eviction also needs deletion in the map
(backward-shift deletion keeps linear probing free of tombstones) and a free list of slots,
so the arrays would no longer fill strictly from the front.
"""
import numpy as np

from hpcps.kernels import embedding

OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")


def _power_of_two_at_least(n):
    return 1 << max(1, (int(n) - 1).bit_length())


class EmbeddingStore:
    """One shard's rows of one table: id -> slot map, rows, optimizer state.

    Parameters
    ----------
    dim : int
        Row width d.
    table : int, optional
        The table's number (>= 0); part of every row's initialiser.
    seed : int, optional
        The run's seed (>= 0); part of every row's initialiser.
    optimizer : str, optional
        ``"rowwise_adagrad"`` (default: one accumulator per row), ``"adagrad"`` (one per
        element) or ``"sgd"`` (no state).
    init_scale : float, optional
        New rows are uniform in [-init_scale, init_scale); default ``1/sqrt(dim)``.
    initial_accumulator : float, optional
        Adagrad's accumulator of a new row (default 0).
    capacity : int, optional
        Rows to allocate at first (default 1024); grows by doubling.

    Attributes
    ----------
    n_rows : int
        Rows held.
    """

    def __init__(self, dim, *, table=0, seed=0, optimizer="rowwise_adagrad", init_scale=None,
                 initial_accumulator=0.0, capacity=1024):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        dim, capacity = int(dim), int(capacity)
        if dim < 1 or capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1, got {dim} and {capacity}")
        if table < 0 or seed < 0:
            raise ValueError(f"table and seed must be >= 0, got {table} and {seed}")
        self.dim, self.table, self.seed, self.optimizer = dim, int(table), int(seed), optimizer
        self.init_scale = float(1.0 / np.sqrt(dim) if init_scale is None else init_scale)
        self.initial_accumulator = float(initial_accumulator)
        self.n_rows = 0
        self._ids = np.empty(capacity, dtype=np.int64)
        self._rows = np.empty((capacity, dim), dtype=np.float32)
        self._accum = self._new_accum(capacity)
        size = _power_of_two_at_least(2 * capacity)
        self._keys = np.full(size, -1, dtype=np.int64)
        self._vals = np.empty(size, dtype=np.int64)

    def _new_accum(self, capacity):
        if self.optimizer == "rowwise_adagrad":
            return np.empty(capacity, dtype=np.float32)
        if self.optimizer == "adagrad":
            return np.empty((capacity, self.dim), dtype=np.float32)
        return None

    def __len__(self):
        return self.n_rows

    @property
    def capacity(self):
        """Rows the arrays hold before they grow."""
        return self._ids.shape[0]

    @property
    def ids(self):
        """(n_rows,) int64 view: the id of each slot."""
        return self._ids[:self.n_rows]

    @property
    def rows(self):
        """(n_rows, dim) float32 view: the rows, by slot."""
        return self._rows[:self.n_rows]

    @property
    def accum(self):
        """The Adagrad accumulators by slot (a view), or None for SGD."""
        return None if self._accum is None else self._accum[:self.n_rows]

    # ------------------------------------------------------------------ growth

    def _reserve(self, extra):
        """Room for ``extra`` more rows: the arrays and the map grow by doubling.

        The one place where memory grows, hence where a capacity limit and eviction would
        decide instead (see the module docstring).
        """
        need = self.n_rows + extra
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            n = self.n_rows
            ids, rows, accum = self._ids, self._rows, self._accum
            self._ids = np.empty(cap, dtype=np.int64)
            self._rows = np.empty((cap, self.dim), dtype=np.float32)
            self._accum = self._new_accum(cap)
            self._ids[:n], self._rows[:n] = ids[:n], rows[:n]
            if accum is not None:
                self._accum[:n] = accum[:n]
        if 2 * need > self._keys.shape[0]:
            size = self._keys.shape[0]
            while size < 2 * need:
                size *= 2
            self._keys = np.empty(size, dtype=np.int64)
            self._vals = np.empty(size, dtype=np.int64)
            embedding.hash_rebuild(self._keys, self._vals, self._ids, self.n_rows)

    def _create(self, start, stop):
        """Initial values of the new slots ``start:stop``."""
        embedding.init_rows(self._rows, self._ids, start, stop, self.table, self.seed,
                            self.init_scale)
        if self._accum is not None:
            self._accum[start:stop] = self.initial_accumulator

    # ------------------------------------------------------------------ access

    def slots(self, ids, create=True):
        """The slot of each id (1-D int64, ids >= 0); missing ids get new rows, or -1 when
        ``create`` is False. One thread at a time."""
        if create:
            self._reserve(ids.shape[0] if isinstance(ids, np.ndarray) and ids.ndim == 1 else 0)
        slots, n = embedding.hash_lookup(self._keys, self._vals, ids, self._ids, self.n_rows,
                                         create)
        if n > self.n_rows:
            self._create(self.n_rows, n)
            self.n_rows = n
        return slots

    def pull(self, ids, out=None):
        """(len(ids), dim) rows of ``ids``, created on first touch."""
        slots = self.slots(ids)
        return np.take(self._rows, slots, axis=0, out=out)

    def peek(self, ids, out=None):
        """(len(ids), dim) rows of ``ids`` without storing any: an id not held reads as the
        row it would be created with (its initialiser depends on (table, id, seed) only)."""
        slots = self.slots(ids, create=False)
        if out is None:
            out = np.empty((len(ids), self.dim), dtype=np.float32)
        held = slots >= 0
        if held.all():
            return np.take(self._rows, slots, axis=0, out=out)
        out[held] = self._rows[slots[held]]
        missing = np.ascontiguousarray(ids[~held], dtype=np.int64)
        fresh = np.empty((len(missing), self.dim), dtype=np.float32)
        embedding.init_rows(fresh, missing, 0, len(missing), self.table, self.seed,
                            self.init_scale)
        out[~held] = fresh
        return out

    def load(self, ids, rows, accum=None):
        """Set the rows of ``ids`` (distinct) to ``rows`` and their optimizer state to
        ``accum`` (a checkpoint's; None: the initial state), creating the missing ones."""
        slots = self.slots(np.ascontiguousarray(ids, dtype=np.int64))
        self._rows[slots] = rows
        if self._accum is not None:
            self._accum[slots] = self.initial_accumulator if accum is None else accum

    @property
    def row_bytes(self):
        """Nominal bytes a row costs: its id (8), its values (4 x dim), its optimizer state
        (4 per row, 4 x dim per element, or none) and two 16-byte entries of the id map
        (half full; right after the map doubles it is a quarter full: 32 bytes more)."""
        state = {"rowwise_adagrad": 4, "adagrad": 4 * self.dim, "sgd": 0}[self.optimizer]
        return 8 + 4 * self.dim + state + 32

    def resident_bytes(self):
        """Bytes of the rows in use (ids, values, state) and of the whole id map: what is
        resident of this store (the arrays' unused tail is never touched)."""
        per_row = self.row_bytes - 32
        return self.n_rows * per_row + self._keys.nbytes + self._vals.nbytes

    def apply(self, slots, grads, lr, eps=1e-8):
        """Apply ``grads`` (len(slots), dim) to the rows ``slots`` (distinct) with the
        store's optimizer. Safe from several threads at once (Hogwild)."""
        n = self.n_rows
        if self.optimizer == "rowwise_adagrad":
            embedding.rowwise_adagrad(self._rows[:n], self._accum[:n], slots, grads, lr, eps)
        elif self.optimizer == "adagrad":
            embedding.adagrad_rows(self._rows[:n], self._accum[:n], slots, grads, lr, eps)
        else:
            embedding.sgd_rows(self._rows[:n], slots, grads, lr)

    def push(self, ids, grads, lr, eps=1e-8, l2=0.0):
        """Apply ``grads`` to the rows of ``ids`` (distinct), created on first touch. ``l2``:
        weight decay of the rows pushed, ``l2 * row`` added to each one's gradient (lazy:
        a row decays when it is used, as the rows a batch touches are the only ones it
        moves)."""
        slots = self.slots(ids)
        if l2:
            grads = grads + np.float32(l2) * self._rows[slots]
        self.apply(slots, grads, lr, eps)
