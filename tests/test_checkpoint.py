"""Checkpoints: exact round trip, plain-h5py layout, atomic writes under SIGKILL, and refusal
(CheckpointError, never a raw h5py error or a hang) of missing, truncated and corrupt files."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import read_line

from hpcps.io import checkpoint
from hpcps.errors import CheckpointError
from hpcps.tools.inspect import describe, summarize

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))

CONFIG = {"layers": [6, 5, 3], "lr": 0.01, "resume": None, "sync": True, "name": "x",
          "tags": ["a", "b"], "empty": [], "model": {"act": "relu", "dropout": 0.0}}


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
        config=dict(CONFIG, layers=list(sizes)),
        dataset={"name": "toy", "fingerprint": "abc", "n_train": 10, "n_test": 5,
                 "n_features": sizes[0], "n_classes": sizes[-1]},
        metrics={"test_accuracy": 0.5, "train_loss": 1 / 3, "elapsed_s": 12.25})


def same(a: checkpoint.Checkpoint, b: checkpoint.Checkpoint) -> bool:
    """Bit-exact equality of two checkpoints (arrays compared with dtype and shape)."""
    def arrays_equal(x, y):
        return x.keys() == y.keys() and all(
            x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
            and x[k].tobytes() == y[k].tobytes() for k in x)
    return (arrays_equal(a.params, b.params) and arrays_equal(a.opt_state, b.opt_state)
            and (a.optimizer, a.step, a.config, a.dataset, a.metrics)
            == (b.optimizer, b.step, b.config, b.dataset, b.metrics))


# -- round trip and layout ----------------------------------------------------------------------
def test_round_trip_is_bit_exact(tmp_path):
    ck = make()
    assert checkpoint.save(tmp_path / "c.h5", ck) == tmp_path / "c.h5"
    got = checkpoint.load(tmp_path / "c.h5")
    assert same(got, ck)
    assert got.config["resume"] is None and got.config["sync"] is True
    assert isinstance(got.config["lr"], float)
    assert got.config["model"] == {"act": "relu", "dropout": 0.0}
    assert got.metrics["train_loss"] == 1 / 3  # float64 survives exactly
    assert type(got.step) is int and got.path == tmp_path / "c.h5"
    assert all(v.flags.writeable and v.dtype == np.float32 for v in got.params.values())


def test_round_trip_sgd_and_special_values(tmp_path):
    ck = make(optimizer="sgd", sizes=(4, 3))
    ck.params["layer0/W"][0, 0] = np.nan  # a diverged run can still be saved and inspected
    ck.metrics = {"train_loss": float("nan"), "steps": np.int64(3), "acc": np.float32(0.25)}
    checkpoint.save(tmp_path / "c.h5", ck)
    got = checkpoint.load(tmp_path / "c.h5")
    assert got.opt_state == {} and got.optimizer == "sgd"
    assert got.params["layer0/W"].tobytes() == ck.params["layer0/W"].tobytes()
    assert math.isnan(got.metrics["train_loss"]) and got.metrics["steps"] == 3
    assert got.metrics["acc"] == 0.25 and type(got.metrics["steps"]) is int
    assert "NON-FINITE 1" in describe(tmp_path / "c.h5")


def test_plain_h5py_reads_the_documented_paths(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    with h5py.File(tmp_path / "c.h5", "r") as f:
        a = f.attrs
        # strings are fixed-length UTF-8 (see checkpoint._fixed_str): h5py returns bytes
        assert a["format"].decode() == "hpcps-checkpoint" and a["layout_version"] == 1
        assert a["hpcps_version"].decode() == __import__("hpcps").__version__
        assert list(a["layer_sizes"]) == [6, 5, 3] and a["step"] == 7
        assert a["created"].decode().startswith("20")
        assert "docs/formats.md" in a["description"].decode()
        assert json.loads(a["config_json"]) == CONFIG
        for i, (n_in, n_out) in enumerate([(6, 5), (5, 3)]):
            W, b = f[f"params/layer{i}/W"], f[f"params/layer{i}/b"]
            assert W.shape == (n_in, n_out) and b.shape == (n_out,) and W.dtype == np.float32
            assert "fan_in, fan_out" in W.attrs["description"].decode()
            for d in (W, b):
                assert d.fletcher32 and d.chunks is not None and d.compression is None
        assert f["optimizer"].attrs["name"].decode() == "adagrad"
        acc = f["optimizer/accum/layer0/b"]
        assert acc.shape == (5,) and acc.fletcher32
        assert "Adagrad accumulator" in acc.attrs["description"].decode()
        c = f["config"].attrs
        assert c["lr"] == 0.01 and list(c["layers"]) == [6, 5, 3] and bool(c["sync"]) is True
        assert c["resume"].decode() == "none" and [t.decode() for t in c["tags"]] == ["a", "b"]
        assert c["model.act"].decode() == "relu" and c["empty"].decode() == "[]"
        assert f["dataset"].attrs["n_features"] == 6
        assert f["dataset"].attrs["name"].decode() == "toy"
        assert f["metrics"].attrs["test_accuracy"] == 0.5


def test_layer_sizes_and_refused_input(tmp_path):
    assert checkpoint.layer_sizes(make(sizes=(4, 8, 8, 2)).params) == [4, 8, 8, 2]
    W = np.zeros((3, 2), np.float32)
    b = np.zeros(2, np.float32)
    bad_params = [
        ({"layer0/W": W.astype(np.float64), "layer0/b": b}, "float32"),
        ({"layer0/W": W}, "layer0/b is missing"),
        ({"layer0/W": W, "layer0/b": b, "layer2/W": np.zeros((2, 2), np.float32),
          "layer2/b": b}, "without gaps"),
        ({"layer0/W": W, "layer0/b": b, "layer1/W": np.zeros((3, 2), np.float32),
          "layer1/b": b}, "do not chain"),
        ({"layer0/W": W, "layer0/b": np.zeros(3, np.float32)}, "fan_out"),
        ({"layer0/weights": W}, "not of the form"),
        ({}, "non-empty"),
    ]
    for params, msg in bad_params:
        with pytest.raises(CheckpointError, match=msg):
            checkpoint.layer_sizes(params)
    good = make()
    bad_checkpoints = [
        (dict(step=-1), "step"),
        (dict(step=True), "step"),
        (dict(config={"lr": object()}), r"config\.lr is a object"),
        (dict(config={1: 2}), "not a string"),
        (dict(opt_state={"accum": np.float32(1.0)}), "numeric ndarray"),
        (dict(opt_state={"accum": np.array(1.0)}), "0-d"),
        (dict(opt_state={"a": np.ones(2), "a/b": np.ones(2)}), "clash"),
        (dict(opt_state={"../x": np.ones(2)}), "opt_state key"),
        (dict(optimizer=""), "optimizer"),
    ]
    for change, msg in bad_checkpoints:
        ck = checkpoint.Checkpoint(**{**good.__dict__, **change})
        with pytest.raises(CheckpointError, match=msg):
            checkpoint.save(tmp_path / "c.h5", ck)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


# -- atomic writes ------------------------------------------------------------------------------
WRITER = """
import sys, numpy as np
from hpcps.io import checkpoint
n, loop = int(sys.argv[2]), sys.argv[3] == "loop"
params = {"layer0/W": np.full((n, n), 2.0, np.float32), "layer0/b": np.full(n, 2.0, np.float32),
          "layer1/W": np.full((n, 10), 2.0, np.float32), "layer1/b": np.full(10, 2.0, np.float32)}
