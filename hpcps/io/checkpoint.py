"""Checkpoints: one self-describing HDF5 file per save, written atomically.

A checkpoint holds the whole model (every layer, unpartitioned), the optimizer state, the step,
the run's config, the identity of the dataset and the latest metrics. It does not record how
many ranks wrote it, so a run can resume on a different number of servers, replicas or
partitions. Whoever holds the full state (after a gather) calls :func:`save`; this module does
no MPI. Plain ``h5py`` reads the file; ``python -m hpcps.inspect FILE`` prints a summary.

File layout (``LAYOUT_VERSION = 1``)::

    /                                 root attributes:
    |   format          "hpcps-checkpoint"
    |   layout_version  1
    |   hpcps_version   version of hpcps that wrote the file
    |   step            global step (mini-batches applied)
    |   created         UTC time of the save, ISO 8601
    |   layer_sizes     int64 array [n_0, n_1, ..., n_L], e.g. [784, 512, 512, 10]
    |   description     one sentence saying what the file is and where it is explained
    |   config_json     the config as JSON (what load() uses: types survive)
    |   dataset_json    the dataset identity as JSON (what load() uses)
    |   metrics_json    the metrics as JSON (what load() uses)
    |   meta_sha256     SHA-256 of everything except the array data (see below)
    |
    +-- params/                       attr description
    |   +-- layer0/
    |   |   +-- W      float32 (n_0, n_1)   attr description: y = act(x @ W + b)
    |   |   +-- b      float32 (n_1,)       attr description
    |   +-- layer1/ ... layer{L-1}/
    +-- optimizer/                    attrs name ("sgd", "adagrad", ...), description
    |   +-- accum/layer0/W ...        one dataset per opt_state key, attr description
    +-- config/                       one attr per config key, nested keys joined with "."
    |                                 (lists as arrays, None as the string "none")
    +-- dataset/                      one attr per dataset identity key (name, fingerprint,
    |                                 n_train, n_test, n_features, n_classes)
    +-- metrics/                      one attr per metric (train_loss, test_accuracy, ...)

Integrity. Every dataset is chunked with the Fletcher-32 filter, so a flipped byte in the array
data fails the read; no compression (gzip is ~50x slower than raw writes on incompressible
weights). The file uses the HDF5 1.10 format (``libver=("v110", "latest")``), whose superblock,
object headers and indexes carry checksums of their own. Every string attribute is a
fixed-length UTF-8 string, so it sits in a checksummed object header: variable-length strings
live in HDF5's global heap, which has no checksum, and one flipped byte there made the HDF5
library loop forever on open. (h5py hands fixed-length strings back as ``bytes``:
``f.attrs["format"].decode()``; ``json.loads`` takes the bytes as they are.) On top of that,
``meta_sha256`` is a SHA-256 over the format, layout version, step, optimizer name, the names,
shapes and dtypes of all datasets and the three JSON strings; load() recomputes it, so an edited
or damaged value that still parses is refused. Flipping any single byte of a checkpoint makes
load() raise or return exactly the saved state (tests/test_checkpoint.py sweeps the file). The
per-key attributes of ``/config``, ``/dataset`` and ``/metrics`` are for people and for tools
that read the file with h5py; load() reads the JSON copies.

Atomicity. save() writes ``<name>.tmp-<pid>`` in the target's directory, flushes and fsyncs it,
closes it, renames it onto the target with ``os.replace`` and fsyncs the directory. A crash or
``kill -9`` during the write leaves the previous checkpoint untouched; the stale temporary file
is harmless (load() of it fails cleanly), and the next save by a process with the same pid
replaces it. Temporary files of other pids are left alone: they may belong to a live writer.

Every problem with a file or with the state handed to save() raises
:class:`hpcps.errors.CheckpointError` with the path and the reason.

This module is the file: writing, reading, finding the newest. What a checkpoint holds and the
checks on it (architecture, optimizer state, finiteness, fit to a resuming run) are
:mod:`hpcps.io.checkpoint_state`, whose names this module also exports.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcps import __version__
from hpcps.errors import CheckpointError
from hpcps.io.checkpoint_state import (PARAM_NAME, Checkpoint, architecture_sizes,
                                       check_compatible, check_finite, checked, conv_model,
                                       layer_sizes, nonfinite)
from hpcps.io.hdf5_writes import replace_whole

# The record and its checks are checkpoint_state's; importers keep naming them from here.
__all__ = ["DESCRIPTION", "FORMAT", "LAYOUT_VERSION", "PARAM_NAME", "PERSISTED", "Checkpoint",
           "architecture_sizes", "check_compatible", "check_finite", "conv_model", "flatten_keys",
           "latest", "layer_sizes", "load", "load_with_header", "nonfinite", "peek_step", "save"]

FORMAT = "hpcps-checkpoint"
LAYOUT_VERSION = 1
PERSISTED = "persisted"  # the group of a persistence manifest (its chunk steps)

DESCRIPTION = (
    "hpcps training checkpoint: the network's weights under /params, optimizer state under "
    "/optimizer, the run's config, dataset identity and metrics; the layout is explained in the "
    "hpcps docs (docs/formats.md, section 'Checkpoints') and in the docstring of "
    "hpcps/io/checkpoint.py, and "
    "'python -m hpcps.inspect FILE' prints a summary."
)

# What a known optimizer-state kind means, for the description attribute of its datasets.
_OPT_KINDS = {
    "accum": "Adagrad accumulator (running sum of squared gradients)",
    "momentum": "momentum buffer (velocity)",
    "velocity": "momentum buffer (velocity)",
}


# ---------------------------------------------------------------------------------------------
# writing


def _meta_digest(step: int, optimizer: str, arrays: dict[str, tuple[tuple[int, ...], str]],
                 config_json: str, dataset_json: str, metrics_json: str) -> str:
    """SHA-256 over all content except array data; ``arrays`` maps HDF5 path to (shape, dtype)."""
    canonical = json.dumps(
        {
            "format": FORMAT,
            "layout_version": LAYOUT_VERSION,
            "step": int(step),
            "optimizer": optimizer,
            "arrays": {k: [list(s), d] for k, (s, d) in sorted(arrays.items())},
            "config_json": config_json,
            "dataset_json": dataset_json,
            "metrics_json": metrics_json,
        },
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _fixed_str(value: str | list[str]) -> np.ndarray:
    """A fixed-length UTF-8 string (or array of them) for an attribute.

    Variable-length strings would live in HDF5's unchecksummed global heap, where a flipped byte
    in an object's length made HDF5 loop forever on open; fixed-length strings sit inside the
    checksummed object headers. h5py returns them as bytes; ``.decode()`` gives the text.
    """
    encoded: bytes | list[bytes]
    if isinstance(value, list):
        encoded = [v.encode("utf-8") for v in value]
        longest = max((len(e) for e in encoded), default=1)
    else:
        encoded = value.encode("utf-8")
        longest = len(encoded)
    return np.array(encoded, dtype=h5py.string_dtype("utf-8", max(1, longest)))


def _human_attr(value: Any) -> Any:
    """A value as an HDF5 attribute a person can read: lists as arrays, None as "none"."""
    if value is None:
        return _fixed_str("none")
    if isinstance(value, str):
        return _fixed_str(value)
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return _fixed_str(value)
        if all(isinstance(v, bool) for v in value):
            return np.array(value, dtype=bool)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return np.array(value)
    return _fixed_str(json.dumps(value))  # empty or mixed lists: the JSON text says it best


def flatten_keys(d: dict, prefix: str = "") -> dict[str, Any]:
    """``d`` as one level, nested keys joined with ``"."``: the attribute names of ``/config``,
    ``/dataset`` and ``/metrics`` (an empty dict stays a value, so it is not lost)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _write_attrs(group: h5py.Group, d: dict) -> None:
    for k, v in flatten_keys(d).items():
        group.attrs[k or "(empty key)"] = _human_attr(v)  # HDF5 refuses an empty attribute name


