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

**Capacity** (``max_rows``, ``--table-capacity``): the store holds at most ``max_rows`` rows.
When a training pull brings new ids that do not fit, the rows unused for the longest go
first (LRU): each slot carries a "last used" tick, which every pull and push of the row
advances (the rows of one call get consecutive ticks, in the order asked, so the order is
total and a reference can follow it exactly). Eviction never takes a row of the call being
served, and it works in bulk: it frees enough for the new rows and a tenth of the capacity
more (:data:`HEADROOM`), so that the store holds 90% of ``max_rows`` right after it. Each
eviction costs O(max_rows) (choosing the victims with ``argpartition``, moving the last
live slots into the freed ones so the arrays stay dense from the front, and rebuilding the
map with ``hash_rebuild``; the map has no deletion, so a rebuild is what keeps probing free
of tombstones), and at least ``max_rows / 10`` new rows come in before the next one: about
thirty cheap operations per new row, amortized. An evicted row is gone: its next use starts
again from its initial row. Evaluation reads (:meth:`peek`) neither evict, create, nor
count as a use.

**Admission** (``admission``, ``--admit-after c``, :mod:`hpcps.ps.admission`): a training
pull of an id without a row counts a sighting of it, and the row is created only at its c-th
sighting; until then the pull answers zeros for it (counted in ``zeroed``). A store with a
capacity or admission never creates rows on a push: the gradient of a row it does not hold
(evicted since its pull, or not admitted) is dropped and counted in ``dropped``. With
admission, :meth:`peek` reads a row not held as zeros, what training pulls of a new id read,
rather than its initial row (the rule :mod:`hpcps.tools.evaluate` follows offline).

