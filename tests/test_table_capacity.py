"""Capacity with eviction and admission after c sightings (``--table-capacity``,
``--admit-after``): the row store against a plain Python reference (LRU order, eviction
counts, dense arrays, a consistent map), the count-min sketch, the table files, and
multi-rank downpour runs (every launch has a hard timeout, tests/mpirun.py)."""
from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict

import h5py
import numpy as np
import pytest

from hpcps.io import tables
from hpcps.ps.admission import COUNTER_MAX, Admission, CountMinSketch
from hpcps.ps.embedding_store import HEADROOM, EmbeddingStore

import mpirun

DIM = 4
SPEC = "embed8,fc16,fc1"


def initial(ids, table=0, seed=5):
    """The rows ``ids`` start from (what a fresh store would create)."""
    return EmbeddingStore(DIM, table=table, seed=seed).peek(np.asarray(ids, np.int64))


class Reference:
    """The store's contract in plain Python: an LRU dict of rows (least recent first), SGD
    pushes, bulk eviction to ``cap - headroom`` rows, admission by exact counts."""

    def __init__(self, cap, after=1, lr=0.5):
        self.cap, self.after, self.lr = cap, after, lr
        self.headroom = max(1, int(HEADROOM * cap))
        self.rows = OrderedDict()
        self.seen = Counter()
        self.evicted = self.dropped = self.zeroed = 0
        self.gone = set()  # ids evicted and not held since

    def pull(self, ids):
        out, admitted = {}, []
        for i in ids:
            if i in self.rows:
                admitted.append(i)
                continue
            self.seen[i] += 1
            if self.seen[i] >= self.after:
                admitted.append(i)
            else:
                out[i] = np.zeros(DIM, np.float32)
                self.zeroed += 1
        new = [i for i in admitted if i not in self.rows]
        if len(self.rows) + len(new) > self.cap:
            batch = set(admitted)
            go = min(len(self.rows) + len(new) - max(0, self.cap - self.headroom),
                     len(self.rows) - (len(admitted) - len(new)))
            victims = [i for i in self.rows if i not in batch][:go]
            for i in victims:
                del self.rows[i]
                self.gone.add(i)
            self.evicted += len(victims)
        for i, row in zip(new, initial(new)):
            self.rows[i] = row.copy()
            self.gone.discard(i)
        for i in admitted:
            self.rows.move_to_end(i)
            out[i] = self.rows[i]
        return np.array([out[i] for i in ids], np.float32).reshape(len(ids), DIM)

    def push(self, ids, grads):
        for i, g in zip(ids, grads):
            if i in self.rows:
                self.rows[i] = self.rows[i] - np.float32(self.lr) * g
                self.rows.move_to_end(i)
            else:
                self.dropped += 1


def check_consistent(store, ref):
    """Dense arrays, the map finds every held id at its slot and no evicted one, the LRU
    order, the counts and the rows are the reference's."""
    n = len(store)
    assert n <= store.max_rows and len(store.ids) == n and len(store.rows) == n
    assert len(set(store.ids.tolist())) == n, "an id in two slots"
    np.testing.assert_array_equal(store.slots(store.ids.copy(), create=False), np.arange(n))
    gone = np.array(sorted(ref.gone), np.int64)
    assert (store.slots(gone, create=False) == -1).all(), "an evicted id is still found"
    by_recency = store.ids[np.argsort(store.used, kind="stable")].tolist()
    assert by_recency == list(ref.rows), "LRU order"
    assert len(np.unique(store.used)) == n, "ticks are distinct"
    assert (store.evicted, store.dropped, store.zeroed) == (ref.evicted, ref.dropped,
                                                            ref.zeroed)
    want = np.array([ref.rows[i] for i in store.ids.tolist()], np.float32).reshape(n, DIM)
    np.testing.assert_allclose(store.rows, want, rtol=1e-5, atol=1e-6)