def _opt_description(optimizer: str, key: str, params: dict) -> str:
    kind, _, rest = key.partition("/")
    text = f"{optimizer} optimizer state {key!r}"
    if kind in _OPT_KINDS:
        text += f": {_OPT_KINDS[kind]}"
    if rest in params:
        text += f" for /params/{rest} (same shape)"
    return text


def _write_conv_params(g: h5py.Group, model, params: dict, put) -> None:
    """/params of a conv model: its spec and layers in the group's attributes, kernels
    (out, in, kh, kw) as in ONNX and PyTorch (docs/conv.md)."""
    g.attrs["description"] = _fixed_str(
        f"the parameters of the network {model.spec_text!r} on {model.input_shape} images "
        "(C, H, W); layers with parameters are numbered layer0, layer1, ...: conv kernels W "
        "are (out_maps, in_maps, kh, kw) as in ONNX and PyTorch, fc weights W (fan_in, "
        "fan_out) with y = act(x @ W + b) on the maps flattened in C, H, W order")
    g.attrs["model_spec"] = _fixed_str(model.spec_text)
    g.attrs["architecture"] = _fixed_str(model.describe())
    for op in model.ops:
        if op.param < 0:
            continue
        W, b = params[f"layer{op.param}/W"], params[f"layer{op.param}/b"]
        if op.spec.kind == "conv":
            what = (f"{op.spec.text}: kernels (out_maps, in_maps, kh, kw) = {W.shape}, "
                    "cross-correlation as in torch.nn.functional.conv2d")
        else:
            what = f"{op.spec.text}: weights (fan_in, fan_out) = {W.shape}: y = act(x @ W + b)"
        put(f"params/layer{op.param}/W", W, what)
        put(f"params/layer{op.param}/b", b, f"{op.spec.text}: biases, one per output "
            f"{'map' if op.spec.kind == 'conv' else 'unit'}, shape {b.shape}")


