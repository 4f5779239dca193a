"""The combination matrix: every strategy against layouts, thread counts and its own options.

Dimensions, for every strategy the registry knows (a new strategy is included with no edit
here; its own option values go in ``OWN`` below):

* P (``--partitions``) 1, 2, 3; R (replicas) 1, 2, 3; S (``--servers``) 1, 2, 3 where the
  strategy has shards, else none; one coordinator where it has one; N = S + C + R * P;
* ``--threads`` 1, 2;
* ``--trace`` off, on (an accepted run with it must also write a trace.json holding every
  rank's events);
* the update options of the strategies built on the replica loop: none, or ``--weight-decay
  1e-4 --lr-schedule cosine`` (sandblaster and downpour's ``--push activations`` refuse both;
  ``tests/test_config.py`` checks each refusal alone);
* the data: in memory, streamed from the file (``--data-memory 0.01``) with its images moved
  (``--augment shift:1``), or in memory less a
  tenth held out for validation (``--validation-fraction 0.1``; streaming with rows held out
  is ``tests/test_stream_runs.py``'s), for every strategy
  whose replicas read a block of the training set (sandblaster's replicas hold all of it and
  refuse a set over the budget, a refusal that depends on the data's size, not on the command
  line: ``tests/test_stream_runs.py`` checks it and its message);
* the strategy's own options (``OWN``), defaults included (downpour's warm start stays on
  unless the row says ``--warmup-steps 0``);
* the model (``MODELS``): the MLP of ``--layers``, a conv model (``--model``; with ``--push
  activations`` its conv layers go dense), or the conv model with ``--dropout``. Embedding
  models and the strategies that train only them (hybrid) have their own combination test,
  ``tests/test_ctr_server.py``, whose data are categorical.

Each combination is first judged in this process the way every rank judges it at start
(``config.parse``, then the layout plan). Accepted: ``mpiexec -n N python -m hpcps.train`` on
the digits set must finish within its time limit, reach the requested step and learn (test
accuracy at least the bar of its kind, 0.45-0.8, set from measured runs: see ``MIN_ACCURACY``;
10% is chance and about 20% a model stopped early at this size). Refused: the same command
must end with exit code 2 before any training (no progress record, no checkpoint), with
exactly one ``hpcps: error`` line holding the message the in-process check gave, and no
traceback. Beside the matrix, ``MUST_ACCEPT`` and ``MUST_REFUSE`` are written by hand from
the docs, so that the code under test is not the only judge of what it should accept.

The product has about 3.07 million combinations (downpour alone 2,985,984), too many for
every run, so the default run takes a fixed sample per strategy (``pairwise.pairwise``, a
deterministic greedy covering array: the same rows every time) in which every pair of values
of any two
dimensions appears, and every pair that some accepted combination holds appears in an
accepted one (so no pair is "covered" only by a row refused for another reason); plus one
16-rank case that used to hang. To choose the sample, every row of the product is judged
(``acceptance``: each dimension's piece of the command line parsed once, the pieces merged,
then ``config.from_values`` once per row's options for every R, and the layout plan once per
layout and number of ranks; the options in two processes, this one and a forked child), so
collecting this module takes about 40 s on 2 cores. Sizes and
runtime: see ``python tests/test_combinations.py`` and the README.
``HPCPS_FULL_MATRIX=1`` runs the whole product instead (many hours on 2 cores).
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import pickle
import tempfile
import types

import numpy as np
import pytest
from pairwise import pairwise
from mpirun import train

from hpcps import config
from hpcps.errors import ConfigError
from hpcps.strategies.registry import strategies

FULL = os.environ.get("HPCPS_FULL_MATRIX") == "1"
# Test accuracy bars, from the sample's 77 accepted runs measured on 2026-11-26 (2 shared
# cores, load 5-15; chance is 0.1, a model stopped early about 0.2): SGD strategies at a
# constant rate 0.833-0.972 (median 0.925, 47 runs); with --lr-schedule cosine, whose rate
# falls to 0 over the 600 steps, 0.794-0.947 (median 0.889, 19 runs); sandblaster's 10 L-BFGS
# steps, which give the same result on every layout, 0.842 with the MLP and 0.733 with the
# conv model. Each bar is 0.03-0.1 under the lowest measured run of its kind.
# Compressed pushes (--compress threshold) to a conv model learn more slowly: downpour with
# tau auto, momentum, --n-push 3 and 2 replicas measured 0.667, 0.694, 0.706, 0.75, 0.783 and
# twice >= 0.8 in seven runs (2026-11-26, loaded machine); its bar is 0.1 under the lowest.
# Images moved by --augment shift:1 (a pixel of an 8x8 digit is an eighth of it) are a harder
# task for these 600-step runs: the sample's 22 accepted rows with it measured 0.522-0.922
# (median 0.79; 2026-11-28, 2 shared cores), the lowest with compressed pushes and the cosine
# rate together; without --augment the same rows reach the bars above. Its own bar, under the
# lowest by 0.07.
MIN_ACCURACY_AUGMENTED = 0.45
MIN_ACCURACY = 0.8
MIN_ACCURACY_COMPRESSED_CONV = 0.55
MIN_ACCURACY_COSINE = 0.7
MIN_ACCURACY_SANDBLASTER = {"mlp": 0.8, "conv": 0.7}
LAYERS = "64,32,10"
CONV = "conv3x3x8p1,pool2,fc32,fc10"  # digits: 8x8 -> 8x8x8 -> 4x4x8 -> 32 -> 10
MODELS = [["--layers", LAYERS], ["--model", CONV], ["--model", CONV, "--dropout", "0.25"]]
UPDATES = [[], ["--weight-decay", "1e-4", "--lr-schedule", "cosine"]]
# the data in memory, or a budget so small (10 KiB) that every replica streams its block and
# the chief its evaluation splits (hpcps.strategies.feed), with the streamed images moved
# (--augment, which acts on the batches either way: one value, so that the product does not
# grow), or in memory less a validation split
DATA = [[], ["--data-memory", "0.01", "--augment", "shift:1"], ["--validation-fraction", "0.1"]]
COMMON = ["--eval-every", "0", "--checkpoint-every", "0",
          "--progress-every", "0.5", "--timeout", "60"]
# run length: SGD steps are global mini-batches (enough for downpour's 200-step warm start to
# end and the others to join); a batch method's step is one evaluation of its default batch,
# the whole set
SGD_RUN = ["--steps", "600", "--batch-size", "16"]
BATCH_RUN = ["--steps", "10", "--portions", "8"]
# settings under which each strategy learns reliably on digits, oversubscribed on 2 cores
SETTINGS = {"deadreckon": ["--lr", "0.05"]}

# Each strategy's own dimensions: name -> list of option lists (one value each).
OWN = {
    "downpour": {
        "compress": [[], ["--compress", "threshold"],
                     ["--compress", "threshold", "--tau", "auto", "--density", "0.05",
                      "--residual-clip", "4", "--grad-clip", "5", "--optimizer", "momentum"],
                     ["--compress", "threshold", "--golomb", "off"]],
        "push": [[], ["--push", "activations"]],
        "periods": [[], ["--n-fetch", "2", "--n-push", "3"], ["--persist-every", "0.05"]],
        # the warm start, the wire and the chunk size share a dimension: --wire-dtype bf16
        # and --chunk-bytes then meet every value of every other dimension, and each other
        # (as dimensions of their own they would double the rows judged at collection)
        "warmup": [[], ["--warmup-steps", "0", "--chunk-bytes", "1024"],
                   ["--wire-dtype", "bf16"], ["--wire-dtype", "bf16", "--chunk-bytes", "1024"]],
        # how replicas are held together (Adam's epoch quorum excludes a staleness bound)
        "consistency": [[], ["--staleness-bound", "1"], ["--softsync", "2", "--staleness-lr",
                                                        "on"], ["--epoch-quorum", "0.75"]],
        # ranks that may die, copies of the shards, spares, and joins (the chief and the
        # shards listen for launches that join, through the routed world: hpcps.mpi.joins)
        "faults": [[], ["--heartbeat-timeout", "20"], ["--ps-copies", "2", "--joins", "1"],
                   ["--spares", "1", "--joins", "1"]],
    },
    "deadreckon": {"tau": [["--tau", "0.003"], ["--tau", "auto", "--density", "0.02",
                                                  "--sparsity-warmup", "100"]],
                   "clip": [[], ["--residual-clip", "4", "--grad-clip", "5"]],
                   "golomb": [[], ["--golomb", "off"]],
                   "warmup": [[], ["--warmup-steps", "0"]],
                   "lr_scaling": [[], ["--lr-scaling", "sqrt"], ["--lr-scaling", "mean"]]},
    "sync": {"prefetch": [[], ["--prefetch", "0"]],
             "optimizer": [[], ["--optimizer", "momentum"]],
             "lr_rule": [[], ["--lr-rule", "none"], ["--lr-warmup-steps", "0"]],
             "wire": [[], ["--wire-dtype", "bf16"]]},
    "averaging": {"period": [["--average-every", "1"], []],
                  "state": [[], ["--average-state", "off"]],
                  "optimizer": [[], ["--optimizer", "momentum", "--nesterov", "on"]],
                  "lr_rule": [[], ["--lr-rule", "none"], ["--lr-warmup-steps", "0"]],
                  "wire": [[], ["--wire-dtype", "bf16"]]},
    "sandblaster": {"flush": [[], ["--flush-every", "1"]],
                    "chunks": [[], ["--chunk-bytes", "1024"]],
                    "faults": [[], ["--heartbeat-timeout", "20"]],
                    "wire": [[], ["--wire-dtype", "bf16"]]},
}


def dimensions(name: str, spec) -> tuple[list[str], list[list]]:
    names = ["P", "R", "S", "T", "model", "trace", "update"]
    dims = [[1, 2, 3], [1, 2, 3], [1, 2, 3] if spec.uses_servers else [0], [1, 2], MODELS,
            [[], ["--trace"]], UPDATES]
    if spec.replica_data == "shard":  # replicas that may stream their block
        names.append("data")
        dims.append(DATA)
    for option, values in OWN.get(name, {}).items():
        names.append(option)
        dims.append(values)
    return names, dims


def run_options(spec) -> list[str]:
    return BATCH_RUN if spec.whole_batch else SGD_RUN


def spares_of(own) -> int:
    """The --spares K a row's own options give (ranks beside its S, R and P)."""
    flat = [v for values in own for v in values]
    return int(flat[flat.index("--spares") + 1]) if "--spares" in flat else 0


