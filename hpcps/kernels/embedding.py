"""Kernels for sparse embedding tables: compiled (``ext/embedding.pyx``), with NumPy references.

A step of a click-through model touches a few thousand rows of tables far larger than one
machine. The replica turns its batch's ids into unique ids and an inverse index
(:func:`unique_ids`), pulls only those rows, pools them into the batch (:func:`gather`),
and after backward sums each row's gradient over the positions that used it
(:func:`segment_sum`); the shard applies the summed gradients to its rows
(:func:`rowwise_adagrad`, :func:`adagrad_rows`, :func:`sgd_rows`). The shard's row store,
``hpcps.ps.embedding_store``, uses :func:`hash_lookup`, :func:`hash_rebuild` and
:func:`init_rows`.

Layout of a batch: ``ids`` is ``(B, P)`` int64, one row per example, P positions. Fields
are consecutive ranges of positions given by ``offsets`` (F + 1 increasing int64, from 0 to
P, each field at least one position wide): a single-valued field is one position, a
multi-valued field a fixed-width block padded with -1. ``offsets=None`` makes every
position its own field. Ids are >= 0; -1 is padding (skipped when pooling, inverse -1).

Hogwild-safe: the compiled functions release the GIL for their whole loop, keep no global
state, and allocate their scratch per call, so several threads may call them at once; on
the same rows of a table the updates race as Hogwild's do (see ``ext/embedding.pyx``).

Where the extension is missing, or ``HPCPS_NO_EXTENSION=1`` (read once, at import), the
NumPy references in :mod:`hpcps.kernels.reference` run, with one warning; results agree to
float32 rounding (bit for bit unless the build contracts into FMA). The functions here
check their input for both with ``ValueError``: dtypes, C-contiguity, shapes, ids and
indices in range (the compiled loops trust them), written arrays writable and apart from
the others.

Attributes
----------
HAVE_EXTENSION : bool
    True when the compiled kernels are the ones in use.
POOLING : tuple of str
    ``("sum", "mean")``.
"""
import operator

import numpy as np

from . import _check_array, _check_no_overlap, _check_scalar, load_extension, reference

_impl, HAVE_EXTENSION = load_extension("_embedding", reference, "hpcps.kernels.embedding")

POOLING = ("sum", "mean")

__all__ = [
    "HAVE_EXTENSION", "POOLING", "adagrad_rows", "field_offsets", "gather", "hash_lookup",
    "hash_rebuild", "init_rows", "rowwise_adagrad", "segment_sum", "sgd_rows", "unique_ids",
]


# --------------------------------------------------------------------------- checks

def _check_int64(name, a, ndim=None, writable=False):
    _check_array(name, a, writable, ndim, dtype=np.int64)


def _check_range(name, a, low, high):
    """Every entry of ``a`` in ``[low, high)``."""
    if a.size and (a.min() < low or a.max() >= high):
        raise ValueError(f"{name} must lie in [{low}, {high}), got values in "
                         f"[{a.min()}, {a.max()}]")


def _pooling(mode):
    if mode not in POOLING:
        raise ValueError(f"mode must be one of {POOLING}, got {mode!r}")
    return mode == "mean"


def _offsets(offsets, positions):
    """``offsets`` checked against ``positions`` columns, or one field per column."""
    if offsets is None:
        return np.arange(positions + 1, dtype=np.int64)
    _check_int64("offsets", offsets, ndim=1)
    if offsets.shape[0] < 1 or offsets[0] != 0 or offsets[-1] != positions:
        raise ValueError(f"offsets must run from 0 to the {positions} positions, got "
                         f"{offsets[:1].tolist()}...{offsets[-1:].tolist()}")
    if offsets.shape[0] > 1 and np.diff(offsets).min() < 1:
        raise ValueError("offsets must increase: every field is at least one position wide")
    return offsets


def field_offsets(widths):
    """``offsets`` for fields of the given widths (positions each): ``[0, w0, w0+w1, ...]``."""
    widths = np.asarray(widths, dtype=np.int64).reshape(-1)
    if widths.size and widths.min() < 1:
        raise ValueError(f"every field is at least one position wide, got {widths.tolist()}")
    return np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)


def _optimizer_args(table, slots, grads, lr):
    _check_array("table", table, writable=True, ndim=2)
    _check_int64("slots", slots, ndim=1)
    _check_array("grads", grads, writable=False, ndim=2)
    if grads.shape != (slots.shape[0], table.shape[1]):
        raise ValueError(f"grads must have shape {(slots.shape[0], table.shape[1])} "
                         f"(len(slots), dim), got {grads.shape}")
    _check_range("slots", slots, 0, table.shape[0])
    return _check_scalar("lr", lr)