ck = checkpoint.Checkpoint(params, "sgd", {}, 2, {"run": "writer"}, {"name": "toy"})
print("ready", flush=True)
checkpoint.save(sys.argv[1], ck)
while loop:
    checkpoint.save(sys.argv[1], ck)
"""


def test_sigkill_mid_write_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "c.h5"
    old = make(step=1)
    checkpoint.save(path, old)
    before = path.read_bytes()
    # a ~150 MB write takes a few tenths of a second: kill it once the temp file has grown
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "6000", "once"],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    tmp = tmp_path / f"c.h5.tmp-{proc.pid}"
    try:
        assert read_line(proc.stdout.fileno(), 60).strip() == "ready"
        deadline = time.monotonic() + 60
        while not (tmp.exists() and tmp.stat().st_size > 4 << 20):
            assert proc.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before and same(checkpoint.load(path), old)
    assert tmp.exists()  # the stale temp of the killed writer: harmless, and refused if loaded
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoint.load(tmp)
    new = make(step=9, seed=1)
    checkpoint.save(path, new)
    assert same(checkpoint.load(path), new)
    assert tmp.exists()  # another pid's temp is left alone: it may belong to a live writer


def test_sigkill_at_random_moments_never_damages_the_checkpoint(tmp_path):
    path = tmp_path / "c.h5"
    checkpoint.save(path, make(step=1, sizes=(2000, 10)))
    for delay in (0.0, 0.05, 0.2, 0.45):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "2000", "loop"],
                                stdout=subprocess.PIPE, text=True, env=ENV)
        try:
            assert read_line(proc.stdout.fileno(), 60).strip() == "ready"
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        got = checkpoint.load(path)  # whichever save completed last, never a broken file
        if got.step == 1:
            assert same(got, make(step=1, sizes=(2000, 10)))
        else:
            assert got.step == 2 and (got.params["layer0/W"] == 2.0).all()
            assert got.params["layer0/W"].shape == (2000, 2000) and got.config == {"run": "writer"}


def test_stale_temp_of_our_own_pid_is_replaced_and_failed_writes_clean_up(tmp_path):
    path = tmp_path / "c.h5"
    stale = tmp_path / f"c.h5.tmp-{os.getpid()}"
    stale.write_bytes(b"half a checkpoint from a crashed save")
    checkpoint.save(path, make())
    assert not stale.exists() and same(checkpoint.load(path), make())
    (tmp_path / "dir.h5").mkdir()  # os.replace onto a directory fails after the write
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        checkpoint.save(tmp_path / "dir.h5", make())
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        checkpoint.save(tmp_path / "no" / "such" / "dir" / "c.h5", make())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5", "dir.h5"]


# -- damaged files ------------------------------------------------------------------------------
def test_truncated_files_are_refused(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    raw = (tmp_path / "c.h5").read_bytes()
    cuts = {0, 1, 8, 100, 512, len(raw) // 2, len(raw) - 1, *range(0, len(raw), 331)}
    for cut in sorted(cuts):
        bad = tmp_path / "cut.h5"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match=r"is unreadable \(truncated or corrupt\)"):
            checkpoint.load(bad)


def test_flipped_bytes_in_weights_are_detected(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make(sizes=(300, 200, 3)))
    with h5py.File(tmp_path / "c.h5", "r") as f:
        dset = f["params/layer0/W"]
        chunks = [dset.id.get_chunk_info(i) for i in range(dset.id.get_num_chunks())]
        bias = f["params/layer1/b"].id.get_chunk_info(0)
    assert len(chunks) > 1
    raw = (tmp_path / "c.h5").read_bytes()
    targets = [(c.byte_offset, c.size)
               for c in (chunks[0], chunks[len(chunks) // 2], chunks[-1], bias)]
    for start, size in targets:
        for offset in (0, 1, size // 2, size - 5, size - 1):  # the last 4 bytes are the checksum
            for mask in (0x01, 0x80, 0xFF):
                bad = bytearray(raw)
                bad[start + offset] ^= mask
                (tmp_path / "flip.h5").write_bytes(bytes(bad))
                with pytest.raises(CheckpointError, match="unreadable"):
                    checkpoint.load(tmp_path / "flip.h5")


SWEEP = """
import json, sys
from hpcps.io import checkpoint
from hpcps.errors import CheckpointError
src, tmp, stride = sys.argv[1], sys.argv[2], int(sys.argv[3])
raw = open(src, "rb").read()
ref = checkpoint.load(src)
out = {"refused": 0, "intact": 0, "silently_changed": [], "raw_errors": []}
for off in range(0, len(raw), stride):
    bad = bytearray(raw)
    bad[off] ^= 0xFF
    open(tmp, "wb").write(bad)
    try:
        got = checkpoint.load(tmp)
    except CheckpointError:
        out["refused"] += 1
        continue
    except Exception as exc:
        out["raw_errors"].append([off, repr(exc)])
        continue
    same = (got.config, got.dataset, got.metrics, got.step, got.optimizer) == (
        ref.config, ref.dataset, ref.metrics, ref.step, ref.optimizer) and all(
        got.params[k].tobytes() == ref.params[k].tobytes() for k in ref.params) and all(
        got.opt_state[k].tobytes() == ref.opt_state[k].tobytes() for k in ref.opt_state)
    if (same and got.params.keys() == ref.params.keys()
            and got.opt_state.keys() == ref.opt_state.keys()):
        out["intact"] += 1
    else:
        out["silently_changed"].append(off)
