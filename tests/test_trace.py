"""--trace (hpcps.trace, hpcps.runtime.timeline): the recorder and the format alone, then
4-rank runs of downpour, sync and deadreckon whose one trace.json holds every rank's compute,
waits and messages (with bytes) on one clock."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mpirun import ROOT, run_mpi, train

from hpcps import config, trace
from hpcps.errors import ConfigError


def test_clock_offset_takes_the_fastest_round_trip():
    # remote clock = local + 1000; the first ping was delayed on the way out by 400
    samples = [(0, 1000 + 450, 500), (1000, 1000 + 1010, 1020), (3000, 1000 + 3030, 3100)]
    offset, half_rtt = trace.clock_offset(samples)
    assert offset == pytest.approx(1000.0) and half_rtt == pytest.approx(10.0)


def test_events_move_onto_rank_zero_clock_and_sort():
    t = trace.Tracer()
    t.span(trace.COMPUTE, "gradient", 5_000, {"examples": 16})
    t.events[-1] = (trace.COMPUTE, "gradient", 5_000, 2_000, t.events[-1][4], {"examples": 16})
    t.message("push gradient", 1234, 9_000)
    a = trace.chrome_events(1, "replica 1", t.kept(), offset_ns=1_000, base_ns=4_000)
    b = trace.chrome_events(0, "server 0", [("wait", "w", 4_500, 100, 7, None)], 0, 4_000)
    doc = json.loads(trace.merge([trace.pack(0, b), trace.pack(1, a)], {"x": 1}))
    assert doc["otherData"] == {"x": 1} and doc["displayTimeUnit"] == "ms"
    timed = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    grad = next(e for e in timed if e["name"] == "gradient")
    assert grad["ts"] == 2.0 and grad["dur"] == 2.0 and grad["pid"] == 1  # (5000+1000-4000)/1000
    push = next(e for e in timed if e["name"] == "push gradient")
    assert push["args"]["bytes"] == 1234 and push["cat"] == trace.MESSAGE
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 1 (replica 1)", "rank 0 (server 0)"}
    json.loads(json.dumps(doc))  # strict JSON


def test_the_merge_interleaves_the_ranks_by_time_without_changing_an_event():
    """Three ranks' events, with equal times across and within ranks, recorded out of order
    (a span is recorded when it ends), names that need escaping, and a rank with none: the
    merged file holds every event as it was, the metadata first in rank order, then the
    timed ones by time, ties by rank and then as recorded."""
    rng = np.random.default_rng(0)
    per_rank = []
    for r in range(3):
        evs = [("wait" if k % 2 else "compute", f'w "{r}"\n{k}', int(rng.integers(0, 40)) * 500,
                int(rng.integers(0, 900)), 7, {"bytes": k} if k % 3 else None)
               for k in range(0 if r == 1 else 60)]
        per_rank.append(trace.chrome_events(r, f"rank {r}", evs, 0.0, 0.0))
    text = trace.merge([trace.pack(r, e, dropped=0) for r, e in enumerate(per_rank)], {})
    got = json.loads(text)["traceEvents"]
    meta = [e for evs in per_rank for e in evs if e["ph"] == "M"]
    expected = meta + sorted((e for evs in per_rank for e in evs if e["ph"] != "M"),
                             key=lambda e: (e["ts"], e["pid"]))
    assert got == expected
    assert trace.unpack_head(trace.pack(2, per_rank[2], dropped=5))["dropped"] == 5


def test_a_tracer_keeps_its_last_events_and_counts_every_one():
    t = trace.Tracer(max_events=5)
    for k in range(12):
        t.span(trace.COMPUTE, f"pass {k}", t.now())
    assert [e[1] for e in t.kept()] == [f"pass {k}" for k in range(7, 12)]
    assert t.recorded() == 12 and t.recorded() == 12  # asking does not count
    t.message("push", 10, t.now())
    assert t.recorded() == 13 and len(t.kept()) == 5


def test_activated_sets_and_restores_the_recorder():
    assert trace.ACTIVE is None
    with trace.activated(trace.Tracer()) as t:
        assert trace.ACTIVE is t
    assert trace.ACTIVE is None


def test_a_rank_that_dropped_events_says_so_in_the_file_and_on_stderr(tmp_path, capsys):
    from types import SimpleNamespace

    from mpi4py import MPI

    from hpcps.runtime import timeline
    tl = timeline.Timeline(trace.Tracer(max_events=5), 0.0, 0.0, 0.0)
    for k in range(12):
        tl.tracer.span(trace.COMPUTE, "gradient", tl.tracer.now())
    path = timeline.finish(MPI.COMM_SELF, tl, SimpleNamespace(kind="coordinator"), tmp_path,
                           10.0)
    doc = json.loads(path.read_text())
    assert doc["otherData"]["dropped_events"] == {"0": 7}
    assert doc["otherData"]["events_kept_per_rank"] == 5
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == 5
    err = capsys.readouterr().err
    assert "keeps each rank's last 5 events" in err and "dropped on ranks [0]" in err


def test_trace_is_a_switch(tmp_path):
    assert config.parse([]).trace is False
    assert config.parse(["--trace"]).trace is True
    toml = tmp_path / "c.toml"
    toml.write_text("trace = true\n")
    assert config.parse(["--config", str(toml)]).trace is True
    toml.write_text('trace = "yes"\n')
    with pytest.raises(ConfigError, match="trace has the wrong type"):
        config.parse(["--config", str(toml)])


def check_trace(run_dir, ranks: int, server_ranks=()) -> dict:
    """trace.json parses as trace-event JSON with every rank's compute, waits and messages."""
    doc = json.loads((run_dir / "trace.json").read_text())
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and set(doc["otherData"]["offsets_us"]) == \
        {str(r) for r in range(ranks)}
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cat"] in trace.CATEGORIES, e
    timed = [e for e in events if e["ph"] == "X"]
    assert timed and min(e["ts"] for e in timed) > -1e3  # on rank 0's clock, after its start
    for r in range(ranks):
        cats = {e["cat"] for e in timed if e["pid"] == r}
        assert {trace.COMPUTE, trace.WAIT, trace.MESSAGE} <= cats, (r, cats)
        sent = [e for e in timed if e["pid"] == r and e["cat"] == trace.MESSAGE]
        assert all(e["args"]["bytes"] >= 0 for e in sent) and \
            sum(e["args"]["bytes"] for e in sent) > 0, r
        if r not in server_ranks:
            assert any(e["name"] == "gradient" for e in timed if e["pid"] == r), r
            assert any(e["cat"] == trace.STEP for e in timed if e["pid"] == r), r
    return doc


