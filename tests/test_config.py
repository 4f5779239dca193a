from pathlib import Path

import pytest

from hpcps import config
from hpcps.errors import ConfigError
from hpcps.strategies.downpour import DOWNPOUR_TAU


def test_defaults_fill_by_strategy():
    cfg = config.parse([])
    assert cfg.strategy == "downpour" and cfg.servers == 1 and cfg.optimizer == "adagrad"
    assert cfg.n_fetch == 1 and cfg.n_push == 1 and cfg.warmup_steps == 200
    s = config.parse(["--strategy", "sync"])
    assert s.servers == 0 and s.n_fetch is None and s.warmup_steps is None and s.tau is None
    d = config.parse(["--strategy", "deadreckon"])
    assert d.servers == 0 and d.optimizer == "sgd" and d.tau == "auto" and d.golomb == "on"
    c = config.parse(["--compress", "threshold"])
    assert c.tau == DOWNPOUR_TAU and c.golomb == "on"
    assert config.parse([]).compress == "none" and config.parse([]).tau is None


def test_every_strategy_with_the_linear_rule_has_a_warm_up():
    """--lr-rule linear reads --lr-warmup-steps: every strategy that takes the rule gives the
    warm-up a default (hybrid had none, and its replicas failed with a TypeError)."""
    from hpcps.model.spec import is_embedding_spec
    from hpcps.strategies.registry import strategies
    taking = []
    for name, spec in strategies().items():
        model = ["--model", "embed8,fc16,fc1"] if spec.embeddings and not spec.dense_models \
            else []
        try:
            cfg = config.parse(["--strategy", name, "--lr-rule", "linear", *model])
        except ConfigError:
            continue  # the strategy does not take the rule
        assert is_embedding_spec(cfg.model) == bool(model)
        assert isinstance(cfg.lr_warmup_steps, int) and cfg.lr_warmup_steps >= 0, name
        taking.append(name)
    assert {"sync", "averaging", "hybrid"} <= set(taking), taking


def test_cli_values_and_layers():
    cfg = config.parse(["--layers", "64,32,10", "--lr", "0.5", "--batch-size", "7",
                        "--activation", "tanh", "--steps", "9"])
    assert cfg.layers == (64, 32, 10) and cfg.lr == 0.5 and cfg.batch_size == 7
    assert cfg.activation == "tanh" and cfg.total_steps(1000) == 9


def test_epochs_to_steps():
    cfg = config.parse(["--epochs", "2", "--batch-size", "10"])
    assert cfg.total_steps(1001) == 201  # ceil(2 * 1001 / 10)
    assert config.parse([]).total_steps(60000) == 7500  # default 4 epochs of batch 32


