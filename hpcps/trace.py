"""``--trace``: where the time goes, per rank, as Chrome trace-event JSON (the format
chrome://tracing and Perfetto open; Horovod's timeline uses it too).

This module is the recorder and the format; it knows no MPI. Code on the hot paths records
through the process's one :data:`ACTIVE` recorder, which is None unless ``--trace`` was given::

    tr = trace.ACTIVE
    t0 = tr.now() if tr is not None else 0
    ...                                     # compute, wait or send
    if tr is not None:
        tr.span(trace.WAIT, what, t0)

so a run without ``--trace`` pays one global lookup and a None check per event site. One
recorder per process is the right scope: events come from every thread of the rank (Hogwild
threads, the prefetcher), as with the ``logging`` module's root logger; ``train.py`` sets it
for the run and clears it after (:func:`activated`).

Categories (``cat``): :data:`STEP` one iteration of a replica, :data:`COMPUTE` a gradient
(or a Sandblaster portion), :data:`WAIT` a wait on other ranks that did not complete at once
(its name says what for, as in the ``--timeout`` message), :data:`MESSAGE` a message or
collective with its bytes (``args.bytes``; a server's handling of a message spans the
handler: the update it applies). Times are recorded with ``time.perf_counter_ns`` (the
monotonic clock, per host) and moved onto rank 0's clock when the files are merged:
:mod:`hpcps.runtime.timeline` measures each rank's offset against rank 0 at start.
"""
from __future__ import annotations

import itertools
import json
import struct
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

STEP, COMPUTE, WAIT, MESSAGE = "step", "compute", "wait", "message"
CATEGORIES = (STEP, COMPUTE, WAIT, MESSAGE)
MAX_NAME = 120  # characters of an event name kept (wait descriptions can be long)
# events each rank keeps: the latest; earlier ones are dropped and counted (about 0.4 KB each
# in memory and 0.12 KB in the file: a long run's trace holds its last stretch, not all of it)
MAX_EVENTS = 100_000

ACTIVE: "Tracer | None" = None


class Tracer:
    """One rank's events, in memory until the end of the run (``events``: tuples of
    ``(cat, name, start_ns, dur_ns, thread id, args)`` on this process's clock), the latest
    ``max_events`` of them; :meth:`recorded` counts every one."""

    def __init__(self, max_events: int = MAX_EVENTS):
        self.events: deque[tuple] = deque(maxlen=max_events)
        self._seq = itertools.count()  # next() is atomic: threads count without a lock
        self.t0 = time.perf_counter_ns()

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    def span(self, cat: str, name: str, start_ns: int, args: dict | None = None) -> None:
        """A complete event from ``start_ns`` to now, on the calling thread."""
        end = time.perf_counter_ns()
        # deque.append is atomic under the GIL: threads record without a lock
        self.events.append((cat, name, start_ns, end - start_ns, threading.get_ident(), args))
        next(self._seq)

    def message(self, name: str, nbytes: int, start_ns: int, **args) -> None:
        """A message or collective of ``nbytes`` bytes, from ``start_ns`` to now."""
        self.span(MESSAGE, name, start_ns, {"bytes": int(nbytes), **args})

    def recorded(self) -> int:
        """Events recorded so far, kept or dropped (ask when no thread records)."""
        n = next(self._seq)
        self._seq = itertools.count(n)
        return n

    def kept(self) -> list[tuple]:
        """The events kept, copied at once (a thread may still be recording)."""
        return list(self.events.copy())  # deque.copy runs in C: no thread switch inside


@contextmanager
def activated(tracer: "Tracer | None"):
    """Make ``tracer`` the process's recorder for the ``with`` block (None: no tracing)."""
    global ACTIVE
    before, ACTIVE = ACTIVE, tracer
    try:
        yield tracer
    finally:
        ACTIVE = before


