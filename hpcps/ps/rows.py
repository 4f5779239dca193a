"""Embedding rows on the parameter server: where a row lives, the shard that holds it, the
replica that pulls and pushes it.

**Placement.** Row ``id`` of table ``t`` lives on shard ``place(t, id, S)``
(:func:`hpcps.kernels.embedding.place`, a 64-bit mix of the pair): consecutive or hot ids of
one table spread over every shard, and the same id of two tables lands independently. Every
rank computes the same placement; nothing is stored. A shard's rows go to disk as one HDF5
file (:mod:`hpcps.io.tables`), which any number of shards can read back.

**Messages** (:class:`hpcps.mpi.protocol.Tag`), each one buffer: the float64 header, then

- ``PULL_ROWS`` (replica -> shard): n tables (int64), then n ids (int64), sorted by table;
  ``H.EXAMPLES`` is 1 when missing rows are to be created (training), 0 when they are read
  without being stored (evaluation: a row never trained reads as its initial values, which
  depend only on (table, id, seed), so evaluating creates nothing);
- ``ROWS`` (shard -> replica): the n rows, float32, in the order asked;
- ``PUSH_ROWS`` (replica -> shard): n tables, n ids, then the n row gradients (float32): the
  gradient of the batch's mean loss, summed over the positions that used the row, applied by
  the shard's row optimizer at ``--row-lr``;
- ``ROWS_DONE`` (world rank 0 -> shard): the final evaluation has read what it needs.

A step pulls each unique id of its batch once and pushes each once
(:meth:`hpcps.model.ctr.CtrModel.lookup`). The pull is the step's only wait; the push is sent
without waiting, and a shard handles one replica's messages in the order sent, so the next
pull of the same rows sees this push applied.

**Capacity and admission** (``--table-capacity``, ``--admit-after``): each table's
:class:`~hpcps.ps.embedding_store.EmbeddingStore` holds at most ``max_rows`` rows, evicting
the least recently used, and creates a row at the c-th training pull of its id, counted in
one count-min sketch per shard shared by its tables (:mod:`hpcps.ps.admission`). A shard
answers zeros for an id not admitted, and drops the pushed gradient of a row it does not
hold (evicted by another replica's pull between this replica's pull and push, or not
admitted); :meth:`RowShard.figures` counts both and the rows evicted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from hpcps.errors import NonFiniteError
from hpcps.io import tables
from hpcps.kernels.embedding import place
from hpcps.mpi.comm import REQUEST_NULL, Transport, reply_spin_s, size_of, wait_all
from hpcps.mpi.protocol import HEADER_BYTES, ByteMessage, H, Tag
from hpcps.ps.admission import Admission
from hpcps.ps.embedding_store import EmbeddingStore


def _pairs_bytes(n: int) -> int:
    return 16 * n


class RowShard:
    """One shard's rows of every table, served to replicas.

    Parameters
    ----------
    comm : the communicator replicas send on (the world).
    n_tables, dim : the model's tables and their row width.
    seed : the run's seed (every row's initialiser).
    optimizer : the row optimizer (:data:`hpcps.ps.embedding_store.OPTIMIZERS`).
    lr : its rate (``--row-lr``).
    eps : Adagrad's epsilon.
    l2 : weight decay of the rows pushed (``--row-l2``).
    init_scale : new rows are uniform in [-init_scale, init_scale) (``--row-init-scale``).
    max_rows : the most rows of each table held (``--table-capacity``; None: unbounded).
    admit_after : create a row at the c-th training pull of its id (``--admit-after``; 1:
        at the first, and no sketch is allocated).
    """

    def __init__(self, comm, n_tables: int, dim: int, seed: int, optimizer: str, lr: float,
                 eps: float = 1e-8, l2: float = 0.0, init_scale: float | None = None,
                 max_rows: int | None = None, admit_after: int = 1):
        self.net = Transport(comm)
        self.l2 = float(l2)
        self.dim = int(dim)
        self.lr, self.eps = float(lr), float(eps)
        self.admission = Admission(admit_after) if admit_after > 1 else None
        self.tables = [EmbeddingStore(dim, table=t, seed=seed, optimizer=optimizer,
                                      init_scale=init_scale, max_rows=max_rows,
                                      admission=self.admission)
                       for t in range(n_tables)]
        self._in = np.empty(0, dtype=np.uint8)
        self._out = ByteMessage(0)
        self._header = np.empty(HEADER_BYTES, dtype=np.uint8)
        self.pulls = self.pushes = self.rows_out = self.rows_in = 0
        self.bytes_in = self.bytes_out = 0
        self._written: tuple | None = None  # (path, pulls, pushes) of the last file written

    def handlers(self) -> dict:
        """``{tag: handler(source, status)}`` for :func:`hpcps.ps.serve.serve`."""
        return {Tag.PULL_ROWS: self._on_pull, Tag.PUSH_ROWS: self._on_push}

    def _take(self, src: int, status, tag: int) -> tuple[np.ndarray, np.ndarray]:
        size = size_of(status)
        if size > len(self._in):
            self._in = np.empty(max(size, 2 * len(self._in)), dtype=np.uint8)
        buf = self._in[:size]
        self.net.take(buf, src, tag)
        self.bytes_in += size
        if size < HEADER_BYTES or (size - HEADER_BYTES) % 8:
            raise RuntimeError(f"a {Tag(tag).name} message of {size} bytes from rank {src} "
                               "is not a header followed by 8-byte words")
        return buf[:HEADER_BYTES].view(np.float64), buf[HEADER_BYTES:]

    def _split(self, tables: np.ndarray, src: int):
        """(table, start, stop) of each run of one table in a message sorted by table."""
        if len(tables) and (tables[0] < 0 or tables[-1] >= len(self.tables)
                            or np.any(np.diff(tables) < 0)):
            raise RuntimeError(f"rank {src} sent rows of tables outside 0..{len(self.tables) - 1}"
                               " or not sorted by table")
        cuts = np.flatnonzero(np.diff(tables)) + 1
        starts = np.concatenate([[0], cuts]).astype(np.int64)
        stops = np.concatenate([cuts, [len(tables)]]).astype(np.int64)
        return [(int(tables[a]), int(a), int(b)) for a, b in zip(starts, stops) if b > a]

    def _on_pull(self, src: int, status) -> bool:
        header, body = self._take(src, status, Tag.PULL_ROWS)
        words = body.view(np.int64)
        n = len(words) // 2
        tables, ids = words[:n], words[n:]
        create = bool(header[H.EXAMPLES])
        need = 4 * n * self.dim
        if need > len(self._out.body):
            self._out = ByteMessage(max(need, 2 * len(self._out.body)))
        rows = self._out.body[:need].view(np.float32).reshape(n, self.dim)
        for t, a, b in self._split(tables, src):
            store = self.tables[t]
            if create:
                store.pull(ids[a:b], out=rows[a:b])
            else:
                store.peek(ids[a:b], out=rows[a:b])
        self._out.header[:] = 0.0
        self._out.header[H.EXAMPLES] = n
        # the replica posted its receive before asking: this send waits on nothing of it
        self.net.send_eager(self._out.spec(need), src, Tag.ROWS)
        self.pulls += 1
        self.rows_out += n
        self.bytes_out += HEADER_BYTES + need
        return False

    def _on_push(self, src: int, status) -> bool:
        header, body = self._take(src, status, Tag.PUSH_ROWS)
        n = len(body) // (16 + 4 * self.dim)
        if n * (16 + 4 * self.dim) != len(body):
            raise RuntimeError(f"a PUSH_ROWS message of {len(body)} bytes from rank {src} does "
                               f"not hold whole (table, id, row of {self.dim}) entries")
        words = body[:16 * n].view(np.int64)
        tables, ids = words[:n], words[n:]
        grads = body[16 * n:].view(np.float32).reshape(n, self.dim)
        if not np.isfinite(header[H.LOSS_SUM]):
            raise NonFiniteError(0, f"received from replica {int(header[H.SENDER])} row "
                                 f"gradients whose training loss is {header[H.LOSS_SUM]} "
                                 "(not applied)")
        for t, a, b in self._split(tables, src):
            self.tables[t].push(ids[a:b], grads[a:b], self.lr, self.eps, self.l2)
        self.pushes += 1
        self.rows_in += n
        return False

    def header(self, src: int, tag: int) -> np.ndarray:
        """Take a probed header-only message (:meth:`RowClient.tell`); its float64 header,
        valid until the next one."""
        self.net.take(self._header, src, tag)
        return self._header.view(np.float64)

    def saved(self, dest: int, step: int) -> None:
        """ROWS_SAVED to ``dest`` (the chief): this shard's rows of global ``step`` are in
        their table file."""
        msg = ByteMessage(0)
        msg.header[H.STEPS] = step
        self.net.send_eager(msg.buf, dest, Tag.ROWS_SAVED)

    def on_release(self, src: int, status) -> bool:
        """ROWS_DONE: the chief has evaluated; the shard may leave."""
        self.header(src, Tag.ROWS_DONE)
        return True

    def figures(self) -> dict:
        """This shard's counts for the summary. ``rows_evicted``: rows evicted for want of
        capacity; ``row_grads_dropped``: pushed row gradients dropped, their row not held;
        ``ids_zeroed``: ids answered zeros by training pulls before their admission (an id
        counts at each such pull). The resident bytes include the admission sketch."""
        sketch = self.admission.sketch.nbytes if self.admission is not None else 0
        return {"rows_held": [len(t) for t in self.tables], "row_pulls": self.pulls,
                "row_pushes": self.pushes, "rows_pulled": self.rows_out,
                "rows_pushed": self.rows_in, "row_bytes_in": self.bytes_in,
                "row_bytes_out": self.bytes_out,
                "row_bytes_resident": sum(t.resident_bytes() for t in self.tables) + sketch,
                "rows_evicted": sum(t.evicted for t in self.tables),
                "row_grads_dropped": sum(t.dropped for t in self.tables),
                "ids_zeroed": sum(t.zeroed for t in self.tables)}

    def load(self, files: Sequence[Path], shard: int, n_shards: int) -> int:
        """Take this shard's rows (``place(t, id, n_shards) == shard``) from the table files
        of a checkpoint (:func:`hpcps.io.tables.table_files`), written by any number of
        shards; returns the rows taken. A row's optimizer state comes along when the files
        hold the same optimizer's."""
        taken = 0
        for t, store in enumerate(self.tables):
            # a part at a time: the files hold every shard's rows, S times this shard's share
            for ids, values, accum, optimizer in tables.read_parts(files, t):
                mine = place(np.full(len(ids), t, dtype=np.int64), ids, n_shards) == shard
                same = accum is not None and optimizer == store.optimizer
                store.load(ids[mine], values[mine], accum[mine] if same else None)
                taken += int(mine.sum())
        return taken

    def write(self, path: Path, shard: int, n_shards: int, step: int) -> Path:
        """This shard's rows of every table as one HDF5 file (:mod:`hpcps.io.tables`).

        The same file again with no pull or push served since is not written twice: it holds
        these rows already (a run whose last step is a checkpoint's asks for both)."""
        mark = (Path(path), self.pulls, self.pushes)
        if mark == self._written and mark[0].exists():
            return mark[0]
        written = tables.write(path, self.tables, shard, n_shards, step)
        self._written = mark
        return written


