"""What ``--trace`` costs: training throughput with and without it; print one JSON object.

For each configuration (``--strategy`` on N ranks), runs ``mpiexec -n N python -m hpcps.train``
``--repeats`` times without and with ``--trace``, alternating (off, on, off, on, ...) so that
load from other processes falls on both alike, and reports the median examples/s of each, their
ratio, the size of ``trace.json`` and its number of events. It also times, in this process,
one recorded event (:meth:`hpcps.trace.Tracer.span`) and the check a run without ``--trace``
makes at each event site (one global lookup and a None test), so the cost when off is stated
per event, not only as a throughput difference lost in noise; and the end of a traced run (each
rank packing its events, rank 0 merging them: ``merge``, for 4 ranks of 50,000 events and 16
of 100,000, the most a rank keeps).

Usage::

    python bench/bench_trace.py                  # digits, 64,32,10, 3 strategies x 4 ranks, ~5 min
    python bench/bench_trace.py --data /path/mnist.h5 --layers 784,512,512,10 --repeats 5
    python bench/bench_trace.py --merge-only     # the end of a traced run alone, ~1 min

The figures depend on the machine's load: state it with them (docs/tools.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import (RunError, find_mpiexec, log, machine, summary_of,  # noqa: E402
                         train)

CONFIGS = [("downpour", 4), ("sync", 4), ("deadreckon", 4)]


def per_event_costs(n: int = 1000, repeats: int = 300) -> dict:
    """Nanoseconds per event site: off (lookup + None check, over an empty statement) and on
    (a recorded span). The fastest of ``repeats`` rounds: on a loaded machine the others
    measure the scheduler, not the code."""
    from hpcps import trace

    def best(stmt: str, env: dict) -> float:
        return min(timeit.repeat(stmt, globals=env, number=n, repeat=repeats)) / n

    empty = best("pass", {})
    off = best("tr = trace.ACTIVE\nif tr is not None: pass", {"trace": trace}) - empty
    t = trace.Tracer()
    on = best("t0 = t.now()\nt.span('wait', 'x', t0)", {"t": t}) - empty
    return {"off_ns_per_site": round(off * 1e9, 1), "on_ns_per_event": round(on * 1e9, 1),
            "events_recorded_while_timing": len(t.events)}


def merge_costs(ranks: int = 4, events: int = 50_000) -> dict:
    """The end of a traced run, in this process: ``ranks`` ranks' ``events`` events each
    (a replica's mix: messages with bytes, passes) turned into trace-event dicts and packed
    (:func:`hpcps.trace.pack`, which each rank does at once beside the others), then merged
    into the file's text (:func:`hpcps.trace.merge`, rank 0 alone). Seconds, fastest of 3."""
    import threading
    import time

    from hpcps import trace
    me = threading.get_ident()
    recorded = [("message" if i % 3 else "compute", "push gradient" if i % 3 else "gradient",
                 1000 * i, 500, me, {"bytes": 12345, "shards": [1]} if i % 3 else
                 {"examples": 32}) for i in range(events)]
    packs, merges = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        parts = [trace.pack(r, trace.chrome_events(r, "replica", recorded, 0.0, 0.0, {}, me),
                            dropped=0) for r in range(ranks)]
        t1 = time.perf_counter()
        text = trace.merge(parts, {})
        merges.append(time.perf_counter() - t1)
        packs.append((t1 - t0) / ranks)
    return {"ranks": ranks, "events_per_rank": events, "pack_s_per_rank": round(min(packs), 3),
            "merge_s_on_rank_0": round(min(merges), 3), "file_bytes": len(text)}


def run_config(mpiexec: str, strategy: str, ranks: int, args, repeats: int, tmp: Path,
               timeout: float) -> dict:
    rates = {"off": [], "on": []}
    trace_bytes, trace_events = [], []
    for i in range(repeats):
        for mode in ("off", "on"):
            work = tmp / f"{strategy}-{ranks}-{mode}-{i}"
            work.mkdir()
            extra = ["--trace"] if mode == "on" else []
            records = train(mpiexec, ranks, ["--strategy", strategy, *args, *extra], work,
                            timeout)
            rates[mode].append(summary_of(records)["examples_per_s"])
            if mode == "on":
                path = work / "run" / "trace.json"
                trace_bytes.append(path.stat().st_size)
                trace_events.append(len(json.loads(path.read_text())["traceEvents"]))
            log(f"{strategy} N={ranks} trace {mode}: {rates[mode][-1]:.0f} examples/s")
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"strategy": strategy, "ranks": ranks,
            "examples_per_s_off": off, "examples_per_s_on": on,
            "on_over_off": round(on / off, 3),
            "all_off": rates["off"], "all_on": rates["on"],
            "trace_bytes": statistics.median(trace_bytes),
            "trace_events": statistics.median(trace_events)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/work/scratch/data/digits.h5")
    p.add_argument("--layers", default="64,32,10")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--merge-only", action="store_true",
                   help="time only the end of a traced run (in this process, seconds)")
    a = p.parse_args(argv)
    merge = [merge_costs(4, 50_000), merge_costs(16, 100_000)]
    if a.merge_only:
        out = {"bench": "trace_merge", "machine": machine(None), "merge": merge}
        print(json.dumps(out, indent=2))
        from machine import save  # bench/machine.py
        save("bench_trace_merge", out)  # bench/results/, for bench/render.py
        return 0
    mpiexec = find_mpiexec()
    args = ["--data", a.data, "--layers", a.layers, "--steps", str(a.steps), "--batch-size",
            str(a.batch_size), "--eval-every", "0", "--checkpoint-every", "0",
            "--progress-every", "60"]
    out = {"bench": "trace", "machine": machine(mpiexec), "args": args,
           "repeats": a.repeats, "per_event": per_event_costs(), "merge": merge, "runs": []}
    with tempfile.TemporaryDirectory(prefix="hpcps-bench-trace-") as tmp:
        for strategy, ranks in CONFIGS:
            try:
                out["runs"].append(run_config(mpiexec, strategy, ranks, args, a.repeats,
                                              Path(tmp), a.timeout))
            except RunError as exc:
                log(str(exc))
                return 1
    print(json.dumps(out, indent=2))
    from machine import save  # bench/machine.py
    save("bench_trace", out)  # bench/results/, for bench/render.py
    return 0


if __name__ == "__main__":
    sys.exit(main())
