"""Checkpoints: round trip, plain-h5py layout, atomic writes, and refusal of damaged files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpcps import checkpoint
from hpcps.errors import CheckpointError
from mpirun import ROOT


def make(step=7, sizes=(6, 5, 3), seed=0, optimizer="adagrad"):
    rng = np.random.default_rng(seed)
    params, state = {}, {}
    for i in range(len(sizes) - 1):
        for name, shape in (("W", (sizes[i], sizes[i + 1])), ("b", (sizes[i + 1],))):
            params[f"layer{i}/{name}"] = rng.standard_normal(shape).astype(np.float32)
            if optimizer == "adagrad":
                state[f"accum/layer{i}/{name}"] = rng.random(shape).astype(np.float32)
    return checkpoint.Checkpoint(
        params=params, optimizer=optimizer, opt_state=state, step=step,
        config={"layers": list(sizes), "lr": 0.01, "resume": None, "sync": True, "name": "x"},
        dataset={"name": "toy", "fingerprint": "abc", "n_train": 10, "n_test": 5,
                 "n_features": sizes[0], "n_classes": sizes[-1]},
        metrics={"test_accuracy": 0.5})


def test_round_trip_is_exact(tmp_path):
    ck = make()
    checkpoint.save(tmp_path / "c.h5", ck)
    got = checkpoint.load(tmp_path / "c.h5")
    assert got.step == 7 and got.optimizer == "adagrad"
    assert got.config == ck.config and got.dataset == ck.dataset and got.metrics == ck.metrics
    for k, v in ck.params.items():
        np.testing.assert_array_equal(got.params[k], v)
    for k, v in ck.opt_state.items():
        np.testing.assert_array_equal(got.opt_state[k], v)


def test_plain_h5py_reads_the_documented_paths(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f.attrs["format"] == "hpcps-checkpoint" and f.attrs["layout_version"] == 1
        assert list(f.attrs["layer_sizes"]) == [6, 5, 3] and f.attrs["step"] == 7
        assert f["params/layer1/W"].shape == (5, 3)
        assert f["optimizer"].attrs["name"] == "adagrad"
        assert f["optimizer/accum/layer0/b"].shape == (5,)
        assert f["params/layer0/W"].fletcher32


def test_truncated_files_are_refused(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    raw = (tmp_path / "c.h5").read_bytes()
    for cut in (1, 100, len(raw) // 2, len(raw) - 1):
        bad = tmp_path / f"cut{cut}.h5"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt|unreadable"):
            checkpoint.load(bad)


def test_flipped_bytes_in_weights_are_detected(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    with h5py.File(tmp_path / "c.h5", "r") as f:
        info = f["params/layer0/W"].id.get_chunk_info(0)
    raw = bytearray((tmp_path / "c.h5").read_bytes())
    for offset in (0, info.size // 2, info.size - 5):
        bad = bytearray(raw)
        bad[info.byte_offset + offset] ^= 0x10
        (tmp_path / "flip.h5").write_bytes(bytes(bad))
        with pytest.raises(CheckpointError):
            checkpoint.load(tmp_path / "flip.h5")


def test_not_hdf5_missing_and_unknown_version(tmp_path):
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(CheckpointError):
        checkpoint.load(tmp_path / "text.h5")
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.load(tmp_path / "none.h5")
    checkpoint.save(tmp_path / "c.h5", make())
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        f.attrs["layout_version"] = 99
    with pytest.raises(CheckpointError, match="99"):
        checkpoint.load(tmp_path / "c.h5")


def test_check_compatible(tmp_path):
    ck = make()
    ident = dict(ck.dataset)
    assert checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", ident) == []
    with pytest.raises(CheckpointError, match="6,5,3"):
        checkpoint.check_compatible(ck, [6, 4, 3], "adagrad", ident)
    with pytest.raises(CheckpointError, match="sgd"):
        checkpoint.check_compatible(ck, [6, 5, 3], "sgd", ident)
    with pytest.raises(CheckpointError):
        checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", {**ident, "n_classes": 4})
    warnings = checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", {**ident, "fingerprint": "z"})
    assert warnings and "fingerprint" in warnings[0]


WRITER = """
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from hpcps import checkpoint
from test_checkpoint import make
ck = make(step=2, sizes=(2000, 2000, 10))
print("ready", flush=True)
while True:
    checkpoint.save(sys.argv[1], ck)
"""


def test_kill_during_writes_never_damages_the_checkpoint(tmp_path):
    path = tmp_path / "c.h5"
    checkpoint.save(path, make(step=1, sizes=(2000, 2000, 10)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for delay in (0.05, 0.2, 0.45):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(ROOT / "tests")],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        got = checkpoint.load(path)  # whichever save completed last, never a broken file
        assert got.step in (1, 2)
        assert got.params["layer0/W"].shape == (2000, 2000)


def test_inspect_cli(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "hpcps.inspect", str(tmp_path / "c.h5")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and "layer1/W" in run.stdout and "(5, 3)" in run.stdout
    run = subprocess.run([sys.executable, "-m", "hpcps.inspect", "--json", str(tmp_path / "c.h5")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0 and '"step": 7' in run.stdout
    (tmp_path / "bad.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 50)
    run = subprocess.run([sys.executable, "-m", "hpcps.inspect", str(tmp_path / "bad.h5")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 4 and run.stderr.startswith("hpcps.inspect: error:")
