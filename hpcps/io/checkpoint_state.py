"""What a checkpoint holds and whether it is sound: the :class:`Checkpoint` record, the checks
of its parameters against an architecture (an MLP's chained layers, or the conv model its
config names), of its optimizer state and JSON parts, of finiteness, and of its fit to a run
that wants to resume from it. No file access: :mod:`hpcps.io.checkpoint` writes and reads the
HDF5 file and holds what it reads to these same rules, so a hand-edited file gets no more
leeway than a bad ``save()`` call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcps.errors import CheckpointError, HpcpsError

# The name of a parameter under /params (and a key of Checkpoint.params).
PARAM_NAME = re.compile(r"^layer(0|[1-9][0-9]*)/(W|b)$")
_OPT_KEY_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass
class Checkpoint:
    """Everything a run needs to resume.

    Parameters
    ----------
    params : dict of str to ndarray
        ``"layer{i}/W"`` float32 ``(fan_in, fan_out)`` and ``"layer{i}/b"`` float32
        ``(fan_out,)`` for layers ``0..L-1``, shapes chaining from layer to layer.
    optimizer : str
        Name of the optimizer whose state this is, e.g. ``"sgd"`` or ``"adagrad"``.
    opt_state : dict of str to ndarray
        Optimizer state by key, e.g. ``"accum/layer0/W"``; empty for plain SGD.
    step : int
        Global step: mini-batches applied so far.
    config : dict
        The run's config as plain JSON-able values (tuples come back as lists).
    dataset : dict
        Dataset identity: name, fingerprint, n_train, n_test, n_features, n_classes.
    metrics : dict
        Latest metrics, e.g. ``{"train_loss": .., "test_accuracy": .., "elapsed_s": ..}``.
    path : Path or None
        The file this was loaded from (set by :func:`load`, used in messages; not compared).
    """

    params: dict[str, np.ndarray]
    optimizer: str
    opt_state: dict[str, np.ndarray]
    step: int
    config: dict
    dataset: dict
    metrics: dict = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------------------------------------
# validation (shared by save and load, so a hand-edited file is held to the same rules)


def layer_sizes(params: dict[str, np.ndarray]) -> list[int]:
    """Return ``[n_0, n_1, ..., n_L]`` of a params dict, checking names, dtypes and shapes.

    Raises
    ------
    CheckpointError
        If a name is not ``layer{i}/W`` or ``layer{i}/b``, a layer is missing or incomplete, an
        array is not float32, or the shapes do not chain (W_i is (n_i, n_{i+1}), b_i (n_{i+1},)).
    """
    if not isinstance(params, dict) or not params:
        raise CheckpointError(
            "params must be a non-empty dict like "
            "{'layer0/W': .., 'layer0/b': ..}"
        )
    layers: dict[int, set[str]] = {}
    for name, value in params.items():
        m = PARAM_NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise CheckpointError(
                f"param name {name!r} is not of the form 'layer{{i}}/W' or "
                f"'layer{{i}}/b'"
            )
        if not isinstance(value, np.ndarray) or value.dtype != np.float32:
            kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise CheckpointError(f"param {name} must be a float32 ndarray, got {kind}")
        layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    n_layers = len(layers)
    if sorted(layers) != list(range(n_layers)):
        raise CheckpointError(
            f"layers must be numbered 0..{n_layers - 1} without gaps, got "
            f"{sorted(layers)}"
        )
    sizes: list[int] = []
    for i in range(n_layers):
        for part in ("W", "b"):
            if part not in layers[i]:
                raise CheckpointError(f"param layer{i}/{part} is missing")
        W, b = params[f"layer{i}/W"], params[f"layer{i}/b"]
        if W.ndim != 2 or b.ndim != 1 or b.shape[0] != W.shape[1]:
            raise CheckpointError(
                f"layer{i}: W must be (fan_in, fan_out) and b (fan_out,), got W {W.shape} and b "
                f"{b.shape}"
            )
        if i == 0:
            sizes.append(int(W.shape[0]))
        elif W.shape[0] != sizes[-1]:
            raise CheckpointError(
                f"layer{i}/W has fan_in {W.shape[0]} but layer{i - 1} has fan_out {sizes[-1]}: "
                "shapes do not chain"
            )
        sizes.append(int(W.shape[1]))
    return sizes


def conv_model(config: dict, dataset: dict):
    """The :class:`~hpcps.model.convnet.ConvNet` a checkpoint's config names (``model``), on its
    dataset's image shape; None for an MLP checkpoint and for an embedding model's, whose
    dense parameters are its fc layers in the MLP's layout (its rows: ``tables/``)."""
    spec = config.get("model") if isinstance(config, dict) else None
    if not isinstance(spec, str) or not spec:   # an MLP's run (config files of others: any)
        return None
    from hpcps.model.spec import is_embedding_spec
    if is_embedding_spec(spec):
        return None
    from hpcps.model.convnet import ConvNet
    shape = dataset.get("image_shape") or (dataset.get("n_features", 0), 1, 1)
    try:
        return ConvNet(spec, shape, config.get("activation", "relu"))
    except (ValueError, TypeError, HpcpsError) as exc:
        raise CheckpointError(f"its config names model {spec!r}, which cannot be built on "
                              f"images of shape {shape}: {exc}") from None