def combination(name: str, spec, row) -> dict:
    P, R, S, T, model, *own = row  # own: --trace, then the strategy's own options
    n = S + int(spec.coordinator) + R * P + spares_of(own)
    argv = ["--strategy", name, "--partitions", str(P), "--threads", str(T), *model]
    if spec.uses_servers:
        argv += ["--servers", str(S)]
    for values in own:
        argv += values
    label = f"{name}-P{P}-R{R}-S{S}-T{T}" + ("-conv" if "--model" in model else "") + (
        "-dropout" if "--dropout" in model else "") + "".join(
        "-" + "=".join(v.lstrip("-") for v in values) for values in own if values)
    return {"id": label, "n": n, "argv": argv + SETTINGS.get(name, [])}


@functools.cache
def _given(piece: tuple[str, ...]) -> tuple:
    """The options a piece of a command line sets, as hpcps's argparse parser reads them."""
    return tuple(vars(config.build_parser().parse_args(list(piece))).items())


def judged(name: str, spec, row) -> bool:
    """``accepted(combination(name, spec, row), spec)``, fast: see :func:`acceptance`."""
    P, R, S, T, model, *own = row
    fields = _options(name, (P, S, T, tuple(model), *(tuple(v) for v in own)))
    return fields is not None and _planned(name, fields, S + int(spec.coordinator) + R * P)


