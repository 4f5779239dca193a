"""Delayed persistence (``--persist-every SECONDS``, downpour): each server shard writes its
own chunks to its own HDF5 file from a background thread, and a manifest checkpoint reads
them as HDF5 virtual datasets (Project Adam, section 3.3: the shard's chunks are a write-back
cache whose dirty chunks are flushed in the background).

Files, in the run directory::

    checkpoint-persisted.h5          the manifest: an hpcps checkpoint (hpcps/io/checkpoint.py)
                                     whose /params and /optimizer datasets are virtual
    persist/from-<step>/shard-<s>.h5 shard s's chunks (one generation per run: <step> is
                                     the step the run started from)

A shard file holds, one after the other as contiguous float32 datasets, the shard's local
vector (``params``) and each optimizer state vector (``state/<key>``), in the shard's chunk
order, and ``chunk_step`` (int64, one per chunk): the global step at which each chunk was
last written. Its layout is fixed when the file is created; after that the writer thread
only overwrites raw bytes in place (``os.pwrite`` at the datasets' offsets, which releases
the GIL), so a process killed during a flush leaves a well-formed HDF5 file.

The protocol of a flush. Every ``SECONDS``, at a point between two messages, the shard
copies its dirty chunks (the chunks an update has touched since their last flush: a dense
update touches all) into a snapshot and hands it to the writer thread; serving goes on while
the thread writes each chunk's values and then its ``chunk_step``, and fsyncs the file. If
the thread is still writing the previous snapshot, the shard does not wait: the chunks stay
dirty for the next round. A chunk's recorded step is therefore never newer than its values.

The manifest, written by server shard 0 once every shard has created its file, maps each
layer's array (and each optimizer state array) piece by piece onto the shard files: a chunk
is a run of the flat vector, so it covers at most a few hyperslabs of a layer
(:func:`boxes`). Plain h5py reads ``f["params/layer0/W"]`` as a whole layer. The manifest's
step is the smallest ``chunk_step`` over all chunks (:func:`hpcps.io.checkpoint.load` reads it
from the virtual dataset ``/persisted/chunk_step``): what a resume starts from. Everything
applied after it is the window of potential loss, which the shards report.
"""
from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcps.errors import CheckpointError
from hpcps.io.hdf5_writes import replace_whole

MANIFEST_NAME = "checkpoint-persisted.h5"
STEP_DATASET = "persisted/chunk_step"


# -- the geometry (pure) -------------------------------------------------------------------------
def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[slice, ...], int]]:
    """The flat range ``[lo, hi)`` of a C-order array of ``shape`` as hyperslabs.

    Returns ``[(index, start)]``: ``array[index]`` holds the flat elements
    ``start .. start + its size`` of the range, in order, and the boxes cover it exactly.
    At most ``2 * ndim - 1`` boxes (a partial row, whole rows, a partial row, recursively).
    """
    shape = tuple(int(n) for n in shape)
    if not 0 <= lo <= hi <= int(np.prod(shape)):
        raise ValueError(f"range [{lo}, {hi}) outside an array of shape {shape}")
    if lo == hi:
        return []
    if len(shape) == 1:
        return [((slice(lo, hi),), lo)]
    inner = int(np.prod(shape[1:]))
    first, last = lo // inner, (hi - 1) // inner
    out = []

    def within(row: int, a: int, b: int) -> None:  # [a, b) inside one row
        for index, start in boxes(shape[1:], a, b):
            out.append(((slice(row, row + 1), *index), row * inner + start))

    if first == last:
        within(first, lo - first * inner, hi - first * inner)
        return out
    whole_from = first if lo == first * inner else first + 1
    whole_to = last + 1 if hi == (last + 1) * inner else last
    if whole_from > first:
        within(first, lo - first * inner, inner)
    if whole_to > whole_from:
        out.append(((slice(whole_from, whole_to), *(slice(0, n) for n in shape[1:])),
                    whole_from * inner))
    if whole_to <= last:
        within(last, 0, hi - last * inner)
    return out