def architecture_sizes(params: dict[str, np.ndarray], config: dict, dataset: dict) -> list[int]:
    """:func:`layer_sizes` of an MLP checkpoint; for a conv model (``config["model"]``), its
    parameters checked against the model's names and shapes (conv kernels ``(out, in, kh,
    kw)``) and its ``sizes``: input units, then the output units of each layer with
    parameters."""
    model = conv_model(config, dataset)
    if model is None:
        return layer_sizes(params)
    want = {name: shape for name, shape, _ in model.layout}
    if not isinstance(params, dict) or set(params) != set(want):
        have = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise CheckpointError(f"params {have} are not those of model {model.spec_text!r}: "
                              f"{sorted(want)}")
    for name, shape in want.items():
        value = params[name]
        if not isinstance(value, np.ndarray) or value.dtype != np.float32:
            raise CheckpointError(f"param {name} must be a float32 ndarray")
        if value.shape != shape:
            raise CheckpointError(f"param {name} has shape {value.shape}; model "
                                  f"{model.spec_text!r} needs {shape}")
    return list(model.sizes)



def _check_opt_state(opt_state: dict[str, np.ndarray]) -> None:
    if not isinstance(opt_state, dict):
        raise CheckpointError(f"opt_state must be a dict of arrays, got {type(opt_state).__name__}")
    for key, value in opt_state.items():
        parts = key.split("/") if isinstance(key, str) else [""]
        if not all(_OPT_KEY_PART.match(p) for p in parts):
            raise CheckpointError(
                f"opt_state key {key!r} must be '/'-separated names of letters, digits, '_', '.', "
                "'-'"
            )
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise CheckpointError(f"opt_state {key} must be a numeric ndarray, got {kind}")
        if value.ndim == 0:
            raise CheckpointError(f"opt_state {key} is a 0-d array; store it with shape (1,)")
    keys = set(opt_state)
    for key in keys:
        parts = key.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in keys:
                raise CheckpointError(
                    f"opt_state keys {'/'.join(parts[:k])!r} and {key!r} clash: one would be a "
                    "group of the other"
                )


