"""An embedding model's table files (hpcps.io.tables): one file per shard and checkpoint step,
a set kept whole until a newer checkpoint names a newer one, and a write the file system
refuses told in one line."""
from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcps.errors import CheckpointError
from hpcps.io import tables
from hpcps.ps.embedding_store import EmbeddingStore

DIM = 4


def stores(n_ids: int, seed: int = 0) -> list[EmbeddingStore]:
    out = [EmbeddingStore(DIM, table=t, seed=seed) for t in range(2)]
    for store in out:
        store.pull(np.arange(n_ids, dtype=np.int64))
    return out


def write_set(directory, step: int, n_shards: int, shards=None) -> list:
    return [tables.write(tables.shard_file(directory, s, n_shards, step), stores(10, s), s,
                         n_shards, step) for s in (range(n_shards) if shards is None else shards)]


def test_each_step_has_its_own_files_and_a_set_is_kept_until_a_newer_one_is_whole(tmp_path):
    """Shard 0 of 2 has written step 20, shard 1 has not (it died, or the disk filled): the
    set of step 10, which checkpoint.h5 still names, is whole and nothing is pruned. Once the
    set of 20 is whole, the files of 10 go; a file of a later step (a shard already past the
    next boundary) stays."""
    ten = write_set(tmp_path, 10, 2)
    assert [p.name for p in ten] == ["shard-0-of-2.step-10.h5", "shard-1-of-2.step-10.h5"]
    write_set(tmp_path, 20, 2, shards=[0])
    assert tables.prune(tmp_path, 20, 2, DIM) == []
    assert tables.table_files(tmp_path, 10, 2, DIM) == ten
    write_set(tmp_path, 20, 2, shards=[1])
    (later,) = write_set(tmp_path, 30, 2, shards=[0])
    assert sorted(tables.prune(tmp_path, 20, 2, DIM)) == ten
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard-0-of-2.step-20.h5", "shard-0-of-2.step-30.h5", "shard-1-of-2.step-20.h5"]
    with pytest.raises(CheckpointError, match="no complete set"):
        tables.table_files(tmp_path, 10, 2, DIM)
    assert later.exists()


WRITE_UNDER_A_LIMIT = """
import resource, signal, sys
import h5py
import numpy as np
from hpcps.io import tables
from hpcps.ps.embedding_store import EmbeddingStore
from hpcps.errors import CheckpointError
tables.PART_BYTES = int(sys.argv[2])
big = EmbeddingStore(16, table=0)
big.pull(np.arange(20000, dtype=np.int64))  # 20,000 rows of 16 floats: about 2 MB
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
try:
    tables.write(tables.shard_file(sys.argv[1], 0, 1, 7), [big], 0, 1, 7)
except CheckpointError as exc:
    print(exc)
"""


@pytest.mark.parametrize("part_bytes", [64 << 20, 64 << 10, 4 << 10])
def test_a_table_file_the_file_system_refuses_is_one_line_and_leaves_nothing(tmp_path,
                                                                            part_bytes):
    """A full disk or a quota (here a file-size limit): one CheckpointError with the system's
    reason, no HDF5 traceback on stderr, no temporary file left, and the set written before
    still whole; also when the table is written in parts smaller than HDF5's sieve buffer
    (64 KiB), which failed at the file's close and crashed HDF5 (a segmentation fault)."""
    (tmp_path / "checkpoint.h5").write_bytes(b"")  # a run directory with a checkpoint
    directory = tmp_path / "tables"
    before = write_set(directory, 3, 1)
    run = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_LIMIT, str(directory),
                          str(part_bytes)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
    path = directory / "shard-0-of-1.step-7.h5"
    assert run.stdout.splitlines() == [
        f"cannot write embedding table file {path}: File too large (the checkpoint before and "
        "its table files are unchanged: make room, then --resume auto continues from it)"]
    assert sorted(directory.iterdir()) == before
    assert tables.table_files(directory, 3, 2, DIM) == before


# -- a table is never copied whole to be written or read -------------------------------------
def _table(ids: np.ndarray, dim: int, seed: int) -> EmbeddingStore:
    """A table of rows ``ids`` (in that slot order) with random rows and Adagrad state."""
    rng = np.random.default_rng(seed)
    store = EmbeddingStore(dim, seed=seed, optimizer="adagrad", capacity=len(ids))
    store.load(ids, rng.standard_normal((len(ids), dim), dtype=np.float32),
               rng.random((len(ids), dim), dtype=np.float32))
    return store


def _peak_bytes(fn):
    """``fn()`` and the most bytes Python and NumPy held at once beyond what they held before
    (tracemalloc counts NumPy's arrays)."""
    import tracemalloc
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_table_is_written_sorted_by_id_a_part_at_a_time(tmp_path, monkeypatch):
    """The file holds the rows and their state sorted by id, and writing it takes memory for
    a part of them (here 256 KiB), not for a sorted copy of the whole table."""
    monkeypatch.setattr(tables, "PART_BYTES", 256 << 10)
    dim, ids = 64, np.random.default_rng(0).permutation(200_000)[:20_000].astype(np.int64)
    store = _table(ids, dim, seed=0)
    whole = store.rows.nbytes + store.accum.nbytes  # 10 MB: a copy of them was the old peak
    path, peak = _peak_bytes(lambda: tables.write(tmp_path / "t.h5", [store], 0, 1, 7))
    assert peak < whole / 8, (peak, whole)
    order = np.argsort(ids)
    with h5py.File(path, "r") as f:
        assert (f["table0/ids"][()] == ids[order]).all()
        assert np.array_equal(f["table0/rows"][()], store.rows[order])
        assert np.array_equal(f["table0/accum"][()], store.accum[order])
        assert f["table0"].attrs["rows"] == len(ids)
    assert tables.count([path], 0) == (len(ids), "adagrad")


