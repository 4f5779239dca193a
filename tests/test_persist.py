"""--persist-every: the geometry of a manifest, the shard's writer, and runs (one killed)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from faultinject import wait_for_step
from mpirun import ROOT, end_launch, mpiexec, tagged_env, train

from hpcps.io import checkpoint
from hpcps.ps.chunks import ChunkPlan
from hpcps.model.mlp import MLP, PartitionedMLP
from hpcps.ps.persist import (MANIFEST_NAME, Persister, boxes, create_shard_file, mapping,
                              placements)


# -- geometry (pure) -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 3, 4, 5), (1, 9), (6, 1)])
def test_boxes_cover_a_flat_range_exactly(shape):
    n = int(np.prod(shape))
    flat = np.arange(n).reshape(shape)
    rng = np.random.default_rng(n)
    pairs = [(0, n), (0, 1), (n - 1, n)] + [tuple(sorted(rng.integers(0, n + 1, 2)))
                                            for _ in range(60)]
    for lo, hi in pairs:
        got = boxes(shape, lo, hi)
        assert len(got) <= 2 * len(shape) - 1
        seen = []
        for index, start in got:
            block = flat[index].ravel()
            assert list(block) == list(range(start, start + len(block)))
            seen += list(block)
        assert seen == list(range(lo, hi)), (shape, lo, hi)


def reassemble(model, full, shards):
    """Whole arrays rebuilt from the shards' local vectors through ``mapping``."""
    out = {name: np.full(shape, np.nan, np.float32) for name, shape, _ in full.layout}
    for base, plan, j, local in shards:
        for name, maps in mapping(plan.pieces[j], base, placements(model, full)).items():
            for index, start, count in maps:
                out[name][index] = local[start:start + count].reshape(out[name][index].shape)
    return out