def _virtual(f: h5py.File, name: str, shape, dtype, pieces) -> h5py.Dataset:
    """A virtual dataset ``name`` of ``shape`` assembled from ``pieces``: ``[(file, dataset,
    its length, [(index, start, count)])]``, each mapping ``source[start:start + count]`` of a
    1-D source dataset onto the hyperslab ``index``."""
    layout = h5py.VirtualLayout(shape=tuple(shape), dtype=dtype)
    for file, dset, length, maps in pieces:
        src = h5py.VirtualSource(file, dset, shape=(length,))
        for index, start, count in maps:
            layout[index] = src[start:start + count]
    fill = np.nan if np.dtype(dtype).kind == "f" else -1
    return f.create_virtual_dataset(name, layout, fillvalue=fill)


def _write(path: Path, ckpt: Checkpoint, virtual: dict | None = None) -> None:
    """Write ``ckpt`` to ``path`` (not atomically), flush and fsync it. save() wraps this.

    ``virtual``: write a persistence manifest instead (:mod:`hpcps.ps.persist`): every
    dataset is virtual, ``virtual[name]`` says from which pieces of which shard files, and
    the arrays of ``ckpt`` only give the shapes."""
    sizes, config, dataset, metrics = checked(ckpt)
    config_json = json.dumps(config)
    dataset_json = json.dumps(dataset)
    metrics_json = json.dumps(metrics)
    arrays = {f"params/{k}": (v.shape, v.dtype.str) for k, v in ckpt.params.items()}
    arrays.update({f"optimizer/{k}": (v.shape, v.dtype.str) for k, v in ckpt.opt_state.items()})
    digest = _meta_digest(int(ckpt.step), ckpt.optimizer, arrays, config_json, dataset_json,
                          metrics_json)

    with h5py.File(path, "w", libver=("v110", "latest"), track_order=True) as f:
        a = f.attrs
        a["format"] = _fixed_str(FORMAT)
        a["layout_version"] = LAYOUT_VERSION
        a["hpcps_version"] = _fixed_str(__version__)
        a["step"] = np.int64(ckpt.step)
        now = datetime.datetime.now(datetime.timezone.utc)
        a["created"] = _fixed_str(now.isoformat(timespec="seconds"))
        a["layer_sizes"] = np.array(sizes, dtype=np.int64)
        a["description"] = _fixed_str(DESCRIPTION)
        a["config_json"] = _fixed_str(config_json)
        a["dataset_json"] = _fixed_str(dataset_json)
        a["metrics_json"] = _fixed_str(metrics_json)
        a["meta_sha256"] = _fixed_str(digest)

        def put(name: str, data: np.ndarray, description: str) -> None:
            if virtual is None:
                dset = f.create_dataset(name, data=data, chunks=True, fletcher32=True)
            else:
                dset = _virtual(f, name, data.shape, data.dtype, virtual[name])
            dset.attrs["description"] = _fixed_str(description)

        if virtual is not None:
            g = f.create_group(PERSISTED)
            g.attrs["description"] = _fixed_str(
                "this checkpoint is a manifest: its datasets are virtual, read from the server "
                "shards' own files (hpcps/ps/persist.py, docs/fault-tolerance.md); its step "
                "is the smallest of chunk_step, the step at which each chunk was last written")
            _virtual(f, f"{PERSISTED}/chunk_step", virtual[f"{PERSISTED}/chunk_step"][0],
                     np.int64, virtual[f"{PERSISTED}/chunk_step"][1])

        g = f.create_group("params")
        conv = conv_model(config, dataset)
        if conv is not None:
            _write_conv_params(g, conv, ckpt.params, put)
        else:
            g.attrs["description"] = _fixed_str(
                f"the network's parameters, {len(sizes) - 1} fully connected layers of sizes "
                f"{' -> '.join(map(str, sizes))}; layer i computes y = act(x @ W + b)"
            )
        for i in range(len(sizes) - 1 if conv is None else 0):
            W, b = ckpt.params[f"layer{i}/W"], ckpt.params[f"layer{i}/b"]
            put(f"params/layer{i}/W", W,
                f"weights of layer {i}, shape (fan_in, fan_out) = {W.shape}: y = act(x @ W + b)")
            put(f"params/layer{i}/b", b,
                f"biases of layer {i}, shape (fan_out,) = {b.shape}: y = act(x @ W + b)")

        g = f.create_group("optimizer")
        g.attrs["name"] = _fixed_str(ckpt.optimizer)
        g.attrs["description"] = _fixed_str(
            f"state of the {ckpt.optimizer} optimizer, one dataset per key"
            + ("" if ckpt.opt_state else " (none: this optimizer keeps no state)")
        )
        for key, value in ckpt.opt_state.items():
            put(f"optimizer/{key}", value, _opt_description(ckpt.optimizer, key, ckpt.params))

        _write_attrs(f.create_group("config", track_order=True), config)
        _write_attrs(f.create_group("dataset", track_order=True), dataset)
        _write_attrs(f.create_group("metrics", track_order=True), metrics)

        f.flush()
        fd = f.id.get_vfd_handle()  # the sec2 driver's file descriptor
        os.fsync(fd if isinstance(fd, int) else int(fd))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # cannot open directories (not POSIX): the rename is done, durability best effort
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory (EINVAL); the rename still happened
    finally:
        os.close(fd)