print(json.dumps(out))
"""


def test_a_flipped_byte_anywhere_is_refused_or_harmless(tmp_path):
    """Flip bytes all over the file (metadata, attributes, data, free space): every load either
    raises CheckpointError or returns the exact original. Run in a subprocess with a timeout,
    because a corrupt HDF5 file can make the library hang (it did with variable-length strings)."""
    checkpoint.save(tmp_path / "c.h5", make())
    run = subprocess.run([sys.executable, "-c", SWEEP, str(tmp_path / "c.h5"),
                          str(tmp_path / "flip.h5"), "7"],
                         capture_output=True, text=True, env=ENV, timeout=240)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["silently_changed"] == [] and out["raw_errors"] == []
    assert out["refused"] > 500


def test_not_hdf5_missing_and_wrong_files(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found: .*none.h5"):
        checkpoint.load(tmp_path / "none.h5")
    (tmp_path / "text.h5").write_text("hello")
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "header.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 50)
    for name in ("text.h5", "empty.h5", "header.h5"):
        with pytest.raises(CheckpointError, match="unreadable"):
            checkpoint.load(tmp_path / name)
    with pytest.raises(CheckpointError, match="is a directory, not a file$"):
        checkpoint.load(tmp_path)
    # a run directory given where its checkpoint was meant: the message names the file(s)
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.save(run / "checkpoint.h5", make(step=7))
    with pytest.raises(CheckpointError, match=f"holds {run / 'checkpoint.h5'}; give that file$"):
        checkpoint.load(run)
    checkpoint.save(run / "checkpoint-old.h5", make(step=3))
    with pytest.raises(CheckpointError, match=f"holds {run / 'checkpoint.h5'}, "
                       f"{run / 'checkpoint-old.h5'}; give one of them$"):
        checkpoint.load(run)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(CheckpointError, match="not an hpcps checkpoint"):
        checkpoint.load(tmp_path / "other.h5")
    with h5py.File(tmp_path / "other.h5", "r+") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(CheckpointError, match="format is 'something-else'"):
        checkpoint.load(tmp_path / "other.h5")


def test_unknown_layout_version_and_missing_pieces(tmp_path):
    path = tmp_path / "c.h5"
    checkpoint.save(path, make())
    with h5py.File(path, "r+") as f:
        f.attrs["layout_version"] = 99
    with pytest.raises(CheckpointError, match="layout_version 99.*reads layout_version 1"):
        checkpoint.load(path)
    for doomed, named in (("params/layer1/b", "/params/layer1/b"), ("dataset", "/dataset")):
        checkpoint.save(path, make())
        with h5py.File(path, "r+") as f:
            del f[doomed]
        with pytest.raises(CheckpointError, match=f"lacks the (dataset|group) {named}"):
            checkpoint.load(path)
    checkpoint.save(path, make())
    with h5py.File(path, "r+") as f:
        del f.attrs["config_json"]
    with pytest.raises(CheckpointError, match="lacks the root attribute 'config_json'"):
        checkpoint.load(path)


def test_edited_metadata_is_refused(tmp_path):
    """A valid-looking but altered value (here the config) fails the meta_sha256 check."""
    path = tmp_path / "c.h5"
    checkpoint.save(path, make())
    with h5py.File(path, "r+") as f:
        f.attrs["config_json"] = json.dumps(dict(CONFIG, lr=0.03))
    with pytest.raises(CheckpointError, match="meta_sha256"):
        checkpoint.load(path)


# -- compatibility with the resuming run --------------------------------------------------------
def test_check_compatible(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    ck = checkpoint.load(tmp_path / "c.h5")
    ident = dict(ck.dataset)
    assert checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", ident) == []
    assert checkpoint.check_compatible(ck, (6, 5, 3)) == []
    where = f"checkpoint {tmp_path / 'c.h5'}"
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_compatible(ck, [6, 4, 3], "adagrad", ident)
    assert str(err.value) == f"{where} holds layers 6,5,3 but this run asks for 6,4,3"
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_compatible(ck, [6, 5, 3], "sgd", ident)
    assert "'adagrad'" in str(err.value) and "'sgd'" in str(err.value)
    assert "refused" in str(err.value) and "state would not match" in str(err.value)
    for key, value in (("n_classes", 4), ("n_features", 7)):
        with pytest.raises(CheckpointError, match=f"{key} = {ck.dataset[key]} .* {key} = {value}"):
            checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", {**ident, key: value})
    warnings = checkpoint.check_compatible(ck, [6, 5, 3], "adagrad", {**ident, "fingerprint": "z"})
    assert len(warnings) == 1 and "fingerprint 'abc'" in warnings[0] and "'z'" in warnings[0]
    # a checkpoint built in memory has no path: the message still reads well
    with pytest.raises(CheckpointError, match="^the checkpoint holds layers"):
        checkpoint.check_compatible(make(), [6, 3])


# -- inspection ---------------------------------------------------------------------------------
def test_describe_lists_everything(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    text = describe(tmp_path / "c.h5")
    for needle in ("hpcps-checkpoint, layout_version 1", "step          7", "6 -> 5 -> 3",
                   "(53 parameters)", "layer0/W", "(6, 5)", "layer1/b", "(3,)", "mean",
                   "optimizer adagrad", "accum/layer1/W", "lr = 0.01", "resume = null",
                   "model.act = \"relu\"", "fingerprint = \"abc\"", "test_accuracy = 0.5"):
        assert needle in text, needle
    facts = summarize(tmp_path / "c.h5")
    W = make().params["layer0/W"]
    assert facts["params"]["layer0/W"]["shape"] == [6, 5]
    assert facts["params"]["layer0/W"]["max"] == float(W.max())
    assert facts["params"]["layer0/W"]["mean"] == pytest.approx(float(W.mean(dtype=np.float64)))


def inspect(*args):
    return subprocess.run([sys.executable, "-m", "hpcps.inspect", *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=60)


def test_inspect_cli(tmp_path):
    checkpoint.save(tmp_path / "c.h5", make())
    run = inspect(tmp_path / "c.h5")
    assert run.returncode == 0 and run.stderr == ""
    assert "layer1/W" in run.stdout and "(5, 3)" in run.stdout and "(6, 5)" in run.stdout
    run = inspect("--json", tmp_path / "c.h5")
    assert run.returncode == 0
    facts = json.loads(run.stdout)
    assert facts["step"] == 7 and facts["layer_sizes"] == [6, 5, 3]
    assert facts["params"]["layer1/W"]["shape"] == [5, 3] and facts["config"] == CONFIG
    (tmp_path / "bad.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 50)
    for bad in (tmp_path / "bad.h5", tmp_path / "missing.h5"):
        run = inspect(bad)
        assert run.returncode == CheckpointError.exit_code == 4
        assert run.stderr.startswith("hpcps.inspect: error: ") and run.stdout == ""
        assert "Traceback" not in run.stderr
    run = inspect("--help")
    assert run.returncode == 0 and "--json" in run.stdout and "Exit status" in run.stdout


FULL_DISK = r"""
import resource, signal, sys
sys.path.insert(0, sys.argv[2])
from test_checkpoint import make
from hpcps.io import checkpoint
from hpcps.errors import CheckpointError
path = sys.argv[1]
checkpoint.save(path, make(step=3, sizes=(6, 5, 3)))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    checkpoint.save(path, make(step=9, sizes=(64, 2048, 10)))  # about 1 MB
except CheckpointError as exc:
    print("refused:", exc)
print("step", checkpoint.load(path).step, flush=True)
import os
os._exit(0)  # HDF5's state after the failed close can crash its cleanup at exit (a job aborts)
"""


def test_a_write_the_file_system_refuses_is_one_message_and_keeps_the_old_checkpoint(tmp_path):
    """A full disk or a quota, here a file-size limit: HDF5 fails the write deep in its cache
    and its objects fail again as they are freed (tracebacks on stderr, then an unrelated
    "slist already enabled?" on close). save() raises one CheckpointError with the system's
    reason, prints nothing else, leaves no temporary file and keeps the old checkpoint."""
    path = tmp_path / "c.h5"
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(Path(__file__).parent)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"refused: cannot write checkpoint {path}: File too large (the checkpoint there "
        "before is unchanged: make room, then --resume auto continues from it)", "step 3"]
    assert run.stderr == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]