COMMON = ["--layers", "64,32,10", "--steps", "160", "--batch-size", "16", "--eval-every", "0",
          "--checkpoint-every", "0", "--timeout", "60", "--trace"]


@pytest.mark.parametrize("strategy,extra,servers", [
    ("downpour", ["--warmup-steps", "20"], (3,)),
    ("sync", [], ()),
    ("deadreckon", ["--warmup-steps", "20"], ()),
])
def test_trace_of_a_four_rank_run(strategy, extra, servers, digits_h5, tmp_path):
    run = train(4, "--strategy", strategy, "--data", str(digits_h5), "--run-dir", str(tmp_path),
                *COMMON, *extra, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    assert f"trace: {tmp_path / 'trace.json'}" in run.stdout
    doc = check_trace(tmp_path, 4, servers)
    timed = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    if strategy == "downpour":  # the server applies the pushes it receives
        names = {e["name"] for e in timed if e["pid"] == 3}
        assert "apply update" in names and any(n.startswith("PUSH from rank") for n in names)
    if strategy == "sync":
        assert any(e["name"] == "allreduce gradient" and e["args"]["bytes"] == 4 * 2411
                   for e in timed), "the allreduce carries the 2410 gradients and the loss"


def test_a_trace_the_file_system_refuses_leaves_the_run_whole(digits_h5, tmp_path):
    """Rank 0 may not write a file past 60 kB (RLIMIT_FSIZE, a full disk's stand-in): the
    checkpoint (38 kB) fits, trace.json (about 100 kB) does not. The run ends as it would
    have (exit code 0, its summary and checkpoint written) with one warning, and no
    temporary file is left."""
    run_dir = tmp_path / "run"
    run = run_mpi(2, [str(ROOT / "tests" / "scripts" / "limited_train.py"), "--strategy",
                      "sync", "--layers", "64,32,10", "--data", str(digits_h5), "--steps",
                      "200", "--trace", "--run-dir", str(run_dir)], timeout=120,
                  env={"HPCPS_TEST_FSIZE": "60000", "HPCPS_TEST_FSIZE_RANK": "0"})
    assert run.returncode == 0, run.output[-3000:]
    assert run.stderr.splitlines() == [f"hpcps: warning: cannot write {run_dir / 'trace.json'}: "
                                       "File too large; the run ends without its trace"], \
        run.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").open()]
    assert kinds[-1] == "summary" and (run_dir / "checkpoint.h5").exists()
    assert [p.name for p in run_dir.iterdir() if "trace" in p.name] == []