def zipf_batches(rng, steps, vocab, size):
    """Batches of distinct ids, a Zipf-like head and a long tail."""
    for _ in range(steps):
        uniq = np.unique(np.minimum(rng.zipf(1.3, size), vocab) - 1).astype(np.int64)
        yield uniq[rng.permutation(len(uniq))]  # first-seen order is not sorted


@pytest.mark.parametrize("cap,after", [(64, 1), (37, 1), (64, 3), (1000, 2)])
def test_store_follows_the_reference(cap, after):
    rng = np.random.default_rng(cap + after)
    adm = Admission(after, CountMinSketch(4, 1 << 16)) if after > 1 else None
    store = EmbeddingStore(DIM, seed=5, optimizer="sgd", max_rows=cap, capacity=8,
                           admission=adm)
    ref = Reference(cap, after)
    last = []
    for k, ids in enumerate(zipf_batches(rng, 300, 500, 30)):
        got = store.pull(ids)
        np.testing.assert_allclose(got, ref.pull(ids.tolist()), rtol=1e-5, atol=1e-6)
        last.append(ids)
        # a third of the time, push a batch six pulls old instead: some of its rows are gone
        push = last[-7] if k % 3 == 0 and len(last) > 6 else ids
        grads = rng.standard_normal((len(push), DIM)).astype(np.float32)
        store.push(push, grads, 0.5)
        ref.push(push.tolist(), grads)
        check_consistent(store, ref)
    if cap < 500:
        assert store.evicted > 0 and store.dropped > 0
    if after > 1:
        assert store.zeroed > 0


def test_eviction_is_in_bulk_to_ninety_percent():
    store = EmbeddingStore(DIM, max_rows=100)
    for k in range(10):
        store.pull(np.arange(10 * k, 10 * k + 10, dtype=np.int64))
    assert len(store) == 100 and store.evicted == 0
    store.pull(np.arange(100, 105, dtype=np.int64))  # 5 new: down to 90 rows held
    assert store.evicted == 15 and len(store) == 90
    assert set(store.ids.tolist()) == set(range(15, 105))  # the 15 least recent went
    store.pull(np.arange(105, 115, dtype=np.int64))  # 10 more fit without an eviction
    assert store.evicted == 15 and len(store) == 100
    assert store.capacity == 100, "the arrays never grow past the capacity"


def test_eviction_spares_the_rows_of_the_batch():
    store = EmbeddingStore(DIM, max_rows=10)
    store.pull(np.arange(10, dtype=np.int64))
    before = store.pull(np.array([0], np.int64)).copy()
    store.pull(np.arange(1, 10, dtype=np.int64))  # 0 is now the least recently used
    got = store.pull(np.array([0, 10], np.int64))  # but it is in the batch: others go
    assert 0 in store.ids and 10 in store.ids and store.evicted == 2
    np.testing.assert_array_equal(got[0], before[0])
    with pytest.raises(ValueError, match="more than its capacity"):
        store.pull(np.arange(100, 111, dtype=np.int64))


def test_an_evicted_row_starts_again_from_its_initial_row():
    store = EmbeddingStore(DIM, seed=5, optimizer="sgd", max_rows=4)
    one = np.array([7], np.int64)
    store.pull(one)
    store.push(one, np.ones((1, DIM), np.float32), 1.0)
    assert not np.allclose(store.pull(one), initial(one))
    store.pull(np.arange(100, 104, dtype=np.int64))  # evicts 7
    assert 7 not in store.ids
    np.testing.assert_array_equal(store.peek(one), initial(one))  # read, not stored
    assert 7 not in store.ids and store.evicted == 1
    np.testing.assert_array_equal(store.pull(one), initial(one))


