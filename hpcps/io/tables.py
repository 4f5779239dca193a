"""Embedding tables on disk: each server shard's rows in one HDF5 file beside the checkpoint.

An embedding model's checkpoint is ``checkpoint.h5`` (the fc layers, as any model's) and the
directory ``tables/`` beside it, one file per server shard, ``shard-<s>-of-<S>.step-<N>.h5``,
each written by its shard alone (no table is ever gathered on one rank)::

    /                       attrs: format "hpcps-embedding-rows", shard, n_shards, step,
                                   dim, n_tables, placement (how ids map to shards)
    /table<t>/ids           int64 (n,)      the ids this shard holds, sorted
    /table<t>/rows          float32 (n, D)  their rows, in the same order
    /table<t>/accum         float32 (n,) per-row Adagrad, (n, D) per-element; absent for SGD
              attrs: optimizer, rows

Plain enough for h5py: ``f["table0/rows"][()]``. The files of one checkpoint share its
``step``; :func:`table_files` finds the complete set of them, written by any number of shards
(a resumed run re-hashes them onto its own, :meth:`hpcps.ps.rows.RowShard.load`). Files of
another shard count or step may sit beside them (an earlier run in the same directory) and are
passed over.

A new checkpoint's files take new names, so the set of the checkpoint before stays whole
until ``checkpoint.h5`` names the new step: a shard that cannot write its file (a full disk)
or dies writing it leaves that checkpoint usable. :func:`prune` then removes the older sets.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from hpcps.errors import CheckpointError
from hpcps.io.hdf5_writes import replace_whole, unbuffered

TABLES_DIR = "tables"  # beside checkpoint.h5
FORMAT = "hpcps-embedding-rows"


def shard_file(directory: Path, shard: int, n_shards: int, step: int) -> Path:
    return Path(directory) / f"shard-{shard}-of-{n_shards}.step-{int(step)}.h5"


def write(path: Path, stores: Sequence, shard: int, n_shards: int, step: int) -> Path:
    """Write ``stores`` (one :class:`hpcps.ps.embedding_store.EmbeddingStore` per table: ids,
    rows, accum, optimizer) as one file, to a temporary name fsynced and renamed into place.

    Raises CheckpointError, leaving nothing behind, when the file system refuses the write (a
    full disk, a quota): the reason in one line, HDF5's own reports of it kept off stderr."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    dim = stores[0].dim if stores else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    why = replace_whole(tmp, path, lambda tmp: _write(tmp, stores, shard, n_shards, step, dim))
    if why is not None:
        kept = (" (the checkpoint before and its table files are unchanged: make room, then "
                "--resume auto continues from it)") if (path.parent.parent /
                                                       "checkpoint.h5").exists() else ""
        raise CheckpointError(f"cannot write embedding table file {path}: {why}{kept}")
    return path


# The most bytes of a table's rows and optimizer state a write or a read holds in memory at
# once beside the table itself: a shard's table may be most of its memory, so a file is written
# and read a part at a time, never as one sorted copy of the table.
PART_BYTES = 64 << 20


def part_rows(dim: int) -> int:
    """Rows of width ``dim`` in one part: each its id, its values and at most ``dim`` values
    of optimizer state, :data:`PART_BYTES` in all."""
    return max(1, PART_BYTES // (8 + 8 * max(1, int(dim))))


def _write(tmp: Path, stores: Sequence, shard: int, n_shards: int, step: int, dim: int) -> None:
    with unbuffered(tmp) as f:
        f.attrs.update(format=FORMAT, shard=shard, n_shards=n_shards, step=int(step),
                       dim=dim, n_tables=len(stores),
                       placement="hpcps.kernels.embedding.place: splitmix64's finaliser "
                                 "of id + (table + 1) * 0x9E3779B97F4A7C15, mod n_shards")
        for t, store in enumerate(stores):
            order = np.argsort(store.ids, kind="stable")
            g = f.create_group(f"table{t}")
            g.attrs.update(optimizer=store.optimizer, rows=len(store))
            g.create_dataset("ids", data=store.ids[order])
            by_slot = {"rows": store.rows}
            if store.accum is not None:
                by_slot["accum"] = store.accum
            out = {name: g.create_dataset(name, shape=a.shape, dtype=a.dtype)
                   for name, a in by_slot.items()}
            step_rows = part_rows(dim)
            for a in range(0, len(order), step_rows):  # sorted by id, a part at a time
                part = order[a:a + step_rows]
                for name, values in by_slot.items():
                    out[name][a:a + len(part)] = values[part]
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())