def test_toml_and_cli_precedence(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('lr = 0.2\nbatch-size = 16\nlayers = [64, 10]\nstrategy = "sync"\n')
    cfg = config.parse(["--config", str(f), "--lr", "0.3"])
    assert cfg.lr == 0.3 and cfg.batch_size == 16 and cfg.layers == (64, 10)
    assert cfg.strategy == "sync"


@pytest.mark.parametrize("text,needle", [
    ("learning_rate = 0.1\n", "unknown key 'learning_rate'"),
    ("bach_size = 3\n", "did you mean 'batch_size'"),
    ("lr = 'fast'\n", "wrong type"),
    ("lr = \n", "not valid TOML"),
    ("validation-fraction = 0.1\nvalidation_fraction = 0.2\n",
     "gives option validation_fraction twice, as 'validation-fraction' and "
     "'validation_fraction'"),
])
def test_bad_toml(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        config.parse(["--config", str(f)])


def test_missing_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.parse(["--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize("argv,needle", [
    (["--learning-rate", "1"], "unrecognized arguments"),
    (["--strategy", "magic"], "invalid choice"),
    (["--lr", "-1"], "must be positive"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--timeout", "inf"], "--timeout must be a finite number"),
    (["--seed", "-5"], "--seed must be >= 0"),
    (["--layers", "784"], "at least an input and an output"),
    (["--layers", "a,b"], "comma-separated integers"),
    (["--strategy", "sync", "--n-push", "4"], "applies only to --strategy downpour"),
    (["--strategy", "sync", "--servers", "2"], "uses no parameter servers"),
    (["--strategy", "deadreckon", "--servers", "1"], "uses no parameter servers"),
    (["--servers", "0"], "at least one server shard"),
    (["--strategy", "sync", "--tau", "1"], "applies only to --strategy downpour or deadreckon"),
    (["--strategy", "deadreckon", "--compress", "threshold"], "applies only"),
    (["--strategy", "deadreckon", "--optimizer", "adagrad"], "only --optimizer sgd or momentum"),
    (["--tau", "0.1"], "only with --compress threshold"),
    (["--compress", "threshold", "--tau", "0"], "must be positive"),
    (["--golomb", "maybe"], "invalid choice"),
    (["--strategy", "sandblaster", "--prefetch", "3"], "applies only"),
    (["--prefetch", "-1"], ">= 0"),
    (["--epochs", "1", "--steps", "5"], "not both"),
    (["--partitions", "2", "--servers", "3"], "multiple of P"),
    (["--checkpoint-every", "-1"], ">= 0"),
    (["--strategy", "sync", "--average-every", "2"], "applies only to --strategy averaging"),
    (["--strategy", "averaging", "--average-every", "0"], "must be positive"),
    (["--strategy", "averaging", "--optimizer", "lbfgs"], "runs only --optimizer adagrad or sgd"),
    (["--strategy", "sandblaster", "--partitions", "2"], "replicas of one rank each"),
    (["--strategy", "sync", "--batch-size", "0"], "--batch-size 0"),
    (["--strategy", "sync", "--lr-rule", "none", "--lr-warmup-steps", "10"],
     "the rule here is none, which has no warm-up"),
    (["--strategy", "hybrid", "--model", "ctr-dnn", "--lr-warmup-steps", "10"],
     "the rule here is none"),
    (["--chunk-bytes", "3"], r"at least 4 \(a chunk holds at least one 4-byte parameter\)"),
    (["--momentum", "0.5"], "applies only to --optimizer momentum, not adagrad"),
    (["--strategy", "sync", "--nesterov", "on"], "applies only to --optimizer momentum"),
    (["--optimizer", "momentum", "--momentum", "1"], "below 1"),
    (["--strategy", "deadreckon", "--optimizer", "momentum", "--nesterov", "on"],
     "without Nesterov's variant"),
    (["--strategy", "deadreckon", "--tau", "0.002", "--density", "0.01"], "needs --tau auto"),
    (["--strategy", "deadreckon", "--tau", "0.002", "--sparsity-warmup", "10"],
     "needs --tau auto"),
    (["--strategy", "deadreckon", "--tau", "auto", "--density", "2"], "a fraction of the elements"),
    (["--strategy", "deadreckon", "--tau", "auto", "--density", "0"], "must be positive"),
    (["--strategy", "deadreckon", "--tau", "often"], "a positive number or 'auto'"),
    (["--strategy", "deadreckon", "--residual-clip", "-1"], "must be >= 0"),
    (["--strategy", "sync", "--density", "0.01"], "applies only to --strategy"),
    (["--strategy", "sync", "--staleness-bound", "1"], "applies only to --strategy downpour"),
    (["--staleness-bound", "1", "--n-fetch", "2"], "needs a fetch every step"),
    (["--staleness-bound", "-1"], ">= 0"),
    (["--softsync", "2", "--push", "activations"], "use --push gradients"),
    (["--staleness-lr", "on", "--staleness-bound", "2"], "choose one"),
    (["--strategy", "deadreckon", "--softsync", "2"], "applies only to --strategy downpour"),
    (["--softsync", "0"], "must be positive"),
    (["--strategy", "sync", "--inject-slow", "1:never"], "wants RANK:FACTOR"),
    (["--inject-slow", "1:0.5"], "factor >= 1"),
    (["--weight-decay", "-0.1"], ">= 0"),
    (["--strategy", "sandblaster", "--weight-decay", "1e-4"], "applies only to --strategy"),
    (["--push", "activations", "--weight-decay", "1e-4"], "use --push gradients"),
    (["--lr-schedule", "step"], "invalid choice"),
    (["--strategy", "sandblaster", "--lr-schedule", "cosine"], "applies only to --strategy"),
    (["--push", "activations", "--lr-schedule", "cosine"], "fixed --lr in a fused kernel"),
    (["--table-capacity", "100"], "--table-capacity applies to embedding models"),
    (["--admit-after", "2"], "--admit-after applies to embedding models"),
    (["--model", "ctr-dnn", "--table-capacity", "0"], "--table-capacity must be positive"),
    (["--model", "ctr-dnn", "--admit-after", "0"], "--admit-after must be positive"),
    (["--model", "ctr-dnn", "--admit-after", "65536"], "at most 65535"),
    (["--strategy", "sync", "--table-capacity", "100"], "applies only to --strategy downpour"),
])
def test_bad_cli(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        config.parse(argv)


def test_partitions_default_one_shard_each():
    assert config.parse(["--partitions", "3"]).servers == 3
    assert config.parse(["--partitions", "2", "--servers", "4"]).servers == 4
    assert config.parse(["--partitions", "2", "--strategy", "sync"]).servers == 0


def test_threads_go_with_every_strategy():
    for strategy in ("sync", "downpour", "deadreckon"):
        cfg = config.parse(["--strategy", strategy, "--partitions", "2", "--threads", "2"])
        assert (cfg.threads, cfg.partitions) == (2, 2)
    assert config.parse(["--strategy", "sandblaster", "--threads", "3"]).threads == 3


def test_round_trip_dict():
    cfg = config.parse(["--layers", "64,10"])
    assert config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError):
        config.from_dict({**cfg.to_dict(), "bogus": 1})


def test_every_option_has_help():
    text = config.build_parser().format_help()
    for name, option in config.OPTIONS.items():
        assert option.flag in text and option.help
    for name in config.OWNERS:  # strategy options are listed under their strategy
        assert f"{config.OWNERS[name][0]} options" in text


def test_the_typed_config_names_every_common_option():
    """hpcps.options.RunConfig, the type checkers read, has a typed attribute for every
    option all runs have, of the option's type, and none other."""
    import typing

    from hpcps.options import TAU_TYPE, RunConfig
    hints = typing.get_type_hints(RunConfig)
    assert set(hints) == {o.name for o in config.COMMON}, set(hints) ^ {o.name for o in
                                                                           config.COMMON}
    for o in config.COMMON:
        want = {config.LAYERS: tuple[int, ...], TAU_TYPE: float | str}.get(o.type, o.type)
        args = typing.get_args(hints[o.name]) or (hints[o.name],)
        assert want in args or hints[o.name] == want, (o.name, hints[o.name], want)
        if o.default is None:
            assert type(None) in args, (o.name, "may be unset: its type must admit None")
    cfg = config.parse(["--strategy", "sync"])
    assert isinstance(cfg.lr, float) and cfg.layers == (784, 512, 512, 10)


# -- the run directory ---------------------------------------------------------------------------
def _leave_run(run_dir, argv, checkpoint=True):
    """What a run leaves in its directory: a start record with its config (resume resolved,
    as hpcps.job writes it) and, optionally, a checkpoint file."""
    import json
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = {**config.parse(argv).to_dict(), "resume": None}
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "start", "time_s": 0.0, "config": saved}) + "\n")
        f.write('{"kind": "progress", "step": 10}\n')
    if checkpoint:
        (run_dir / "checkpoint.h5").write_bytes(b"")


