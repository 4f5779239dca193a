"""An embedding model's table files (hpcps.io.tables): one file per shard and checkpoint step,
a set kept whole until a newer checkpoint names a newer one, and a write the file system
refuses told in one line."""
from __future__ import annotations

import subprocess
import sys

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
import numpy as np
from hpcps.io import tables
from hpcps.ps.embedding_store import EmbeddingStore
from hpcps.errors import CheckpointError
big = EmbeddingStore(16, table=0)
big.pull(np.arange(20000, dtype=np.int64))  # 20,000 rows of 16 floats: about 2 MB
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
try:
    tables.write(tables.shard_file(sys.argv[1], 0, 1, 7), [big], 0, 1, 7)
except CheckpointError as exc:
    print(exc)
"""


def test_a_table_file_the_file_system_refuses_is_one_line_and_leaves_nothing(tmp_path):
    """A full disk or a quota (here a file-size limit): one CheckpointError with the system's
    reason, no HDF5 traceback on stderr, no temporary file left, and the set written before
    still whole."""
    (tmp_path / "checkpoint.h5").write_bytes(b"")  # a run directory with a checkpoint
    directory = tmp_path / "tables"
    before = write_set(directory, 3, 1)
    run = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_LIMIT, str(directory)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
    path = directory / "shard-0-of-1.step-7.h5"
    assert run.stdout.splitlines() == [
        f"cannot write embedding table file {path}: File too large (the checkpoint before and "
        "its table files are unchanged: make room, then --resume auto continues from it)"]
    assert sorted(directory.iterdir()) == before
    assert tables.table_files(directory, 3, 2, DIM) == before