def save(path: str | os.PathLike, ckpt: Checkpoint, virtual: dict | None = None) -> Path:
    """Write ``ckpt`` to ``path`` atomically and return the path.

    The state is checked first (nothing is written for bad input). The file is written as
    ``<name>.tmp-<pid>`` in the same directory, flushed, fsynced and closed, then renamed onto
    ``path`` and the directory fsynced: a reader sees the old file or the new one, never a
    partial one, also if this process is killed during the write.

    Parameters
    ----------
    path : str or PathLike
        Target file, conventionally ``*.h5``. Its directory must exist.
    ckpt : Checkpoint
        The full state; see :class:`Checkpoint` for the rules it must follow.

    Raises
    ------
    CheckpointError
        If the state breaks the rules, or the file cannot be written (the reason is given).
    """
    path = Path(path)
    checked(ckpt)  # refuse bad input before touching the file system
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")

    def write(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)  # a stale temp of a crashed save by a process with our pid
        _write(tmp, ckpt, virtual)

    why = replace_whole(tmp, path, write)
    if why is not None:
        kept = (" (the checkpoint there before is unchanged: make room, then --resume auto "
                "continues from it)") if path.exists() else ""
        raise CheckpointError(f"cannot write checkpoint {path}: {why}{kept}")
    _fsync_dir(path.parent)
    return path


# ---------------------------------------------------------------------------------------------
# reading


def _attr_str(attrs: h5py.AttributeManager, name: str) -> str:
    value = attrs[name]
    if isinstance(value, (bytes, np.bytes_)):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise ValueError(f"attribute {name!r} is {type(value).__name__}, expected a string")
    return value


def _datasets(group: h5py.Group) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    group.visititems(visit)
    return found


