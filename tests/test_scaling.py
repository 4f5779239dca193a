"""The scaling model (hpcps.tools.scaling, over the strategies' own cost models): the pure
alpha-beta formulas, deadreckon's check against Strom's Table 2, and its bytes per step against
what the strategies report in a real run."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hpcps.compress.codec import HEADER_BYTES
from hpcps.errors import DataError
from hpcps.strategies.deadreckon.cost import message_bytes, strom_table2
from hpcps.tools import scaling
from hpcps.tools.scaling import Workload, bytes_per_step, predict, ring
from mpirun import train

W = Workload(n_params=1_000_000, batch=32, compute_s=0.01, update_s_per_param=1e-9)


def test_ring_allreduce_cost():
    assert ring(1e6, 1, 1e-5, 1e-9) == 0.0
    # 2 latencies and 2 (R-1)/R of the buffer per rank
    assert ring(1e6, 4, 1e-5, 1e-9) == pytest.approx(6e-5 + 1.5e6 * 1e-9)
    # and each node sums 3/4 of the 250,000 floats
    assert ring(1e6, 4, 1e-5, 1e-9, 4e-9) == pytest.approx(6e-5 + 1.5e6 * 1e-9 + 187_500 * 4e-9)


def test_the_vector_work_of_a_step_is_counted():
    """sync's allreduce sums (R-1)/R of the vector on each node; deadreckon thresholds and
    packs the whole vector every step; the measured figures are positive."""
    n, R = W.n_params, 4
    summing = replace(W, reduce_s_per_param=1e-9, reckon_s_per_param=2e-9)
    t = {s: R * W.batch / predict(s, W, R, 1e-5, 1e-9) for s in ("sync", "deadreckon")}
    t2 = {s: R * W.batch / predict(s, summing, R, 1e-5, 1e-9) for s in ("sync", "deadreckon")}
    assert t2["sync"] - t["sync"] == pytest.approx((R - 1) / R * (n + 1) * 1e-9)
    assert t2["deadreckon"] - t["deadreckon"] == pytest.approx(n * 2e-9)
    m = scaling.measure_compute([64, 32, 10], 16, repeats=2)
    assert m["reduce_s_per_param"] > 0 and m["reckon_s_per_param"] > 0, m


@pytest.mark.parametrize("strategy", ["sync", "averaging", "deadreckon"])
def test_a_free_network_scales_linearly(strategy):
    for k in (1, 2, 16, 128):
        assert predict(strategy, W, k, 0.0, 0.0) == pytest.approx(k * predict(strategy, W, 1,
                                                                                0.0, 0.0))


@pytest.mark.parametrize("strategy", scaling.modelled())
def test_a_slower_network_is_never_faster(strategy):
    for k in (4, 8, 64):
        fast = predict(strategy, W, k, 1e-6, 1e-10)
        slow = predict(strategy, W, k, 1e-4, 1e-8)
        assert 0 < slow <= fast


def test_downpour_is_bounded_by_its_shards():
    beta = 8e-9  # 1 Gb/s: a shard takes one 4 MB push and serves one 4 MB fetch in 64 ms
    bound = W.batch / (8 * W.n_params * beta + W.n_params * W.update_s_per_param)
    assert predict("downpour", W, 256, 0.0, beta) == pytest.approx(bound, rel=1e-6)
    more = replace(W, servers=4)  # four shards take four times the pushes
    assert predict("downpour", more, 259, 0.0, beta) == pytest.approx(4 * bound, rel=1e-6)
    assert predict("downpour", W, 1, 0.0, beta) == 0.0  # no node left to train


def test_a_lone_downpour_replica_waits_for_its_push_to_be_applied():
    """With one replica nothing overlaps: its step is the pass, the push, the shard applying
    it (the ask queues behind the push), and the fetch."""
    alpha, beta = 2e-5, 1e-9
    step = W.compute_s + 3 * alpha + 8 * W.n_params * beta + W.n_params * W.update_s_per_param
    assert predict("downpour", W, 2, alpha, beta) == pytest.approx(W.batch / step)


def test_sandblasters_coordinator_and_shard_take_no_core():
    """On shared cores only sandblaster's R = N - 2 replicas compute (the coordinator and the
    shard sleep between messages): its portions run at R ranks' share of the cores."""
    w = replace(W, cores=2, co_run=1.25, portion_s_per_example=1e-4, update_s_per_param=0.0)
    free = replace(w, cores=None, co_run=1.0)
    for nodes in (4, 8):
        R = nodes - 2
        work = {k: w.batch_examples / predict("sandblaster", k, nodes, 0.0, 0.0)
                for k in (w, free)}
        commands = 0.0  # alpha 0
        assert work[w] - commands == pytest.approx(w.share(R) * (work[free] - commands))
    assert w.share(2) == 1.25 and w.share(6) == 1.25 * 3