def _check_eps(eps):
    eps = _check_scalar("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return eps


# --------------------------------------------------------------------------- replica side

def unique_ids(ids, sort=False):
    """The unique ids of a batch and, for each position, the index of its id among them.

    Parameters
    ----------
    ids : numpy.ndarray
        int64 C-contiguous, any shape; ids >= 0, -1 for padding (left out).
    sort : bool, optional
        Unique ids ascending; by default in the order they are first seen (row-major).

    Returns
    -------
    uniq : numpy.ndarray
        (m,) int64, the unique ids.
    inverse : numpy.ndarray
        int64 of the shape of ``ids``: ``uniq[inverse] == ids`` where ``ids >= 0``, -1 at
        padding.

    Raises
    ------
    ValueError
        If ``ids`` is not an int64 C-contiguous array or holds an id below -1.
    """
    _check_int64("ids", ids)
    if ids.size and ids.min() < -1:
        raise ValueError(f"ids must be >= 0, or -1 for padding; got {ids.min()}")
    flat = ids.reshape(-1)
    uniq = np.empty(flat.shape[0], dtype=np.int64)
    inverse = np.empty(flat.shape[0], dtype=np.int64)
    m = _impl.unique_inverse(flat, uniq, inverse, bool(sort))
    return uniq[:m].copy(), inverse.reshape(ids.shape)


def gather(rows, inverse, offsets=None, mode="sum", out=None):
    """Pool the batch's rows per example and field: ``out[b, f]`` is the sum (or mean) of
    ``rows[inverse[b, c]]`` over the positions c of field f that are not padding.

    Parameters
    ----------
    rows : numpy.ndarray
        (m, d) float32 C-contiguous: the unique ids' rows, as pulled.
    inverse : numpy.ndarray
        (B, P) int64 C-contiguous, from :func:`unique_ids`: entries in [0, m), or -1.
    offsets : numpy.ndarray, optional
        (F + 1,) int64 field boundaries over the P positions (:func:`field_offsets`); None
        makes every position a field (``out[b, c] = rows[inverse[b, c]]``).
    mode : str, optional
        ``"sum"`` or ``"mean"`` (over the field's valid positions). A field with none gets
        zeros.
    out : numpy.ndarray, optional
        (B, F, d) float32 C-contiguous; allocated when None.

    Returns
    -------
    numpy.ndarray
        ``out``.

    Raises
    ------
    ValueError
        On wrong dtypes, shapes or layouts, an ``inverse`` entry outside [-1, m), bad
        ``offsets``, an unknown ``mode``, or an ``out`` that is read-only or overlaps an input.
    """
    mean = _pooling(mode)
    _check_array("rows", rows, writable=False, ndim=2)
    _check_int64("inverse", inverse, ndim=2)
    _check_range("inverse", inverse, -1, rows.shape[0])
    offsets = _offsets(offsets, inverse.shape[1])
    shape = (inverse.shape[0], offsets.shape[0] - 1, rows.shape[1])
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    else:
        _check_array("out", out, writable=True, ndim=3)
        if out.shape != shape:
            raise ValueError(f"out must have shape {shape}, got {out.shape}")
        _check_no_overlap([("out", out)], [("rows", rows), ("inverse", inverse),
                                           ("offsets", offsets)])
    _impl.gather_pooled(rows, inverse, offsets, mean, out)
    return out


def segment_sum(grad_out, inverse, n_rows, offsets=None, mode="sum", out=None):
    """The backward of :func:`gather`: each unique row's gradient, summed over the positions
    that used it (with ``"mean"``, each position's share is 1/count of its field's valid
    positions).

    Parameters
    ----------
    grad_out : numpy.ndarray
        (B, F, d) float32 C-contiguous gradient of the loss with respect to ``gather``'s out.
    inverse : numpy.ndarray
        (B, P) int64 C-contiguous, entries in [0, n_rows) or -1.
    n_rows : int
        m, the number of unique ids.
    offsets, mode
        As for :func:`gather`.
    out : numpy.ndarray, optional
        (n_rows, d) float32 C-contiguous, overwritten; allocated when None.

    Returns
    -------
    numpy.ndarray
        ``out``: row k is the gradient of unique id k. Each row's sum runs in position order.

    Raises
    ------
    ValueError
        As for :func:`gather`, and when ``grad_out``'s shape does not fit.
    """
    mean = _pooling(mode)
    try:
        n_rows = operator.index(n_rows)
    except TypeError:
        raise ValueError(f"n_rows must be an integer, got {n_rows!r}") from None
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    _check_array("grad_out", grad_out, writable=False, ndim=3)
    _check_int64("inverse", inverse, ndim=2)
    _check_range("inverse", inverse, -1, n_rows)
    offsets = _offsets(offsets, inverse.shape[1])
    if grad_out.shape[:2] != (inverse.shape[0], offsets.shape[0] - 1):
        raise ValueError(f"grad_out must have shape (batch {inverse.shape[0]}, fields "
                         f"{offsets.shape[0] - 1}, dim), got {grad_out.shape}")
    shape = (n_rows, grad_out.shape[2])
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    else:
        _check_array("out", out, writable=True, ndim=2)
        if out.shape != shape:
            raise ValueError(f"out must have shape {shape}, got {out.shape}")
        _check_no_overlap([("out", out)], [("grad_out", grad_out), ("inverse", inverse),
                                           ("offsets", offsets)])
    _impl.segment_sum(grad_out, inverse, offsets, mean, out)
    return out


# --------------------------------------------------------------------------- shard side

def rowwise_adagrad(table, accum, slots, grads, lr, eps=1e-8):
    """Adagrad with one accumulator per row, on the rows ``slots`` of ``table``, in place.

    For each k, with ``s = slots[k]`` and ``g = grads[k]``: ``accum[s] += mean(g**2)``, then
    ``table[s] -= lr / sqrt(accum[s] + eps) * g``. One float per row instead of d: the
    accumulator costs 1/d of the table (per-element Adagrad doubles it).

    Parameters
    ----------
    table : numpy.ndarray
        (n, d) float32 C-contiguous rows, updated.
    accum : numpy.ndarray
        (n,) float32, updated.
    slots : numpy.ndarray
        (k,) int64 in [0, n), distinct (duplicates are applied one after the other by the
        compiled kernel but not by the reference: the results then differ).
    grads : numpy.ndarray
        (k, d) float32 C-contiguous, row k for ``slots[k]``.
    lr, eps : float
        Finite; ``eps >= 0``.

    Raises
    ------
    ValueError
        On wrong dtypes, shapes or layouts, a slot out of range, an array written that is
        read-only or overlaps another, or bad scalars.
    """
    lr = _optimizer_args(table, slots, grads, lr)
    eps = _check_eps(eps)
    _check_array("accum", accum, writable=True, ndim=1)
    if accum.shape[0] != table.shape[0]:
        raise ValueError(f"accum must have {table.shape[0]} entries (one per row), "
                         f"got {accum.shape[0]}")
    _check_no_overlap([("table", table), ("accum", accum)], [("slots", slots), ("grads", grads)])
    _impl.rowwise_adagrad_rows(table, accum, slots, grads, lr, eps)


def adagrad_rows(table, accum, slots, grads, lr, eps=1e-8):
    """Per-element Adagrad on the rows ``slots``, in place: for each element
    ``accum += g*g; w -= lr*g / (sqrt(accum) + eps)`` (the form of
    ``hpcps.kernels.adagrad_update``, so a dense and a sparse parameter learn alike).

    ``accum`` is (n, d) float32 C-contiguous; the rest as for :func:`rowwise_adagrad`.
    """
    lr = _optimizer_args(table, slots, grads, lr)
    eps = _check_eps(eps)
    _check_array("accum", accum, writable=True, ndim=2)
    if accum.shape != table.shape:
        raise ValueError(f"accum must have the table's shape {table.shape}, got {accum.shape}")
    _check_no_overlap([("table", table), ("accum", accum)], [("slots", slots), ("grads", grads)])
    _impl.adagrad_rows(table, accum, slots, grads, lr, eps)


def sgd_rows(table, slots, grads, lr):
    """``table[slots[k]] -= lr * grads[k]`` in place; arguments as for
    :func:`rowwise_adagrad`."""
    lr = _optimizer_args(table, slots, grads, lr)
    _check_no_overlap([("table", table)], [("slots", slots), ("grads", grads)])
    _impl.sgd_rows(table, slots, grads, lr)


# --------------------------------------------------------------------------- row store

def _check_map(keys, vals):
    _check_int64("keys", keys, ndim=1, writable=True)
    _check_int64("vals", vals, ndim=1, writable=True)
    n = keys.shape[0]
    if n < 2 or n & (n - 1) or vals.shape[0] != n:
        raise ValueError(f"keys and vals must have one length, a power of two >= 2; got "
                         f"{keys.shape[0]} and {vals.shape[0]}")


def hash_lookup(keys, vals, ids, ids_by_slot, n_rows, insert):
    """Slots of ``ids`` in an open-addressing (linear probing) map ``keys -> vals``.

    Parameters
    ----------
    keys, vals : numpy.ndarray
        int64, one length, a power of two; empty entries have key -1. Updated with
        ``insert``.
    ids : numpy.ndarray
        (k,) int64 ids >= 0.
    ids_by_slot : numpy.ndarray
        int64, ``ids_by_slot[s]`` the id of slot s; with ``insert`` it must have room for
        ``n_rows + k`` entries, and new slots get their ids written here.
    n_rows : int
        Slots in use.
    insert : bool
        Give missing ids the next slots (first-seen order); otherwise they get -1.

    Returns
    -------
    slots : numpy.ndarray
        (k,) int64.
    n_rows : int
        Slots in use afterwards.

    Raises
    ------
    ValueError
        On wrong dtypes or layouts, a negative id, or a map that would be more than half
        full (the caller grows it first: :func:`hash_rebuild`).
    """
    _check_map(keys, vals)
    _check_int64("ids", ids, ndim=1)
    _check_int64("ids_by_slot", ids_by_slot, ndim=1, writable=bool(insert))
    if ids.size and ids.min() < 0:
        raise ValueError(f"ids must be >= 0, got {ids.min()}")
    n_rows = operator.index(n_rows)
    if not 0 <= n_rows <= ids_by_slot.shape[0]:
        raise ValueError(f"n_rows must lie in [0, {ids_by_slot.shape[0]}], got {n_rows}")
    _check_no_overlap([("keys", keys), ("vals", vals), ("ids_by_slot", ids_by_slot)],
                      [("ids", ids)])
    slots = np.empty(ids.shape[0], dtype=np.int64)
    n_rows = _impl.lookup_insert(keys, vals, ids, slots, ids_by_slot, n_rows, bool(insert))
    return slots, int(n_rows)


def hash_rebuild(keys, vals, ids_by_slot, n_rows):
    """Fill ``keys -> vals`` (cleared here) with ``ids_by_slot[s] -> s`` for s < n_rows."""
    _check_map(keys, vals)
    _check_int64("ids_by_slot", ids_by_slot, ndim=1)
    n_rows = operator.index(n_rows)
    if not 0 <= n_rows <= ids_by_slot.shape[0]:
        raise ValueError(f"n_rows must lie in [0, {ids_by_slot.shape[0]}], got {n_rows}")
    _check_no_overlap([("keys", keys), ("vals", vals)], [("ids_by_slot", ids_by_slot)])
    keys.fill(-1)
    _impl.rebuild_index(keys, vals, ids_by_slot, n_rows)


def init_rows(rows, ids_by_slot, start, stop, table, seed, scale):
    """Initial values of rows ``start:stop``, uniform in [-scale, scale), drawn from
    (table, id, seed) alone: a row's first values are the same on every shard count.

    ``table`` and ``seed`` are integers in [0, 2**64); ``scale`` finite.
    """
    _check_array("rows", rows, writable=True, ndim=2)
    _check_int64("ids_by_slot", ids_by_slot, ndim=1)
    start, stop = operator.index(start), operator.index(stop)
    if not 0 <= start <= stop <= min(rows.shape[0], ids_by_slot.shape[0]):
        raise ValueError(f"start:stop {start}:{stop} out of range")
    table, seed = operator.index(table), operator.index(seed)
    for name, x in (("table", table), ("seed", seed)):
        if not 0 <= x < 1 << 64:
            raise ValueError(f"{name} must lie in [0, 2**64), got {x}")
    scale = _check_scalar("scale", scale)
    _impl.init_rows(rows, ids_by_slot, start, stop, table, seed, scale)


# -- placement of rows on shards ------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def place(tables: np.ndarray, ids: np.ndarray, n_shards: int) -> np.ndarray:
    """The shard of each (table, id) pair: splitmix64's finaliser of ``id + (table + 1) *
    golden``, modulo ``n_shards`` (int64 array)."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + (tables.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z ^= z >> np.uint64(31)
    return (z % np.uint64(n_shards)).astype(np.int64)