@dataclass(frozen=True)
class Placement:
    """Where one array of one partition's local vector sits: ``name`` (``layer0/W``), its
    shape in the local vector, its offset in the global (partition-major) vector, and the
    offset along ``axis`` in the whole array of the partition's slice (its columns, or a
    conv kernel's output maps; 0 when P = 1)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    shift: int
    axis: int = -1


def placements(model, full_model) -> list[Placement]:
    """Every array of every partition of ``model`` (a whole model, a PartitionedMLP or a
    PartitionedConvNet)."""
    parts = getattr(model, "part_sizes", None)
    if parts is None:
        return [Placement(name, tuple(shape), off, 0) for name, shape, off in full_model.layout]
    axis = getattr(model, "axis", lambda name: -1)
    out, base = [], 0
    for q, size in enumerate(parts):
        off = base
        for name, shape in model._shapes(q):
            layer = int(name.split("/")[0][5:])
            out.append(Placement(name, tuple(shape), off, model.cols[layer][q][0],
                                 axis(name)))
            off += int(np.prod(shape))
        base += size
    return out


def mapping(pieces: list[tuple[int, int, int]], base: int, places: list[Placement]):
    """For a shard whose chunks are ``pieces`` ((lo, hi, at): the partition vector's
    ``[lo, hi)`` is at ``at`` in the shard's local vector) of a partition whose vector starts
    at ``base`` in the global one: ``{name: [(index in the whole array, source start,
    count)]}``."""
    out: dict[str, list] = {}
    for lo, hi, at in pieces:
        glo, ghi = base + lo, base + hi
        for p in places:
            size = int(np.prod(p.shape))
            a, b = max(glo, p.offset), min(ghi, p.offset + size)
            if a >= b:
                continue
            for index, start in boxes(p.shape, a - p.offset, b - p.offset):
                ax = p.axis % len(index)
                index = tuple(slice(s.start + p.shift, s.stop + p.shift) if i == ax else s
                              for i, s in enumerate(index))
                count = int(np.prod([s.stop - s.start for s in index]))
                out.setdefault(p.name, []).append(
                    (index, at + (p.offset + start) - glo, count))
    return out


# -- the shard's file and its writer -------------------------------------------------------------
def shard_file(directory: Path, shard: int) -> Path:
    return directory / f"shard-{shard}.h5"


def create_shard_file(path: Path, params: np.ndarray, state: dict[str, np.ndarray],
                      chunks: list[tuple[int, int]], step: int, shard: int) -> dict[str, int]:
    """Write a shard's file with its current values; return each dataset's byte offset.

    ``chunks``: (at, length) of each chunk in the local vector. Written to a temporary name
    and renamed, so the file is either absent or whole."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    offsets: dict[str, int] = {}

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["shard"] = shard
            f.attrs["description"] = (
                "one hpcps server shard's chunks of the parameters and optimizer state, "
                "overwritten in place by its writer thread; read the run's "
                "checkpoint-persisted.h5, which maps them back to layers")
            f.create_dataset("params", data=params)
            for key, vec in state.items():
                f.create_dataset(f"state/{key}", data=vec)
            f.create_dataset("chunk_step", data=np.full(len(chunks), step, dtype=np.int64))
            f.create_dataset("chunk_at", data=np.array([at for at, _ in chunks],
                                                       dtype=np.int64))
            f.flush()
            offsets.update({name: f[name].id.get_offset() for name in
                            ["params", "chunk_step"] + [f"state/{k}" for k in state]})
        if any(v is None for v in offsets.values()):
            raise RuntimeError(f"{tmp}: a dataset has no storage allocated")

    why = replace_whole(tmp, path, write)
    if why is not None:
        raise CheckpointError(f"cannot write the persistence file {path}: {why} (make room, "
                              "or run without --persist-every)")
    return offsets


class Persister:
    """A shard's write-back cache: dirty chunks, snapshots, and the writer thread.

    ``arrays``: the shard's live vectors (``params`` and ``state/<key>``), updated in place
    by the shard; ``chunks``: (at, length) of each chunk in them.
    """

    def __init__(self, path: Path, arrays: dict[str, np.ndarray],
                 chunks: list[tuple[int, int]], offsets: dict[str, int], every: float,
                 step: int):
        self.path = path
        self.arrays = arrays
        self.snap = {k: np.empty_like(v) for k, v in arrays.items()}
        self.chunks = chunks
        self.offsets = offsets
        self.every = every
        self.dirty = np.zeros(len(chunks), dtype=bool)
        self.persisted_step = step  # every chunk is on disk at least at this step
        self.flushes = 0
        self.skipped = 0   # rounds the writer was still busy
        self.bytes = 0
        self.write_s = 0.0
        self.copy_s = 0.0
        self.max_window = 0
        self._next = time.monotonic() + every
        self._busy = threading.Event()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._fd = os.open(path, os.O_WRONLY)
        self._thread = threading.Thread(target=self._run, name="hpcps-persist", daemon=True)
        self._thread.start()

    # -- the shard's thread --------------------------------------------------------------------
    def touch(self) -> None:
        """An update was applied to the whole local vector: every chunk is dirty."""
        self.dirty[:] = True

    def maybe_flush(self, step: int) -> None:
        """Between messages: start a flush if one is due and the writer is free."""
        if self._error is not None:
            raise RuntimeError(f"persisting to {self.path} failed: {self._error}") \
                from self._error
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every
        if self._busy.is_set():
            self.skipped += 1
            return
        self._start(step)

    def _start(self, step: int) -> None:
        which = np.flatnonzero(self.dirty)
        self.max_window = max(self.max_window, step - self.persisted_step)
        t = time.perf_counter()
        for c in which:
            at, n = self.chunks[c]
            for k, v in self.arrays.items():
                self.snap[k][at:at + n] = v[at:at + n]
        self.copy_s += time.perf_counter() - t
        self.dirty[which] = False
        self._busy.set()
        self._jobs.put((which, step))

    def close(self, step: int) -> None:
        """At the end of serving: wait for the writer, flush what is dirty, stop the thread."""
        self._busy_wait()
        self._start(step)
        self._busy_wait()
        self._jobs.put(None)
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise RuntimeError(f"persisting to {self.path} failed: {self._error}") \
                from self._error

    def _busy_wait(self) -> None:
        while self._busy.is_set() and self._error is None:
            time.sleep(0.001)

    def unpersisted(self, step: int) -> int:
        """Updates (global steps) applied since the last completed flush: what a crash now
        could lose."""
        return step - self.persisted_step

    def figures(self) -> dict:
        return {"flushes": self.flushes, "skipped_rounds": self.skipped,
                "bytes_written": self.bytes, "write_s": round(self.write_s, 3),
                "copy_s": round(self.copy_s, 3), "persisted_step": self.persisted_step,
                "max_window_steps": self.max_window, "manifest": MANIFEST_NAME}

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            which, step = job
            try:
                t = time.perf_counter()
                stamp = np.array([step], dtype=np.int64)
                for c in which:  # each dirty chunk's values, then its step
                    at, n = self.chunks[c]
                    for k, snap in self.snap.items():
                        self.bytes += os.pwrite(self._fd, memoryview(snap[at:at + n]),
                                                self.offsets[k] + 4 * at)
                    os.pwrite(self._fd, memoryview(stamp), self.offsets["chunk_step"] + 8 * c)
                os.fsync(self._fd)
                # the clean chunks have not changed since the last flush wrote them: they too
                # hold their values at this step
                os.pwrite(self._fd, memoryview(np.full(len(self.chunks), step, np.int64)),
                          self.offsets["chunk_step"])
                os.fsync(self._fd)
                self.write_s += time.perf_counter() - t
                self.flushes += 1
                self.persisted_step = step
            except BaseException as exc:  # reported by the shard's thread at its next check
                self._error = exc
            finally:
                self._busy.clear()


# -- setting it up on the shards (collective over the server communicator) -----------------------
def start(ctx, shard: int, shards: list, params: np.ndarray, state: dict[str, np.ndarray],
          every: float, step: int) -> Persister:
    """Create this shard's file, let server shard 0 write the manifest once every shard has
    its file, and start the writer. ``shards``: ``(partition, offset of the partition's
    slice in the global vector, its ChunkPlan, the shard's index among the partition's
    shards)`` for every shard in order (:func:`hpcps.strategies.downpour.shard_locals`)."""
    from hpcps.mpi.comm import barrier, bcast

    comm, timeout = ctx.grid.server_comm, ctx.cfg.timeout
    stamp = np.array([time.time_ns() // 1_000_000], dtype=np.int64)  # shard 0's, for all
    bcast(comm, stamp, 0, timeout, "server shard 0 to name the persistence files")
    top = Path(ctx.run_dir) / "persist"
    generation = top / f"from-{step}-{int(stamp[0])}"
    generation.mkdir(parents=True, exist_ok=True)
    _, _, plan, j = shards[shard]
    chunks = [(at, hi - lo) for lo, hi, at in plan.pieces[j]]
    path = shard_file(generation, shard)
    arrays = {"params": params, **{f"state/{k}": v for k, v in state.items()}}
    offsets = create_shard_file(path, params, state, chunks, step, shard)
    barrier(comm, timeout, "the other server shards to create their persistence files")
    if shard == 0:
        write_manifest(ctx, shards, generation, step)
        for old in top.iterdir():  # earlier runs' files: the new manifest no longer reads them
            if old != generation and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return Persister(path, arrays, chunks, offsets, every, step)


def write_manifest(ctx, shards: list, generation: Path, step: int) -> Path:
    """The checkpoint whose datasets read the shard files in ``generation``."""
    from hpcps.io import checkpoint
    full = ctx.full_model
    keys = list(ctx.optimizer.state_keys)
    places = placements(ctx.model, full)
    rel = generation.relative_to(Path(ctx.run_dir))
    virtual: dict[str, list] = {}
    steps, n_chunks = [], 0
    for s, (part, base, plan, j) in enumerate(shards):
        file = str(rel / shard_file(Path("."), s))
        length = plan.sizes[j]
        for name, maps in mapping(plan.pieces[j], base, places).items():
            virtual.setdefault(f"params/{name}", []).append((file, "params", length, maps))
            for k in keys:
                virtual.setdefault(f"optimizer/{k}/{name}", []).append(
                    (file, f"state/{k}", length, maps))
        c = len(plan.pieces[j])
        steps.append((file, "chunk_step", c, [((slice(n_chunks, n_chunks + c),), 0, c)]))
        n_chunks += c
    virtual[f"{checkpoint.PERSISTED}/chunk_step"] = ((n_chunks,), steps)
    shape_only = {name: np.broadcast_to(np.float32(0), shape) for name, shape, _ in full.layout}
    ckpt = checkpoint.Checkpoint(
        params=shape_only, optimizer=ctx.cfg.optimizer,
        opt_state={f"{k}/{name}": a for k in keys for name, a in shape_only.items()},
        step=int(step), config=ctx.cfg.to_dict(), dataset=ctx.dataset.to_dict(),
        metrics={"persist_every_s": ctx.cfg.persist_every})
    return checkpoint.save(Path(ctx.run_dir) / MANIFEST_NAME, ckpt, virtual)