def _net(two, **at):
    return {"pingpong": {"alpha_s": two[0], "beta_s_per_byte": two[1], "ranks": 2},
            "pingpong_at": {k[1:]: {"alpha_s": a, "beta_s_per_byte": b}
                            for k, (a, b) in at.items()}}


def test_a_pairs_link_slows_with_the_ranks_computing_beside_it():
    """pair_link: the two-rank ping-pong with nobody computing, each pingpong_at with its
    ranks less the pair computing, straight lines between, the ends held beyond."""
    net = _net((1e-5, 1e-9), n4=(3e-5, 2e-9), n8=(7e-5, 6e-9))
    assert scaling.pair_link(net, 0) == pytest.approx((1e-5, 1e-9))
    assert scaling.pair_link(net, 1) == pytest.approx((2e-5, 1.5e-9))
    assert scaling.pair_link(net, 2) == pytest.approx((3e-5, 2e-9))
    assert scaling.pair_link(net, 4) == pytest.approx((5e-5, 4e-9))
    assert scaling.pair_link(net, 20) == pytest.approx((7e-5, 6e-9))
    assert scaling.pair_link(_net((1e-5, 1e-9)), 5) == pytest.approx((1e-5, 1e-9))


def test_downpour_replicas_compute_beside_the_link_for_their_part_of_the_step():
    """computing_beside: sandblaster's other replicas all compute; downpour's other replicas
    for the part of their step they compute, at the link that many of them leave it (a fixed
    point): nearly none when the shard's link is the bottleneck, nearly all when it is not."""
    shared = replace(W, cores=2)
    net = _net((1e-5, 1e-9), n4=(1e-5, 4e-9), n8=(1e-5, 1e-8))

    def link(c):
        return scaling.pair_link(net, c)
    assert scaling.computing_beside("sandblaster", shared, 8, link) == 5.0
    assert scaling.computing_beside("sandblaster", shared, 2, link) == 0.0
    for nodes in (2, 4, 8):
        c = scaling.computing_beside("downpour", shared, nodes, link)
        R = nodes - 1
        step = R * W.batch / predict("downpour", shared, nodes, *link(c))
        assert c == pytest.approx((R - 1) * min(1.0, shared.compute(nodes) / step), abs=1e-3)
    assert scaling.computing_beside("downpour", shared, 2, link) == 0.0  # one replica
    # 1 Gb/s or slower and 8 MB per replica step: the replicas mostly wait for the shard
    slow = _net((1e-5, 8e-9), n4=(1e-5, 2e-8), n8=(1e-5, 4e-8))
    assert scaling.computing_beside("downpour", shared, 8,
                                    lambda c: scaling.pair_link(slow, c)) < 1.0
    tiny = replace(shared, n_params=1000)  # a few KB: the replicas mostly compute
    assert scaling.computing_beside("downpour", tiny, 8, link) > 5.0


def test_a_measured_allreduce_replaces_the_ring_formula():
    """measured_allreduce interpolates the bench's Iallreduce times (in proportion beyond the
    largest size); sync and averaging then pay it instead of the ring formula."""
    ar = scaling.measured_allreduce({"bytes": [8, 1000, 3000], "seconds": [1e-4, 2e-3, 8e-3]})
    assert ar(8, 4) == pytest.approx(1e-4) and ar(2000, 4) == pytest.approx(5e-3)
    assert ar(6000, 4) == pytest.approx(1.6e-2)
    R, n = 4, W.n_params
    free = {s: R * W.batch / predict(s, W, R, 1e-5, 1e-9) for s in ("sync", "averaging")}
    fixed = {s: R * W.batch / predict(s, W, R, 1e-5, 1e-9, allreduce=lambda m, r: 0.05)
             for s in ("sync", "averaging")}
    assert fixed["sync"] - free["sync"] == pytest.approx(0.05 - ring(4 * (n + 1), R, 1e-5, 1e-9))
    assert fixed["averaging"] - free["averaging"] == pytest.approx(
        (0.05 - ring(8 * n, R, 1e-5, 1e-9)) / W.average_every)
    assert predict("deadreckon", W, R, 1e-5, 1e-9, allreduce=lambda m, r: 1.0) == \
        predict("deadreckon", W, R, 1e-5, 1e-9)


