"""Tests for hpcps.kernels.embedding and hpcps.ps.embedding_store.

Each compiled kernel is compared with its NumPy reference (``hpcps.kernels.reference``) on
random input: float32 rows, int64 ids up to 2**62 with -1 padding. The compiled module is
imported directly, so the comparison runs whatever ``HPCPS_NO_EXTENSION`` says; the public
functions (which check input, then run either) are tested as a third implementation.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from hpcps.kernels import embedding, reference
from hpcps.ps.embedding_store import EmbeddingStore

try:
    from hpcps.kernels import _embedding as compiled
except ImportError:
    compiled = None

needs_extension = pytest.mark.skipif(
    compiled is None,
    reason="hpcps.kernels._embedding is not built (run `python setup.py build_ext --inplace`)",
)
# float32: the sums run in the same order in both, so only FMA contraction (a build with
# -march=native) may move a result by an ulp or so.
RTOL, ATOL = 2e-6, 1e-7
HUGE = 1 << 62
REPO = Path(__file__).resolve().parents[1]

IMPLS = [
    pytest.param(reference, id="reference"),
    pytest.param(compiled, id="compiled", marks=needs_extension),
]


def _ids(rng, shape, vocab, pad=0.1, huge=True):
    """int64 ids: Zipf-like repeats over ``vocab`` values, some near 2**62, -1 padding."""
    base = rng.integers(0, vocab, size=shape)
    if huge:
        values = np.where(rng.random(vocab) < 0.5, HUGE - 1 - np.arange(vocab),
                          rng.integers(0, HUGE, size=vocab))
    else:
        values = np.arange(vocab)
    ids = values[base].astype(np.int64)
    ids[rng.random(shape) < pad] = -1
    return np.ascontiguousarray(ids)


def _unique_both(ids, sort):
    out = []
    for impl in (reference, compiled):
        uniq = np.empty(ids.size, dtype=np.int64)
        inverse = np.empty(ids.size, dtype=np.int64)
        m = impl.unique_inverse(ids.reshape(-1), uniq, inverse, sort)
        out.append((uniq[:m], inverse))
    return out


# --------------------------------------------------------------------------- unique

@needs_extension
@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("shape, vocab", [((512, 26), 3000), ((7, 3), 5), ((1000,), 10**6),
                                          ((1,), 1)])
def test_unique_compiled_matches_reference(shape, vocab, sort):
    ids = _ids(np.random.default_rng(vocab), shape, vocab)
    (u1, i1), (u2, i2) = _unique_both(ids, sort)
    np.testing.assert_array_equal(u1, u2)
    np.testing.assert_array_equal(i1, i2)
    flat = ids.reshape(-1)
    valid = flat >= 0
    np.testing.assert_array_equal(u1[i1[valid]], flat[valid])
    assert (i1[~valid] == -1).all()
    assert len(set(u1.tolist())) == len(u1)
    if sort:
        assert (np.diff(u1) > 0).all()
    else:   # first-seen order
        firsts = [flat[valid].tolist().index(x) for x in u1[:50].tolist()]
        assert firsts == sorted(firsts)


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("ids, uniq, inverse", [
    ([], [], []),
    ([-1, -1, -1], [], [-1, -1, -1]),
    ([7, 7, 7, 7], [7], [0, 0, 0, 0]),
    ([HUGE + 5, -1, 0, HUGE + 5, (1 << 63) - 1], None, None),
])
def test_unique_edge_cases(ids, uniq, inverse, sort):
    ids = np.array(ids, dtype=np.int64)
    u, inv = embedding.unique_ids(ids, sort=sort)
    if uniq is not None:
        np.testing.assert_array_equal(u, uniq)
        np.testing.assert_array_equal(inv, inverse)
    else:
        expected = [HUGE + 5, 0, (1 << 63) - 1]
        np.testing.assert_array_equal(u, sorted(expected) if sort else expected)
        np.testing.assert_array_equal(u[inv[inv >= 0]], ids[ids >= 0])
        assert inv[1] == -1
    if compiled is not None:
        (u1, i1), (u2, i2) = _unique_both(ids, sort)
        np.testing.assert_array_equal(u1, u2)
        np.testing.assert_array_equal(i1, i2)


def test_unique_keeps_shape_and_refuses_bad_ids():
    ids = np.array([[3, -1], [3, 4]], dtype=np.int64)
    u, inv = embedding.unique_ids(ids)
    assert inv.shape == (2, 2)
    np.testing.assert_array_equal(u, [3, 4])
    with pytest.raises(ValueError, match=">= 0, or -1"):
        embedding.unique_ids(np.array([1, -2], dtype=np.int64))
    with pytest.raises(ValueError, match="int64"):
        embedding.unique_ids(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="C-contiguous"):
        embedding.unique_ids(np.arange(10, dtype=np.int64)[::2])


# --------------------------------------------------------------------------- gather, backward

def _batch(seed, B=64, widths=(1, 1, 3, 1, 5), d=16, vocab=200, pad=0.2):
    """ids (B, P), their unique rows (m, d), inverse, offsets, and an upstream gradient."""
    rng = np.random.default_rng(seed)
    offsets = embedding.field_offsets(widths)
    ids = _ids(rng, (B, int(offsets[-1])), vocab, pad)
    uniq, inverse = embedding.unique_ids(ids)
    rows = rng.standard_normal((uniq.shape[0], d), dtype=np.float32)
    grad_out = rng.standard_normal((B, len(widths), d), dtype=np.float32)
    return rows, inverse, offsets, grad_out


def _pooled_loop(rows, inverse, offsets, mean):
    """The plain-Python definition, in float64."""
    B, F, d = inverse.shape[0], len(offsets) - 1, rows.shape[1]
    out = np.zeros((B, F, d))
    for b in range(B):
        for f in range(F):
            picked = [inverse[b, c] for c in range(offsets[f], offsets[f + 1])
                      if inverse[b, c] >= 0]
            if picked:
                out[b, f] = rows[picked].astype(np.float64).sum(0)
                if mean:
                    out[b, f] /= len(picked)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_matches_definition(impl, mean, seed):
    rows, inverse, offsets, _ = _batch(seed)
    out = np.full((inverse.shape[0], len(offsets) - 1, rows.shape[1]), np.nan, np.float32)
    impl.gather_pooled(rows, inverse, offsets, mean, out)
    np.testing.assert_allclose(out, _pooled_loop(rows, inverse, offsets, mean),
                               rtol=1e-5, atol=1e-6)


@needs_extension
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("B, widths, d", [(512, (1,) * 26, 16), (33, (4, 1, 2), 7),
                                          (5, (1,), 1), (512, (1,) * 20 + (6,) * 6, 16)])
def test_gather_and_segment_sum_compiled_match_reference(B, widths, d, mean):
    rows, inverse, offsets, grad_out = _batch(B * d, B, widths, d, vocab=B * 4)
    F = len(widths)
    outs = [np.empty((B, F, d), np.float32) for _ in range(2)]
    compiled.gather_pooled(rows, inverse, offsets, mean, outs[0])
    reference.gather_pooled(rows, inverse, offsets, mean, outs[1])
    np.testing.assert_allclose(outs[0], outs[1], rtol=RTOL, atol=ATOL)
    grads = [np.full(rows.shape, np.nan, np.float32) for _ in range(2)]
    compiled.segment_sum(grad_out, inverse, offsets, mean, grads[0])
    reference.segment_sum(grad_out, inverse, offsets, mean, grads[1])
    np.testing.assert_allclose(grads[0], grads[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_segment_sum_is_the_gradient_of_gather(mode):
    # <gather(rows), G> is linear in rows, so its gradient is segment_sum(G), exactly.
    rows, inverse, offsets, grad_out = _batch(5, B=9, d=3)
    g = embedding.segment_sum(grad_out, inverse, rows.shape[0], offsets, mode).astype(np.float64)
    rng = np.random.default_rng(1)
    for _ in range(3):
        v = rng.standard_normal(rows.shape).astype(np.float32)
        pooled = _pooled_loop(v, inverse, offsets, mode == "mean")
        assert np.isclose((pooled * grad_out).sum(), (g * v).sum(), rtol=1e-4)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_gather_edge_cases(mode):
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    # empty batch
    out = embedding.gather(rows, np.empty((0, 4), np.int64), embedding.field_offsets([1, 3]),
                           mode)
    assert out.shape == (0, 2, 2)
    g = embedding.segment_sum(np.empty((0, 2, 2), np.float32), np.empty((0, 4), np.int64), 3,
                              embedding.field_offsets([1, 3]), mode)
    np.testing.assert_array_equal(g, np.zeros((3, 2)))
    # all padding: zeros, and no rows at all
    inverse = np.full((2, 4), -1, np.int64)
    out = embedding.gather(np.empty((0, 2), np.float32), inverse, None, mode)
    np.testing.assert_array_equal(out, np.zeros((2, 4, 2)))
    g = embedding.segment_sum(np.ones((2, 4, 2), np.float32), inverse, 0, None, mode)
    assert g.shape == (0, 2)
    # one id repeated in every position of one multi-valued field
    inverse = np.zeros((3, 4), np.int64)
    out = embedding.gather(rows, inverse, np.array([0, 4], np.int64), mode)
    np.testing.assert_array_equal(out[:, 0], np.tile(rows[0] * (1 if mode == "mean" else 4),
                                                     (3, 1)))
    g = embedding.segment_sum(np.ones((3, 1, 2), np.float32), inverse, 3,
                              np.array([0, 4], np.int64), mode)
    np.testing.assert_allclose(g[0], [3.0, 3.0] if mode == "mean" else [12.0, 12.0])
    np.testing.assert_array_equal(g[1:], 0.0)
    if compiled is not None:    # the same through the compiled and reference kernels
        for impl in (compiled, reference):
            o = np.empty((3, 1, 2), np.float32)
            impl.gather_pooled(rows, inverse, np.array([0, 4], np.int64), mode == "mean", o)
            np.testing.assert_array_equal(o, out)


def test_gather_and_segment_sum_refuse_bad_input():
    rows, inverse, offsets, grad_out = _batch(0, B=4, d=3)
    with pytest.raises(ValueError, match="inverse must lie in"):
        embedding.gather(rows[:1], inverse, offsets)
    with pytest.raises(ValueError, match="mode"):
        embedding.gather(rows, inverse, offsets, "max")
    with pytest.raises(ValueError, match="offsets must run from 0"):
        embedding.gather(rows, inverse, offsets[:-1])
    with pytest.raises(ValueError, match="at least one position wide"):
        embedding.gather(rows, inverse, np.array([0, 0, int(offsets[-1])], np.int64))
    with pytest.raises(ValueError, match="float32"):
        embedding.gather(rows.astype(np.float64), inverse, offsets)
    with pytest.raises(ValueError, match="out must have shape"):
        embedding.gather(rows, inverse, offsets, out=np.empty((1, 1, 1), np.float32))
    with pytest.raises(ValueError, match="grad_out must have shape"):
        embedding.segment_sum(grad_out[:, :1].copy(), inverse, rows.shape[0], offsets)
    with pytest.raises(ValueError, match="inverse must lie in"):
        embedding.segment_sum(grad_out, inverse, 1, offsets)
    with pytest.raises(ValueError, match="n_rows must be >= 0"):
        embedding.segment_sum(grad_out, inverse, -1, offsets)


# --------------------------------------------------------------------------- row updates

def _shard(seed, n=500, d=16, k=300):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((n, d), dtype=np.float32)
    accum_row = rng.uniform(0, 2, n).astype(np.float32)
    accum_el = rng.uniform(0, 2, (n, d)).astype(np.float32)
    slots = rng.permutation(n)[:k].astype(np.int64)
    grads = rng.standard_normal((k, d), dtype=np.float32)
    return table, accum_row, accum_el, slots, grads


@needs_extension
@pytest.mark.parametrize("k", [0, 1, 300])
@pytest.mark.parametrize("d", [1, 16, 33])
def test_row_updates_compiled_match_reference(k, d):
    table, accum_row, accum_el, slots, grads = _shard(k + d, d=d, k=k)
    for name, accum in (("rowwise_adagrad_rows", accum_row), ("adagrad_rows", accum_el),
                        ("sgd_rows", None)):
        results = []
        for impl in (compiled, reference):
            t = table.copy()
            args = (t,) if accum is None else (t, accum.copy())
            extra = (0.05,) if accum is None else (0.05, 1e-8)
            getattr(impl, name)(*args, slots, grads, *extra)
            results.append(args)
        for a, b in zip(*results):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)
        untouched = np.setdiff1d(np.arange(table.shape[0]), slots)
        np.testing.assert_array_equal(results[0][0][untouched], table[untouched])


def test_rowwise_adagrad_formula():
    table = np.zeros((3, 4), np.float32)
    accum = np.full(3, 1.0, np.float32)
    g = np.array([[1, 1, 1, 1], [2, 0, 0, 0]], np.float32)
    embedding.rowwise_adagrad(table, accum, np.array([2, 0], np.int64), g, lr=0.1, eps=0.0)
    np.testing.assert_allclose(accum, [2.0, 1.0, 2.0])            # 1 + mean(g**2)
    np.testing.assert_allclose(table[2], -0.1 / np.sqrt(2.0) * g[0], rtol=1e-6)
    np.testing.assert_allclose(table[0], -0.1 / np.sqrt(2.0) * g[1], rtol=1e-6)
    np.testing.assert_array_equal(table[1], 0.0)


def test_adagrad_rows_equals_dense_adagrad_on_those_rows():
    import hpcps.kernels as kernels
    table, _, accum, slots, grads = _shard(3)
    t, a = table.copy(), accum.copy()
    embedding.adagrad_rows(t, a, slots, grads, 0.05, 1e-8)
    for k, s in enumerate(slots[:20]):
        w, acc = table[s].copy(), accum[s].copy()
        kernels.adagrad_update(w, grads[k].copy(), acc, 0.05, 1e-8)
        np.testing.assert_allclose(t[s], w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(a[s], acc, rtol=RTOL, atol=ATOL)


def test_row_updates_refuse_bad_input():
    table, accum, accum_el, slots, grads = _shard(0, k=5)
    with pytest.raises(ValueError, match="slots must lie in"):
        embedding.rowwise_adagrad(table, accum, slots + 10**6, grads, 0.1)
    with pytest.raises(ValueError, match="grads must have shape"):
        embedding.sgd_rows(table, slots, grads[:, :3].copy(), 0.1)
    with pytest.raises(ValueError, match="one per row"):
        embedding.rowwise_adagrad(table, accum[:3].copy(), slots, grads, 0.1)
    with pytest.raises(ValueError, match="table's shape"):
        embedding.adagrad_rows(table, accum_el[:3].copy(), slots, grads, 0.1)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        embedding.adagrad_rows(table, accum_el, slots, grads, 0.1, -1.0)
    with pytest.raises(ValueError, match="lr must be finite"):
        embedding.sgd_rows(table, slots, grads, float("nan"))
    table.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        embedding.sgd_rows(table, slots, grads, 0.1)


# --------------------------------------------------------------------------- the row store

@needs_extension
def test_hash_and_init_compiled_match_reference():
    rng = np.random.default_rng(0)
    for z in [0, 1, HUGE, (1 << 64) - 1]:
        assert compiled.mix64(z) == reference.mix64(z)
    size = 1 << 12
    maps = [(np.full(size, -1, np.int64), np.empty(size, np.int64), np.empty(size, np.int64))
            for _ in range(2)]
    counts = [0, 0]
    for step in range(4):
        ids = _ids(rng, (400,), 600, pad=0.0)
        found = []
        for j, impl in enumerate((compiled, reference)):
            keys, vals, by_slot = maps[j]
            slots = np.empty(ids.shape[0], np.int64)
            counts[j] = impl.lookup_insert(keys, vals, ids, slots, by_slot, counts[j], True)
            found.append(slots)
        np.testing.assert_array_equal(found[0], found[1])
        assert counts[0] == counts[1]
    np.testing.assert_array_equal(maps[0][2][:counts[0]], maps[1][2][:counts[0]])
    # a map built by one implementation is read correctly by the other
    probe = np.concatenate([maps[0][2][:counts[0]], [HUGE - 10**6, 12345]]).astype(np.int64)
    for j, impl in enumerate((compiled, reference)):
        keys, vals, by_slot = maps[1 - j]
        slots = np.empty(probe.shape[0], np.int64)
        assert impl.lookup_insert(keys, vals, probe, slots, by_slot, counts[j], False) == counts[j]
        np.testing.assert_array_equal(slots[:-2], np.arange(counts[j]))
        assert (slots[-2:] == -1).all()
    rows = [np.empty((counts[0], 7), np.float32) for _ in range(2)]
    compiled.init_rows(rows[0], maps[0][2], 0, counts[0], 3, 42, 0.5)
    reference.init_rows(rows[1], maps[0][2], 0, counts[0], 3, 42, 0.5)
    np.testing.assert_allclose(rows[0], rows[1], rtol=RTOL, atol=ATOL)
    assert np.abs(rows[0]).max() <= 0.5 and rows[0].std() > 0.2


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_store_grows_and_keeps_rows(optimizer):
    store = EmbeddingStore(4, table=1, seed=7, optimizer=optimizer, capacity=2)
    rng = np.random.default_rng(0)
    seen = {}
    for _ in range(6):
        ids = np.unique(_ids(rng, (300,), 2000, pad=0.0))
        rows = store.pull(ids)
        for i, r in zip(ids.tolist(), rows):
            if i in seen:
                np.testing.assert_array_equal(seen[i], r)
            seen[i] = r.copy()
    assert len(store) == len(seen)
    assert store.capacity >= len(store) and store.capacity < 4 * len(store) + 300
    assert set(store.ids.tolist()) == set(seen)
    ids = np.array(sorted(seen)[:10], np.int64)
    before = store.pull(ids).copy()
    store.push(ids, np.ones((10, 4), np.float32), lr=0.1)
    assert (store.pull(ids) < before).all()
    assert len(store) == len(seen)
    slots = store.slots(np.array([HUGE + 1], np.int64), create=False)
    assert slots.tolist() == [-1] and len(store) == len(seen)


def test_store_rows_do_not_depend_on_the_shard_count():
    ids = _ids(np.random.default_rng(3), (2000,), 5000, pad=0.0)
    ids = np.unique(ids)
    single = EmbeddingStore(8, table=2, seed=11)
    expected = single.pull(ids)
    for shards in (2, 3, 4):
        stores = [EmbeddingStore(8, table=2, seed=11, capacity=16) for _ in range(shards)]
        owner = ids % shards
        for s, store in enumerate(stores):
            mine = ids[owner == s]
            np.testing.assert_array_equal(store.pull(mine), expected[owner == s])
    other = EmbeddingStore(8, table=3, seed=11).pull(ids[:5])
    assert not np.array_equal(other, expected[:5])


def test_store_map_is_not_crowded_by_shard_placement():
    # Ids placed on one of 8 shards by mix64(id) % 8 agree in mix64's low bits; the map
    # salts its hash, so their homes still spread over the whole map.
    ids = np.array([x for x in range(40000) if reference.mix64(x) % 8 == 0], np.int64)
    store = EmbeddingStore(2)
    store.slots(ids)
    used = np.flatnonzero(store._keys >= 0)
    assert used.size == ids.size
    assert np.mean(used % 8 == 0) < 0.25       # 1/8 when spread; near 1 when crowded


def test_store_refuses_bad_ids():
    store = EmbeddingStore(4)
    with pytest.raises(ValueError, match="ids must be >= 0"):
        store.pull(np.array([1, -1], np.int64))
    with pytest.raises(ValueError, match="int64"):
        store.pull(np.array([1.5]))
    with pytest.raises(ValueError, match="optimizer"):
        EmbeddingStore(4, optimizer="adam")
    keys, vals, by_slot = (np.full(8, -1, np.int64), np.empty(8, np.int64),
                           np.empty(8, np.int64))
    with pytest.raises(ValueError, match="n_rows must lie in"):
        embedding.hash_lookup(keys, vals, np.array([1], np.int64), by_slot, -1, True)
    with pytest.raises(ValueError, match="too full"):
        embedding.hash_lookup(keys, vals, np.arange(4, dtype=np.int64), by_slot, 1, True)
    with pytest.raises(ValueError, match="power of two"):
        embedding.hash_lookup(keys[:6].copy(), vals[:6].copy(), np.array([1], np.int64),
                              by_slot, 0, True)


# --------------------------------------------------------------------------- threads

def _run_threads(fn, n=4):
    errors = []
    barrier = threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as exc:    # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_kernels_from_several_threads_at_once():
    batches = [_batch(seed, B=256, widths=(1,) * 20 + (4,) * 6) for seed in range(4)]
    expected = []
    for rows, inverse, offsets, grad_out in batches:
        expected.append((embedding.gather(rows, inverse, offsets, "mean"),
                         embedding.segment_sum(grad_out, inverse, rows.shape[0], offsets,
                                               "mean")))
    ids = [_ids(np.random.default_rng(s), (512, 26), 3000) for s in range(4)]
    uniques = [embedding.unique_ids(x, sort=s % 2 == 1) for s, x in enumerate(ids)]

    def work(i):
        rows, inverse, offsets, grad_out = batches[i]
        for _ in range(10):
            u, inv = embedding.unique_ids(ids[i], sort=i % 2 == 1)
            np.testing.assert_array_equal(u, uniques[i][0])
            np.testing.assert_array_equal(inv, uniques[i][1])
            np.testing.assert_array_equal(embedding.gather(rows, inverse, offsets, "mean"),
                                          expected[i][0])
            np.testing.assert_array_equal(
                embedding.segment_sum(grad_out, inverse, rows.shape[0], offsets, "mean"),
                expected[i][1])

    _run_threads(work)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_store_apply_from_threads_on_disjoint_rows_equals_sequential(optimizer):
    ids = np.arange(4000, dtype=np.int64) * 7919 + HUGE
    grads = np.random.default_rng(0).standard_normal((4000, 16), dtype=np.float32)
    stores = [EmbeddingStore(16, optimizer=optimizer) for _ in range(2)]
    for store in stores:
        store.pull(ids)
    parts = np.array_split(np.arange(4000), 4)
    for _ in range(3):
        for p in parts:
            stores[0].apply(stores[0].slots(ids[p]), grads[p], 0.05)
    slots = [stores[1].slots(ids[p], create=False) for p in parts]

    def work(i):
        for _ in range(3):
            stores[1].apply(slots[i], grads[parts[i]], 0.05)

    _run_threads(work)
    np.testing.assert_array_equal(stores[0].rows, stores[1].rows)
    if stores[0].accum is not None:
        np.testing.assert_array_equal(stores[0].accum, stores[1].accum)


def test_racy_updates_of_shared_rows_stay_finite():
    # Hogwild: threads hitting the same rows may lose updates but never corrupt a row.
    store = EmbeddingStore(16)
    ids = np.arange(64, dtype=np.int64)
    slots = store.slots(ids)
    grads = np.ones((64, 16), np.float32)

    def work(i):
        for _ in range(200):
            store.apply(slots, grads, 0.01)

    _run_threads(work)
    assert np.isfinite(store.rows).all()
    assert (store.rows < 1.0 / 4 - 0.01).all()      # every row moved down from its start


# --------------------------------------------------------------------------- fallback

def test_missing_extension_warns_once_and_the_store_runs_on_the_references():
    # Hide the compiled module, as on a machine where it was never built: one warning, and
    # a store trained a few steps holds what it holds with the compiled kernels.
    code = """
        import json, sys, warnings
        import numpy as np

        class HideExtension:
            def find_spec(self, name, path=None, target=None):
                if name == "hpcps.kernels._embedding":
                    raise ImportError("hidden by the test")
                return None

        sys.meta_path.insert(0, HideExtension())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from hpcps.kernels import embedding
            from hpcps.ps.embedding_store import EmbeddingStore
        ids = np.array([[5, -1, 2**62 + 3], [5, 9, -1]], dtype=np.int64)
        uniq, inverse = embedding.unique_ids(ids)
        store = EmbeddingStore(4, seed=3, capacity=1)
        for step in range(3):
            rows = store.pull(uniq)
            out = embedding.gather(rows, inverse, np.array([0, 1, 3]), "mean")
            grads = embedding.segment_sum(out, inverse, len(uniq), np.array([0, 1, 3]), "mean")
            store.push(uniq, grads, 0.1)
        print(json.dumps({"have": embedding.HAVE_EXTENSION, "rows": store.pull(uniq).tolist(),
                          "warnings": [str(c.message) for c in caught
                                       if "embedding" in str(c.message)]}))
        """
    results = []
    for hide in (True, False):
        env = dict(os.environ, HPCPS_NO_EXTENSION="0")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        body = textwrap.dedent(code)
        if not hide:
            body = body.replace("sys.meta_path.insert(0, HideExtension())", "")
        proc = subprocess.run([sys.executable, "-c", body], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout))
    hidden, built = results
    assert hidden["have"] is False
    assert len(hidden["warnings"]) == 1 and "slower" in hidden["warnings"][0]
    if compiled is not None:
        assert built["have"] is True and built["warnings"] == []
        np.testing.assert_allclose(hidden["rows"], built["rows"], rtol=RTOL, atol=ATOL)