@functools.cache
def acceptance(name: str) -> np.ndarray:
    """Whether hpcps accepts each row of strategy ``name``'s product, in product order
    (:func:`judge_product`), kept on disk between test processes under a key of everything the
    verdicts depend on (:func:`_judgement_key`): each process that collects this module (one
    per ``pytest -n`` worker) needs them, and judging the product costs about 40 s of CPU. The
    first process judges while the others wait on a lock, then read its file."""
    import fcntl
    from conftest import mnist_cache_dir
    where = mnist_cache_dir() / "combinations"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"acceptance-{name}-{_judgement_key(name)}.npy"
    with open(where / f"acceptance-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        try:
            return np.load(path)
        except (OSError, ValueError):
            pass  # not judged yet (or a file cut short): judge it now
        ok = judge_product(name)
        kept = sorted(where.glob(f"acceptance-{name}-*.npy"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-7]:  # other sources' verdicts: keep the 7 newest, for other trees
            old.unlink(missing_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        np.save(temporary, ok, allow_pickle=False)
        temporary.with_name(temporary.name + ".npy").replace(path)  # np.save adds ".npy"
        return ok


def _judgement_key(name: str) -> str:
    """A digest of what strategy ``name``'s verdicts depend on: :func:`_sources_digest` and
    the strategy's name."""
    import hashlib
    return hashlib.sha256(f"{name}\0{_sources_digest()}".encode()).hexdigest()[:24]


@functools.cache
def _sources_digest() -> str:
    """A digest of what every strategy's verdicts depend on, computed once per process:
    hpcps's sources, the packages of every strategy declaration (plug-ins too), this module
    and the sampler, the ``HPCPS_*`` environment, the cores this process may use, the CPU's
    flags and the versions of Python and NumPy."""
    import hashlib
    import importlib.util
    import platform
    from pathlib import Path

    from hpcps.strategies.registry import _declaration_modules
    here = Path(__file__).resolve().parent
    roots = {Path(config.__file__).resolve().parent}
    for module in _declaration_modules():
        origin = importlib.util.find_spec(module).origin
        roots.add(Path(origin).resolve().parent)
    files = sorted({f for root in roots for f in root.rglob("*.py")})
    files += [here / "test_combinations.py", here / "pairwise.py"]
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("flags")][:1] if Path("/proc/cpuinfo").exists() else []
    digest.update(repr((sorted((k, v) for k, v in os.environ.items()
                               if k.startswith("HPCPS_")),
                        len(os.sched_getaffinity(0)), os.cpu_count(), flags,
                        platform.python_version(), np.__version__)).encode())
    return digest.hexdigest()


def judge_product(name: str) -> np.ndarray:
    """Whether hpcps accepts each row of strategy ``name``'s product, in product order, fast
    enough for the whole product (about 2 million rows for downpour). The command line is cut
    into the pieces each dimension adds, each piece is parsed once, and their options are merged
    in command-line order (a later piece wins where two set one option, as argparse does),
    then judged by ``config.from_values`` and the layout plan as ``config.parse`` would. R
    enters only the number of ranks, not the options, so the options are judged once for
    every R, and the plan once per layout and number of ranks. The options are judged in
    one forked process per core (pure Python, no MPI), the plan here. Checked against the
    whole-command-line judgement by test_the_fast_judgement_agrees."""
    spec = strategies()[name]
    _, dims = dimensions(name, spec)
    tuples = [[tuple(v) if isinstance(v, list) else v for v in d] for d in dims]
    rest = list(itertools.product(*tuples[2:]))  # S, T, the model and the options after R
    keys = [(P, *others) for P in dims[0] for others in rest]
    fields = _judge_options(name, keys)
    ok = np.zeros((len(dims[0]), len(dims[1]), len(rest)), dtype=bool)
    for p, P in enumerate(dims[0]):
        for k, (S, *_) in enumerate(rest):
            kept = fields[p * len(rest) + k]
            if kept is None:
                continue
            for r, R in enumerate(dims[1]):
                ok[p, r, k] = _planned(name, kept, S + int(spec.coordinator) + R * P)
    return ok.ravel()


def _judge_options(name: str, keys: list[tuple]) -> list:
    """``[_options(name, key) for key in keys]``, the second half judged by a forked child
    (pure Python, no MPI) while this process judges the first: the same list in the same
    order. One process where there is one core, few keys or no fork."""
    if len(os.sched_getaffinity(0)) < 2 or len(keys) < 20_000 or not hasattr(os, "fork"):
        return [_options(name, key) for key in keys]
    half = len(keys) // 2
    with tempfile.TemporaryFile() as out:
        pid = os.fork()
        if pid == 0:  # the child: judge the second half, write it, leave at once
            code = 1
            try:
                pickle.dump([_options(name, key) for key in keys[half:]], out)
                out.flush()
                code = 0
            finally:
                os._exit(code)
        first = [_options(name, key) for key in keys[:half]]
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"the process judging {name}'s options failed ({status})")
        out.seek(0)
        return first + pickle.load(out)


@functools.cache
def _planned(name: str, fields: tuple, n: int) -> bool:
    """Whether the layout plan takes a row's options (``fields``, what :func:`_options`
    keeps: servers, partitions, inject_slow, spares) on ``n`` ranks besides its spares."""
    servers, partitions, inject_slow, spares = fields
    cfg = types.SimpleNamespace(servers=servers, partitions=partitions,
                                spec=strategies()[name], inject_slow=inject_slow,
                                spares=spares)
    try:
        config.plan(cfg, n + (spares or 0))
    except ConfigError:
        return False
    return True


@functools.cache
def _options(name: str, key: tuple):
    """What the layout plan reads of a row's Config (its options: everything but R) as
    (servers, partitions, inject_slow, spares), or None if they are refused. Only those few
    fields are kept: the product has ~10^5 keys."""
    spec = strategies()[name]
    P, S, T, model, *own = key
    pieces = [("--strategy", name, "--partitions", str(P), "--threads", str(T)), model]
    if spec.uses_servers:
        pieces.append(("--servers", str(S)))
    pieces += list(own)
    pieces += [tuple(SETTINGS.get(name, [])), tuple(run_options(spec) + COMMON)]
    values: dict = {}
    for piece in pieces:
        values.update(_given(piece))
    try:
        cfg = config.from_values(values)
    except ConfigError:
        return None
    return cfg.servers, cfg.partitions, cfg.inject_slow, getattr(cfg, "spares", None)


@functools.cache
def sample(name: str) -> list[tuple]:
    """The rows of strategy ``name`` that run: the pairwise sample, or the whole product."""
    spec = strategies()[name]
    _, dims = dimensions(name, spec)
    if FULL:
        return list(itertools.product(*dims))
    return pairwise(dims, accept=acceptance(name))


# HPCPS_COMBINATIONS_ONLY=name[,name]: the matrix of those strategies alone (the plug-in test
# runs a strategy registered from outside hpcps through it)
ONLY = [n for n in os.environ.get("HPCPS_COMBINATIONS_ONLY", "").split(",") if n]


def matrix() -> list[dict]:
    out = []
    for name, spec in strategies().items():
        # the models here are an MLP and conv nets: a strategy for embedding models only
        # refuses every row; its own matrix is tests/test_ctr_server.py's
        if not spec.dense_models:
            continue
        if not ONLY or name in ONLY:
            out += [combination(name, spec, row) for row in sample(name)]
    if ONLY:
        return out
    # the README's 16-rank downpour grid with the default warm start (it used to hang)
    out.append({"id": "downpour-N16-S4-P2-default-warm-start", "n": 16,
                "argv": ["--strategy", "downpour", "--servers", "4", "--partitions", "2",
                         *MODELS[0]]})
    return out


def verdict(argv: list[str], n: int) -> str | None:
    """None if hpcps accepts ``argv`` on ``n`` ranks, else the message it refuses it with."""
    return _verdict(tuple(argv), n)


@functools.cache
def _verdict(argv: tuple[str, ...], n: int) -> str | None:
    # cached: the pairwise sampler and the coverage test judge the same rows many times
    try:
        config.plan(config.parse(list(argv) + COMMON), n)
    except ConfigError as exc:
        return str(exc)
    return None


def accepted(case: dict, spec) -> bool:
    return verdict(case["argv"] + run_options(spec), case["n"]) is None


def min_accuracy(argv: list[str]) -> float:
    """The accuracy bar of an accepted combination (see MIN_ACCURACY)."""
    if strategies()[argv[1]].whole_batch:
        return MIN_ACCURACY_SANDBLASTER["conv" if "--model" in argv else "mlp"]
    if "--augment" in argv:
        return MIN_ACCURACY_AUGMENTED
    if "threshold" in argv and "--model" in argv:
        return MIN_ACCURACY_COMPRESSED_CONV
    if "cosine" in argv:
        return MIN_ACCURACY_COSINE
    return MIN_ACCURACY


def records(run_dir, kind):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


CASES = matrix()


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_combination(case, digits_h5, tmp_path):
    argv, n = case["argv"], case["n"]
    steps = run_options(strategies()[argv[1]])
    refused = verdict(argv + steps, n)
    run = train(n, *argv, *COMMON, *steps, "--data", str(digits_h5), "--run-dir",
                str(tmp_path), timeout=180)
    if refused is not None:
        assert run.returncode == 2, (refused, run.output[-3000:])
        errors = [line for line in run.stderr.splitlines() if line.startswith("hpcps: error")]
        assert len(errors) == 1 and refused.splitlines()[0] in errors[0], (refused, run.stderr)
        # at once, ordered by events and not by the clock (13 ranks start slowly on 2 shared
        # cores): no progress record, no checkpoint, nothing trained
        assert "Traceback" not in run.output and not records(tmp_path, "progress")
        assert not (tmp_path / "checkpoint.h5").exists()
        return
    assert run.returncode == 0, run.output[-4000:]
    summary = records(tmp_path, "summary")
    assert summary, run.output[-3000:]
    s = summary[-1]
    # an epoch quorum lets an epoch end without a slow replica's last mini-batches
    least = int(steps[1]) // 2 if "--epoch-quorum" in argv else int(steps[1])
    assert s["step"] >= least, s
    bar = min_accuracy(argv)
    assert s["test_accuracy"] >= bar, (s["test_accuracy"], bar, run.stdout[-2000:])
    if not strategies()[argv[1]].whole_batch:  # a replica's iteration and its pass, timed
        assert 0 < s["pass_cpu_s"] and 0 < s["pass_s"] < s["step_s"], s
    if "--trace" in argv:
        events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        ranks = {e["pid"] for e in events if e["ph"] == "X"}
        assert ranks == set(range(n)), (sorted(ranks), n)
        # said by the reporter, whoever it is (sandblaster's coordinator did not say it)
        assert f"trace: {tmp_path / 'trace.json'}" in run.stdout, run.stdout[-2000:]


# -- a fixed list, written by hand from docs/options.md and docs/strategies.md ----------------
# The matrix above judges each row by hpcps's own parse and layout plan; these do not: each
# entry is what the docs say, so a valid combination wrongly refused (or a documented refusal
# wrongly accepted) fails here whatever the code computes. (ranks, options, where it is said)
MUST_ACCEPT = [
    (16, ["--servers", "4", "--partitions", "1"], "strategies.md: N = 16 example grids"),
    (16, ["--servers", "4", "--partitions", "2"], "strategies.md: 6 replicas of 2 ranks"),
    (16, ["--strategy", "sync", "--partitions", "4"], "strategies.md: 4 replicas of 4 ranks"),
    (3, ["--strategy", "downpour"], "options.md: --servers default P, so S = 1, R = 2"),
    (4, ["--strategy", "downpour", "--partitions", "2", "--servers", "2"], "S + R * P"),
    (8, ["--strategy", "downpour", "--servers", "2", "--partitions", "2"],
     "strategies.md: S + R * P, S a multiple of P"),
    (4, ["--strategy", "sandblaster"], "strategies.md: S = 1 + R = 2 + 1 coordinator"),
    (5, ["--strategy", "sandblaster", "--servers", "2"],
     "strategies.md: N = S + C + R * P, 2 + 1 + 2 * 1"),
    (2, ["--strategy", "sync"], "options.md: --servers 0 for the others"),
    (3, ["--strategy", "sync", "--partitions", "3", "--threads", "2"], "--threads any P"),
    (2, ["--strategy", "averaging", "--average-every", "4", "--average-state", "off"],
     "options.md: averaging only"),
    (2, ["--strategy", "sync", "--optimizer", "momentum", "--nesterov", "on"], "options.md"),
    (2, ["--strategy", "sync", "--weight-decay", "1e-4", "--lr-schedule", "cosine"],
     "options.md: --weight-decay, --lr-schedule with sync"),
    (2, ["--strategy", "deadreckon", "--lr-scaling", "sqrt", "--golomb", "off"],
     "options.md: deadreckon only"),
    (2, ["--strategy", "deadreckon", "--tau", "auto", "--density", "0.02",
         "--sparsity-warmup", "100", "--residual-clip", "4", "--grad-clip", "5"],
     "options.md: --tau auto, --density, clipping"),
    (3, ["--strategy", "downpour", "--n-fetch", "2", "--n-push", "3"], "downpour only"),
    (3, ["--strategy", "downpour", "--compress", "threshold", "--tau", "0.01"],
     "options.md: --tau with --compress threshold"),
    (3, ["--strategy", "downpour", "--compress", "threshold", "--tau", "auto"],
     "compression.md: mpiexec -n 3 ... --compress threshold --tau auto"),
    (3, ["--strategy", "downpour", "--staleness-bound", "1"], "needs --n-fetch 1 (default)"),
    (3, ["--strategy", "downpour", "--softsync", "2", "--staleness-lr", "on"], "options.md"),
    (4, ["--strategy", "downpour", "--epoch-quorum", "0.75"], "options.md: Project Adam"),
    (3, ["--strategy", "downpour", "--push", "activations"], "options.md: --push"),
    (3, ["--strategy", "downpour", "--persist-every", "1"], "options.md: downpour only"),
    (4, ["--strategy", "downpour", "--heartbeat-timeout", "10"],
     "fault-tolerance.md: mpiexec -n 4 ... --heartbeat-timeout 10"),
    (4, ["--strategy", "downpour", "--servers", "2", "--ps-copies", "2"],
     "options.md: --servers at least C, --partitions 1"),
    (5, ["--strategy", "downpour", "--servers", "3", "--ps-copies", "2", "--softsync", "2",
         "--staleness-lr", "on"], "fault-tolerance.md: copies run the policy in order"),
    (5, ["--strategy", "downpour", "--servers", "3", "--ps-copies", "2", "--staleness-bound",
         "1"], "fault-tolerance.md: copies keep SSP's clocks"),
    (4, ["--strategy", "sandblaster", "--heartbeat-timeout", "10", "--flush-every", "1"],
     "options.md: sandblaster takes --heartbeat-timeout"),
    (5, ["--strategy", "downpour", "--spares", "1"], "fault-tolerance.md: spares"),
    (8, ["--strategy", "downpour", "--servers", "3", "--ps-copies", "2", "--spares", "2",
         "--softsync", "2"], "fault-tolerance.md: spares with copies"),
    (6, ["--strategy", "downpour", "--spares", "2", "--compress", "threshold", "--push",
         "gradients", "--persist-every", "1"], "spares: what a replica pushes is its own"),
    (3, ["--strategy", "downpour", "--chunk-bytes", "1024"], "downpour, sandblaster"),
    (3, ["--strategy", "downpour", "--model", CONV, "--dropout", "0.25"], "--dropout, --model"),
    (3, ["--strategy", "downpour", "--inject-slow", "0:3"], "a replica's world rank"),
    (4, ["--strategy", "downpour", "--servers", "2", "--ps-copies", "2", "--wire-dtype",
         "bf16"], "options.md: --wire-dtype, downpour"),
    (3, ["--strategy", "downpour", "--push", "activations", "--wire-dtype", "bf16"],
     "options.md: activation pushes travel as bf16"),
    (6, ["--strategy", "sync", "--partitions", "2", "--threads", "2", "--wire-dtype", "bf16"],
     "options.md: model-parallel exchanges"),
    (3, ["--strategy", "averaging", "--wire-dtype", "bf16"], "options.md: averaging's rounds"),
    (4, ["--strategy", "sandblaster", "--wire-dtype", "bf16"], "options.md: sandblaster"),
    (3, ["--strategy", "downpour", "--augment", "shift:2"], "options.md: --augment"),
    (4, ["--strategy", "sync", "--partitions", "2", "--augment", "shift:1"],
     "options.md: --augment, every strategy on the replica loop"),
]
# (ranks, options, a word the one message must hold: the option or the layout it refuses)
MUST_REFUSE = [
    (2, ["--strategy", "sync", "--n-push", "2"], "--n-push"),
    (3, ["--strategy", "downpour", "--tau", "0.01"], "--tau"),
    (2, ["--strategy", "deadreckon", "--optimizer", "adagrad"], "optimizer"),
    (4, ["--strategy", "sandblaster", "--optimizer", "sgd"], "optimizer"),
    (3, ["--strategy", "downpour", "--staleness-bound", "1", "--n-fetch", "2"], "--n-fetch"),
    (3, ["--strategy", "downpour", "--push", "activations", "--weight-decay", "1e-4"],
     "--push activations"),
    (3, ["--strategy", "downpour", "--push", "activations", "--chunk-bytes", "1024"],
     "--push activations"),
    (4, ["--strategy", "downpour", "--servers", "1", "--ps-copies", "2"], "--servers"),
    (5, ["--strategy", "downpour", "--servers", "2", "--partitions", "2"], "5"),
    (4, ["--strategy", "downpour", "--servers", "2", "--partitions", "3"], "multiple of P"),
    (4, ["--strategy", "sandblaster", "--partitions", "2"], "--partitions 1"),
    (2, ["--strategy", "sync", "--average-every", "2"], "--average-every"),
    (2, ["--strategy", "sync", "--lr-scaling", "sqrt"], "--lr-scaling"),
    (3, ["--strategy", "downpour", "--dropout", "0.25"], "--dropout"),
    (4, ["--strategy", "sandblaster", "--inject-slow", "3:2"], "--inject-slow"),
    (5, ["--strategy", "downpour", "--spares", "1", "--staleness-bound", "1"],
     "--spares with --staleness-bound"),
    (6, ["--strategy", "downpour", "--spares", "1", "--epoch-quorum", "0.75"],
     "--spares with --epoch-quorum"),
    (6, ["--strategy", "downpour", "--spares", "1", "--servers", "2", "--partitions", "2"],
     "--partitions"),
    (4, ["--strategy", "sandblaster", "--spares", "1"], "--spares"),
    (3, ["--strategy", "downpour", "--spares", "3"], "3 spare(s)"),
    (2, ["--strategy", "deadreckon", "--wire-dtype", "bf16"], "--wire-dtype"),
    (4, ["--strategy", "sandblaster", "--augment", "shift:1"], "--augment"),
    (2, ["--strategy", "sync", "--augment", "shift:0"], "shift:K"),
]


def _doc_id(n: int, argv: list[str]) -> str:
    return f"N{n} " + " ".join(argv)


@pytest.mark.parametrize("n,argv,where", MUST_ACCEPT,
                         ids=[_doc_id(n, a) for n, a, _ in MUST_ACCEPT])
def test_what_the_docs_allow_is_accepted(n, argv, where):
    run = BATCH_RUN if "sandblaster" in argv[:2] else SGD_RUN
    refused = verdict(argv + run, n)
    assert refused is None, (where, refused)


@pytest.mark.parametrize("n,argv,word", MUST_REFUSE,
                         ids=[_doc_id(n, a) for n, a, _ in MUST_REFUSE])
def test_what_the_docs_refuse_is_refused(n, argv, word):
    run = BATCH_RUN if "sandblaster" in argv[:2] else SGD_RUN
    refused = verdict(argv + run, n)
    assert refused is not None and word in refused, refused


def test_the_sample_covers_every_pair():
    """Every pair of values appears; every pair an accepted combination holds appears in an
    accepted row of the sample. Recounted here over the whole product with NumPy (each row's
    value indices), apart from the sampler's own bookkeeping."""
    for name, spec in strategies().items():
        if not spec.dense_models:  # not in this matrix (see matrix())
            continue
        _, dims = dimensions(name, spec)
        sizes = [len(d) for d in dims]
        free = [k for k, n in enumerate(sizes) if n > 1]
        index = [{repr(v): i for i, v in enumerate(d)} for d in dims]
        rows = sample(name)
        assert len(rows) == sum(1 for c in CASES if c["id"].startswith(name + "-P")), name
        chosen = np.array([[index[k][repr(v)] for k, v in enumerate(r)] for r in rows])
        chosen_ok = np.array([judged(name, spec, r) for r in rows])
        product = np.indices(sizes, dtype=np.int8).reshape(len(sizes), -1)  # product order
        ok = acceptance(name)
        for i, j in itertools.combinations(free, 2):
            def pairs(where, cols):
                seen = np.zeros((sizes[i], sizes[j]), dtype=bool)
                seen[cols[i][where], cols[j][where]] = True
                return seen
            every = np.ones(len(rows), dtype=bool)
            assert pairs(every, chosen.T).all(), (name, i, j)
            missing = pairs(ok, product) & ~pairs(chosen_ok, chosen.T)
            assert not missing.any(), (name, i, j, np.argwhere(missing)[:5])


def test_the_fast_judgement_agrees():
    """The sampler's judgement (``judged``: pieces of the command line parsed apart) gives the
    verdict of the whole command line through ``config.parse`` on every row of the sample and
    on every 101st row of each strategy's product."""
    for name, spec in strategies().items():
        _, dims = dimensions(name, spec)
        rows = list(sample(name)) + list(itertools.islice(itertools.product(*dims), 0, None, 101))
        for row in rows:
            assert judged(name, spec, row) == accepted(combination(name, spec, row), spec), \
                (row, verdict(combination(name, spec, row)["argv"] + run_options(spec),
                              combination(name, spec, row)["n"]))


def test_pairwise_is_small_and_deterministic():
    dims = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2], ["a", "b"], ["x", "y", "z"]]
    rows = pairwise(dims)
    assert rows == pairwise(dims) and 9 <= len(rows) <= 15
    with pytest.raises(ValueError):
        pairwise([[1, 2], []])