def _sets(directory: Path) -> list[tuple[Path, tuple[int, int, int, int, int]]]:
    """Every readable table file in ``directory`` with its (step, dim, n_tables, n_shards,
    shard)."""
    found = []
    for path in sorted(Path(directory).glob("shard-*-of-*.h5")):
        try:
            with h5py.File(path, "r") as f:
                a = f.attrs
                found.append((path, (int(a["step"]), int(a["dim"]), int(a["n_tables"]),
                                     int(a["n_shards"]), int(a["shard"]))))
        except (OSError, KeyError, ValueError):
            continue  # not a table file, or a torn one: another set may be whole
    return found


def prune(directory: Path, step: int, n_tables: int, dim: int) -> list[Path]:
    """Remove the table files of steps before ``step`` once a complete set of ``step`` is in
    ``directory`` (the checkpoint that names it is written); returns the files removed.
    Files of later steps (a shard already past the next boundary) are kept."""
    try:
        table_files(directory, step, n_tables, dim)
    except CheckpointError:
        return []
    gone = []
    for path, (at, *_) in _sets(directory):
        if at < step:
            try:
                path.unlink()
                gone.append(path)
            except OSError:
                pass  # removed by another process, or not ours to remove: harmless
    return gone


def table_files(directory: Path, step: int, n_tables: int, dim: int) -> list[Path]:
    """The table files in ``directory`` that hold the rows at global ``step``: the complete
    set ``shard-<s>-of-<S>.step-<N>.h5``, s = 0..S-1, of one S, each with attributes ``step``,
    ``n_tables`` and ``dim`` as asked. Raises CheckpointError when there is none."""
    sets: dict[int, dict[int, Path]] = {}
    for path, (at, d, t, n, shard) in _sets(directory):
        if (at, d, t) == (step, dim, n_tables):
            sets.setdefault(n, {})[shard] = path
    for n, got in sorted(sets.items()):
        if sorted(got) == list(range(n)):
            return [got[s] for s in range(n)]
    raise CheckpointError(f"{directory} holds no complete set of embedding table files "
                          f"(shard-<s>-of-<S>.step-<N>.h5) of step {step} with {n_tables} "
                          f"tables of {dim} dimensions: the checkpoint's rows are missing")


def read(files: Sequence[Path], table: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str | None]:
    """Table ``table``'s rows from every file: (ids, rows, accum or None, optimizer). The whole
    table in memory: a tool's (``hpcps.evaluate``); a shard reads only its own rows, a part
    at a time (:func:`read_parts`)."""
    parts = list(read_parts(files, table))
    have = [a for _, _, a, _ in parts if a is not None]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate(have) if len(have) == len(parts) and have else None,
            parts[-1][3] if parts else None)


def read_parts(files: Sequence[Path], table: int):
    """Table ``table``'s rows from every file in turn, a part of at most :data:`PART_BYTES`
    of rows and optimizer state at a time (at least one part a file, perhaps empty): yields
    (ids, rows, accum or None, optimizer) in the files' order."""
    for path in files:
        with _table(path, table) as g:
            n, optimizer = g["ids"].shape[0], str(g.attrs.get("optimizer", ""))
            step = part_rows(g["rows"].shape[1])
            for a in range(0, max(n, 1), step):
                yield (g["ids"][a:a + step], g["rows"][a:a + step],
                       g["accum"][a:a + step] if "accum" in g else None, optimizer)


def count(files: Sequence[Path], table: int) -> tuple[int, str | None]:
    """Table ``table``'s rows in every file, and its optimizer, without reading the rows."""
    n, optimizer = 0, None
    for path in files:
        with _table(path, table) as g:
            n += int(g["ids"].shape[0])
            optimizer = str(g.attrs.get("optimizer", ""))
    return n, optimizer


@contextlib.contextmanager
def _table(path: Path, table: int):
    """The group of table ``table`` in the file ``path``, open for reading; a file or table
    that cannot be read is a CheckpointError naming both."""
    try:
        with h5py.File(path, "r") as f:
            yield f[f"table{table}"]
    except (OSError, KeyError) as exc:
        raise CheckpointError(f"cannot read table {table} from {path}: {exc}") from None