def _plain(value: Any, where: str) -> Any:
    """Return ``value`` as plain JSON types (numpy scalars unwrapped), or raise naming ``where``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.generic):
        return _plain(value.item(), where)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {k!r} is not a string (JSON keys are strings)")
            out[k] = _plain(v, f"{where}.{k}")
        return out
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, not a JSON value "
        "(str/int/float/bool/list/dict/None)"
    )


def checked(ckpt: Checkpoint) -> tuple[list[int], dict, dict, dict]:
    """What :func:`hpcps.io.checkpoint.save` writes of ``ckpt``, checked: (layer sizes, config,
    dataset, metrics as plain JSON values). Raises CheckpointError naming what is wrong."""
    if not isinstance(ckpt, Checkpoint):
        raise CheckpointError(f"save() needs a Checkpoint, got {type(ckpt).__name__}")
    sizes = architecture_sizes(ckpt.params, ckpt.config if isinstance(ckpt.config, dict) else {},
                               ckpt.dataset if isinstance(ckpt.dataset, dict) else {})
    if not isinstance(ckpt.optimizer, str) or not _OPT_KEY_PART.match(ckpt.optimizer):
        raise CheckpointError(
            "optimizer must be a name like 'sgd' or 'adagrad', got "
            f"{ckpt.optimizer!r}"
        )
    _check_opt_state(ckpt.opt_state)
    if isinstance(ckpt.step, bool) or not isinstance(ckpt.step, (int, np.integer)) or ckpt.step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {ckpt.step!r}")
    plain = []
    for name in ("config", "dataset", "metrics"):
        value = getattr(ckpt, name)
        if not isinstance(value, dict):
            raise CheckpointError(f"{name} must be a dict, got {type(value).__name__}")
        plain.append(_plain(value, name))
    return sizes, plain[0], plain[1], plain[2]


def nonfinite(arrays: dict[str, np.ndarray]) -> tuple[int, str] | None:
    """None when every value of the named arrays is finite; else (how many values are NaN or
    infinite, the name of the first array holding one). One pass over each array."""
    total, first = 0, ""
    for name, a in arrays.items():
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.sum(a, dtype=np.float64)):
                continue  # a float64 sum of float32 values is finite only when every one is
        bad = int(np.count_nonzero(~np.isfinite(a)))
        total += bad
        if bad and not first:
            first = name
    return None if total == 0 else (total, first)


def check_finite(ckpt: Checkpoint) -> None:
    """Refuse to resume from parameters or optimizer state holding NaN or infinity.

    :func:`load` reads such a file (a diverged state may be inspected); resuming from it
    would train on NaN. Training never writes one (``hpcps.strategies.context``).

    Raises
    ------
    CheckpointError
        Naming the file, how many values are not finite and where the first is.
    """
    bad = nonfinite({**{f"params/{k}": v for k, v in ckpt.params.items()},
                     **{f"optimizer/{k}": v for k, v in ckpt.opt_state.items()}})
    if bad is not None:
        raise CheckpointError(f"{source_of(ckpt)} holds {bad[0]} NaN or infinite value(s), the "
                              f"first in {bad[1]}: the run that wrote it had diverged; resume "
                              "from an earlier checkpoint or start anew")


# ---------------------------------------------------------------------------------------------
# compatibility with the run that wants to resume


def source_of(ckpt: Checkpoint) -> str:
    return f"checkpoint {ckpt.path}" if ckpt.path is not None else "the checkpoint"


def check_compatible(ckpt: Checkpoint, layer_sizes: list[int], optimizer: str | None = None,
                     dataset: dict | None = None) -> list[str]:
    """Refuse to resume ``ckpt`` into a different model; return warnings for lesser mismatches.

    Parameters
    ----------
    ckpt : Checkpoint
        As returned by :func:`load`.
    layer_sizes : list of int
        The run's layer sizes ``[n_0, ..., n_L]``.
    optimizer : str, optional
        The run's optimizer; resuming with another one is refused (its state would not match).
    dataset : dict, optional
        The run's dataset identity. Different ``n_features`` or ``n_classes`` are refused; a
        different ``name`` or ``fingerprint`` alone is allowed with a warning.

    Returns
    -------
    list of str
        Warnings for the caller to print (empty when everything matches).
    """
    where = source_of(ckpt)
    have = architecture_sizes(ckpt.params, ckpt.config, ckpt.dataset)
    want = [int(n) for n in layer_sizes]
    if have != want:
        raise CheckpointError(
            f"{where} holds layers {','.join(map(str, have))} but this run asks for "
            f"{','.join(map(str, want))}"
        )
    if optimizer is not None and optimizer != ckpt.optimizer:
        raise CheckpointError(
            f"{where} was written by optimizer {ckpt.optimizer!r} but this run asks for "
            f"{optimizer!r}; "
            f"resuming with another optimizer is refused because its state would not match "
            f"(use optimizer {ckpt.optimizer!r}, or start a new run)"
        )
    warnings: list[str] = []
    if dataset is not None:
        for key in ("n_features", "n_classes"):
            if key in dataset and key in ckpt.dataset and dataset[key] != ckpt.dataset[key]:
                raise CheckpointError(
                    f"{where} was trained on data with {key} = {ckpt.dataset[key]} but this run's "
                    f"dataset has {key} = {dataset[key]}"
                )
        for key in ("name", "fingerprint"):
            if key in dataset and key in ckpt.dataset and dataset[key] != ckpt.dataset[key]:
                warnings.append(
                    f"{where} was trained on dataset {key} {ckpt.dataset[key]!r} but this run uses "
                    f"{dataset[key]!r}; resuming anyway (same n_features and n_classes)"
                )
    return warnings
