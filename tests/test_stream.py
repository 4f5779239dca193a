"""Serial tests of streaming data (hpcps.io.data.stream): the iterator against the in-memory
one, the chunk plan and the budget rule, evaluation in chunks."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hpcps.errors import DataError
from hpcps.io.data import Batches, Prefetcher
from hpcps.io.data.h5format import DenseWriter, load_split, write_dataset
from hpcps.io.data.stream import (MIN_CHUNK_ROWS, RowSource, StreamBatches, chunks, decide,
                                  plan_stream, stream_bytes)
from hpcps.runtime.memory import MIB, data_budget

N, D = 1000, 3


def numbered(path, n=N, d=D, writer=False):
    """A dataset whose row i has x[i, 0] == i (so a batch tells which rows it holds)."""
    x = np.zeros((n, d), np.float32)
    x[:, 0] = np.arange(n)
    y = np.arange(n) % 10
    if writer:  # chunked datasets, read through h5py
        with DenseWriter(path, n_features=d, name="t", description="t", source="t",
                         x_description="t") as w:
            w.append("train", x, y)
            w.append("test", x[:20], y[:20])
            w.finish(10)
    else:  # contiguous float32: read by pread
        write_dataset(path, name="t", description="t", source="t", n_classes=10,
                      x_description="t", train=(x, y), test=(x[:20], y[:20]))
    return path


@pytest.fixture(params=["contiguous", "chunked"])
def h5(request, tmp_path):
    return numbered(tmp_path / "n.h5", writer=request.param == "chunked")


def rows_of(batch):
    return batch[0][:, 0].astype(np.int64)


def stream(path, batch=32, seed=0, chunk=100, window=3, lo=0, hi=N, held=()):
    src = RowSource(str(path), "train", D, lo, hi, np.asarray(held, np.int64))
    return StreamBatches(src, batch, seed, chunk, window)


def served(it, n_batches):
    try:
        return np.concatenate([rows_of(next(it)) for _ in range(n_batches)])
    finally:
        it.close()


@pytest.mark.parametrize("batch,chunk,window", [(32, 100, 3), (7, 64, 1), (1000, 256, 8),
                                                (50, 1000, 2), (33, 333, 4)])
def test_every_row_once_per_epoch_and_full_batches(h5, batch, chunk, window):
    it = stream(h5, batch, 3, chunk, window)
    epochs = 3
    n_batches = epochs * N // batch
    out = []
    for k in range(n_batches):
        x, y = next(it)
        assert x.shape == (batch, D) and y.shape == (batch,) and x.dtype == np.float32
        assert np.array_equal(y, x[:, 0].astype(np.int64) % 10)  # labels stay with rows
        out.append(x[:, 0].astype(np.int64))
        assert it.epoch == (k + 1) * batch // N
        assert it.epochs_done == pytest.approx((k + 1) * batch / N)
    it.close()
    rows = np.concatenate(out)
    for e in range(len(rows) // N):
        assert np.array_equal(np.sort(rows[e * N:(e + 1) * N]), np.arange(N)), e


def test_contiguous_float32_is_read_without_h5py(tmp_path):
    fast = stream(numbered(tmp_path / "a.h5"))
    slow = stream(numbered(tmp_path / "b.h5", writer=True))
    assert fast._reader._fd >= 0 and slow._reader._fd < 0
    assert np.array_equal(served(fast, 30), served(slow, 30))


def test_epoch_counting_is_that_of_batches(h5):
    x, y = load_split(h5, "train")
    ref, it = Batches(x, y, 48, seed=0), stream(h5, 48)
    for _ in range(100):
        next(ref)
        next(it)
        assert (it.epoch, it.epochs_done) == (ref.epoch, ref.epochs_done)
    it.close()


def test_reproducible_from_the_seed_and_seeds_differ(h5):
    a, b, c = served(stream(h5, seed=5), 70), served(stream(h5, seed=5), 70), \
        served(stream(h5, seed=6), 70)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_the_same_order_whatever_the_reading_thread_does(h5):
    # behind a Prefetcher (another thread between), and read one batch at a time with pauses
    a = served(stream(h5, seed=1), 40)
    pre = Prefetcher(stream(h5, seed=1), depth=3)
    b = np.concatenate([rows_of(next(pre)) for _ in range(40)])
    pre.close()
    assert np.array_equal(a, b)
    assert not pre.batches._thread.is_alive()  # Prefetcher.close stopped the reader too


def test_the_window_mixes_rows_of_several_chunks(h5):
    chunk, window, batch = 100, 4, 40
    rows = served(stream(h5, batch, 0, chunk, window), N // batch)
    # each batch draws from the window's chunks: typically from several, never from one only
    per_batch = [len(set(r // chunk)) for r in rows.reshape(-1, batch)]
    assert min(per_batch) >= 2 and np.mean(per_batch) > 3
    # the chunk order itself is permuted: the first window is not chunks 0..3 every epoch
    firsts = {tuple(sorted(set(served(stream(h5, batch, s, chunk, window), 2) // chunk)))
              for s in range(5)}
    assert len(firsts) > 1
    # a window of one chunk still shuffles inside the chunk
    one = served(stream(h5, 10, 0, chunk, 1), 10)
    assert len(set(one // chunk)) == 1 and not np.array_equal(one, np.sort(one))


def test_held_out_rows_and_blocks_are_left_out(h5):
    held = np.array([3, 150, 151, 599, 700])
    it = stream(h5, 25, 0, 64, 3, lo=100, hi=600, held=held)
    assert len(it.source) == 500 - 3
    rows = served(it, 2 * 497 // 25)
    first = rows[:497]
    assert np.array_equal(np.sort(first), np.setdiff1d(np.arange(100, 600), held))


def test_explicit_rows_and_chunks_in_order(h5):
    rows = np.array([0, 5, 6, 400, 999])
    src = RowSource(str(h5), "train", D, rows=rows)
    parts = list(chunks(src, 2))
    assert [len(p[1]) for p in parts] == [2, 2, 1]
    assert np.array_equal(np.concatenate([p[0][:, 0] for p in parts]), rows)
    whole = RowSource(str(h5), "train", D, 0, N)
    got = np.concatenate([x[:, 0] for x, _ in chunks(whole, 300)])
    assert np.array_equal(got, np.arange(N))


def test_refusals(h5):
    with pytest.raises(DataError, match="fewer than batch_size"):
        stream(h5, 50, lo=0, hi=40)
    with pytest.raises(DataError, match="batch_size"):
        stream(h5, 0)


def test_a_bad_row_ends_the_stream_with_its_message(tmp_path):
    path = numbered(tmp_path / "nan.h5")
    import h5py
    with h5py.File(path, "r+") as f:
        f["train/x"][700, 1] = np.nan
    it = stream(path, 100, chunk=100, window=1)
    with pytest.raises(DataError, match="non-finite"):
        for _ in range(20):
            next(it)
    it.close()


# -- the plan and the budget -------------------------------------------------------------------
def test_the_chunk_plan_fits_the_budget():
    d = 784
    chunk, window = plan_stream(d, 60000, 64 * MIB)
    assert stream_bytes(chunk, window, d) <= 64 * MIB and window == 8
    assert plan_stream(d, 60000, 10 * 2 ** 30)[0] * (4 * d + 8) <= 4 * MIB  # capped at 4 MiB
    assert plan_stream(d, 60000, 1000)[0] == MIN_CHUNK_ROWS  # tiny budgets: the floor
    assert plan_stream(d, 100, 1000) == (100, 1)  # never more rows than there are


def test_what_streams():
    d = decide(100, 50, 150, 10)  # everything fits together: nothing streams
    assert not d.train and not d.evaluation
    d = decide(100, 50, 120, 10)
    assert d.train and not d.evaluation
    d = decide(100, 50, 40, 10)
    assert d.train and d.evaluation
    d = decide(0, 50, 40, 10)  # a rank that holds only the evaluation splits
    assert not d.train and d.evaluation
    # a training block that may not stream: the evaluation splits make room, or it is refused
    assert decide(100, 50, 120, 10, train_may_stream=False) == (False, True)
    assert decide(100, 50, 90, 10, train_may_stream=False) == (True, True)


def test_the_budget_rule():
    gib = 2 ** 30
    # half of what is available on the node, shared by its ranks
    assert data_budget(ranks_on_node=4, mem_available=16 * gib) == 2 * gib
    # a cgroup limit below it wins (limit - usage)
    assert data_budget(4, 16 * gib, cgroup_limit=8 * gib, cgroup_usage=4 * gib) == gib // 2
    # an address-space limit per process (RLIMIT_AS) wins when smaller: half of what is left
    assert data_budget(1, 16 * gib, rlimit_as=600 * MIB, vm_size=400 * MIB) == 100 * MIB
    assert data_budget(1, 16 * gib, rlimit_as=300 * MIB, vm_size=400 * MIB) == 0


# -- the job's decision (hpcps.strategies.feed.plan), as every rank computes it --------------
def _plan(argv, n, budgets, n_train=60000, n_test=10000, d=784, val=0):
    from hpcps import config
    from hpcps.strategies.feed import plan
    cfg = config.parse(argv)
    layout = config.plan(cfg, n)
    return plan(cfg, layout, n_train, n_test, d, val, [int(b * MIB) for b in budgets],
                "test budget")


def test_the_job_streams_when_any_replica_block_does_not_fit():
    rb = 784 * 4 + 8
    block = 30000 * rb / MIB  # MNIST over 2 replicas: 89.9 MiB each
    f = _plan(["--strategy", "sync"], 2, [1000, 1000])
    assert not f.train and not f.evaluation and "data in memory" in f.describe()
    # rank 1 has less memory: every replica streams (the partitions of a replica must draw
    # the same batches), with the chunk plan of the smallest budget
    f = _plan(["--strategy", "sync"], 2, [1000, 60])
    assert f.train and not f.evaluation and f.budget == 60 * MIB
    assert stream_bytes(f.chunk_rows, f.window, 784) <= 60 * MIB
    assert "stream from the file in chunks of" in f.describe()
    # the chief's test set beside its block: the block streams, the test set fits beside it
    f = _plan(["--strategy", "sync"], 2, [block + 10, 1000])
    assert f.train and not f.evaluation
    f = _plan(["--strategy", "sync"], 2, [20, 1000])
    assert f.train and f.evaluation and 256 <= f.eval_rows <= 8192
    # a server shard holds no data; downpour with 1 shard and 2 replicas
    f = _plan(["--strategy", "downpour", "--servers", "1"], 3, [1000, 1000, 1])
    assert not f.train and not f.evaluation


def test_strategies_that_cannot_stream_refuse_with_the_way_out():
    from hpcps.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        _plan(["--strategy", "sandblaster"], 4, [100] * 4)
    text = str(err.value)
    assert "holds the whole training set" in text and "--data-memory 180 or more" in text
    assert "downpour" in text and "sync" in text and "sandblaster" not in text.split(":")[-1]
    # its test set may stream while the training set fits alone
    f = _plan(["--strategy", "sandblaster"], 4, [190] * 4)
    assert not f.train and f.evaluation
    # a categorical file's rows stream too (d: a row's size in float32 numbers)
    f = _plan(["--strategy", "downpour", "--servers", "1", "--model", "embed8,fc16,fc1"], 3,
              [1] * 3, d=40)
    assert f.train and f.evaluation


def test_this_machines_budget_is_read_and_explained():
    from hpcps.runtime.memory import system_data_budget
    budget, why = system_data_budget(4)
    assert budget > 0 and "MemAvailable" in why and "4 rank(s) on the node" in why
    assert system_data_budget(1)[0] >= budget


def test_the_reading_thread_runs_below_the_training_thread(h5):
    """The reading thread lowers its own priority by READER_NICE (Linux: per thread), so on
    cores all taken it reads in what training leaves; the caller's stays as it was."""
    from hpcps.io.data.stream import READER_NICE
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    it = stream(h5)
    try:
        next(it)  # the thread has run (it read the first window)
        reader = it._thread.native_id
        assert os.getpriority(os.PRIO_PROCESS, reader) == min(19, mine + READER_NICE)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        it.close()