def load_with_header(path: str | os.PathLike) -> tuple[Checkpoint, dict[str, Any]]:
    """Read a checkpoint fully, as :func:`load` does, and the facts about the file itself.

    Returns
    -------
    ckpt : Checkpoint
        What :func:`load` returns.
    header : dict
        ``format``, ``layout_version``, ``hpcps_version`` and ``created`` (None when the file
        lacks them) and ``file_size`` in bytes: what ``python -m hpcps.inspect`` shows besides
        the state itself.

    Raises
    ------
    CheckpointError
        As :func:`load`.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file"
                              + _files_in_run_dir(path))

    def missing(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} lacks {what}: not a complete hpcps checkpoint")

    try:
        with h5py.File(path, "r") as f:
            a = f.attrs
            if "format" not in a:
                raise CheckpointError(
                    f"{path} is an HDF5 file but not an hpcps checkpoint (no root attribute "
                    "'format')"
                )
            fmt = _attr_str(a, "format")
            if fmt != FORMAT:
                raise CheckpointError(
                    f"{path} is not an hpcps checkpoint: format is {fmt!r}, expected "
                    f"{FORMAT!r}"
                )
            if "layout_version" not in a:
                raise missing("the root attribute 'layout_version'")
            version = a["layout_version"]
            if not isinstance(version, (int, np.integer)) or int(version) != LAYOUT_VERSION:
                shown = int(version) if isinstance(version, (int, np.integer)) else repr(version)
                raise CheckpointError(
                    f"checkpoint {path} has layout_version {shown}; this hpcps ({__version__}) "
                    f"reads layout_version {LAYOUT_VERSION} only"
                )
            for name in ("step", "layer_sizes", "config_json", "dataset_json", "metrics_json",
                         "meta_sha256"):
                if name not in a:
                    raise missing(f"the root attribute {name!r}")
            for name in ("params", "optimizer", "config", "dataset", "metrics"):
                if name not in f:
                    raise missing(f"the group /{name}")
            if "name" not in f["optimizer"].attrs:
                raise missing("the attribute 'name' of /optimizer")

            sizes = [int(n) for n in np.asarray(a["layer_sizes"]).ravel()]
            for i in range(len(sizes) - 1):
                for part in ("W", "b"):
                    name = f"layer{i}/{part}"
                    if name not in f["params"]:
                        raise missing(f"the dataset /params/{name}")
            if PERSISTED in f:
                _check_sources(f, path)
            params = {k: d[()] for k, d in _datasets(f["params"]).items()}
            opt_state = {k: d[()] for k, d in _datasets(f["optimizer"]).items()}
            step = a["step"]
            persisted = _persisted_step(f) if PERSISTED in f else None
            optimizer = _attr_str(f["optimizer"].attrs, "name")
            config_json = _attr_str(a, "config_json")
            dataset_json = _attr_str(a, "dataset_json")
            metrics_json = _attr_str(a, "metrics_json")
            stored_digest = _attr_str(a, "meta_sha256")
            header = {
                "format": fmt,
                "layout_version": int(version),
                "hpcps_version": _attr_str(a, "hpcps_version") if "hpcps_version" in a else None,
                "created": _attr_str(a, "created") if "created" in a else None,
                "file_size": path.stat().st_size,
            }
    except CheckpointError:
        raise
    except Exception as exc:  # h5py raises OSError, KeyError, ValueError, ... for damaged files
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {type(exc).__name__}: {exc}"
        ) from exc

    arrays = {f"params/{k}": (v.shape, v.dtype.str) for k, v in params.items()}
    arrays.update({f"optimizer/{k}": (v.shape, v.dtype.str) for k, v in opt_state.items()})
    if not isinstance(step, (int, np.integer)):
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): step is "
            f"{step!r}"
        )
    digest = _meta_digest(int(step), optimizer, arrays, config_json, dataset_json, metrics_json)
    if digest != stored_digest:
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): its metadata does not match "
            f"meta_sha256 (names, shapes, step or JSON attributes were altered)"
        )
    try:
        config, dataset, metrics = (json.loads(s)
                                    for s in (config_json, dataset_json, metrics_json))
    except ValueError as exc:
        raise CheckpointError(
            f"checkpoint {path} is unreadable (truncated or corrupt): {exc}"
        ) from exc
    if persisted is not None:  # a manifest: the step its shard files hold
        step = persisted
    ckpt = Checkpoint(params=params, optimizer=optimizer, opt_state=opt_state, step=int(step),
                      config=config, dataset=dataset, metrics=metrics, path=path)
    try:
        found = checked(ckpt)[0]
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path} is inconsistent: {exc}") from exc
    if found != sizes:
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: layer_sizes says {sizes} but /params holds {found}"
        )
    return ckpt, header


def _check_sources(f: h5py.File, path: Path) -> None:
    """A manifest's shard files must all be there: a missing one would read as fill values."""
    for name in [f"{PERSISTED}/chunk_step"] + [f"params/{k}" for k in _datasets(f["params"])]:
        for source in f[name].virtual_sources():
            where = Path(source.file_name)
            where = where if where.is_absolute() else path.parent / where
            if not where.is_file():
                raise CheckpointError(f"checkpoint {path} is a persistence manifest, and the "
                                      f"server shard file {where} it reads is missing")