def test_the_cluster_check_takes_the_allreduce_measured_with_the_runs_ranks(tmp_path):
    cal = {"compute_s": 0.002, "update_s_per_param": 1e-9, "portion_s_per_example": 1e-4,
           "reduce_s_per_param": 2e-10, "reckon_s_per_param": 1e-9, "co_run": 1.0}
    slow = {"bytes": [8, 10**6], "seconds": [1e-3, 0.5]}
    pp2 = {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9, "ranks": 2, "allreduce": slow}
    pp4 = {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9, "ranks": 4}  # none measured
    runs = [{"strategy": s, "ranks": k, "replicas": k, "servers": 0, "compute": cal,
             "examples_per_s": 1000.0, "bytes_per_step": 1.0}
            for s in ("sync", "averaging") for k in (2, 4)]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"layers": "64,32,10", "machine": {"nproc": 8},
                                "networks": [{"rate": "1gbit", "pingpong": pp2,
                                              "pingpong_at": {"4": pp4},
                                              "throughput": runs}]}))
    rows = scaling.validate_cluster(str(path), background=0.0)
    n = (64 + 1) * 32 + (32 + 1) * 10
    w = scaling.measured_workload(cal, n, 32, cores=8, co_run=1.0)
    ar = scaling.measured_allreduce(slow)
    for row in rows:
        k = row["ranks"]
        expect = predict(row["strategy"], w, k, 2e-5, 1e-9, allreduce=ar if k == 2 else None)
        assert row["predicted"] == pytest.approx(expect, rel=1e-3), row
    assert rows[0]["predicted"] < predict("sync", w, 2, 2e-5, 1e-9) / 2  # 6 ms, not 0.07


def test_shared_cores_slow_compute_past_the_core_count():
    shared = replace(W, cores=2)
    assert shared.compute(2) == W.compute_s and shared.compute(8) == 4 * W.compute_s
    # beside 2 other jobs' threads: 1 rank gets 2/3 of a core, 8 ranks 2/10
    loaded = replace(W, cores=2, background=2.0)
    assert loaded.compute(1) == pytest.approx(1.5 * W.compute_s)
    assert loaded.compute(8) == pytest.approx(5 * W.compute_s)


def test_deadreckon_messages_follow_compress():
    w = replace(W, updates_per_step=1000, bits_per_update=11.0)
    assert message_bytes(w) == HEADER_BYTES + 8 + 1375
    assert bytes_per_step("deadreckon", w, 5) == 4 * message_bytes(w)
    with pytest.raises(ValueError):
        bytes_per_step("nosuch", w, 2)


def test_strom_table2_shape_within_a_quarter():
    rows = strom_table2()
    assert [r["nodes"] for r in rows] == [1, 5, 10, 20, 40, 80]
    assert all(abs(r["relative_difference"]) <= 0.25 for r in rows), rows
    # the curve bends: the speed-up per node falls as nodes are added
    per_node = [r["model_speedup"] / r["nodes"] for r in rows]
    assert per_node == sorted(per_node, reverse=True)


@pytest.mark.parametrize("strategy,extra", [
    ("sync", []), ("downpour", ["--warmup-steps", "0"]),
    ("sync", ["--wire-dtype", "bf16"]), ("downpour", ["--warmup-steps", "0", "--wire-dtype",
                                                      "bf16"]),
    ("averaging", []), ("averaging", ["--wire-dtype", "bf16"])])
def test_bytes_per_step_are_what_the_run_reports(strategy, extra, digits_h5, tmp_path):
    """The model's bytes per step equal the summary's of a real 3-rank run (bf16 on the
    wire: 2 bytes a value)."""
    run = train(3, "--strategy", strategy, "--data", str(digits_h5), "--layers", "64,32,10",
                "--steps", "40", "--eval-every", "0", "--checkpoint-every", "0",
                "--run-dir", str(tmp_path), *extra, timeout=120)
    assert run.returncode == 0, run.output
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    summary = [r for r in map(json.loads, lines) if r["kind"] == "summary"][-1]
    # run_steps: each replica's iterations (averaging's last average, at the end, counts)
    w = Workload(n_params=64 * 32 + 32 + 32 * 10 + 10, batch=32, compute_s=1.0,
                 value_bytes=2 if "bf16" in extra else 4,
                 run_steps=round(summary["steps_trained"] / summary["replicas"]))
    want = bytes_per_step(strategy, w, summary["replicas"])
    assert summary["bytes_per_step"] == pytest.approx(want, rel=0.01, abs=2)