def test_admission_zeros_until_the_cth_sighting():
    adm = Admission(3, CountMinSketch(4, 1 << 12))
    store = EmbeddingStore(DIM, table=0, seed=5, optimizer="sgd", admission=adm)
    ids = np.array([4, 9], np.int64)
    for k in range(2):
        np.testing.assert_array_equal(store.pull(ids), np.zeros((2, DIM), np.float32))
        store.push(ids, np.ones((2, DIM), np.float32), 1.0)  # dropped: no row
        assert len(store) == 0 and store.zeroed == 2 * (k + 1) and store.dropped == 2 * (k + 1)
    np.testing.assert_array_equal(store.peek(ids), 0.0)  # evaluation reads zeros too
    np.testing.assert_array_equal(store.pull(ids), initial(ids))  # the third: real rows
    assert len(store) == 2 and store.zeroed == 4
    store.push(ids, np.ones((2, DIM), np.float32), 1.0)
    np.testing.assert_allclose(store.pull(ids), initial(ids) - 1.0, atol=1e-6)
    assert store.dropped == 4
    # another table's id 4 is another key of the same (shared) sketch
    other = EmbeddingStore(DIM, table=1, seed=5, admission=adm)
    assert not other.pull(np.array([4], np.int64)).any() and len(other) == 0


def test_admission_mixed_batch_keeps_the_order_asked():
    store = EmbeddingStore(DIM, seed=5, admission=Admission(2, CountMinSketch(4, 1 << 12)))
    store.pull(np.array([1, 2], np.int64))
    got = store.pull(np.array([3, 1, 4, 2], np.int64))  # 1, 2 admitted now; 3, 4 not yet
    np.testing.assert_array_equal(got[[0, 2]], 0.0)
    np.testing.assert_array_equal(got[[1, 3]], initial([1, 2]))
    assert sorted(store.ids.tolist()) == [1, 2] and store.zeroed == 4


def test_count_min_sketch_never_counts_low_and_saturates():
    rng = np.random.default_rng(1)
    sketch = CountMinSketch(4, 1 << 8)  # small: many collisions
    truth = Counter()
    for _ in range(200):
        ids = np.unique(np.minimum(rng.zipf(1.2, 50), 5000)).astype(np.int64)
        table = int(rng.integers(3))
        got = sketch.add(table, ids)
        truth.update((table, int(i)) for i in ids)
        assert all(g >= truth[(table, int(i))] for g, i in zip(got, ids))
    keys = list(truth)
    for table in range(3):
        ids = np.array([i for t, i in keys if t == table], np.int64)
        est = sketch.estimate(table, ids)
        assert all(e >= truth[(table, int(i))] for e, i in zip(est, ids))
    wide = CountMinSketch()  # the default: 4 x 2**20 uint16, 8 MiB
    assert wide.nbytes == 8 << 20
    for _ in range(3):
        wide.add(2, np.arange(1000, dtype=np.int64))
    assert (wide.estimate(2, np.arange(1000, dtype=np.int64)) == 3).all()  # exact, no clash
    assert (wide.estimate(1, np.arange(1000, dtype=np.int64)) == 0).all()
    wide.counts[:] = COUNTER_MAX - 1
    assert (wide.add(0, np.array([5], np.int64)) == COUNTER_MAX).all()
    assert (wide.add(0, np.array([5], np.int64)) == COUNTER_MAX).all()  # no wrap to 0
    with pytest.raises(ValueError):
        Admission(COUNTER_MAX + 1)
    from hpcps.options import ADMIT_AFTER_MAX  # what the option refuses beyond
    assert ADMIT_AFTER_MAX == COUNTER_MAX


def test_load_beyond_the_capacity_keeps_the_rows_given_last():
    store = EmbeddingStore(DIM, max_rows=10)
    ids = np.arange(25, dtype=np.int64)
    rows = np.arange(25 * DIM, dtype=np.float32).reshape(25, DIM)
    store.load(ids, rows)
    assert len(store) <= 10 and store.evicted == 25 - len(store)
    assert 24 in store.ids and set(store.ids.tolist()) <= set(range(15, 25))
    np.testing.assert_array_equal(store.rows, rows[store.ids])