def _persisted_step(f: h5py.File) -> int:
    steps = np.asarray(f[f"{PERSISTED}/chunk_step"][()])
    if len(steps) == 0 or steps.min() < 0:
        raise CheckpointError(f"checkpoint {f.filename}: a shard file lacks the steps of its "
                              "chunks")
    return int(steps.min())


def _candidates(directory: Path) -> list[Path]:
    """The files ``checkpoint*.h5`` in ``directory``, by step (highest first), then newest."""
    found = [p for p in directory.glob("checkpoint*.h5") if p.is_file()] \
        if directory.is_dir() else []
    return sorted(found, key=lambda p: (peek_step(p) or -1, p.stat().st_mtime), reverse=True)


def _files_in_run_dir(directory: Path) -> str:
    """For the message when a directory is given as a checkpoint: the checkpoints it holds
    (a run directory holds ``checkpoint.h5``), or nothing to add."""
    found = _candidates(directory)
    if not found:
        return ""
    if len(found) == 1:
        return f": it holds {found[0]}; give that file"
    return f": it holds {', '.join(map(str, found))}; give one of them"


def peek_step(path: str | os.PathLike) -> int | None:
    """The step of the checkpoint at ``path`` from its root attribute alone (no arrays read;
    for a persistence manifest, its chunks' steps), or None when there is no readable
    checkpoint there. For messages about a stopped run and for ``--resume auto``."""
    try:
        with h5py.File(path, "r") as f:
            if PERSISTED in f:
                return _persisted_step(f)
            step = f.attrs.get("step")
            return int(step) if isinstance(step, (int, np.integer)) else None
    except Exception:  # missing, not HDF5, damaged: there is no checkpoint to name
        return None


def latest(run_dir: str | os.PathLike) -> tuple[Checkpoint | None, list[str]]:
    """The newest valid checkpoint in ``run_dir``, for ``--resume auto``.

    Candidates are the files ``checkpoint*.h5`` (hpcps writes ``checkpoint.h5``; a temporary
    ``checkpoint.h5.tmp-<pid>`` left by a killed writer is not one), tried by step, highest
    first, then by modification time: the first that :func:`load` reads and whose values are
    finite (:func:`check_finite`) is returned, with one line per candidate skipped and why.
    ``(None, [])`` when there is no candidate (start fresh).

    Raises
    ------
    CheckpointError
        When there are candidates and none is valid: starting fresh would overwrite them, so
        the user decides (the message names each file and its problem).
    """
    directory = Path(run_dir)
    found = _candidates(directory)
    skipped: list[str] = []
    for path in found:
        try:
            ckpt = load(path)
            check_finite(ckpt)
            return ckpt, skipped
        except CheckpointError as exc:
            skipped.append(f"skipped {path}: {exc}")
    if skipped:
        raise CheckpointError(f"--resume auto found no valid checkpoint in {directory}: "
                              + "; ".join(skipped) + ". Move the file(s) away to start "
                              "fresh, or give --resume a checkpoint")
    return None, []


def load(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint fully into memory (the file is closed on return).

    Raises
    ------
    CheckpointError
        If the file is missing, not HDF5, truncated or corrupt (a failed checksum), not an hpcps
        checkpoint, of a layout version this hpcps does not read, or lacks a piece (named).
    """
    return load_with_header(path)[0]