# -- categorical files (ids, labels and dense features) stream too ---------------------------


def categorical(path, n=700, ids_dtype=None):
    """A categorical file whose row i has ids[i, 0] == i % 50 (field a), ids[i, 1] == i // 50
    (field b) and dense[i, 0] == i, so a batch tells which rows it holds; ``ids_dtype``:
    rewrite /train/ids in that dtype (read through h5py, not pread)."""
    import h5py

    from hpcps.io.data.categorical import CategoricalWriter, Field
    fields = [Field("a", 1, 50), Field("b", 1, n // 50 + 1)]
    i = np.arange(n)
    ids = np.stack([i % 50, i // 50], axis=1).astype(np.int64)
    dense = np.stack([i, -i], axis=1).astype(np.float32)
    y = (i % 3 == 0).astype(np.int64)
    with CategoricalWriter(path, name="c", description="c", source="c", split_note="c",
                           fields=fields, n_rows={"train": n, "test": 40},
                           dense_names=["d0", "d1"], label_description="c") as w:
        w.write("train", ids, y, dense)
        w.write("test", ids[:40], y[:40], dense[:40])
        w.close()
    if ids_dtype is not None:
        with h5py.File(path, "r+") as f:
            del f["train/ids"]
            f.create_dataset("train/ids", data=ids.astype(ids_dtype), chunks=(64, 2))
    return path


@pytest.mark.parametrize("ids_dtype", [None, np.int32])
def test_categorical_rows_stream_as_load_block_reads_them(tmp_path, ids_dtype):
    """Every row of a replica's block once per epoch, each row's ids, dense features and
    label together and as load_block reads them, full batches of ((ids, dense), y); the
    same by pread (int64 ids) and through h5py (int32 ids)."""
    from hpcps.io.data.categorical import CategoricalRows, load_block, open_categorical
    path = categorical(tmp_path / "c.h5", ids_dtype=ids_dtype)
    info = open_categorical(path)
    block = load_block(path, "train", 1, 2)  # rows 350..699
    src = RowSource(str(path), "train", 2 * 2 + 2, 350, 700, layout=CategoricalRows.of(info))
    assert src.row_bytes == 2 * 8 + 8 + 2 * 4
    it = StreamBatches(src, 32, 5, 60, 2)
    try:
        got = []
        for _ in range(2 * 350 // 32):
            (ids, dense), y = next(it)
            assert ids.shape == (32, 2) and ids.dtype == np.int64 and dense.shape == (32, 2)
            assert dense.dtype == np.float32 and y.dtype == np.int64 and y.shape == (32,)
            r = dense[:, 0].astype(np.int64)
            np.testing.assert_array_equal(ids, block.ids[r - 350])
            np.testing.assert_array_equal(dense, block.dense[r - 350])
            np.testing.assert_array_equal(y, block.y[r - 350])
            got.append(r)
        rows = np.concatenate(got)
        assert sorted(rows[:350]) == list(range(350, 700))  # the first epoch: each row once
    finally:
        it.close()
    # evaluation in chunks: the split in order, as ((ids, dense), y)
    test = RowSource(str(path), "test", 6, 0, 40, layout=CategoricalRows.of(info))
    pieces = list(chunks(test, 15))
    assert [len(y) for _, y in pieces] == [15, 15, 10]
    whole = load_block(path, "test")
    np.testing.assert_array_equal(np.concatenate([ids for (ids, _), _ in pieces]), whole.ids)
    np.testing.assert_array_equal(np.concatenate([d for (_, d), _ in pieces]), whole.dense)


def test_a_bad_id_in_a_streamed_chunk_is_refused_with_its_row(tmp_path):
    """An id past its field's vocabulary, met when its chunk is read, ends the iterator
    with the row numbered from the start of the split, as load_block words it."""
    import h5py

    from hpcps.io.data.categorical import CategoricalRows, open_categorical
    path = categorical(tmp_path / "c.h5")
    info = open_categorical(path)
    with h5py.File(path, "r+") as f:
        f["train/ids"][517, 0] = 50  # field a has ids 0..49
    src = RowSource(str(path), "train", 6, 0, 700, layout=CategoricalRows.of(info))
    it = StreamBatches(src, 50, 0, 100, 1)
    try:
        with pytest.raises(DataError, match=r"row 517, column 0 \(field 'a'\): 50"):
            for _ in range(14):
                next(it)
    finally:
        it.close()