def test_table_files_hold_only_the_rows_held(tmp_path):
    stores = [EmbeddingStore(DIM, table=t, max_rows=20) for t in range(2)]
    for k in range(10):
        for store in stores:
            store.pull(np.arange(7 * k, 7 * k + 7, dtype=np.int64))
    assert all(s.evicted for s in stores)
    path = tables.write(tmp_path / "shard-0-of-1.h5", stores, 0, 1, step=3)
    with h5py.File(path, "r") as f:
        for t, store in enumerate(stores):
            ids = f[f"table{t}/ids"][()]
            assert sorted(ids.tolist()) == sorted(store.ids.tolist())
            assert len(ids) == len(store) <= 20
            order = np.argsort(store.ids)
            np.testing.assert_array_equal(f[f"table{t}/rows"][()], store.rows[order])
    back = EmbeddingStore(DIM, table=1, max_rows=20)
    got_ids, got_rows, accum, _ = tables.read([path], 1)
    back.load(got_ids, got_rows, accum)
    assert sorted(back.ids.tolist()) == sorted(stores[1].ids.tolist())


# -- multi-rank runs -----------------------------------------------------------------------

summary = mpirun.last_summary


def test_small_capacity_and_admission_train(ctr_h5, tmp_path, capsys):
    """2 replicas, 2 shards, 80 rows per table and shard of a vocabulary of 300 (about 150
    per shard): rows are evicted, pushes to evicted rows dropped, tail ids answered zeros,
    and the model still learns; the table files hold at most the capacity."""
    run_dir = tmp_path / "run"
    run = mpirun.train(4, "--model", SPEC, "--data", str(ctr_h5), "--servers", "2",
                       "--epochs", "2", "--batch-size", "64", "--warmup-steps", "20",
                       "--table-capacity", "80", "--admit-after", "2", "--eval-every", "0",
                       "--run-dir", str(run_dir), "--timeout", "60", timeout=240)
    assert run.returncode == 0, run.output
    rec = summary(run_dir)
    assert rec["test_auc"] > 0.65, rec["test_auc"]
    assert rec["table_capacity"] == 80 and rec["admit_after"] == 2
    assert rec["rows_evicted"] > 0 and rec["row_grads_dropped"] > 0 and rec["ids_zeroed"] > 0
    assert max(rec["rows_held_per_shard"]) <= 5 * 80
    assert "rows evicted" in run.stdout and "ids answered zeros before admission" in run.stdout
    assert "at most 80 rows per table and shard" in run.stdout
    for path in sorted((run_dir / "tables").glob("shard-*.h5")):
        with h5py.File(path, "r") as f:
            for t in range(5):
                ids = f[f"table{t}/ids"][()]
                assert len(ids) <= 80 and len(np.unique(ids)) == len(ids)
    # hpcps.evaluate reads the table files as the shards did (ids not held: zeros)
    from hpcps.tools import evaluate
    assert evaluate.main([str(run_dir / "checkpoint.h5"), "--data", str(ctr_h5),
                          "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["auc"] == pytest.approx(rec["test_auc"], abs=1e-6)


@pytest.mark.parametrize("extra,words", [
    (["--table-capacity", "63"], "--table-capacity 63 is below the rows one batch can touch"),
    (["--table-capacity", "100", "--threads", "2"],  # a pull serves both threads' batches
     "up to min(--batch-size 64 x --threads 2 x 1, 300) = 128"),
    (["--admit-after", "70000"], "at most 65535"),
    (["--table-capacity", "0"], "--table-capacity must be positive"),
])
def test_refused_at_start(ctr_h5, tmp_path, extra, words):
    t0 = time.monotonic()
    run = mpirun.train(3, "--model", SPEC, "--data", str(ctr_h5), "--servers", "1",
                       "--batch-size", "64", *extra, "--run-dir", str(tmp_path / "run"),
                       timeout=60)
    assert run.returncode == 2, run.output
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("hpcps: error")]
    assert len(errors) == 1 and words in errors[0], run.stderr
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "run" / "checkpoint.h5").exists()


def test_refused_without_an_embedding_model(digits_h5, tmp_path):
    for flag in ("--table-capacity", "--admit-after"):
        run = mpirun.train(2, "--data", str(digits_h5), "--servers", "1", flag, "100",
                           "--run-dir", str(tmp_path / "run"), timeout=60)
        assert run.returncode == 2, run.output
        assert f"{flag} applies to embedding models" in run.stderr