def test_slurm_default_run_dir_is_the_jobs_and_continues_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--strategy", "sync", "--lr", "0.05", "--resume", "auto"]
    assert config.run_dir_for(config.parse(argv), "x", "12") == Path("runs/slurm-12")
    _leave_run(tmp_path / "runs" / "slurm-12", argv)
    # a requeue or a retry: the same run, even with a longer run or other timeouts
    again = argv + ["--steps", "5000", "--timeout", "30", "--eval-every", "7"]
    assert config.run_dir_for(config.parse(again), "x", "12") == Path("runs/slurm-12")
    # an array task or another job: a directory of its own
    other = config.parse(["--strategy", "averaging", "--resume", "auto"])
    assert config.run_dir_for(other, "x", "12_1") == Path("runs/slurm-12_1")


def test_slurm_default_run_dir_refuses_another_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _leave_run(tmp_path / "runs" / "slurm-12", ["--strategy", "sync", "--lr", "0.05"])
    other = config.parse(["--strategy", "averaging", "--lr", "0.05", "--resume", "auto"])
    with pytest.raises(ConfigError, match=r"holds a sync run with another configuration "
                       r"\(strategy: 'sync' there, 'averaging' here.*would resume: .*"
                       r"--run-dir runs/slurm-12-2"):
        config.run_dir_for(other, "x", "12")
    lr = config.parse(["--strategy", "sync", "--lr", "0.1"])
    with pytest.raises(ConfigError, match=r"lr: 0.05 there, 0.1 here\), which this run "
                       "would overwrite"):
        config.run_dir_for(lr, "x", "12")
    same = config.parse(["--strategy", "sync", "--lr", "0.05"])   # no --resume auto
    with pytest.raises(ConfigError, match="would overwrite: continue it with --resume auto"):
        config.run_dir_for(same, "x", "12")
    # the way out: --run-dir (not checked: the user chose it)
    named = config.parse(["--strategy", "averaging", "--run-dir", "runs/slurm-12-2"])
    assert config.run_dir_for(named, "x", "12") == Path("runs/slurm-12-2")


def test_slurm_default_run_dir_with_checkpoints_but_no_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "slurm-12"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint-100.h5").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds checkpoint-100.h5, which this run would "
                       "overwrite"):
        config.run_dir_for(config.parse([]), "x", "12")
    # --resume auto checks the files themselves (hpcps.io.checkpoint.latest)
    auto = config.parse(["--resume", "auto"])
    assert config.run_dir_for(auto, "x", "12") == Path("runs/slurm-12")
    # an empty directory, or one of metrics without a start record, is nobody's
    (run_dir / "checkpoint-100.h5").unlink()
    (run_dir / "metrics.jsonl").write_text('{"kind": "progress"}\nnot json\n')
    assert config.run_dir_for(config.parse([]), "x", "12") == Path("runs/slurm-12")
