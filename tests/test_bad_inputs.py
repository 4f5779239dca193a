"""The catalogue of bad inputs: each kind gets its exit code and a clear message, no rank hangs,
and a checkpoint already in the run directory is never damaged (docs/errors.md).

Kinds that need no MPI call the function that refuses them and check the exception's exit code
and message (``CASES``). The others run ``mpiexec -n 1..3 python -m hpcps.train`` on digits
with a hard time limit (a hang fails the test) and check the exit code, that one message was
printed, that the job ended within seconds and that the checkpoint placed in its run directory
beforehand is byte for byte the same afterwards (``RUNS``).
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpirun import train

from hpcps import config, job as hpcps_train

from hpcps.compress import codec as compress

from hpcps.io import checkpoint, data
from hpcps.errors import HpcpsError, NonFiniteError
from hpcps.runtime.metrics import DivergenceWatch
from hpcps.model.mlp import MLP, PartitionedMLP
from hpcps.mpi.protocol import H, Message
from hpcps.ps.gradient_shard import HEALTH_EVERY, GradientShard
from hpcps.strategies import context
from hpcps.strategies.sandblaster.coordinator import _check_health
from hpcps.mpi.topology import Layout, shard_range

LAYERS = "64,32,10"
QUICK = ["--layers", LAYERS, "--batch-size", "16", "--progress-every", "0.2",
         "--eval-every", "0", "--checkpoint-every", "0"]
MPI_LIMIT_S = 60   # a launch that outlives this is a hang
FAST_S = 30        # and every refusal must come well before it


# -- files every kind draws from --------------------------------------------------------------
def _copy_dataset(src: Path, dst: Path, edit) -> Path:
    """``src`` with its arrays passed through ``edit(arrays)`` (a dict of the four)."""
    with h5py.File(src, "r") as f:
        arrays = {k: f[k][()] for k in ("train/x", "train/y", "test/x", "test/y")}
        attrs = dict(f.attrs)
    edit(arrays)
    with h5py.File(dst, "w") as f:
        for k, v in arrays.items():
            f[k] = v
        f.attrs.update(attrs)
    return dst


def _set(key, row, col, value):
    def edit(a):
        a[key][row, col] = value
    return edit


@pytest.fixture(scope="module")
def files(digits_h5, tmp_path_factory):
    """Bad datasets, config files, checkpoints and one good checkpoint, made once."""
    d = tmp_path_factory.mktemp("bad")
    f = {"digits": digits_h5}
    f["nan_data"] = _copy_dataset(digits_h5, d / "nan.h5", _set("train/x", 700, 5, np.nan))
    f["inf_test"] = _copy_dataset(digits_h5, d / "inf_test.h5", _set("test/x", 3, 0, -np.inf))

    def all_nan(a):
        a["train/x"][:] = np.nan
    f["all_nan"] = _copy_dataset(digits_h5, d / "all_nan.h5", all_nan)

    def wide(a):
        a["train/x"] = a["train/x"].astype(np.float64)
        a["train/x"][10, 2] = 1e39
    f["f64_overflow"] = _copy_dataset(digits_h5, d / "f64.h5", wide)

    def three_d(a):
        a["train/x"] = a["train/x"].reshape(-1, 8, 8)
    f["three_d"] = _copy_dataset(digits_h5, d / "3d.h5", three_d)

    def negative(a):
        a["train/y"][4] = -1
    f["negative_label"] = _copy_dataset(digits_h5, d / "neg.h5", negative)

    def short_y(a):
        a["test/y"] = a["test/y"][:-1]
    f["short_y"] = _copy_dataset(digits_h5, d / "short_y.h5", short_y)
    f["not_hdf5"] = d / "text.h5"
    f["not_hdf5"].write_text("train,x\n1,2\n")
    f["bad_key"] = d / "key.toml"
    f["bad_key"].write_text("learning_rate = 0.1\n")
    f["bad_toml"] = d / "syntax.toml"
    f["bad_toml"].write_text("lr = = 0.1\n")
    f["bad_type"] = d / "type.toml"
    f["bad_type"].write_text('lr = "fast"\n')

    # a good checkpoint (plain SGD, so every SGD strategy can resume it) and its damaged kin
    good = d / "good"
    run = train(1, "--strategy", "sync", "--optimizer", "sgd", "--lr", "0.1", "--data",
                str(digits_h5), "--run-dir", str(good), "--steps", "40", *QUICK,
                timeout=MPI_LIMIT_S)
    assert run.returncode == 0, run.output
    f["good"] = good / "checkpoint.h5"
    raw = f["good"].read_bytes()
    f["truncated"] = d / "truncated.h5"
    f["truncated"].write_bytes(raw[: len(raw) // 2])
    with h5py.File(f["good"], "r") as h:
        off = h["params/layer0/W"].id.get_chunk_info(0).byte_offset
    flipped = bytearray(raw)
    for i in range(off + 8, off + 64):
        flipped[i] ^= 0xFF
    f["corrupt"] = d / "corrupt.h5"
    f["corrupt"].write_bytes(bytes(flipped))
    ck = checkpoint.load(f["good"])
    ck.params["layer1/W"][3, 2] = np.nan
    f["nan_ckpt"] = checkpoint.save(d / "nan_ckpt.h5", ck)
    ck = checkpoint.load(f["good"])
    ck.params = {k: v * np.float32(1e30) for k, v in ck.params.items()}  # finite, overflows
    f["huge_ckpt"] = checkpoint.save(d / "huge_ckpt.h5", ck)
    return f


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# -- kinds refused without MPI: (id, call, exit code, words the message must hold) ------------
def _parse(*argv):
    return lambda f: config.parse(list(argv))


def _parse_with(key, *argv):
    return lambda f: config.parse(["--config", str(f[key]), *argv])


def _load_split(key, split="train", shard=0, n_shards=1):
    return lambda f: data.load_split(f[key], split, shard, n_shards)


def _resume(key, *argv):
    """What train.py does with --resume: load, check finiteness and compatibility."""
    def run(f):
        ck = checkpoint.load(f[key] if key in f else key)
        checkpoint.check_finite(ck)
        cfg = config.parse(["--strategy", "sync", "--optimizer", "sgd", "--layers", LAYERS,
                            *argv])
        return checkpoint.check_compatible(ck, list(cfg.layers), optimizer=cfg.optimizer)
    return run


def _message(n_weights, mangle):
    msg = compress.encode(np.array([4, 18, 80, 83], dtype=np.uint32), golomb=True)
    return lambda f: compress.decode(mangle(np.frombuffer(bytes(msg), np.uint8).copy()),
                                     n_weights)


def _flip(at):
    def mangle(b):
        b[at] ^= 0xFF
        return b
    return mangle


def _run_dir(path_of):
    return lambda f: hpcps_train.check_run_dir(Path(path_of(f)), True)


def _dataset_fit(layers):
    def run(f):
        cfg = config.parse(["--strategy", "sync", "--data", str(f["digits"]),
                            "--layers", layers])
        return hpcps_train._check_dataset(cfg)
    return run


CASES = [
    # options
    ("unknown option", _parse("--bogus-option"), 2, "unrecognized arguments: --bogus-option"),
    ("number not a number", _parse("--lr", "fast"), 2, "invalid float value: 'fast'"),
    ("negative steps", _parse("--steps", "-5"), 2, "--steps must be positive, got -5"),
    ("unknown strategy", _parse("--strategy", "gossip"), 2, "invalid choice: 'gossip'"),
    ("option of another strategy", _parse("--strategy", "sync", "--n-fetch", "2"), 2,
     "--n-fetch applies only to --strategy downpour"),
    ("one layer", _parse("--layers", "64"), 2, "at least an input and an output width"),
    ("zero-width layer", _parse("--layers", "64,0,10"), 2, "widths must be positive"),
    ("epochs and steps", _parse("--epochs", "1", "--steps", "5"), 2,
     "give --epochs or --steps, not both"),
    ("servers without servers", _parse("--strategy", "sync", "--servers", "1"), 2,
     "uses no parameter servers"),
    ("momentum without momentum", _parse("--momentum", "0.5"), 2,
     "--momentum applies only to --optimizer momentum"),
    ("whole batch for SGD", _parse("--strategy", "sync", "--batch-size", "0"), 2,
     "is not for --strategy sync"),
    ("lr for L-BFGS", _parse("--strategy", "sandblaster", "--lr", "0.1"), 2,
     "--lr does not apply to --strategy sandblaster"),
    # config files
    ("unknown config key", _parse_with("bad_key"), 2,
     "unknown key 'learning_rate' in config file"),
    ("config not TOML", _parse_with("bad_toml"), 2, "is not valid TOML"),
    ("config value of the wrong type", _parse_with("bad_type"), 2,
     "lr has the wrong type: got 'fast'"),
    ("config file missing", lambda f: config.parse(["--config", "/nonexistent/c.toml"]), 2,
     "config file not found: /nonexistent/c.toml"),
    # layouts
    ("no rank left for replicas", lambda f: Layout.plan(3, 3), 2, "cannot lay out N=3"),
    ("partitions do not divide", lambda f: Layout.plan(4, 1, 2), 2,
     "replicas of P=2 partitions"),
    ("layer narrower than P", lambda f: PartitionedMLP((64, 3, 10), "relu", 4, 0), 2,
     "layer 0 has 3 neurons, fewer than --partitions 4"),
    ("more shards than parameters", lambda f: shard_range(5, 10, 0), 2,
     "10 server shards for a model of only 5 parameters"),
    ("layers do not fit the data", _dataset_fit("32,10"), 2, "does not fit dataset"),
    # datasets
    ("dataset missing", lambda f: data.open_dataset("/nonexistent/d.h5"), 3,
     "dataset not found: /nonexistent/d.h5"),
    ("dataset not HDF5", lambda f: data.open_dataset(f["not_hdf5"]), 3,
     "not a readable HDF5 file"),
    ("features not 2-D", lambda f: data.open_dataset(f["three_d"]), 3, "expected 2-D (N, D)"),
    ("negative label", lambda f: data.open_dataset(f["negative_label"]), 3,
     "negative labels (min -1)"),
    ("labels and rows differ", lambda f: data.open_dataset(f["short_y"]), 3,
     "one label per row of /test/x"),
    ("more replicas than rows", _load_split("digits", "train", 4999, 5000), 3,
     "too few for 5000 shards"),
    ("NaN feature", _load_split("nan_data"), 3,
     "holds 1 non-finite value(s) (NaN or infinity) in rows 0..1436; the first is row 700, "
     "column 5 (nan)"),
    ("infinite test feature", _load_split("inf_test", "test"), 3,
     "/test/x holds 1 non-finite value(s) (NaN or infinity) in rows 0..359; the first is row "
     "3, column 0 (-inf). Every evaluation on it would be NaN"),
    ("all features NaN", _load_split("all_nan", "train", 2, 3), 3,
     "holds 30656 non-finite value(s) (NaN or infinity) in rows 958..1436; the first is row "
     "958, column 0"),
    ("float64 beyond float32", _load_split("f64_overflow"), 3,
     "the file stores float64; values beyond float32's range become infinite"),
    # checkpoints
    ("checkpoint missing", _resume("/nonexistent/ck.h5"), 4,
     "checkpoint not found: /nonexistent/ck.h5"),
    ("checkpoint truncated", _resume("truncated"), 4, "truncated or corrupt"),
    ("checkpoint corrupt", _resume("corrupt"), 4, "corrupt"),
    ("checkpoint is a directory", lambda f: checkpoint.load(f["good"].parent), 4,
     "is a directory, not a file"),
    ("dataset given as checkpoint", _resume("digits"), 4, "not an hpcps checkpoint"),
    ("checkpoint of another model", lambda f: checkpoint.check_compatible(
        checkpoint.load(f["good"]), [64, 16, 10]), 4, "holds layers 64,32,10"),
    ("checkpoint of another optimizer", lambda f: checkpoint.check_compatible(
        checkpoint.load(f["good"]), [64, 32, 10], optimizer="adagrad"), 4,
     "written by optimizer 'sgd' but this run asks for 'adagrad'"),
    ("checkpoint holding NaN", _resume("nan_ckpt"), 4,
     "holds 1 NaN or infinite value(s), the first in params/layer1/W"),
    # message bytes
    ("message not a message", lambda f: compress.decode(b"\x00" * 40, 1000), 6,
     "not an hpcps compressed message: magic 0x00000000"),
    ("message truncated", _message(1000, lambda b: b[:-1]), 6,
     "header announces 3 payload bytes, 2 arrived"),
    ("message of another version", _message(1000, _flip(4)), 6, "has version 254"),
    ("message count corrupt", _message(1000, _flip(9)), 6,
     "count 65284 does not fit 24 payload bits"),
    ("message padding corrupt", _message(1000, _flip(17)), 6,
     "padding bits are not all ones"),
    ("message index beyond the model", _message(20, lambda b: b), 6,
     "points past the model's 20 weights"),
    # run directories
    ("run dir cannot be created", _run_dir(lambda f: "/proc/hpcps-forbidden/run"), 2,
     "--run-dir /proc/hpcps-forbidden/run cannot be created"),
    ("run dir is a file", _run_dir(lambda f: f["not_hdf5"]), 2,
     "is a file, not a directory"),
    ("run dir not writable", _run_dir(lambda f: "/proc/self"), 2,
     "--run-dir /proc/self is not writable"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,call,code,needle", CASES, ids=[c[0] for c in CASES])
def test_refused_without_mpi(name, call, code, needle, files):
    with pytest.raises(HpcpsError) as info:
        call(files)
    assert info.value.exit_code == code, (name, info.value)
    assert needle in str(info.value), (name, str(info.value))


@pytest.mark.timeout(30)
def test_each_rank_checks_the_rows_it_reads(files):
    """Row 700 is in shard 1 of 3 (rows 479..957): shard 0 reads clean rows and trains."""
    x, _ = data.load_split(files["nan_data"], "train", 0, 3)
    assert np.isfinite(x).all() and len(x) == 479
    with pytest.raises(HpcpsError, match="in rows 479..957; the first is row 700, column 5"):
        data.load_split(files["nan_data"], "train", 1, 3)


# -- numerical health without MPI -------------------------------------------------------------
def _ctx(run_dir: Path, digits_h5, reporter_rank: int = 0, rank: int = 0):
    """What save_checkpoint and explain_nonfinite read of a Context, for one rank."""
    cfg = config.parse(["--strategy", "sync", "--optimizer", "sgd", "--lr", "0.1",
                        "--layers", LAYERS, "--data", str(digits_h5)])
    layout = Layout.plan(3, 0)
    grid = types.SimpleNamespace(rank=rank, role=layout.role(rank), layout=layout)
    return types.SimpleNamespace(cfg=cfg, grid=grid, full_model=MLP((64, 32, 10)),
                                 dataset=data.open_dataset(digits_h5), run_dir=run_dir,
                                 reporter=reporter_rank, partitioned=False, start_step=0)


@pytest.mark.timeout(30)
def test_a_nonfinite_checkpoint_is_never_written(files, digits_h5, tmp_path):
    shutil.copy(files["good"], tmp_path / "checkpoint.h5")
    before = _sha(tmp_path / "checkpoint.h5")
    ctx = _ctx(tmp_path, digits_h5)
    params = ctx.full_model.init_params(0)
    params[17] = np.inf
    with pytest.raises(NonFiniteError) as info:
        context.save_checkpoint(ctx, params, {}, 120)
    assert info.value.exit_code == 7 and info.value.step == 120
    assert "1 NaN or infinite value(s), the first in params/layer0/W" in str(info.value)
    assert _sha(tmp_path / "checkpoint.h5") == before
    assert not list(tmp_path.glob("*.tmp-*"))  # nothing half-written either
    # the job's message names the checkpoint left in place, the role and the usual cause
    text = str(context.explain_nonfinite(ctx, info.value))
    assert "training diverged at step 120: replica 0 (rank 0) refused to write a checkpoint" \
        in text
    assert f"the last checkpoint, {tmp_path / 'checkpoint.h5'} (step 40), is left as it was" \
        in text
    assert "a learning rate too large for sgd (--lr 0.1)" in text


@pytest.mark.timeout(30)
def test_only_the_reporting_rank_prints_at_once(digits_h5, tmp_path):
    exc = NonFiniteError(5, "computed a training loss of nan on its own mini-batch")
    loud = context.explain_nonfinite(_ctx(tmp_path, digits_h5, 0, 0), exc)
    quiet = [context.explain_nonfinite(_ctx(tmp_path, digits_h5, 0, r), exc) for r in (1, 2)]
    assert loud.defer_s == 0 and 0 < quiet[0].defer_s < quiet[1].defer_s <= 5
    assert "no checkpoint was written to" in str(loud) and "replica 2 (rank 2)" in str(quiet[1])


def _shard(n=10):
    shard = GradientShard(None, np.zeros(n, np.float32), {}, lambda w, g, s: w.__isub__(g),
                          n_replicas=2, step=30)
    return shard


@pytest.mark.timeout(30)
def test_shard_refuses_a_nonfinite_push_before_applying_it():
    shard = _shard()
    msg = Message(10)
    msg.header[H.SENDER] = 1
    msg.header[H.STEPS] = 1
    msg.header[H.LOSS_SUM] = float("nan")
    msg.payload[:] = np.nan
    with pytest.raises(NonFiniteError, match="received from replica 1 a gradient whose "
                                             "training loss is nan"):
        shard.check_push(msg.header)
    assert np.isfinite(shard.params).all()
    msg.header[H.LOSS_SUM] = 2.0  # a finite loss with an infinite gradient: the periodic check
    msg.payload[:] = np.inf
    with pytest.raises(NonFiniteError, match="holds 10 NaN or infinite parameter") as info:
        for _ in range(HEALTH_EVERY):
            shard.check_push(msg.header)
            shard.policy.on_push(shard, 1, msg.header, msg.payload)
    assert info.value.exit_code == 7 and shard.version == HEALTH_EVERY


@pytest.mark.timeout(30)
def test_sandblaster_checks_loss_and_gradient():
    space = types.SimpleNamespace(dot=lambda a, b: 4.0)
    _check_health(space, 0.3, 7)  # finite: nothing happens
    with pytest.raises(NonFiniteError, match="training loss at the current point to be inf"):
        _check_health(space, math.inf, 7)
    space.dot = lambda a, b: math.nan
    with pytest.raises(NonFiniteError, match=r"gradient at the current point \(g . g = nan\)"):
        _check_health(space, 0.3, 7)


def test_divergence_watch_fires_once_on_a_rising_loss():
    watch = DivergenceWatch()
    rising = [2.3 * 0.99 ** i for i in range(200)] + [5.0] * 300
    fired = [(i, f) for i, loss in enumerate(rising) if (f := watch.update(i, loss))]
    assert len(fired) == 1, fired
    step, f = fired[0]
    assert f["best"] < 0.35 and f["best_step"] < 200 <= f["since_step"] and step < 320
    assert "more than 2x and 0.5 above its best" in watch.describe(f, step)


def test_divergence_watch_leaves_noise_and_slow_learning_alone():
    rng = np.random.default_rng(0)
    watch = DivergenceWatch()
    # a healthy run's loss: falling, with mini-batch noise, spikes and a noisy tail near zero
    for i in range(5000):
        loss = max(0.0, 2.3 * math.exp(-i / 300) + 0.05 + rng.exponential(0.2))
        if i % 400 == 0:
            loss += 3.0
        assert watch.update(i, loss) is None, i
    stuck = DivergenceWatch()  # at chance from the start: not rising, so not diverging
    assert all(stuck.update(i, 2.3 + rng.normal(0, 0.05)) is None for i in range(2000))


# -- kinds that need the job: (id, ranks, args, exit code, words of the message) --------------
def _d(f):
    return ["--data", str(f["digits"])]


RUNS = [
    ("unknown option", 3, lambda f: ["--bogus-option", *_d(f)], 2,
     "unrecognized arguments: --bogus-option"),
    ("unknown config key", 2, lambda f: ["--config", str(f["bad_key"]), *_d(f)], 2,
     "unknown key 'learning_rate'"),
    ("layout that cannot fit", 3, lambda f: ["--servers", "3", *_d(f)], 2,
     "cannot lay out N=3"),
    ("NaN feature on one rank's rows", 3,
     lambda f: ["--strategy", "sync", "--data", str(f["nan_data"])], 3,
     "error (rank 1): "),
    ("all features NaN", 2, lambda f: ["--data", str(f["all_nan"])], 3,
     "non-finite value(s)"),
    pytest.param("truncated checkpoint", 2, lambda f: ["--resume", str(f["truncated"]), *_d(f)],
                 4, "truncated or corrupt", marks=pytest.mark.openmpi),
    ("checkpoint holding NaN", 2,
     lambda f: ["--strategy", "sync", "--optimizer", "sgd", "--resume", str(f["nan_ckpt"]),
                *_d(f)], 4, "the first in params/layer1/W"),
    ("more threads than a replica has examples for", 2,
     lambda f: ["--strategy", "sync", "--threads", "64", *_d(f)], 2,
     "fewer than one step's 1024 (--batch-size 16 x --threads 64)"),
    ("run dir cannot be created", 2,
     lambda f: ["--run-dir", "/proc/hpcps-forbidden", *_d(f)], 2,
     "--run-dir /proc/hpcps-forbidden cannot be created"),
    ("sync lr far too large", 3,
     lambda f: ["--strategy", "sync", "--optimizer", "sgd", "--lr", "1e30", *_d(f)], 7,
     "replica 0 (rank 0) computed a training loss of nan on the 3 replicas' mini-batches"),
    ("downpour lr far too large", 3,
     lambda f: ["--optimizer", "sgd", "--lr", "1e30", "--warmup-steps", "0", *_d(f)], 7,
     "computed a training loss of nan on its own mini-batch"),
    ("averaging lr far too large", 2,
     lambda f: ["--strategy", "averaging", "--optimizer", "sgd", "--lr", "1e30", *_d(f)], 7,
     "computed a training loss of nan"),
    ("deadreckon lr far too large", 2,
     lambda f: ["--strategy", "deadreckon", "--lr", "1e30", *_d(f)], 7,
     "computed a training loss of nan"),
    ("downpour from an overflowing checkpoint", 3,
     lambda f: ["--optimizer", "sgd", "--resume", str(f["huge_ckpt"]), *_d(f)], 7,
     "training diverged at step 40"),
    ("sandblaster from an SGD checkpoint", 3,
     lambda f: ["--strategy", "sandblaster", "--resume", str(f["good"]), "--portions", "4",
                *_d(f)], 4,
     "which --strategy sandblaster does not run (it runs lbfgs), and an optimizer's state "
     "does not carry over to another: resume it with --strategy downpour or averaging or "
     "deadreckon or sync, or start a new run"),
    ("sync from a sandblaster checkpoint", 2,
     lambda f: ["--strategy", "sync", "--resume", str(f["huge_sb"]), *_d(f)], 4,
     "written by optimizer 'lbfgs', which --strategy sync does not run (it runs adagrad or "
     "sgd or momentum)"),
    ("sandblaster from an overflowing checkpoint", 3,
     lambda f: ["--strategy", "sandblaster", "--resume", str(f["huge_sb"]), "--portions", "4",
                *_d(f)], 7,
     "the coordinator (rank 2) found the training loss at the current point to be"),
]


@pytest.fixture(scope="module")
def job_files(files, digits_h5, tmp_path_factory):
    """``files`` plus a Sandblaster checkpoint whose weights overflow the forward pass."""
    d = tmp_path_factory.mktemp("sb")
    run = train(3, "--strategy", "sandblaster", "--data", str(digits_h5), "--run-dir", str(d),
                "--steps", "2", "--portions", "4", *QUICK[:2], "--eval-every", "0",
                "--checkpoint-every", "0", timeout=MPI_LIMIT_S)
    assert run.returncode == 0, run.output
    ck = checkpoint.load(d / "checkpoint.h5")
    ck.params = {k: v * np.float32(1e30) for k, v in ck.params.items()}
    ck.metrics = {}  # no L-BFGS scalars: the coordinator evaluates the loss at x first
    return {**files, "huge_sb": checkpoint.save(d / "huge_sb.h5", ck)}


@pytest.mark.parametrize("name,n,args,code,needle", RUNS,
                         ids=[(r.values if hasattr(r, "values") else r)[0] for r in RUNS])
def test_refused_by_the_job(name, n, args, code, needle, job_files, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    kept = run_dir / "checkpoint.h5"
    shutil.copy(job_files["good"], kept)
    before = _sha(kept)
    extra = [] if "--run-dir" in args(job_files) else ["--run-dir", str(run_dir)]
    run = train(n, *args(job_files), "--layers", LAYERS, "--steps", "300",
                "--batch-size", "16", "--checkpoint-every", "100", *extra,
                timeout=MPI_LIMIT_S)
    assert run.returncode == code, (name, run.output)
    assert needle in run.stderr, (name, run.stderr)
    assert run.stderr.count("hpcps: ") == 1, (name, run.stderr)  # one message, one rank
    assert run.seconds < FAST_S, (name, run.seconds)
    assert _sha(kept) == before, name  # the checkpoint already there is left as it was
    if code == 7:  # ... and the message says so
        assert f"the last checkpoint, {kept} (step 40), is left as it was" in run.stderr
        assert "Usual cause" in run.stderr
    assert not list(run_dir.glob("*.tmp-*"))


# -- the divergence warning in a job ----------------------------------------------------------
@pytest.mark.parametrize("n,args,cause", [
    (1, ["--strategy", "sync", "--optimizer", "sgd", "--lr", "50"],
     "a learning rate too large for sgd (--lr 50)"),
    # a short warm start: replica 0's first losses are its own, from the fresh model (without
    # it, on a fast machine the other replica's first push could blow the model up before
    # replica 0's first step, and a loss that starts high never doubles)
    (3, ["--lr", "200", "--warmup-steps", "10"],
     "too many replicas for asynchronous SGD: 2 replicas")])
def test_a_diverging_run_warns_once_and_goes_on(n, args, cause, files, tmp_path):
    run = train(n, *args, "--data", str(files["digits"]), "--run-dir", str(tmp_path),
                "--steps", "600", *QUICK, timeout=MPI_LIMIT_S)
    assert run.returncode == 0, run.output  # a warning, not a stop
    assert run.stdout.count("warning: training loss diverging") == 1, run.stdout
    assert cause in run.stdout
    warnings = _records(tmp_path, "warning")
    assert len(warnings) == 1 and warnings[0]["reason"] == "diverging"
    assert cause in warnings[0]["message"] and warnings[0]["loss"] > 2 * warnings[0]["best"]
    assert _records(tmp_path, "summary")


def test_a_healthy_asynchronous_run_does_not_warn(files, tmp_path):
    """Downpour's losses are noisy (stale gradients, batches of 16): no warning while it
    learns, over more than the watch's window of steps."""
    run = train(3, "--data", str(files["digits"]), "--run-dir", str(tmp_path), "--steps",
                "900", "--warmup-steps", "50", *QUICK, timeout=MPI_LIMIT_S)
    assert run.returncode == 0, run.output
    assert _records(tmp_path, "summary")[-1]["test_accuracy"] > 0.85
    assert _records(tmp_path, "warning") == [] and "warning" not in run.stdout
