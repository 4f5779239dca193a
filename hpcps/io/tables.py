"""Embedding tables on disk: each server shard's rows in one HDF5 file beside the checkpoint.

An embedding model's checkpoint is ``checkpoint.h5`` (the fc layers, as any model's) and the
directory ``tables/`` beside it, one file per server shard, ``shard-<s>-of-<S>.h5``, each
written by its shard alone (no table is ever gathered on one rank)::

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
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from hpcps.errors import CheckpointError

TABLES_DIR = "tables"  # beside checkpoint.h5
FORMAT = "hpcps-embedding-rows"


def shard_file(directory: Path, shard: int, n_shards: int) -> Path:
    return Path(directory) / f"shard-{shard}-of-{n_shards}.h5"


def write(path: Path, stores: Sequence, shard: int, n_shards: int, step: int) -> Path:
    """Write ``stores`` (one :class:`hpcps.ps.embedding_store.EmbeddingStore` per table: ids,
    rows, accum, optimizer) as one file, to a temporary name fsynced and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    dim = stores[0].dim if stores else 0
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(format=FORMAT, shard=shard, n_shards=n_shards, step=int(step),
                           dim=dim, n_tables=len(stores),
                           placement="hpcps.kernels.embedding.place: splitmix64's finaliser "
                                     "of id + (table + 1) * 0x9E3779B97F4A7C15, mod n_shards")
            for t, store in enumerate(stores):
                order = np.argsort(store.ids, kind="stable")
                g = f.create_group(f"table{t}")
                g.attrs.update(optimizer=store.optimizer, rows=len(store))
                g.create_dataset("ids", data=store.ids[order])
                g.create_dataset("rows", data=store.rows[order])
                if store.accum is not None:
                    g.create_dataset("accum", data=store.accum[order])
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def table_files(directory: Path, step: int, n_tables: int, dim: int) -> list[Path]:
    """The table files in ``directory`` that hold the rows at global ``step``: the complete
    set ``shard-<s>-of-<S>.h5``, s = 0..S-1, of one S, each with attributes ``step``,
    ``n_tables`` and ``dim`` as asked. Raises CheckpointError when there is none."""
    sets: dict[int, dict[int, Path]] = {}
    for path in sorted(Path(directory).glob("shard-*-of-*.h5")):
        try:
            with h5py.File(path, "r") as f:
                a = f.attrs
                if (int(a["step"]), int(a["dim"]), int(a["n_tables"])) != (step, dim, n_tables):
                    continue
                sets.setdefault(int(a["n_shards"]), {})[int(a["shard"])] = path
        except (OSError, KeyError, ValueError):
            continue  # not a table file, or a torn one: another set may be whole
    for n, got in sorted(sets.items()):
        if sorted(got) == list(range(n)):
            return [got[s] for s in range(n)]
    raise CheckpointError(f"{directory} holds no complete set of embedding table files "
                          f"(shard-<s>-of-<S>.h5) of step {step} with {n_tables} tables of "
                          f"{dim} dimensions: the checkpoint's rows are missing")


def read(files: Sequence[Path], table: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, str | None]:
    """Table ``table``'s rows from every file: (ids, rows, accum or None, optimizer)."""
    ids, rows, accum, optimizer = [], [], [], None
    for path in files:
        try:
            with h5py.File(path, "r") as f:
                g = f[f"table{table}"]
                ids.append(g["ids"][()])
                rows.append(g["rows"][()])
                accum.append(g["accum"][()] if "accum" in g else None)
                optimizer = str(g.attrs.get("optimizer", ""))
        except (OSError, KeyError) as exc:
            raise CheckpointError(f"cannot read table {table} from {path}: {exc}") from None
    have = [a for a in accum if a is not None]
    return (np.concatenate(ids), np.concatenate(rows),
            np.concatenate(have) if len(have) == len(accum) and have else None, optimizer)
