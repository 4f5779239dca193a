"""Hybrid training of embedding models (Persia, Lian et al. 2021): the embedding rows
asynchronous through server shards, the dense layers synchronous by allreduce.

An embedding model's parameters are of two kinds. Its tables are huge and sparse: a step
touches a few thousand of 10^7-10^10 rows, so they live on the server shards, hashed by
(table, id), and every replica pulls the rows of its batch and pushes their gradients
without waiting for any other replica (as in downpour, :mod:`hpcps.ps.rows`). Its fc layers
are small and dense and every step touches all of them: each replica holds a copy, and the
replicas allreduce their dense gradients every step and apply the same update, as sync
does, so the dense layers never go stale. Persia's argument: staleness hurts the dense
layers, which every example updates, far more than the rows, which few examples share.

One update consumes R mini-batches, the global step advances by R (as sync). At a checkpoint
the chief asks the shards to write their rows (``tables/shard-<s>-of-<S>.step-<N>.h5``,
:mod:`hpcps.io.tables`) and writes the dense checkpoint once every shard has, and
``--resume`` reads both, on any number of shards. Embedding models only: an MLP or a conv
model is refused at start.
"""
from hpcps.errors import ConfigError
from hpcps.model.spec import is_embedding_spec
from hpcps.options import (EMBEDDING_DEFAULTS, EMBEDDING_EPOCHS, EMBEDDING_OPTIONS,
                           LOOP_OPTIONS, check_embedding_options, check_loop_options,
                           describe_rows, parse_augment, varies, WIRE_DTYPE)
from hpcps.strategies.lr_rule import (DEFAULT_WARMUP_STEPS, LR_RULE_OPTIONS, check_lr_rule,
                                      describe_rate)
from hpcps.strategies.registry import SERVERS, Strategy
from hpcps.strategies.rows_summary import row_lines

def _validate(cfg) -> None:
    if not is_embedding_spec(cfg.model):
        raise ConfigError("--strategy hybrid trains embedding models only (--model embed..., "
                          "ctr-dnn or movielens on a categorical dataset: docs/ctr.md); for "
                          "an MLP or a conv model use --strategy sync or downpour")
    check_embedding_options(cfg, True, {
        "--weight-decay": bool(cfg.weight_decay),
        "--dropout": bool(cfg.dropout), "--augment": parse_augment(cfg.augment) is not None,
        "--lr-schedule cosine": varies(cfg.lr_schedule)})
    check_loop_options(cfg)
    check_lr_rule(cfg, "none")


def _defaults(cfg) -> dict:
    d = {"servers": 1, "prefetch": 2, "lr_rule": "none", "lr_warmup_steps": DEFAULT_WARMUP_STEPS,
         **EMBEDDING_DEFAULTS}
    if cfg.steps is None:
        d["epochs"] = EMBEDDING_EPOCHS
    return d


def _describe(cfg, n_train: int, replicas: int | None = None) -> str:
    return (f"dense layers: {cfg.optimizer} {describe_rate(cfg, replicas)}, allreduced every "
            f"step, batch {cfg.batch_size}/replica; {describe_rows(cfg)}")


STRATEGY = Strategy(
    name="hybrid",
    help="embedding models: rows asynchronous through the server shards, dense layers "
         "allreduced every step (Persia's hybrid)",
    roles={"replica": "hpcps.strategies.hybrid.replica:run",
           "server": "hpcps.strategies.hybrid.server:run"},
    servers=SERVERS,
    options=(*LR_RULE_OPTIONS, *LOOP_OPTIONS, *EMBEDDING_OPTIONS, WIRE_DTYPE),
    defaults=_defaults,
    model_parallel=False,
    embeddings=True,
    dense_models=False,
    validate=_validate,
    describe=_describe,
    summarize="hpcps.strategies.hybrid.server:summarize",
    summary_lines=row_lines,
)