def test_cli_prints_the_curves_and_both_checks(tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert scaling.main(["--model", "64,32,10", "--network", "1gbe", "--nodes", "1,2,128",
                         "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "check 1, Strom 2015 Table 2" in out and "check 2, the emulated cluster" in out
    assert png.stat().st_size > 1000
    with pytest.raises(SystemExit):
        scaling.main(["--alpha", "1e-5"])  # beta missing


def test_every_option_says_its_default_and_layers_takes_the_widths():
    """--layers takes the layer widths (--model, its old name, still works); every option's
    help gives its default."""
    parser = scaling.build_parser()
    for action in parser._actions:
        if action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings
    assert parser.parse_args(["--layers", "64,32,10"]).layers == "64,32,10"
    assert parser.parse_args(["--model", "64,32,10"]).layers == "64,32,10"
    assert "--layers WIDTHS, --model WIDTHS" in parser.format_help()


@pytest.mark.parametrize("argv, says", [
    (["--model", "784"], "at least two layer widths"),
    (["--layers", "784"], "--layers needs at least two layer widths"),
    (["--run-steps", "0"], "--run-steps must be at least 1"),
    (["--model", "784,0,10"], "must be at least 1"),
    (["--model", "784,x,10"], "comma-separated whole numbers"),
    (["--nodes", "1,0"], "--nodes must be at least 1"),
    (["--batch-size", "0"], "--batch-size and --servers must be at least 1"),
    (["--strategies", "sync,hogwild"], "unknown hogwild"),
    (["--alpha", "1e-5", "--beta", "0"], "--beta > 0"),
    (["--compression", "0"], "--compression must be > 0"),
    (["--data", "/no/such.h5"], "no such file"),
    (["--validate-cluster", "/no/such.json"], "not the JSON of bench/cluster"),
    (["--validate-cluster", "NOT_A_BENCH"], "not the JSON of bench/cluster"),
])
def test_the_cli_refuses_bad_input_in_one_line_before_measuring(argv, says, tmp_path, capsys,
                                                                 monkeypatch):
    """A usage error naming the option (exit code 2), not a traceback, and nothing timed."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "hogwild", "models": {}}))
    argv = [str(other) if a == "NOT_A_BENCH" else a for a in argv]
    monkeypatch.setattr(scaling.calibrate, "measure_compute",
                        lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as exc:
        scaling.main(argv + ["--png", ""])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_the_cluster_check_takes_the_latency_measured_with_the_runs_ranks(tmp_path, monkeypatch):
    """Each emulated-cluster run is predicted with the alpha and beta measured while as many
    ranks ran as it had (``pingpong_at``), falling back to the two-rank ping-pong; sync,
    averaging and deadreckon with the ring's figures (every rank sending at once) where the
    record has them, downpour with the pair's; every pass slowed by the measured co-run."""
    asked = {}

    def compute(layers, batch, repeats, data=None):
        asked["data"] = data
        return {"compute_s": 0.004, "update_s_per_param": 1e-9, "portion_s_per_example": 1e-4,
                "reduce_s_per_param": 2e-10, "reckon_s_per_param": 1e-9, "load_average": 0.0}

    def together(layers, batch, k, data=None):
        return {"processes": k, "alone_s": 0.004, "together_s": 0.005, "slowdown": 1.25}
    monkeypatch.setattr(scaling.calibrate, "measure_compute", compute)
    monkeypatch.setattr(scaling.calibrate, "measure_together", together)
    ring4 = {"alpha_s": 5e-3, "beta_s_per_byte": 4e-9}
    two, four = {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9}, {"alpha_s": 3e-3,
                                                               "beta_s_per_byte": 2e-9,
                                                               "ring": ring4}
    net = {"pingpong": two, "pingpong_at": {"4": four}}
    runs = [{"strategy": s, "ranks": k, "replicas": k - (s == "downpour"),
             "servers": int(s == "downpour"), "examples_per_s": 1000.0, "bytes_per_step": 1.0}
            for s in ("sync", "downpour") for k in (2, 4, 8)]
    data = tmp_path / "nowhere.h5"  # the bench's dataset, not on this machine
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"layers": "64,32,10", "data": str(data),
                                "machine": {"nproc": 2, "load_average": 1.0},
                                "networks": [{"rate": "1gbit", "pingpong": two,
                                              "pingpong_at": {"4": four},
                                              "throughput": runs}]}))
    rows = scaling.validate_cluster(str(path))
    assert asked["data"] is None  # the file is not here: dense random inputs
    w = Workload(n_params=(64 + 1) * 32 + (32 + 1) * 10, batch=32, compute_s=0.004,
                 update_s_per_param=1e-9, reduce_s_per_param=2e-10, reckon_s_per_param=1e-9,
                 cores=2, portion_s_per_example=1e-4, co_run=1.25)
    # sync: no ping-pong at 8 ranks, the two-rank one. downpour: a replica's link to its
    # shard with the other replicas computing part of the time beside it (0 with one)
    expect = [("sync", two), ("sync", ring4), ("sync", two), ("downpour", two)]
    for row, (strategy, pp) in zip(rows, expect):
        assert (row["strategy"], row["alpha_s"]) == (strategy, pp["alpha_s"])
    for row in rows:
        assert row["co_run"] == 1.25
        alpha, beta = two["alpha_s"], two["beta_s_per_byte"]
        if row["strategy"] == "sync" and row["ranks"] == 4:
            alpha, beta = ring4["alpha_s"], ring4["beta_s_per_byte"]
        if row["strategy"] == "downpour":
            assert 0 <= row["computing_beside"] <= row["ranks"] - 2
            alpha, beta = scaling.pair_link(net, row["computing_beside"])
            assert two["alpha_s"] <= alpha <= four["alpha_s"]
        assert row["predicted"] == pytest.approx(predict(row["strategy"], w, row["ranks"],
                                                         alpha, beta), rel=1e-3)
    assert 0 < rows[4]["computing_beside"] < rows[5]["computing_beside"]
    data.write_bytes(b"")
    scaling.validate_cluster(str(path))
    assert asked["data"] == str(data)  # the bench's dataset where it is here


