"""Which chunk of the flat parameter vector lives on which server shard (Project Adam, 3.3).

The vector of ``n`` parameters is cut into fixed-size chunks (``--chunk-bytes``, 1 MiB by
default, as in Adam); each chunk is assigned to a shard by **rendezvous hashing with bounded
loads**: every (chunk, shard) pair gets a pseudo-random weight from a 64-bit mix of their ids
and a seed, and a chunk goes to the shard of highest weight that still has room. Room is the
balanced share, ``ceil(chunks / shards)`` chunks, and a second pass tops up any shard left
below ``floor(chunks / shards)`` with the chunks that rank it highest, so shards differ by at
most one chunk. Plain rendezvous hashing moves only the chunks of a shard that leaves; the
bounds add a few moves (measured in the tests: about ``1/S`` of the chunks plus a few
percent), and buy balance that plain hashing gives only for thousands of chunks per shard.

A shard's *local* vector is its chunks one after the other in increasing chunk order, so a
server keeps working on one flat array; :class:`ChunkPlan` copies between the global vector
and each shard's local vector chunk by chunk (slices, not fancy indexing: chunks are large).
"Shard order" is the global vector permuted to every shard's local vector one after the
other; in it each shard's elements are contiguous (``plan.ranges``), which is what the
compressed pushes and the gathers to shard 0 use.

Everything here is pure: no MPI, no clock. Every rank computes the same plan from
``(n, chunk elements, shard ids, seed)``.
"""
from __future__ import annotations

import numpy as np

from hpcps.errors import ConfigError

ITEM_BYTES = 4  # float32 parameters
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values: a cheap, well-spread 64-bit hash."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x & _MASK