@pytest.mark.parametrize("P,S,chunk", [(1, 1, 10_000), (1, 3, 37), (2, 4, 53), (3, 3, 64)])
def test_the_mapping_rebuilds_every_layer(P, S, chunk):
    sizes = (12, 9, 7, 5)
    full = MLP(sizes)
    whole = np.random.default_rng(1).standard_normal(full.n_params).astype(np.float32)
    named = full.views(whole)
    model = PartitionedMLP(sizes, "relu", P, 0) if P > 1 else full
    shards = []
    if P == 1:
        plan = ChunkPlan(full.n_params, chunk, S)
        shards = [(0, plan, j, plan.take(j, whole)) for j in range(S)]
    else:
        base = 0
        for q in range(P):
            local = model.local_from_full(named, q)
            plan = ChunkPlan(len(local), chunk, S // P)
            shards += [(base, plan, j, plan.take(j, local)) for j in range(S // P)]
            base += len(local)
    got = reassemble(model, full, shards)
    for name, a in named.items():
        assert np.array_equal(got[name], a), name


# -- the writer (no MPI) -------------------------------------------------------------------------
CREATE_UNDER_A_LIMIT = """
import resource, signal, sys
from pathlib import Path
import numpy as np
from hpcps.errors import CheckpointError
from hpcps.ps.persist import create_shard_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
params = np.zeros(200_000, np.float32)  # 800 kB
try:
    create_shard_file(Path(sys.argv[1]), params, {}, [(0, len(params))], 0, 0)
except CheckpointError as exc:
    print(exc)
"""


def test_a_persistence_file_the_file_system_refuses_is_one_line(tmp_path):
    """A full disk or quota (a file-size limit here) as a shard creates its file: one
    CheckpointError line with the reason (exit code 4 in a run), no traceback, no file."""
    path = tmp_path / "shard-0.h5"
    run = subprocess.run([sys.executable, "-c", CREATE_UNDER_A_LIMIT, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
    assert run.stdout.splitlines() == [f"cannot write the persistence file {path}: File too "
                                       "large (make room, or run without --persist-every)"]
    assert list(tmp_path.iterdir()) == []


def test_the_writer_flushes_dirty_chunks_and_their_steps(tmp_path):
    params = np.arange(10, dtype=np.float32)
    state = {"accum": np.ones(10, np.float32)}
    chunks = [(0, 4), (4, 4), (8, 2)]
    path = tmp_path / "shard-0.h5"
    offsets = create_shard_file(path, params, state, chunks, 5, 0)
    p = Persister(path, {"params": params, "state/accum": state["accum"]}, chunks, offsets,
                  every=0.0, step=5)
    params += 100
    state["accum"] *= 3
    p.touch()
    p.maybe_flush(9)
    params += 1000  # after the snapshot: not in this flush
    p._busy_wait()
    with h5py.File(path) as f:
        assert np.array_equal(f["params"][()], np.arange(10) + 100)
        assert np.array_equal(f["state/accum"][()], np.full(10, 3))
        assert list(f["chunk_step"][()]) == [9, 9, 9]
    assert p.unpersisted(12) == 3
    p.touch()
    p.close(12)
    with h5py.File(path) as f:
        assert np.array_equal(f["params"][()], np.arange(10) + 1100)
        assert list(f["chunk_step"][()]) == [12, 12, 12]
    assert p.figures()["flushes"] == 2 and p.figures()["persisted_step"] == 12


# -- runs ----------------------------------------------------------------------------------------
def same_state(a: checkpoint.Checkpoint, b: checkpoint.Checkpoint) -> bool:
    return (a.step == b.step and a.params.keys() == b.params.keys()
            and all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
            and all(np.array_equal(a.opt_state[k], b.opt_state[k]) for k in a.opt_state))


COMMON = ["--batch-size", "16", "--eval-every", "0", "--checkpoint-every", "0",
          "--timeout", "60", "--persist-every", "0.02"]


@pytest.mark.parametrize("n,extra", [
    (4, ["--servers", "2", "--chunk-bytes", "1024"]),
    (6, ["--partitions", "2", "--servers", "2", "--optimizer", "momentum"]),
    (4, ["--model", "conv3x3x8p1,pool2,fc32,fc10", "--servers", "2", "--chunk-bytes", "512"]),
])
def test_the_manifest_holds_the_final_state_and_resumes_on_another_n(n, extra, digits_h5,
                                                                     tmp_path):
    """At the end of a run the shards' files, read through the manifest with plain h5py,
    hold exactly the final checkpoint's state; a run on another N resumes from it."""
    model = [] if "--model" in extra else ["--layers", "64,32,10"]
    run = train(n, "--data", str(digits_h5), "--epochs", "3", *model, *extra, *COMMON,
                "--run-dir", str(tmp_path / "a"))
    assert run.returncode == 0, run.output[-3000:]
    final = checkpoint.load(tmp_path / "a" / "checkpoint.h5")
    manifest = checkpoint.load(tmp_path / "a" / MANIFEST_NAME)
    assert same_state(final, manifest)
    with h5py.File(tmp_path / "a" / MANIFEST_NAME) as f:
        assert f["params/layer0/W"].is_virtual
        assert np.array_equal(f["params/layer0/W"][()], final.params["layer0/W"])
    assert "persisted every 0.02 s" in run.stdout
    shard = next((tmp_path / "a" / "persist").glob("*/shard-1.h5"))
    shard.rename(shard.with_suffix(".gone"))
    with pytest.raises(checkpoint.CheckpointError, match="shard file .*shard-1.h5.* is missing"):
        checkpoint.load(tmp_path / "a" / MANIFEST_NAME)
    shard.with_suffix(".gone").rename(shard)
    keep = extra[extra.index("--optimizer"):][:2] if "--optimizer" in extra else []
    keep += extra[extra.index("--model"):][:2] if "--model" in extra else []
    more = train(3, "--data", str(digits_h5), *model, *keep, "--steps", str(final.step + 60),
                 "--resume", str(tmp_path / "a" / MANIFEST_NAME), *COMMON[:-2],
                 "--run-dir", str(tmp_path / "b"))
    assert more.returncode == 0, more.output[-3000:]
    assert checkpoint.load(tmp_path / "b" / "checkpoint.h5").step >= final.step + 60


def records(path, kind):
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def test_the_reported_window_counts_from_the_shard_with_the_oldest_flush():
    """A replica reports shard 0's step, but a persistence manifest holds each chunk at its
    shard's last flush: the steps not yet on disk are counted to the oldest shard's flush,
    whichever shard that is."""
    from hpcps.mpi.protocol import HEADER_SLOTS, H
    from hpcps.ps.client import unpersisted

    def header(steps, behind):
        h = np.zeros(HEADER_SLOTS)
        h[H.STEPS], h[H.UNPERSISTED] = steps, behind
        return h
    assert unpersisted([header(1645, 3)]) == 3
    # shard 1 flushed last at 1641, shard 0 at 1642: 1641 is what is on every disk
    assert unpersisted([header(1645, 3), header(1644, 3)]) == 4
    assert unpersisted([header(1645, 0), header(1646, 2), header(1645, 5)]) == 5


def test_sigkill_of_the_whole_job_loses_at_most_the_reported_window(digits_h5, tmp_path):
    """The whole job is SIGKILLed while the shards flush every 20 ms (a flush is under way
    most of the time): the manifest still loads, its step is at least the persisted step the
    last progress record reported (nothing reported as persisted is lost), --resume auto
    takes it, and the resumed run completes."""
    run_dir = tmp_path / "run"
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "hpcps.train", "--data",
           str(digits_h5), "--layers", "64,512,512,10", "--steps", "200000", "--servers", "2",
           "--progress-every", "0.2", *COMMON, "--run-dir", str(run_dir)]
    env, tag = tagged_env({**os.environ, "OPENBLAS_NUM_THREADS": "1",
                           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 1500, 120)
        time.sleep(0.37)
    finally:
        end_launch(proc.pid, tag)  # the whole job: mpiexec, Hydra's proxies and every rank
        proc.wait(timeout=30)
    reported = records(run_dir / "metrics.jsonl", "progress")
    last = reported[-1]
    assert last["persisted_step"] + last["unpersisted_steps"] == last["step"]
    manifest = checkpoint.load(run_dir / MANIFEST_NAME)
    checkpoint.check_finite(manifest)
    assert manifest.step >= last["persisted_step"] > 0, (manifest.step, last)
    ckpt, _ = checkpoint.latest(run_dir)
    assert ckpt.path.name == MANIFEST_NAME  # checkpoint.h5 is written only at the end
    more = train(4, "--data", str(digits_h5), "--layers", "64,512,512,10", "--servers", "2",
                 "--steps", str(manifest.step + 100), "--resume", "auto", *COMMON,
                 "--run-dir", str(run_dir))
    assert more.returncode == 0, more.output[-3000:]
    assert f"step {manifest.step}" in more.output, more.output[-2000:]


CHILD = r'''
import os, signal, sys
import numpy as np
from pathlib import Path
from hpcps.ps import persist

path, die_at = Path(sys.argv[1]), int(sys.argv[2])
params, accum = np.zeros(12, np.float32), np.zeros(12, np.float32)
chunks = [(0, 4), (4, 4), (8, 4)]
offsets = persist.create_shard_file(path, params, {"accum": accum}, chunks, 0, 0)
p = persist.Persister(path, {"params": params, "state/accum": accum}, chunks, offsets, 0.0, 0)
params[:] = 1; accum[:] = 1; p.touch(); p.maybe_flush(10); p._busy_wait()
real, calls = os.pwrite, [0]

def dying(fd, data, offset):
    calls[0] += 1
    if calls[0] == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data, offset)

os.pwrite = dying
params[:] = 2; accum[:] = 2; p.touch(); p.maybe_flush(20); p._busy_wait()
'''


@pytest.mark.parametrize("die_at", range(1, 11))
def test_a_kill_inside_a_flush_leaves_a_readable_file_no_newer_than_it_says(die_at, tmp_path):
    """A shard process SIGKILLed at each of the 10 writes of a flush (3 chunks x values,
    state, step; then every chunk's step): the file opens with plain h5py, and every chunk
    holds values at least as new as its recorded step (10 or 20)."""
    path = tmp_path / "shard-0.h5"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.run([sys.executable, "-c", CHILD, str(path), str(die_at)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    with h5py.File(path) as f:
        steps, params, accum = f["chunk_step"][()], f["params"][()], f["state/accum"][()]
    for c, step in enumerate(steps):
        values = {float(v) for v in params[4 * c:4 * c + 4]} | \
            {float(v) for v in accum[4 * c:4 * c + 4]}
        assert step in (10, 20)
        assert values <= ({2.0} if step == 20 else {1.0, 2.0}), (die_at, c, step, values)
    assert (steps == 20).all() == (die_at == 10)  # each dirty chunk stamped after its values