class RowClient:
    """A replica's pulls and pushes of its batches' rows, to every shard that holds some.

    Parameters
    ----------
    comm : the communicator the shards listen on.
    server_ranks : each shard's rank in ``comm``.
    n_tables, dim : the model's tables and row width.
    replica : this replica's index (in every header).
    timeout : seconds to wait for a shard's rows before failing with its rank.
    """

    def __init__(self, comm, server_ranks: Sequence[int], n_tables: int, dim: int,
                 replica: int, timeout: float):
        self.net = Transport(comm)
        self.ranks = list(server_ranks)
        self.S = len(self.ranks)
        self.n_tables, self.dim = int(n_tables), int(dim)
        self.replica, self.timeout = int(replica), float(timeout)
        self._ask = [ByteMessage(0) for _ in self.ranks]
        self._reply = [ByteMessage(0) for _ in self.ranks]
        # two push buffers per shard alternate, so a push is on the wire while the next
        # step computes
        self._push = [[ByteMessage(0), ByteMessage(0)] for _ in self.ranks]
        self._push_req = [[REQUEST_NULL, REQUEST_NULL] for _ in self.ranks]
        self._slot = 0
        self._order = np.empty(0, dtype=np.int64)
        self._cuts = np.zeros(self.S + 1, dtype=np.int64)
        self._tables = self._ids = np.empty(0, dtype=np.int64)
        self.bytes_sent = self.bytes_received = 0
        self.rows_pulled = 0

    @staticmethod
    def _fit(msg: ByteMessage, nbytes: int) -> ByteMessage:
        return msg if len(msg.body) >= nbytes else ByteMessage(max(nbytes, 2 * len(msg.body)))

    def pull(self, uniq: Sequence[np.ndarray], create: bool = True) -> list[np.ndarray]:
        """The rows of each table's unique ids (``uniq[t]``), from the shards that hold
        them: a list of (len(uniq[t]), dim) float32 arrays, views of one stacked array.
        ``create`` False: rows not held read as their initial values and are not stored."""
        counts = [len(u) for u in uniq]
        tables = np.repeat(np.arange(self.n_tables, dtype=np.int64), counts)
        ids = np.concatenate(uniq) if uniq else np.empty(0, dtype=np.int64)
        shard = place(tables, ids, self.S)
        order = np.argsort(shard, kind="stable")  # by shard, then (stable) by table
        cuts = np.searchsorted(shard[order], np.arange(self.S + 1))
        self._order, self._cuts, self._tables, self._ids = order, cuts, tables, ids
        reqs, asked = [], []
        for s, dest in enumerate(self.ranks):
            a, b = int(cuts[s]), int(cuts[s + 1])
            if b == a:
                continue
            n = b - a
            self._reply[s] = self._fit(self._reply[s], 4 * n * self.dim)
            reqs.append(self.net.post_recv(self._reply[s].buf[:HEADER_BYTES + 4 * n * self.dim],
                                           dest, Tag.ROWS))
            ask = self._ask[s] = self._fit(self._ask[s], _pairs_bytes(n))
            words = ask.body[:_pairs_bytes(n)].view(np.int64)
            sel = order[a:b]
            words[:n], words[n:] = tables[sel], ids[sel]
            ask.header[:] = 0.0
            ask.header[H.SENDER] = self.replica
            ask.header[H.EXAMPLES] = 1.0 if create else 0.0
            asked.append((s, dest, ask.spec(_pairs_bytes(n))))
        for s, dest, data in asked:  # each shard's receive for the reply is posted already
            self.net.send_eager(data, dest, Tag.PULL_ROWS)
            self.bytes_sent += data.nbytes
        wait_all(reqs, self.timeout, f"embedding rows from server ranks "
                 f"{[self.ranks[s] for s, _, _ in asked]}", reply_spin_s())
        stacked = np.empty((len(ids), self.dim), dtype=np.float32)
        for s, _, _ in asked:
            a, b = int(cuts[s]), int(cuts[s + 1])
            n = b - a
            stacked[order[a:b]] = self._reply[s].body[:4 * n * self.dim].view(
                np.float32).reshape(n, self.dim)
            self.bytes_received += HEADER_BYTES + 4 * n * self.dim
        if create:  # a step's rows (an evaluation's are not counted)
            self.rows_pulled += len(ids)
        starts = np.concatenate([[0], np.cumsum(counts)])
        return [stacked[starts[t]:starts[t + 1]] for t in range(self.n_tables)]

    def push(self, grads: Sequence[np.ndarray], loss: float) -> None:
        """Send each shard the gradients of the rows it gave in the last :meth:`pull`
        (``grads[t]`` for table t's unique ids, in the same order), without waiting."""
        stacked = np.concatenate(grads) if len(grads) > 1 else grads[0]
        if stacked.shape != (len(self._ids), self.dim):
            raise ValueError(f"row gradients of shape {stacked.shape} for the "
                             f"{len(self._ids)} rows pulled")
        slot = self._slot
        self._slot ^= 1
        order, cuts = self._order, self._cuts
        for s, dest in enumerate(self.ranks):
            a, b = int(cuts[s]), int(cuts[s + 1])
            if b == a:
                continue
            n = b - a
            req = self._push_req[s][slot]
            if req != REQUEST_NULL:
                wait_all([req], self.timeout, f"server rank {dest} to take an earlier row push")
            nbytes = _pairs_bytes(n) + 4 * n * self.dim
            msg = self._push[s][slot] = self._fit(self._push[s][slot], nbytes)
            sel = order[a:b]
            words = msg.body[:_pairs_bytes(n)].view(np.int64)
            words[:n], words[n:] = self._tables[sel], self._ids[sel]
            msg.body[_pairs_bytes(n):nbytes].view(np.float32).reshape(n, self.dim)[:] = \
                stacked[sel]
            msg.header[:] = 0.0
            msg.header[H.SENDER] = self.replica
            msg.header[H.LOSS_SUM] = loss
            data = msg.spec(nbytes)
            self._push_req[s][slot] = self.net.send_nowait(data, dest, Tag.PUSH_ROWS)
            self.bytes_sent += data.nbytes

    def drain(self) -> None:
        """Wait for the row pushes still on the wire."""
        pending = [r for pair in self._push_req for r in pair if r != REQUEST_NULL]
        wait_all(pending, self.timeout, f"server ranks {self.ranks} to take the last row pushes")
        self._push_req = [[REQUEST_NULL, REQUEST_NULL] for _ in self.ranks]

    def tell(self, tag: int, step: int = 0) -> None:
        """A header-only message to every shard: this replica and global ``step``."""
        msg = ByteMessage(0)
        msg.header[H.SENDER] = self.replica
        msg.header[H.STEPS] = step
        for dest in self.ranks:
            self.net.send_eager(msg.buf, dest, tag)

    def await_saved(self) -> None:
        """Wait for every shard's ROWS_SAVED (world rank 0): the rows it was asked to write,
        or its final rows, are on disk. Raises PeerTimeout after the timeout."""
        got = [ByteMessage(0) for _ in self.ranks]
        wait_all([self.net.post_recv(m.buf, dest, Tag.ROWS_SAVED)
                  for m, dest in zip(got, self.ranks)], self.timeout,
                 "every server shard to write its embedding table file (ROWS_SAVED)")

    def release(self) -> None:
        """ROWS_DONE to every shard (world rank 0, after the final evaluation)."""
        self.tell(Tag.ROWS_DONE)