Slots move when rows are evicted: slots looked up before a call that may create rows are
stale after it (one thread at a time, as above).
"""
import numpy as np

from hpcps.kernels import embedding

OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")
ABSENT = ("initial", "zeros")  # what peek reads for a row not held
HEADROOM = 0.1  # an eviction frees this fraction of max_rows beyond the new rows (bulk)
_NEVER = np.iinfo(np.int64).max  # the tick of a row that must not be evicted


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
        Rows to allocate at first (default 1024, at most ``max_rows``); grows by doubling.
    max_rows : int, optional
        The most rows held (``--table-capacity``); beyond it the least recently used go
        (module docstring). Default None: unbounded.
    admission : hpcps.ps.admission.Admission, optional
        Create a row only at the c-th training pull of its id (``--admit-after``). Default
        None: at the first.
    absent : str, optional
        What :meth:`peek` reads for a row not held: ``"initial"`` (its initial row) or
        ``"zeros"``. Default: zeros with ``admission``, else initial.

    Attributes
    ----------
    n_rows : int
        Rows held.
    evicted : int
        Rows evicted so far.
    dropped : int
        Row gradients dropped by :meth:`push` because the row was not held.
    zeroed : int
        Ids :meth:`pull` answered with zeros, not yet admitted (each pull of one counts).
    """

    def __init__(self, dim, *, table=0, seed=0, optimizer="rowwise_adagrad", init_scale=None,
                 initial_accumulator=0.0, capacity=1024, max_rows=None, admission=None,
                 absent=None):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        dim, capacity = int(dim), int(capacity)
        if dim < 1 or capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1, got {dim} and {capacity}")
        if table < 0 or seed < 0:
            raise ValueError(f"table and seed must be >= 0, got {table} and {seed}")
        if max_rows is not None:
            max_rows = int(max_rows)
            if max_rows < 1:
                raise ValueError(f"max_rows must be >= 1, got {max_rows}")
            capacity = min(capacity, max_rows)
        absent = ("zeros" if admission is not None else "initial") if absent is None else absent
        if absent not in ABSENT:
            raise ValueError(f"absent must be one of {ABSENT}, got {absent!r}")
        self.dim, self.table, self.seed, self.optimizer = dim, int(table), int(seed), optimizer
        self.init_scale = float(1.0 / np.sqrt(dim) if init_scale is None else init_scale)
        self.initial_accumulator = float(initial_accumulator)
        self.max_rows, self.admission, self.absent = max_rows, admission, absent
        self.n_rows = 0
        self.evicted = self.dropped = self.zeroed = 0
        self._ids = np.empty(capacity, dtype=np.int64)
        self._rows = np.empty((capacity, dim), dtype=np.float32)
        self._accum = self._new_accum(capacity)
        # the tick each slot was last used at (only a bounded store evicts, by it)
        self._used = np.empty(capacity, dtype=np.int64) if max_rows is not None else None
        self._clock = 0
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
    def bounded(self):
        """True when rows may be refused or evicted (a capacity or admission): pushes then
        never create rows."""
        return self.max_rows is not None or self.admission is not None

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

    @property
    def used(self):
        """(n_rows,) int64 view: the tick each slot was last used at (larger: more recent),
        or None without a capacity."""
        return None if self._used is None else self._used[:self.n_rows]

    # ------------------------------------------------------------------ growth

    def _reserve(self, extra):
        """Room for ``extra`` more rows: the arrays and the map grow by doubling (the arrays
        to ``max_rows`` at most: the caller has evicted what does not fit)."""
        need = self.n_rows + extra
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            if self.max_rows is not None:
                cap = max(need, min(cap, self.max_rows))
            n = self.n_rows
            old = self._ids, self._rows, self._accum, self._used
            self._ids = np.empty(cap, dtype=np.int64)
            self._rows = np.empty((cap, self.dim), dtype=np.float32)
            self._accum = self._new_accum(cap)
            self._used = None if old[3] is None else np.empty(cap, dtype=np.int64)
            for new, was in zip((self._ids, self._rows, self._accum, self._used), old):
                if was is not None:
                    new[:n] = was[:n]
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

    def _touch(self, slots):
        """Mark ``slots`` used now, in their order (a bounded store's LRU ticks)."""
        if self._used is not None and len(slots):
            self._used[slots] = np.arange(self._clock, self._clock + len(slots))
            self._clock += len(slots)

    def _make_room(self, new, keep):
        """Evict least recently used rows so that ``new`` more fit in ``max_rows``, never one
        of the slots ``keep``: down to ``max_rows - new - HEADROOM * max_rows`` rows when
        that many may go, else every row but ``keep``. Slots move (the map is rebuilt)."""
        n, cap = self.n_rows, self.max_rows
        if n + new <= cap:
            return
        if new + len(keep) > cap:
            raise ValueError(f"a call needs {new + len(keep)} rows of table {self.table} at "
                             f"once, more than its capacity of {cap} rows")
        headroom = max(1, int(HEADROOM * cap))
        go = min(n + new - max(0, cap - headroom), n - len(keep))
        ticks = self._used[:n].copy()
        ticks[keep] = _NEVER
        victims = np.argpartition(ticks, go - 1)[:go] if go < n else np.arange(n)
        self._evict(victims)

    def _evict(self, victims):
        """Drop the rows at slots ``victims`` (distinct): the live rows of the last slots move
        into the freed ones below, so the arrays stay dense from the front, and the map is
        rebuilt over the slots that remain."""
        n, go = self.n_rows, len(victims)
        left = n - go
        dead = np.zeros(n, dtype=bool)
        dead[victims] = True
        holes = np.flatnonzero(dead[:left])  # freed slots below the new end
        movers = left + np.flatnonzero(~dead[left:])  # live slots past it: as many
        for a in (self._ids, self._rows, self._accum, self._used):
            if a is not None:
                a[holes] = a[movers]
        self.n_rows = left
        embedding.hash_rebuild(self._keys, self._vals, self._ids, left)
        self.evicted += go

    # ------------------------------------------------------------------ access

    def slots(self, ids, create=True):
        """The slot of each id (1-D int64, ids >= 0); missing ids get new rows, or -1 when
        ``create`` is False. With ``max_rows``, new rows that do not fit evict the least
        recently used others first (slots looked up earlier move). One thread at a time."""
        if not create:
            return embedding.hash_lookup(self._keys, self._vals, ids, self._ids, self.n_rows,
                                         False)[0]
        if self.max_rows is not None:
            return self._slots_within_capacity(ids)
        self._reserve(ids.shape[0] if isinstance(ids, np.ndarray) and ids.ndim == 1 else 0)
        slots, n = embedding.hash_lookup(self._keys, self._vals, ids, self._ids, self.n_rows,
                                         True)
        if n > self.n_rows:
            self._create(self.n_rows, n)
            self.n_rows = n
        return slots

    def _slots_within_capacity(self, ids):
        """:meth:`slots` with ``max_rows``: room is made for the new ids alone (the kernel
        wants room in the arrays for every id it may insert, and they stop at ``max_rows``),
        then every id is looked up again, as eviction moves slots; all are marked used."""
        slots = self.slots(ids, create=False)
        missing = slots < 0
        if missing.any():
            new = ids[missing]
            _, first = np.unique(new, return_index=True)
            new = np.ascontiguousarray(new[np.sort(first)])  # distinct, first-seen order
            self._make_room(len(new), np.unique(slots[~missing]))
            self._reserve(len(new))
            _, n = embedding.hash_lookup(self._keys, self._vals, new, self._ids, self.n_rows,
                                         True)
            self._create(self.n_rows, n)
            self.n_rows = n
            slots = self.slots(ids, create=False)
        self._touch(slots)
        return slots

    def pull(self, ids, out=None):
        """(len(ids), dim) rows of ``ids`` (distinct with ``admission``), created on first
        touch; with ``admission``, ids not admitted yet read as zeros and get no row."""
        if self.admission is None:
            slots = self.slots(ids)  # first: it may reallocate the rows
            return np.take(self._rows, slots, axis=0, out=out)
        missing = self.slots(ids, create=False) < 0
        if missing.any():
            refused = missing.copy()
            refused[missing] = ~self.admission.admit(self.table, ids[missing])
            if refused.any():
                if out is None:
                    out = np.empty((len(ids), self.dim), dtype=np.float32)
                kept = ~refused
                slots = self.slots(np.ascontiguousarray(ids[kept]))
                out[kept] = self._rows[slots]
                out[refused] = 0.0
                self.zeroed += int(refused.sum())
                return out
        slots = self.slots(ids)
        return np.take(self._rows, slots, axis=0, out=out)

    def peek(self, ids, out=None):
        """(len(ids), dim) rows of ``ids`` without storing any, evicting any or counting as
        a use: an id not held reads as the row it would be created with (its initialiser
        depends on (table, id, seed) only), or as zeros (``absent="zeros"``)."""
        slots = self.slots(ids, create=False)
        if out is None:
            out = np.empty((len(ids), self.dim), dtype=np.float32)
        held = slots >= 0
        if held.all():
            return np.take(self._rows, slots, axis=0, out=out)
        out[held] = self._rows[slots[held]]
        if self.absent == "zeros":
            out[~held] = 0.0
            return out
        missing = np.ascontiguousarray(ids[~held], dtype=np.int64)
        fresh = np.empty((len(missing), self.dim), dtype=np.float32)
        embedding.init_rows(fresh, missing, 0, len(missing), self.table, self.seed,
                            self.init_scale)
        out[~held] = fresh
        return out

    def load(self, ids, rows, accum=None):
        """Set the rows of ``ids`` (distinct) to ``rows`` and their optimizer state to
        ``accum`` (a checkpoint's; None: the initial state), creating the missing ones
        (admission does not apply: these rows were admitted once). More rows than
        ``max_rows`` go in by parts of ``max_rows``, each evicting the rows least recently
        loaded (checkpoints hold no recency): the rows given last stay."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        part = max(1, len(ids)) if self.max_rows is None else self.max_rows
        for a in range(0, len(ids), part):
            slots = self.slots(ids[a:a + part])
            self._rows[slots] = rows[a:a + part]
            if self._accum is not None:
                self._accum[slots] = (self.initial_accumulator if accum is None
                                      else accum[a:a + part])

    @property
    def row_bytes(self):
        """Nominal bytes a row costs: its id (8), its values (4 x dim), its optimizer state
        (4 per row, 4 x dim per element, or none), its last-use tick with a capacity (8), and
        two 16-byte entries of the id map (half full; right after the map doubles it is a
        quarter full: 32 bytes more)."""
        state = {"rowwise_adagrad": 4, "adagrad": 4 * self.dim, "sgd": 0}[self.optimizer]
        tick = 8 if self.max_rows is not None else 0
        return 8 + 4 * self.dim + state + tick + 32

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
        moves). A bounded store (capacity or admission) creates no row here: the gradients
        of rows it does not hold (evicted since their pull, or not admitted) are dropped and
        counted in ``dropped``."""
        if not self.bounded:
            slots = self.slots(ids)
        else:
            slots = self.slots(ids, create=False)
            held = slots >= 0
            if not held.all():
                self.dropped += int(len(slots) - held.sum())
                slots, grads = slots[held], np.ascontiguousarray(grads[held])
            self._touch(slots)
        if l2:
            grads = grads + np.float32(l2) * self._rows[slots]
        self.apply(slots, grads, lr, eps)
