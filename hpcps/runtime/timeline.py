"""``--trace`` across ranks: align every rank's clock on rank 0's at start, and merge every
rank's events into one ``RUN_DIR/trace.json`` at the end (the recorder: :mod:`hpcps.trace`).

Clocks: each rank records with its own monotonic clock, which on another host starts at
another time. At start, every rank r > 0 exchanges ``PINGS`` ping-pongs with rank 0 and keeps
Cristian's estimate from the fastest round trip (:func:`hpcps.trace.clock_offset`): rank 0's
clock minus its own, uncertain by half that round trip (microseconds within a node, tens of
microseconds across nodes). Clocks drift apart by up to tens of microseconds per second
between hosts; one offset, taken at start, is what Horovod's timeline also assumes (it
timestamps everything on rank 0). The offsets and their uncertainty are written into the
file (``otherData``).

Merge: at the end of training every rank turns its events into trace-event dicts on rank 0's
clock, sorts them by time and encodes each as JSON, and sends them to rank 0 (a gather over
the world communicator, waited on with ``--timeout``), which interleaves the ranks' encoded
events by time without decoding them (:func:`hpcps.trace.merge`) and writes one file that
chrome://tracing and Perfetto (https://ui.perfetto.dev) open. Each rank keeps its last
:data:`hpcps.trace.MAX_EVENTS` events; the file counts the ones dropped before them
(``otherData.dropped_events``). A job that fails or is aborted writes no trace.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np

from hpcps import trace
from hpcps.io.runlog import replace_text
from hpcps.mpi.comm import Transport, bcast, gather_bytes, wait_all
from hpcps.mpi.protocol import Tag

PINGS = 8
FILE = "trace.json"


class Timeline:
    """This rank's recorder and its clock's offset to rank 0 (build it with :func:`start`)."""

    def __init__(self, tracer: trace.Tracer, offset_ns: float, uncertainty_ns: float,
                 base_ns: float):
        self.tracer = tracer
        self.offset_ns = offset_ns
        self.uncertainty_ns = uncertainty_ns
        self.base_ns = base_ns  # rank 0's clock at start: time 0 of the trace
        self.main_ident = threading.main_thread().ident


def start(world, timeout: float) -> Timeline:
    """Measure this rank's clock offset to rank 0 (collective over ``world``)."""
    rank, size = world.Get_rank(), world.Get_size()
    buf = np.zeros(1, dtype=np.int64)
    tracer = trace.Tracer()
    offset = uncertainty = 0.0
    net = Transport(world)
    if rank == 0:
        for r in range(1, size):
            for _ in range(PINGS):
                wait_all([net.post_recv(buf, r, Tag.TRACE_CLOCK)], timeout,
                         f"rank {r} to measure its clock against rank 0 (--trace)")
                buf[0] = time_ns()
                net.send_eager(buf, r, Tag.TRACE_CLOCK)
    else:
        samples = []
        for _ in range(PINGS):
            t1 = time_ns()
            net.send_eager(buf, 0, Tag.TRACE_CLOCK)
            wait_all([net.post_recv(buf, 0, Tag.TRACE_CLOCK)], timeout,
                     "rank 0 to answer a clock ping (--trace)")
            samples.append((t1, int(buf[0]), time_ns()))
        offset, uncertainty = trace.clock_offset(samples)
    base = np.array([tracer.t0 if rank == 0 else 0], dtype=np.int64)
    bcast(world, base, 0, timeout, "rank 0 to send the trace's time zero")
    return Timeline(tracer, offset, uncertainty, float(base[0]))


def time_ns() -> int:
    return trace.Tracer.now()


def label(role) -> str:
    """``replica 1``, ``replica 0 partition 1``, ``server 0``, ``coordinator``."""
    if role.kind == "replica":
        part = f" partition {role.partition}" if role.partition > 0 else ""
        return f"replica {role.replica}{part}"
    if role.kind == "server":
        return f"server {role.shard}"
    return role.kind


def finish(world, tl: Timeline, role, run_dir, timeout: float,
           extra: dict | None = None) -> Path | None:
    """Gather every rank's events on rank 0 and write ``run_dir/trace.json`` there
    (collective over ``world``). Returns the path on rank 0, None elsewhere, or when the file
    system refuses the file (said on stderr, and the run ends as it would have)."""
    rank = world.Get_rank()
    names = {t.ident: t.name for t in threading.enumerate()}
    names[tl.main_ident] = "main"
    kept = tl.tracer.kept()
    events = trace.chrome_events(rank, label(role), kept, tl.offset_ns, tl.base_ns, names,
                                 tl.main_ident)
    mine = trace.pack(rank, events, offset_us=round(tl.offset_ns / 1000, 3),
                      uncertainty_us=round(tl.uncertainty_ns / 1000, 3),
                      dropped=tl.tracer.recorded() - len(kept))
    gathered = gather_bytes(world, np.frombuffer(mine, dtype=np.uint8), timeout,
                            "every rank to send its trace events (--trace)")
    if gathered is None:
        return None
    heads = [trace.unpack_head(b) for b in gathered]
    dropped = {h["rank"]: h["dropped"] for h in heads if h["dropped"]}
    other = {"clock": "each rank's monotonic clock moved onto rank 0's by the offset "
                      "measured at start (Cristian's method)",
             "offsets_us": {h["rank"]: h["offset_us"] for h in heads},
             "uncertainty_us": {h["rank"]: h["uncertainty_us"] for h in heads},
             "events_kept_per_rank": tl.tracer.events.maxlen, "dropped_events": dropped,
             **(extra or {})}
    if dropped:
        print(f"hpcps: note: --trace keeps each rank's last {tl.tracer.events.maxlen:,} events; "
              f"earlier ones were dropped on ranks {sorted(dropped)} (at most "
              f"{max(dropped.values()):,} on one): the trace covers the run's end",
              file=sys.stderr, flush=True)
    text = trace.merge(gathered, other)
    path = Path(run_dir) / FILE
    try:
        replace_text(path, text)
    except OSError as exc:  # a full disk, a quota: the run's results matter more
        print(f"hpcps: warning: cannot write {path}: {exc.strerror or exc}; the run ends "
              "without its trace", file=sys.stderr, flush=True)
        return None
    return path