def test_shared_cores_slow_every_cpu_term():
    """On shared cores the update, the allreduce's sum and deadreckon's work slow down with
    the pass, and a pass runs co_run times longer once every core is busy."""
    shared = replace(W, cores=2, co_run=1.5, update_s_per_param=2e-9, reduce_s_per_param=1e-9,
                     reckon_s_per_param=3e-9)
    assert shared.share(1) == 1.0 and shared.share(2) == 1.5 and shared.share(8) == 6.0
    alone = replace(shared, cores=None)
    for s in ("sync", "deadreckon", "averaging"):
        free = {k: R * W.batch / predict(s, w, R, 0.0, 0.0)
                for k, w, R in (("alone", alone, 8), ("shared", shared, 8))}
        assert free["shared"] == pytest.approx(6.0 * free["alone"]), s


def test_compute_is_measured_on_the_replicas_code_and_the_users_rows(digits_h5):
    """measure_compute times the compiled engine a replica runs (NumPy without it), on rows
    of the user's dataset when given, and says so."""
    from hpcps.engine import hogwild
    path = digits_h5
    m = scaling.measure_compute([64, 32, 10], 16, repeats=2, data=str(path))
    assert ("compiled engine" if hogwild.HAVE_EXTENSION else "NumPy") in m["path"]
    assert "rows of" in m["path"] and "zeros" in m["path"], m["path"]
    dense = scaling.measure_compute([64, 32, 10], 16, repeats=2)
    assert "dense random inputs" in dense["path"]
    assert m["compute_s"] > 0 and dense["compute_s"] > 0
    with pytest.raises(DataError, match="first layer takes 784"):
        scaling.measure_compute([784, 32, 10], 16, repeats=2, data=str(path))