def test_pairwise_takes_verdicts_as_a_function_or_an_array():
    dims = [[1, 2, 3], [1, 2, 3], ["a"], [1, 2], ["x", "y", "z"]]

    def accept(row):  # refuses (3, 3) and (2, "z")
        return row[:2] != (3, 3) and (row[3], row[4]) != (2, "z")
    verdicts = np.array([accept(r) for r in itertools.product(*dims)])
    rows = pairwise(dims, accept=accept)
    assert rows == pairwise(dims, accept=verdicts)
    refused = [r for r in rows if not accept(r)]
    assert any(r[:2] == (3, 3) for r in refused) and any(r[3:] == (2, "z") for r in refused)
    assert all(accept(r) for r in rows[:len(rows) - len(refused)])  # accepted rows first
    with pytest.raises(ValueError):
        pairwise(dims, accept=verdicts[1:])


if __name__ == "__main__":  # sizes of the sample and of the whole product
    for strategy, spec in strategies().items():
        _, dims = dimensions(strategy, spec)
        rows = sample(strategy)
        n_ok = sum(judged(strategy, spec, r) for r in rows)
        ok = acceptance(strategy)  # the fast judgement (test_the_fast_judgement_agrees)
        full, f_ok = ok.size, int(ok.sum())
        print(f"{strategy:12s} sample {len(rows):3d} ({n_ok} accepted)   "
              f"product {full:6d} ({f_ok} accepted)")