def weights(n_chunks: int, shards, seed: int = 0) -> np.ndarray:
    """Rendezvous weights, shape (n_chunks, len(shards)): a function of (chunk, shard id, seed)
    only, so a shard's weights do not change when other shards come or go."""
    c = np.arange(n_chunks, dtype=np.uint64)[:, None]
    s = np.asarray(list(shards), dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        key = _mix(c * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) ^ \
            _mix(s + np.uint64(0x632BE59BD9B4E019))
    return _mix(key)


def assign(n_chunks: int, shards, seed: int = 0) -> np.ndarray:
    """Owner (an element of ``shards``) of each of ``n_chunks`` chunks.

    Rendezvous hashing with bounded loads: each chunk, in chunk order, goes to the shard of
    highest weight with fewer than ``ceil(n_chunks / S)`` chunks; then any shard below
    ``floor(n_chunks / S)`` takes, one at a time, the chunk that ranks it highest among those
    of shards above the floor. Deterministic in its arguments.
    """
    shards = list(shards)
    S = len(shards)
    if S < 1:
        raise ValueError("need at least one shard")
    if len(set(shards)) != S:
        raise ValueError(f"shard ids must differ, got {shards}")
    w = weights(n_chunks, shards, seed)
    cap, floor = -(-n_chunks // S), n_chunks // S
    order = np.argsort(w, axis=1)[:, ::-1]  # preferred shard first
    load = np.zeros(S, dtype=np.int64)
    owner = np.empty(n_chunks, dtype=np.int64)
    for c in range(n_chunks):
        for j in order[c]:
            if load[j] < cap:
                owner[c] = j
                load[j] += 1
                break
    for j in np.flatnonzero(load < floor):
        while load[j] < floor:
            donors = np.flatnonzero(load[owner] > floor)  # chunks whose owner can spare one
            c = donors[np.argmax(w[donors, j])]
            load[owner[c]] -= 1
            owner[c] = j
            load[j] += 1
    return np.asarray(shards, dtype=np.int64)[owner]


def chunk_elements(chunk_bytes: int, n: int, n_shards: int) -> int:
    """Elements per chunk for ``--chunk-bytes``: ``chunk_bytes / 4``, or fewer when the
    ``n``-parameter model would make fewer chunks than ``n_shards`` (then it is cut into
    ``n_shards`` equal chunks, one per shard, so that every shard holds some)."""
    if chunk_bytes < ITEM_BYTES:
        raise ConfigError(f"--chunk-bytes {chunk_bytes}: a chunk holds at least one "
                          f"{ITEM_BYTES}-byte parameter")
    if n < n_shards:
        raise ConfigError(f"{n_shards} server shards for a model of only {n} parameters: "
                          "use fewer --servers")
    return min(chunk_bytes // ITEM_BYTES, -(-n // n_shards))


class ChunkPlan:
    """The chunks of an ``n``-element vector and the shard that holds each.

    Parameters
    ----------
    n : length of the vector.
    chunk : elements per chunk (the last chunk may be shorter).
    n_shards : shards 0 .. n_shards-1 share the chunks.
    alive : shard ids that hold chunks (default all); a plan over fewer shards is what the
        survivors compute when one leaves.
    seed : hashing seed (the same on every rank).

    Raises ConfigError when there are fewer chunks than shards (a shard would hold nothing).
    """

    def __init__(self, n: int, chunk: int, n_shards: int, alive=None, seed: int = 0):
        if chunk < 1:
            raise ValueError(f"chunk of {chunk} elements")
        self.n, self.chunk, self.n_shards = int(n), int(chunk), int(n_shards)
        self.alive = list(range(n_shards)) if alive is None else sorted(alive)
        self.n_chunks = -(-self.n // self.chunk)
        if self.n_chunks < len(self.alive):
            raise ConfigError(
                f"{self.n} parameters make {self.n_chunks} chunk(s) of {self.chunk * ITEM_BYTES} "
                f"bytes, fewer than the {len(self.alive)} server shards: use a smaller "
                f"--chunk-bytes (at most {ITEM_BYTES * (self.n // len(self.alive))}) or fewer "
                "--servers")
        self.owner = assign(self.n_chunks, self.alive, seed)
        # pieces[s]: (global lo, global hi, local lo) of each chunk of shard s, in chunk order
        self.pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n_shards)]
        self.sizes = [0] * self.n_shards
        for c, s in enumerate(self.owner):
            lo, hi = c * self.chunk, min(self.n, (c + 1) * self.chunk)
            self.pieces[s].append((lo, hi, self.sizes[s]))
            self.sizes[s] += hi - lo
        offs = np.cumsum([0] + self.sizes)
        self.ranges = [(int(offs[s]), int(offs[s + 1])) for s in range(self.n_shards)]

    @classmethod
    def contiguous(cls, ranges) -> "ChunkPlan":
        """A plan whose shard s holds exactly ``ranges[s]``, one contiguous piece each (the
        whole-row ranges activation pushes need)."""
        plan = cls.__new__(cls)
        plan.n = int(ranges[-1][1])
        plan.n_shards = len(ranges)
        plan.alive = list(range(plan.n_shards))
        plan.chunk = 0
        plan.n_chunks = plan.n_shards
        plan.owner = np.arange(plan.n_shards)
        plan.pieces = [[(lo, hi, 0)] for lo, hi in ranges]
        plan.sizes = [hi - lo for lo, hi in ranges]
        plan.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        return plan

    # -- copies between the global vector and shards' local vectors ----------------------------
    def take(self, s: int, vec: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Shard ``s``'s local vector, copied out of the global ``vec``."""
        if out is None:
            out = np.empty(self.sizes[s], dtype=vec.dtype)
        for lo, hi, at in self.pieces[s]:
            out[at:at + hi - lo] = vec[lo:hi]
        return out

    def put(self, s: int, local: np.ndarray, vec: np.ndarray) -> None:
        """Write shard ``s``'s local vector into its places in the global ``vec``."""
        for lo, hi, at in self.pieces[s]:
            vec[lo:hi] = local[at:at + hi - lo]

    def to_shard_order(self, vec: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``vec`` permuted so that each shard's local vector is ``out[ranges[s]]``."""
        if out is None:
            out = np.empty_like(vec)
        for s, (a, _) in enumerate(self.ranges):
            for lo, hi, at in self.pieces[s]:
                out[a + at:a + at + hi - lo] = vec[lo:hi]
        return out

    def from_shard_order(self, vec: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The inverse of :meth:`to_shard_order`."""
        if out is None:
            out = np.empty_like(vec)
        for s, (a, _) in enumerate(self.ranges):
            for lo, hi, at in self.pieces[s]:
                out[lo:hi] = vec[a + at:a + at + hi - lo]
        return out

    def balance(self) -> float:
        """Largest shard over the mean shard size, among the shards that hold chunks (1.0 is
        perfect balance)."""
        sizes = [self.sizes[s] for s in self.alive]
        return max(sizes) / (sum(sizes) / len(sizes))


def moved_fraction(before: ChunkPlan, after: ChunkPlan) -> float:
    """Fraction of chunks whose owner differs between two plans of the same chunks."""
    if before.n_chunks != after.n_chunks:
        raise ValueError("plans of different chunkings")
    return float(np.mean(before.owner != after.owner))