def test_a_shard_takes_its_rows_from_every_file_a_part_at_a_time(tmp_path, monkeypatch):
    """A shard resuming (here shard 1 of 4) from the files of 3 shards takes exactly the rows
    placed on it, with their state, reading a part at a time: its peak memory is below the
    files' rows (each file whole, and their concatenation, were the old peak: twice them)."""
    from mpi4py import MPI

    from hpcps.kernels.embedding import place
    from hpcps.ps.rows import RowShard
    monkeypatch.setattr(tables, "PART_BYTES", 256 << 10)
    dim, ids = 64, np.random.default_rng(1).permutation(10**6)[:30_000].astype(np.int64)
    sources = [_table(part, dim, seed=s) for s, part in enumerate(np.array_split(ids, 3))]
    files = [tables.write(tmp_path / f"s{s}.h5", [store], s, 3, 5)
             for s, store in enumerate(sources)]
    whole = sum(s.rows.nbytes + s.accum.nbytes for s in sources)  # 15 MB
    shard = RowShard(MPI.COMM_SELF, 1, dim, seed=9, optimizer="adagrad", lr=0.1)
    taken, peak = _peak_bytes(lambda: shard.load(files, 1, 4))
    assert peak < whole, (peak, whole)
    mine = ids[place(np.zeros(len(ids), dtype=np.int64), ids, 4) == 1]
    assert taken == len(mine) and sorted(shard.tables[0].ids) == sorted(mine)
    got = shard.tables[0]
    slot = {int(i): k for k, i in enumerate(got.ids)}
    for source in sources:
        for k, i in enumerate(source.ids):
            if int(i) in slot:
                assert np.array_equal(got.rows[slot[int(i)]], source.rows[k])
                assert np.array_equal(got.accum[slot[int(i)]], source.accum[k])


def test_a_table_write_over_half_the_timeout_is_warned_about(tmp_path, capsys, monkeypatch):
    """A shard serves nobody while it writes its rows, and the ranks waiting on it fail after
    --timeout: a write that took over half of it says so, naming the shard, the file's size
    and the option to raise; a quick one says nothing. (On a clock the writes move: what is
    judged is the time they report, not how loaded this machine is.)"""
    from types import SimpleNamespace as NS

    from hpcps.strategies import embedding
    clock = NS(now=0.0)
    monkeypatch.setattr(embedding, "time", NS(monotonic=lambda: clock.now))

    class Rows:  # a shard's rows whose write takes ``seconds``
        def __init__(self, seconds):
            self.seconds = seconds

        def write(self, path, shard, n_shards, step):
            clock.now += self.seconds
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * 2**20)
            return path

    ctx = NS(cfg=NS(timeout=0.6), grid=NS(role=NS(shard=1), layout=NS(servers=2)),
             run_dir=tmp_path)
    path = embedding.write_rows(ctx, Rows(0.3), 10)
    assert path == tmp_path / "tables" / "shard-1-of-2.step-10.h5"
    assert capsys.readouterr().out == ""
    embedding.write_rows(ctx, Rows(0.4), 20)
    out = capsys.readouterr().out
    assert out.startswith("[hpcps] warning: server shard 1 took 0.4 s") and out.count("\n") == 1
    assert "to write its embedding table file (0.0 GiB, step 20), over half of --timeout 0.6 s" \
        in out and "raise --timeout" in out, out


def test_the_same_rows_are_not_written_twice(tmp_path, monkeypatch):
    """A run whose last step is a checkpoint's asks its shards for the rows of that step twice
    (the checkpoint, then the end): with no pull or push served in between the file holds
    them already and is not written again; after one, or for another step, it is."""
    from mpi4py import MPI

    from hpcps.ps.rows import RowShard
    shard = RowShard(MPI.COMM_SELF, 1, DIM, seed=0, optimizer="adagrad", lr=0.1)
    shard.tables[0].pull(np.arange(50, dtype=np.int64))
    writes = []
    real = tables.write
    monkeypatch.setattr(tables, "write", lambda path, *a: writes.append(path) or real(path, *a))
    path = tables.shard_file(tmp_path, 0, 1, 20)
    assert shard.write(path, 0, 1, 20) == path and shard.write(path, 0, 1, 20) == path
    assert writes == [path]
    shard.pushes += 1  # a push served (its rows changed)
    shard.write(path, 0, 1, 20)
    later = tables.shard_file(tmp_path, 0, 1, 30)
    shard.write(later, 0, 1, 30)
    assert writes == [path, path, later]
    path.unlink()  # gone (pruned): written again
    shard.write(path, 0, 1, 20)
    assert writes == [path, path, later, path] and path.exists()