def test_the_command_refuses_bad_data_and_png_paths_in_one_line(digits_h5, tmp_path, capsys):
    """--data whose rows do not fit --layers, or a file that is not a dataset: one line, exit
    3 (a traceback, exit 1); --png into a directory that is not there: refused before the
    calibration, exit 2 (after the whole table, with a traceback)."""
    from hpcps.tools.scaling.cli import main
    ckpt = tmp_path / "not-a-dataset.h5"
    import h5py
    with h5py.File(ckpt, "w") as f:
        f.attrs["format"] = "hpcps-checkpoint"
    for data, words in ((digits_h5, "rows of 64 features, but the model's first layer takes "
                                    "784"), (ckpt, "expected 'hpcps-dataset'")):
        assert main(["--data", str(data), "--nodes", "1,2"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("hpcps.scaling: error: ") and words in err, err
        assert err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exc:
        main(["--nodes", "1,2", "--png", str(tmp_path / "missing" / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "Traceback" not in err, err


def test_measure_together_runs_processes_at_once():
    """``slowdown`` is clamped at 1, so it is not checked alone: the unclamped ratio of the
    medians, together over alone, must be that of the same pass timed twice (CPU seconds:
    measured 0.77-0.83 at 2 processes on this 2-core machine, 2026-11-26), not the zero or
    the huge ratio of a pass not run or of times mixed up; and HPCPS_BLAS, which the
    processes are started with, is not left in this process (the autouse fixture checks)."""
    before = os.environ.get("HPCPS_BLAS")
    r = scaling.measure_together([64, 32, 10], 16, 2, repeats=3)
    assert os.environ.get("HPCPS_BLAS") == before
    assert r["processes"] == 2 and r["alone_s"] > 0
    ratio = r["together_s"] / r["alone_s"]
    assert 0.5 <= ratio <= 4.0, r
    assert r["slowdown"] < 4.0, r


def test_the_cluster_check_takes_each_runs_own_calibration(tmp_path, monkeypatch):
    """A run the bench calibrated (``compute``: measured just before it) is predicted with
    those figures; nothing is measured again."""
    def measuring(*a, **k):
        raise AssertionError("measured although every run carries its calibration")
    monkeypatch.setattr(scaling.calibrate, "measure_compute", measuring)
    monkeypatch.setattr(scaling.calibrate, "measure_together", measuring)
    pp = {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9}
    cal = [{"compute_s": t, "update_s_per_param": 1e-9, "portion_s_per_example": 1e-4,
            "reduce_s_per_param": 2e-10, "reckon_s_per_param": 1e-9, "co_run": 1.1}
           for t in (0.002, 0.004)]
    runs = [{"strategy": "sync", "ranks": 2, "replicas": 2, "servers": 0, "compute": c,
             "examples_per_s": 1000.0, "bytes_per_step": 1.0} for c in cal]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"layers": "64,32,10", "machine": {"nproc": 2,
                                                                  "load_average": 1.0},
                                "networks": [{"rate": "1gbit", "pingpong": pp,
                                              "throughput": runs}]}))
    rows = scaling.validate_cluster(str(path))
    n = (64 + 1) * 32 + (32 + 1) * 10
    for row, c in zip(rows, cal):
        w = scaling.measured_workload(c, n, 32, cores=2, co_run=1.1)
        assert row["compute_s"] == c["compute_s"]
        assert row["predicted"] == pytest.approx(predict("sync", w, 2, 2e-5, 1e-9), abs=0.1)
    assert rows[0]["predicted"] > rows[1]["predicted"]


def _bench_cluster():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "bench" / "cluster" / "bench_cluster.py"
    spec = importlib.util.spec_from_file_location("bench_cluster", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cluster_bench_measures_the_steady_rate_without_warm_start():
    """What the check compares the model with: runs where every replica starts at once, and
    the rate between progress records, without the run's start and end."""
    bc = _bench_cluster()
    args = type("Args", (), {"steps": 400, "batch_steps": 3})()
    assert bc.length(args, "deadreckon")[-2:] == ["--warmup-steps", "0"]
    assert bc.length(args, "downpour")[-2:] == ["--warmup-steps", "0"]
    assert bc.length(args, "sync") == ["--steps", "400"]  # no warm start to turn off
    assert bc.length(args, "sandblaster") == ["--steps", "3"]
    start = {"kind": "start", "config": {"batch_size": 32}}
    progress = [{"kind": "progress", "step": s, "time_s": t}
                for s, t in ((1, 0.4), (41, 0.5), (121, 0.7), (400, 1.9))]
    # 120 steps of 32 in 0.3 s between the first record and the last but one
    assert bc.steady_rate([start, *progress]) == pytest.approx(120 * 32 / 0.3)
    assert bc.steady_rate([start, *progress[:2]]) is None
    whole = [{"kind": "progress", "step": 1, "time_s": t} for t in (1.0, 2.0, 3.0)]
    assert bc.steady_rate([start, *whole]) is None


def test_the_cluster_bench_calibrates_co_running_with_the_runs_computing_ranks(monkeypatch):
    """Each run's co-run factor is measured with as many processes as the run has computing
    ranks (sandblaster: its replicas, not the coordinator and shard), at least one per core,
    and the calibration says how many."""
    bc = _bench_cluster()
    assert [bc.computing("sync", n) for n in (2, 4, 8)] == [2, 4, 8]
    assert [bc.computing("downpour", n) for n in (2, 4, 8)] == [2, 4, 8]
    assert [bc.computing("sandblaster", n) for n in (4, 8)] == [2, 6]
    asked = []
    monkeypatch.setattr(scaling, "measure_compute", lambda *a, **k: {
        "compute_s": 2e-3, "path": "stub"})
    monkeypatch.setattr(scaling, "measure_together", lambda layers, batch, processes, **k: (
        asked.append(processes) or {"slowdown": 1.0 + processes / 10}))
    monkeypatch.setattr(bc.os, "cpu_count", lambda: 2)
    args = type("Args", (), {"layers": "784,16,10", "data": None})()
    got = [bc.calibrate(args, p) for p in (1, 2, 6)]
    assert asked == [2, 2, 6]  # at least one per core
    assert [g["co_run_processes"] for g in got] == [2, 2, 6]
    assert got[2]["co_run"] == pytest.approx(1.6) and got[2]["compute_s"] == 2e-3


def test_deadreckon_pays_for_the_words_it_applies_and_no_optimizer():
    """A deadreckon step applies its own words and each peer's message (decoded): R times
    ``words * receive_s_per_word``; its pass is ``reckon_compute_s``; it takes no optimizer
    step, so the update's cost does not enter it; sync's and averaging's do."""
    R, words = 4, 1000.0
    base = replace(W, updates_per_step=words)
    costly = replace(base, receive_s_per_word=1e-7, reckon_compute_s=1.5 * W.compute_s)
    step = {w: R * W.batch / predict("deadreckon", w, R, 1e-5, 1e-9) for w in (base, costly)}
    # the base pays the update's per-parameter figure per word (no receive measured)
    assert step[costly] - step[base] == pytest.approx(R * words * (1e-7 - 1e-9)
                                                      + 0.5 * W.compute_s)
    assert predict("sync", costly, R, 1e-5, 1e-9) == predict("sync", base, R, 1e-5, 1e-9)
    slower_update = replace(costly, update_s_per_param=1e-6)
    assert predict("deadreckon", slower_update, R, 1e-5, 1e-9) == \
        pytest.approx(predict("deadreckon", costly, R, 1e-5, 1e-9))
    for s in ("sync", "averaging"):
        assert predict(s, slower_update, R, 1e-5, 1e-9) < predict(s, costly, R, 1e-5, 1e-9)


def test_deadreckons_step_is_measured_on_its_code():
    """The pass, the thresholding and the words applied, timed in deadreckon's own steps."""
    m = scaling.measure_compute([64, 256, 10], 16, repeats=3)
    assert m["reckon_compute_s"] > 0 and m["reckon_s_per_param"] > 0, m
    assert m["receive_s_per_word"] > 0, m
    w = scaling.measured_workload(m, (64 + 1) * 256 + (256 + 1) * 10, 16)
    assert w.reckon_compute_s == m["reckon_compute_s"]
    assert w.compute(1, w.reckon_compute_s) == m["reckon_compute_s"]
    assert w.compute(1) == m["compute_s"]


def test_the_runs_own_pass_time_replaces_the_shared_cores_terms():
    """in_run_workload: the pass as the run timed it, every other CPU term slowed by the same
    factor, no sharing on top (the run's time holds it already)."""
    shared = replace(W, cores=2, co_run=1.5, background=1.0, reduce_s_per_param=1e-9,
                     reckon_s_per_param=3e-9, receive_s_per_word=2e-8,
                     portion_s_per_example=1e-4, reckon_compute_s=2 * W.compute_s)
    run = scaling.in_run_workload(shared, 3 * W.compute_s)
    assert run.share(8) == 1.0 and run.compute(8) == pytest.approx(3 * W.compute_s)
    assert run.compute(8, run.reckon_compute_s) == pytest.approx(3 * W.compute_s)  # as timed
    for term in ("update_s_per_param", "reduce_s_per_param", "reckon_s_per_param",
                 "receive_s_per_word", "portion_s_per_example"):
        assert getattr(run, term) == pytest.approx(3 * getattr(shared, term)), term
    R = 4
    free = replace(shared, cores=None, co_run=1.0, background=0.0)
    assert R * W.batch / predict("sync", run, R, 0.0, 0.0) == \
        pytest.approx(3 * R * W.batch / predict("sync", free, R, 0.0, 0.0))
    # the pass's CPU time: co-running is in it, the wait for a core is not (the model's)
    cpu = scaling.in_run_workload(shared, 3 * W.compute_s, cpu_time=True)
    assert (cpu.cores, cpu.background, cpu.co_run) == (2, 1.0, 1.0)
    assert cpu.compute(8) == pytest.approx(3 * W.compute_s * (8 + 1.0) / 2)
    assert cpu.update_s_per_param == pytest.approx(3 * shared.update_s_per_param)


def test_the_cluster_check_also_predicts_with_each_runs_own_pass_time(tmp_path):
    cal = {"compute_s": 0.002, "update_s_per_param": 1e-9, "portion_s_per_example": 1e-4,
           "reduce_s_per_param": 2e-10, "reckon_s_per_param": 1e-9, "co_run": 1.1}
    runs = [{"strategy": "sync", "ranks": k, "replicas": k, "servers": 0, "compute": cal,
             "examples_per_s": 1000.0, "bytes_per_step": 1.0, **timed}
            for k, timed in ((2, {"pass_s": 0.005}), (2, {}), (4, {"pass_s": 0.005}),
                             (4, {"pass_s": 0.009, "pass_cpu_s": 0.004}))]
    path = _two_core_bench(tmp_path, runs, load_average=1.0)
    timed, untimed, sliced, cpu = scaling.validate_cluster(str(path))
    n = (64 + 1) * 32 + (32 + 1) * 10
    w = scaling.measured_workload(cal, n, 16, cores=2, co_run=1.1)  # the recorded batch
    assert timed["predicted"] == pytest.approx(predict("sync", w, 2, 2e-5, 1e-9), abs=0.1)
    in_run = predict("sync", scaling.in_run_workload(w, 0.005), 2, 2e-5, 1e-9)
    assert timed["predicted_in_run"] == pytest.approx(in_run, abs=0.1)
    assert timed["relative_difference_in_run"] == pytest.approx(in_run / 1000.0 - 1, abs=1e-3)
    # not timed; more ranks than the 2 cores: time-sliced, the pass shows little of it
    assert "predicted_in_run" not in untimed and "predicted_in_run" not in sliced
    # the pass's CPU time, where the run recorded it: any number of ranks, sharing modelled
    w4 = replace(w, background=0.0)  # the recorded load average less the measuring process
    in_run = predict("sync", scaling.in_run_workload(w4, 0.004, cpu_time=True), 4, 2e-5, 1e-9)
    assert cpu["pass_in_run_is_cpu_time"] and cpu["pass_s_in_run"] == 0.004
    assert cpu["predicted_in_run"] == pytest.approx(in_run, abs=0.1)


def _two_core_bench(tmp_path, runs, load_average: float):
    """A bench_cluster record of ``runs`` on one 1 Gb/s network (alpha 20 us, 1 ns a byte),
    the 64-32-10 model at batch 16, on 2 cores whose load average was ``load_average``."""
    path = tmp_path / "cluster.json"
    pp = {"alpha_s": 2e-5, "beta_s_per_byte": 1e-9}
    path.write_text(json.dumps({"layers": "64,32,10", "batch": 16,
                                "machine": {"nproc": 2, "load_average": load_average},
                                "networks": [{"rate": "1gbit", "pingpong": pp,
                                              "throughput": runs}]}))
    return path


def test_an_average_pays_for_its_own_copies_every_k_steps():
    """averaging's step adds, every k steps, the copies into and out of its buffer, measured
    on averaging's own code (pack, to_mean, unpack)."""
    R, k = 4, 4
    copying = replace(W, average_s_per_param=2e-9, average_every=k)
    plain = replace(W, average_every=k)
    step = {w: R * W.batch / predict("averaging", w, R, 1e-5, 1e-9) for w in (plain, copying)}
    assert step[copying] - step[plain] == pytest.approx(W.n_params * 2e-9 / k)
    m = scaling.measure_compute([64, 256, 10], 16, repeats=3)
    assert m["average_s_per_param"] > 0, m


def test_the_bench_table_refuses_a_file_it_did_not_write(tmp_path):
    """``bench_cluster.py --table`` on another bench's JSON, or a missing file: a usage error
    naming the file (exit code 2), not a traceback; needs no root."""
    root = Path(__file__).resolve().parents[1]
    other = tmp_path / "hogwild.json"
    other.write_text(json.dumps({"bench": "hogwild", "models": {}}))
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for path in (other, tmp_path / "missing.json"):
        run = subprocess.run([sys.executable, str(root / "bench" / "cluster" / "bench_cluster.py"),
                              "--table", str(path)], capture_output=True, text=True, env=env,
                             timeout=60)
        assert run.returncode == 2, run.stderr
        assert f"--table {path}: not this bench's JSON" in run.stderr
        assert "Traceback" not in run.stderr


def test_the_cluster_check_shares_the_cores_with_the_load_sampled_before_each_run(tmp_path):
    """A run the bench sampled other jobs' threads for (``background`` in its record) is
    predicted with those, not with the load average recorded at the bench's start (which
    still holds the bench's own earlier runs); a background given by the caller holds for
    every run."""
    cal = {"compute_s": 0.002, "update_s_per_param": 1e-9, "reduce_s_per_param": 2e-10,
           "co_run": 1.0}
    runs = [{"strategy": "sync", "ranks": 2, "replicas": 2, "servers": 0, "compute": cal,
             "examples_per_s": 1000.0, "bytes_per_step": 1.0, **sampled}
            for sampled in ({"background": 0.0}, {"background": 2.0}, {})]
    path = _two_core_bench(tmp_path, runs, load_average=4.0)
    n = (64 + 1) * 32 + (32 + 1) * 10

    def expect(background):
        w = scaling.measured_workload(cal, n, 16, cores=2, background=background)
        return predict("sync", w, 2, 2e-5, 1e-9)

    quiet, busy, unsampled = scaling.validate_cluster(str(path))
    assert quiet["predicted"] == pytest.approx(expect(0.0), abs=0.1)
    assert busy["predicted"] == pytest.approx(expect(2.0), abs=0.1)
    assert unsampled["predicted"] == pytest.approx(expect(3.0), abs=0.1)  # load 4 less 1
    assert quiet["predicted"] > 1.5 * busy["predicted"]
    given = scaling.validate_cluster(str(path), background=1.0)
    assert all(r["predicted"] == pytest.approx(expect(1.0), abs=0.1) for r in given)