def clock_offset(samples) -> tuple[float, float]:
    """Cristian's estimate of (rank 0's clock - this clock) from ping-pongs.

    ``samples``: ``(t_send, t_remote, t_back)`` triples, this rank's clock at send and at
    reply, rank 0's clock when it answered. The round trip with the least delay bounds the
    error best: offset = t_remote - (t_send + t_back) / 2, uncertain by half that round
    trip. Returns (offset, half round trip), in the samples' unit.
    """
    t1, t0, t2 = min(samples, key=lambda s: s[2] - s[0])
    return t0 - (t1 + t2) / 2, (t2 - t1) / 2


def thread_ids(events, main_ident: int | None = None) -> dict[int, int]:
    """Small thread numbers in order of first appearance (the main thread is 0)."""
    out: dict[int, int] = {}
    if main_ident is not None:
        out[main_ident] = 0
    for ev in events:
        if ev[4] not in out:
            out[ev[4]] = len(out)
    return out


def chrome_events(rank: int, label: str, events, offset_ns: float, base_ns: float,
                  thread_names: dict[int, str] | None = None,
                  main_ident: int | None = None) -> list[dict]:
    """One rank's events as trace-event dicts: ``pid`` the rank, ``tid`` its thread,
    ``ts``/``dur`` in microseconds since ``base_ns`` on rank 0's clock
    (``local + offset_ns``)."""
    tids = thread_ids(events, main_ident)
    names = thread_names or {}
    out = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
            "args": {"name": f"rank {rank} ({label})"}},
           {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
            "args": {"sort_index": rank}}]
    for ident, tid in tids.items():
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": names.get(ident, "main" if tid == 0 else f"thread {tid}")}})
    for cat, name, start, dur, ident, args in events:
        ev = {"name": name[:MAX_NAME], "cat": cat, "ph": "X", "pid": rank, "tid": tids[ident],
              "ts": round((start + offset_ns - base_ns) / 1000, 3), "dur": round(dur / 1000, 3)}
        if args:
            ev["args"] = args
        out.append(ev)
    return out


_COMPACT = json.JSONEncoder(separators=(",", ":")).encode  # one encoder for every event


def pack(rank: int, events: list[dict], **figures) -> bytes:
    """One rank's part of the merged file, as bytes for the gather: its trace-event dicts
    (:func:`chrome_events`) with the timed ones sorted by time, each encoded once here, so
    that rank 0 merges the ranks' parts without decoding them (:func:`merge`); ``figures``
    (JSON values) travel with them."""
    meta = [e for e in events if e["ph"] == "M"]
    timed = sorted((e for e in events if e["ph"] != "M"), key=lambda e: e["ts"])
    head = json.dumps({"rank": rank, "meta": meta, "n": len(timed), **figures}).encode()
    ts = np.array([e["ts"] for e in timed], dtype=np.float64)
    body = "\n".join(map(_COMPACT, timed)).encode()
    return struct.pack("<q", len(head)) + head + ts.tobytes() + body


def _split(part: bytes) -> tuple[dict, int]:
    """A :func:`pack`'ed part's figures, and where its time stamps start."""
    (size,) = struct.unpack_from("<q", part)
    return json.loads(part[8:8 + size]), 8 + size


def unpack_head(part: bytes) -> dict:
    """The figures of a :func:`pack`'ed part (its ``rank``, ``meta``, ``n`` and the rest)."""
    return _split(part)[0]


def merge(parts: list[bytes], other: dict) -> str:
    """The merged file from every rank's :func:`pack`'ed part, in rank order: the metadata
    events, then every timed event sorted by time (ties by rank, then as recorded), in the
    JSON Object Format, with ``other`` as its ``otherData``."""
    meta: list[dict] = []
    stamps, lines = [], []
    for part in parts:
        head, at = _split(part)
        n = head["n"]
        meta += head["meta"]
        stamps.append(np.frombuffer(part, np.float64, n, at))
        body = part[at + 8 * n:]
        lines += body.split(b"\n") if n else []  # JSON escapes every newline in a string
    order = np.argsort(np.concatenate(stamps) if stamps else np.zeros(0), kind="stable")
    events = [_COMPACT(e) for e in meta]
    timed = b",".join(lines[i] for i in order).decode()
    return ('{"traceEvents":[' + ",".join(events + ([timed] if timed else [])) +
            '],"displayTimeUnit":"ms","otherData":' + _COMPACT(other) + "}")
