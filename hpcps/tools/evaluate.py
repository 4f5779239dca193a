"""Evaluate a trained checkpoint on a dataset: accuracy, loss, confusion matrix, predictions.

Usage::

    python -m hpcps.evaluate runs/mnist/checkpoint.h5 --data data/mnist.h5
    python -m hpcps.evaluate runs/mnist/checkpoint.h5      # the data the run was trained on
    python -m hpcps.evaluate CKPT --data data/mnist.h5 --predict predictions.csv
    python -m hpcps.evaluate CKPT --input new.csv --predict scores.npy   # unlabelled rows
    python -m hpcps.evaluate CKPT --data data/mnist.h5 --json        # the figures as JSON

One process, no MPI launcher (mpi4py is not even imported): every checkpoint holds the whole
model, whatever layout of servers, replicas and partitions wrote it, so the network is rebuilt
on one process (an :class:`hpcps.model.mlp.MLP`, or for a run with ``--model`` the
:class:`hpcps.model.convnet.ConvNet` its saved config names, on the image shape of its
dataset) and run over the split in batches. The split is read from the file in chunks of
8,192 rows (or ``--batch``, when larger), so a split larger than memory is scored in the
memory of one chunk plus, for each row, its label, predicted class and class probabilities.
The test split's accuracy and loss are what training reports for the same checkpoint (the
same rows, the same forward pass). Without
``--data``, the dataset is the one in the checkpoint's config (``data``), as the run named it.

Predictions (``--predict OUT``), one row per example of the split (or of ``--input``), in its
order:

``OUT.csv``
    A header line ``row,label,predicted,p_0,...,p_{C-1}``, then one line per example: its row
    number in the split, its true class, the predicted class (the largest output) and the
    softmax probability of each class (``%.6g``). Unlabelled rows (``--input``) have no
    ``label`` column.
``OUT.npy``
    A structured array, one element per row, fields ``row``, ``label`` (labelled rows only),
    ``predicted`` (int64) and ``probabilities`` (float32, (C,)): ``np.load(OUT)["predicted"]``.
``OUT.h5`` or ``OUT.hdf5``
    Datasets ``/label`` (labelled rows only) and ``/predicted`` (int64, (N,)) and
    ``/probabilities`` (float32, (N, C)), each with a ``description``; root attributes name the
    checkpoint, its step, the dataset and split, and the accuracy and loss.

Unlabelled rows (``--input FILE``, with ``--predict``): a CSV with a header row whose every
column is a feature (read in row batches by :mod:`hpcps.io.data.convert`'s reader), an HDF5
file with a 2-D ``/x`` (or ``/<split>/x``: a dataset file's rows, labels or not), or a
``.npy`` (rows, or images flattened C, H, W). Its width must be the model's input width.
An embedding model's rows are what its dataset's rows hold (:func:`embedding_input_blocks`):
a ``.npy`` of int ids (N, C), one column per id column of its fields (no dense features), or
an HDF5 file with ``/ids`` (N, C) and, with dense features, ``/dense`` (N, D) (or
``/<split>/ids`` and ``/<split>/dense``: a categorical dataset file's rows); ids are checked
as a dataset's are (integers, -1 or in their field's range). Each row's P(y = 1) is computed
as for ``--data`` (the same table rows and fc layers) and written as two classes, 0 and 1.

Either file is written atomically (a temporary file renamed onto OUT).

Refusals end with ``hpcps.evaluate: error: <reason>`` on stderr and the exit code of the
error's class (:mod:`hpcps.errors`): 4 for a checkpoint that is missing, corrupt, not an hpcps
checkpoint or holds NaN/infinity; 3 for a dataset that is missing or unreadable, or whose
features or classes do not fit the checkpoint's model; 2 for options (``--predict`` with an
unknown suffix or in a directory that does not exist, ``--input`` without ``--predict``;
argparse's own usage errors are 2 too).

Reading and checking the checkpoint is :mod:`hpcps.io.checkpoint`'s job and reading the dataset
:mod:`hpcps.io.data`'s; this module rebuilds the model, runs it and presents the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcps.io import checkpoint, data
from hpcps.io.data.categorical import Features, Field, check_ids
from hpcps.io.data.convert import read_unlabelled_csv
from hpcps.io.data.h5format import check_finite_rows
from hpcps.io.data.stream import EVAL_ROWS, RowSource, chunks
from hpcps.io.hdf5_writes import write_failure
from hpcps.errors import CheckpointError, ConfigError, DataError, HpcpsError
from hpcps.io import tables
from hpcps.model.convnet import ConvNet
from hpcps.model.ctr import CtrModel
from hpcps.model.metrics import binary_metrics
from hpcps.model.spec import is_embedding_spec
from hpcps.ps.embedding_store import EmbeddingStore
from hpcps.model.mlp import ACTIVATIONS, MLP

PREDICTION_SUFFIXES = (".csv", ".npy", ".h5", ".hdf5")
INPUT_SUFFIXES = (".csv", ".npy", ".h5", ".hdf5")


@dataclass
class Evaluation:
    """What evaluating a model on one split gives.

    Attributes
    ----------
    accuracy : float
        Fraction of rows whose predicted class is the label.
    loss : float
        Mean softmax cross-entropy (nats), as training's test loss.
    confusion : ndarray of int64, (C, C)
        ``confusion[i, j]`` counts rows of true class ``i`` predicted as ``j``.
    labels, predicted : ndarray of int64, (N,)
        True and predicted class of each row.
    probabilities : ndarray of float32, (N, C)
        Softmax output of each row.
    """

    accuracy: float
    loss: float
    confusion: np.ndarray
    labels: np.ndarray
    predicted: np.ndarray
    probabilities: np.ndarray

    @property
    def n(self) -> int:
        return int(len(self.labels))


def model_of(ckpt: checkpoint.Checkpoint) -> tuple[MLP | ConvNet, np.ndarray]:
    """The network a checkpoint holds and its flat parameter vector: a :class:`ConvNet` when
    the run's config names a ``model`` spec (built by :func:`checkpoint.conv_model` on the
    image shape saved with the dataset identity), else an :class:`MLP` of the saved layers.

    Raises
    ------
    CheckpointError
        If the parameters hold NaN or infinity, or the config names an unknown activation or
        a model its parameters do not fit.
    """
    where = f"checkpoint {ckpt.path}" if ckpt.path is not None else "the checkpoint"
    activation = ckpt.config.get("activation", "relu")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{where} names activation {activation!r}; this hpcps knows "
                              f"{', '.join(ACTIVATIONS)}")
    for name, a in ckpt.params.items():
        bad = int(np.count_nonzero(~np.isfinite(a)))
        if bad:
            raise CheckpointError(f"{where} holds {bad} NaN or infinite value(s) in params/"
                                  f"{name}: the run that wrote it had diverged; evaluate an "
                                  "earlier checkpoint")
    conv = checkpoint.conv_model(ckpt.config, ckpt.dataset)
    if conv is not None:
        checkpoint.architecture_sizes(ckpt.params, ckpt.config, ckpt.dataset)
        return conv, conv.flatten(ckpt.params)
    model = MLP(checkpoint.layer_sizes(ckpt.params), activation)
    return model, model.flatten(ckpt.params)


def check_fits(ckpt: checkpoint.Checkpoint, sizes: list[int], info: data.DatasetInfo) -> list[str]:
    """Refuse a dataset the model cannot take; return notes on lesser differences.

    Raises
    ------
    DataError
        If the dataset's feature count is not the model's input width, or its class count
        not the model's output width.
    """
    trained_on = ckpt.dataset.get("name", "an unnamed dataset")
    for key, want, what in (("n_features", sizes[0], "inputs"), ("n_classes", sizes[-1],
                                                                 "outputs (classes)")):
        have = getattr(info, key)
        if have != want:
            raise DataError(
                f"dataset {info.path} has {key} = {have}, but the model in checkpoint "
                f"{ckpt.path} (layers {','.join(map(str, sizes))}, trained on {trained_on}) has "
                f"{want} {what}: evaluate it on data shaped like its training set")
    notes = []
    fingerprint = ckpt.dataset.get("fingerprint")
    if fingerprint is not None and fingerprint != info.fingerprint:
        notes.append(f"the checkpoint was trained on {trained_on} (fingerprint {fingerprint}); "
                     f"this is {info.name} (fingerprint {info.fingerprint}): another dataset of "
                     "the same shape")
    return notes


def probabilities(model: MLP | ConvNet, flat: np.ndarray, x: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(logits, softmax probabilities) of rows ``x``, as :func:`evaluate` computes them."""
    logits = model.forward(flat, x)[-1]
    p = logits - logits.max(axis=1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=1, keepdims=True)
    return logits, p


def predict(model: MLP | ConvNet, flat: np.ndarray, blocks) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class int64 (N,), probabilities float32 (N, C)) of the unlabelled rows in
    ``blocks`` (an iterable of (n, D) arrays)."""
    predicted, probs = [], []
    for x in blocks:
        logits, p = probabilities(model, flat, x)
        predicted.append(np.argmax(logits, axis=1))
        probs.append(p.astype(np.float32, copy=False))
    if not predicted:
        raise DataError("the input holds no rows to score")
    return np.concatenate(predicted).astype(np.int64), np.concatenate(probs)


def evaluate(model: MLP | ConvNet, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
             batch: int = 2000) -> Evaluation:
    """Run ``model`` over ``x`` in batches of ``batch`` rows and score it against ``y``
    (:func:`evaluate_pieces` on one piece)."""
    return evaluate_pieces(model, flat, [(x, y)], batch)


PROGRESS_S = 5.0  # seconds between two lines of progress of a long evaluation


def with_progress(pieces, total: int | None):
    """``pieces`` (row blocks, or ``(x, y)`` pieces) as they come, with a line on stderr every
    :data:`PROGRESS_S` seconds: ``hpcps.evaluate: scored 409,600 of 800,000 rows (51%)``."""
    done, shown = 0, time.monotonic()
    for piece in pieces:
        yield piece
        done += len(piece[1] if isinstance(piece, tuple) else piece)
        if time.monotonic() - shown >= PROGRESS_S:
            of = f" of {total:,} rows ({100 * done / total:.0f}%)" if total else " rows"
            print(f"hpcps.evaluate: scored {done:,}{of}", file=sys.stderr, flush=True)
            shown = time.monotonic()


def evaluate_pieces(model: MLP | ConvNet, flat: np.ndarray, pieces, batch: int = 2000
                    ) -> Evaluation:
    """Score ``model`` on the rows of ``pieces`` (an iterable of ``(x, y)``: a split read in
    chunks, so only one chunk's features are in memory at a time), in batches of ``batch``.

    The predicted class is the argmax of the logits and the loss is computed as
    :meth:`MLP.evaluate` does (the probability of the true class floored at 1e-30), so
    accuracy and loss are exactly what training reports. What is kept for every row is its
    label, predicted class and C probabilities.
    """
    n_classes = model.sizes[-1]
    labels, predicted, probs = [], [], []
    total = 0.0
    for x, y in pieces:
        for lo in range(0, len(y), batch):
            yb = np.asarray(y[lo:lo + batch], dtype=np.int64)
            logits, p = probabilities(model, flat, x[lo:lo + batch])
            labels.append(yb)
            predicted.append(np.argmax(logits, axis=1).astype(np.int64))
            probs.append(p.astype(np.float32, copy=False))
            total += float(-np.sum(np.log(np.maximum(p[np.arange(len(yb)), yb], 1e-30)),
                                   dtype=np.float64))
    y_all = np.concatenate(labels) if labels else np.empty(0, np.int64)
    pred_all = np.concatenate(predicted) if predicted else np.empty(0, np.int64)
    confusion = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(confusion, (y_all, pred_all), 1)
    n = max(1, len(y_all))
    return Evaluation(accuracy=int(np.trace(confusion)) / n, loss=total / n, confusion=confusion,
                      labels=y_all, predicted=pred_all,
                      probabilities=(np.concatenate(probs) if probs else
                                     np.empty((0, n_classes), np.float32)))


# ---------------------------------------------------------------------------------------------
# predictions file


def check_predict_path(path: str | os.PathLike) -> Path:
    """Refuse (ConfigError) an output path with an unknown suffix or in a missing directory,
    before any work is done."""
    path = Path(path)
    if path.suffix.lower() not in PREDICTION_SUFFIXES:
        raise ConfigError(f"--predict {path}: the name must end in "
                          f"{', '.join(PREDICTION_SUFFIXES)} (CSV, NumPy or HDF5)")
    if not path.parent.is_dir():
        raise ConfigError(f"--predict {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"--predict {path} is a directory; name a file")
    return path


def write_predictions(path: str | os.PathLike, ev: Evaluation, about: dict[str, Any]) -> Path:
    """Write ``ev``'s predictions as CSV, NumPy or HDF5 (by ``path``'s suffix), atomically.

    ``about`` (checkpoint, step, dataset, split, ...) goes into the HDF5 file's root
    attributes; the CSV and NumPy files hold the rows only.
    """
    return write_rows(path, ev.predicted, ev.probabilities, ev.labels, about)


def write_rows(path: str | os.PathLike, predicted: np.ndarray, probs: np.ndarray,
               labels: np.ndarray | None, about: dict[str, Any]) -> Path:
    """Write per-row predictions (with ``labels`` when known) by ``path``'s suffix, atomically
    (the formats are in the module docstring)."""
    path = check_predict_path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            _write_csv(tmp, predicted, probs, labels)
        elif suffix == ".npy":
            _write_npy(tmp, predicted, probs, labels)
        else:
            _write_h5(tmp, predicted, probs, labels, about)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        why = write_failure(exc)
        if why is None and isinstance(exc, RuntimeError):
            raise
        raise ConfigError(f"cannot write predictions to {path}: {why or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_csv(path: Path, predicted: np.ndarray, probs: np.ndarray,
               labels: np.ndarray | None) -> None:
    n_classes = probs.shape[1]
    header = "row," + ("label," if labels is not None else "") + "predicted," + \
        ",".join(f"p_{c}" for c in range(n_classes))
    with open(path, "w", newline="") as f:
        f.write(header + "\n")
        for i in range(len(predicted)):
            ps = ",".join(f"{p:.6g}" for p in probs[i])
            label = f"{labels[i]}," if labels is not None else ""
            f.write(f"{i},{label}{predicted[i]},{ps}\n")
        f.flush()
        os.fsync(f.fileno())


def _write_npy(path: Path, predicted: np.ndarray, probs: np.ndarray,
               labels: np.ndarray | None) -> None:
    fields: list[tuple] = [("row", np.int64)]
    if labels is not None:
        fields.append(("label", np.int64))
    fields += [("predicted", np.int64), ("probabilities", np.float32, (probs.shape[1],))]
    rows = np.zeros(len(predicted), dtype=fields)
    rows["row"] = np.arange(len(predicted))
    if labels is not None:
        rows["label"] = labels
    rows["predicted"] = predicted
    rows["probabilities"] = probs
    with open(path, "wb") as f:
        np.save(f, rows)
        f.flush()
        os.fsync(f.fileno())


def _write_h5(path: Path, predicted: np.ndarray, probs: np.ndarray, labels: np.ndarray | None,
              about: dict[str, Any]) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["description"] = ("hpcps predictions: one row per example of the split, in its "
                                  "order; written by python -m hpcps.evaluate")
        for key, value in about.items():
            f.attrs[key] = value
        for name, values, text in (
                ("label", labels, "true class of each row"),
                ("predicted", predicted, "predicted class (largest output) of each row"),
                ("probabilities", probs,
                 "softmax probability of each class (columns) for each row")):
            if values is not None:
                f.create_dataset(name, data=values).attrs["description"] = text
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


# ---------------------------------------------------------------------------------------------
# presenting


def format_confusion(confusion: np.ndarray) -> list[str]:
    """The confusion matrix as text: rows true classes, columns predicted ones, with each
    true class's recall (correct / rows of that class) at the end of its row."""
    n = len(confusion)
    width = max(len(str(int(confusion.max(initial=0)))), len(str(n - 1)), 3)
    head = "true\\pred " + " ".join(f"{c:>{width}}" for c in range(n)) + "  recall"
    lines = [head]
    for i, row in enumerate(confusion):
        total = int(row.sum())
        recall = f"{100 * row[i] / total:6.2f}%" if total else "     -"
        lines.append(f"{i:>9} " + " ".join(f"{int(v):>{width}}" for v in row) + f"  {recall}")
    return lines


def describe(ev: Evaluation, facts: dict[str, Any]) -> str:
    """The human-readable report of :func:`main`."""
    correct = int(np.trace(ev.confusion))
    lines = [
        f"checkpoint  {facts['checkpoint']} (step {facts['step']}, {model_words(facts)}, "
        f"{facts['activation']}; trained on {facts['trained_on']})",
        f"dataset     {facts['dataset']} ({facts['dataset_name']}), {facts['split']} split: "
        f"{ev.n} examples",
        f"accuracy    {100 * ev.accuracy:.2f}% ({correct} of {ev.n})",
        f"loss        {ev.loss:.4f} (mean cross-entropy, nats)",
        "confusion matrix (rows: true class, columns: predicted class)",
        *("  " + line for line in format_confusion(ev.confusion)),
    ]
    return "\n".join(lines)


def model_words(facts: dict[str, Any]) -> str:
    """"layers 64 -> 32 -> 10", or a conv model's spec and image shape."""
    if facts.get("model") and not facts.get("image_shape"):
        return f"model {facts['model']}"  # an embedding model
    if facts.get("model"):
        return f"model {facts['model']} on {'x'.join(map(str, facts['image_shape']))} images"
    return f"layers {' -> '.join(map(str, facts['layer_sizes']))}"


def data_path(args: argparse.Namespace, ckpt: checkpoint.Checkpoint) -> str:
    """``--data``, else the dataset the run was trained on (its config's ``data``)."""
    if args.data is not None:
        return args.data
    saved = ckpt.config.get("data") if isinstance(ckpt.config, dict) else None
    if not isinstance(saved, str) or not saved:
        raise ConfigError(f"checkpoint {args.checkpoint} does not say which dataset it was "
                          "trained on: give --data PATH")
    if not Path(saved).is_file():
        raise DataError(f"no --data given, and the dataset checkpoint {args.checkpoint} was "
                        f"trained on, {saved} (its config's data), is not found from "
                        f"{os.getcwd()}: give --data PATH")
    return saved


def held_out(ckpt: checkpoint.Checkpoint, n_train: int) -> np.ndarray | None:
    """The rows of /train the run held out for validation (``--validation-fraction`` with its
    ``--seed``, the same choice training made), or None when it held none out."""
    cfg = ckpt.config if isinstance(ckpt.config, dict) else {}
    fraction = float(cfg.get("validation_fraction") or 0.0)
    if fraction <= 0:
        return None
    return data.holdout_rows(n_train, fraction, int(cfg.get("seed") or 0))


def split_source(path: str, split: str, ckpt: checkpoint.Checkpoint, n_train: int,
                 width: int, layout=None, file_has_val: bool = False,
                 sizes: dict | None = None) -> tuple[RowSource, str]:
    """The rows ``--split`` names and how to say which: the file's split, or, for ``val``
    where the file has no /val, the rows the run held out of /train. ``sizes``: rows per
    split of a categorical file (its info has them); a dense file's are read."""
    if split == "val" and not file_has_val:
        held = held_out(ckpt, n_train)
        if held is None:
            how = (" (write one with python -m hpcps.data convert --validation-fraction F)"
                   if layout is None else "")
            raise DataError(f"{path} has no validation split /val and the run held no rows "
                            "out of /train (--validation-fraction 0): nothing to score as "
                            f"val{how}")
        frac = ckpt.config.get("validation_fraction")
        return (RowSource(path, "train", width, rows=held, layout=layout),
                f"val ({len(held)} rows held out of /train by --validation-fraction {frac:g})")
    n = data.split_rows(path, split) if sizes is None else sizes[split]
    return RowSource(path, split, width, 0, n, layout=layout), split


def input_blocks(path: str | os.PathLike, split: str, n_features: int, batch: int):
    """The rows of an unlabelled file (``--input``) in blocks of ``batch``, checked: the
    model's input width, finite. Formats in the module docstring."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        raise DataError(f"--input {path}: the name must end in {', '.join(INPUT_SUFFIXES)}")
    if not path.is_file():
        raise DataError(f"--input {path} not found")
    if suffix == ".csv":
        for x in read_unlabelled_csv(path, chunk_rows=batch):
            if x.shape[1] != n_features:
                raise DataError(f"--input {path} has {x.shape[1]} columns; the model takes "
                                f"{n_features} features (every column is one; no label)")
            yield x
        return
    if suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read --input {path} as a NumPy array: {exc}") from exc
        rows, name = arr.reshape(len(arr), -1) if arr.ndim > 1 else arr, "the array"
        yield from _checked_blocks(rows, path, name, n_features, batch)
        return
    try:
        with h5py.File(path, "r") as f:
            name = "/x" if "x" in f else f"/{split}/x"
            if not isinstance(f.get(name), h5py.Dataset):
                raise DataError(f"--input {path} has neither /x nor /{split}/x: an unlabelled "
                                "file holds its rows in /x (N, D)")
            yield from _checked_blocks(f[name], path, name, n_features, batch)
    except OSError as exc:
        raise DataError(f"cannot read --input {path}: {exc}") from exc


def _checked_blocks(rows, path: Path, name: str, n_features: int, batch: int):
    if rows.ndim != 2 or rows.shape[1] != n_features or rows.dtype.kind not in "biuf":
        raise DataError(f"--input {path}: {name} has shape {rows.shape} and dtype {rows.dtype}; "
                        f"the model takes rows of {n_features} numbers")
    for lo in range(0, rows.shape[0], batch):
        with np.errstate(over="ignore"):
            x = np.ascontiguousarray(rows[lo:lo + batch], dtype=np.float32)
        check_finite_rows(x, path, None, lo, rows.dtype, name)
        yield x


def embedding_input_blocks(path: str | os.PathLike, split: str, model: CtrModel, fields,
                           batch: int):
    """The rows of an unlabelled file for an embedding model (``--input``), as
    :class:`Features` of ``batch`` rows, checked as a dataset's rows are: a ``.npy`` of int
    ids (N, C) (a model without dense features), or an HDF5 file with ``/ids`` (N, C) and,
    for a model with dense features, ``/dense`` (N, D) (or ``/<split>/ids``, ``/dense``: a
    categorical dataset file's rows)."""
    path = Path(path)
    suffix, cols = path.suffix.lower(), sum(f.width for f in fields)
    dense_too = f" and /dense (N, {model.n_dense})" if model.n_dense else ""
    if suffix not in (".npy", ".h5", ".hdf5"):
        raise DataError(f"--input {path}: an embedding model takes int64 ids, one column per "
                        f"id column of its fields: give a .npy of ids (N, {cols}) or an HDF5 "
                        f"file with /ids (N, {cols}){dense_too}, laid out like its dataset")
    if not path.is_file():
        raise DataError(f"--input {path} not found")
    if suffix == ".npy":
        if model.n_dense:
            raise DataError(f"--input {path}: the model also takes {model.n_dense} dense "
                            f"features, which a .npy of ids cannot hold: give an HDF5 file "
                            f"with /ids (N, {cols}){dense_too}")
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read --input {path} as a NumPy array: {exc}") from exc
        yield from _checked_features(path, fields, cols, batch, ids, "the array")
        return
    try:
        with h5py.File(path, "r") as f:
            group = "/" if "ids" in f else f"/{split}/"
            ids, dense = f.get(group + "ids"), f.get(group + "dense")
            if not isinstance(ids, h5py.Dataset):
                raise DataError(f"--input {path} has neither /ids nor /{split}/ids: an "
                                f"embedding model's rows are ids (N, {cols}){dense_too}")
            if (dense is None) != (model.n_dense == 0):
                raise DataError(f"--input {path}: the model takes {model.n_dense} dense "
                                f"features, but {path} " + ("holds none" if dense is None else
                                                            f"holds {group}dense"))
            yield from _checked_features(path, fields, cols, batch, ids, group + "ids", dense)
    except OSError as exc:
        raise DataError(f"cannot read --input {path}: {exc}") from exc


def _checked_features(path: Path, fields, cols: int, batch: int, ids, name: str, dense=None):
    if ids.ndim != 2 or ids.shape[1] != cols:
        raise DataError(f"--input {path}: {name} has shape {ids.shape}; the model takes ids "
                        f"(N, {cols}): its fields' widths {[f.width for f in fields]}")
    if dense is not None and not (isinstance(dense, h5py.Dataset) and dense.ndim == 2 and
                                  dense.shape[0] == ids.shape[0] and dense.dtype.kind in "biuf"):
        have = (f"has shape {dense.shape} and dtype {dense.dtype}"
                if isinstance(dense, h5py.Dataset) else "is not a dataset")
        raise DataError(f"--input {path}: {dense.name} {have}; expected numbers "
                        f"({ids.shape[0]}, D), a row per id row")
    for lo in range(0, ids.shape[0], batch):
        block = np.asarray(ids[lo:lo + batch])
        check_ids(block, fields, path, "", lo, where=f"--input {path}: {name}")
        x = None
        if dense is not None:
            with np.errstate(over="ignore"):
                x = np.ascontiguousarray(dense[lo:lo + batch], dtype=np.float32)
            check_finite_rows(x, path, None, lo, dense.dtype, dense.name)
        yield Features(block.astype(np.int64), x)


def score_embedding_input(args: argparse.Namespace, ckpt: checkpoint.Checkpoint
                          ) -> tuple[dict[str, Any], list[str]]:
    """``--input FILE --predict OUT`` for an embedding model: each row's P(y = 1), computed
    as :func:`run_embedding` computes a split's (the fields are the checkpoint's)."""
    try:
        fields = tuple(Field(str(n), int(w), int(v)) for n, w, v in ckpt.dataset["fields"])
        n_dense = int(ckpt.dataset.get("n_dense", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{args.checkpoint}: its dataset record names no categorical "
                              f"fields ({exc!r}); it was not written by an embedding run"
                              ) from None
    model, flat = embedding_net(args.checkpoint, ckpt, fields, n_dense, "its fields")
    stores, _ = table_stores(args.checkpoint, ckpt, model)
    z = embedding_logits(model, flat, stores, with_progress(embedding_input_blocks(
        args.input, args.split, model, fields, args.batch), None), args.batch)
    if not len(z):
        raise DataError("the input holds no rows to score")
    predicted, probs = click_rows(z)
    facts = {"checkpoint": str(args.checkpoint), "step": ckpt.step, "model": model.spec_text,
             "input": str(args.input), "n": len(z),
             "predicted_counts": np.bincount(predicted, minlength=2).tolist()}
    write_rows(args.predict, predicted, probs, None,
               {"checkpoint": facts["checkpoint"], "step": ckpt.step, "input": str(args.input)})
    return facts, [f"wrote predictions for {len(z)} rows to {args.predict}"]


def model_facts(args: argparse.Namespace, ckpt: checkpoint.Checkpoint, model) -> dict[str, Any]:
    facts = {
        "checkpoint": str(args.checkpoint), "step": ckpt.step, "layer_sizes": list(model.sizes),
        "activation": model.activation,
        "trained_on": ckpt.dataset.get("name", "an unnamed dataset"),
    }
    if isinstance(model, ConvNet):
        facts.update(model=model.spec_text, image_shape=list(model.input_shape))
    return facts


def score_input(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """``--input FILE --predict OUT``: predictions of unlabelled rows; (facts, notes)."""
    ckpt = checkpoint.load(args.checkpoint)
    if is_embedding_spec(ckpt.config.get("model")):
        return score_embedding_input(args, ckpt)
    model, flat = model_of(ckpt)
    predicted, probs = predict(model, flat, with_progress(
        input_blocks(args.input, args.split, model.sizes[0], args.batch), None))
    facts = model_facts(args, ckpt, model)
    facts.update(input=str(args.input), n=int(len(predicted)),
                 predicted_counts=np.bincount(predicted, minlength=probs.shape[1]).tolist())
    about = {"checkpoint": facts["checkpoint"], "step": ckpt.step, "input": str(args.input)}
    write_rows(args.predict, predicted, probs, None, about)
    return facts, [f"wrote predictions for {len(predicted)} rows to {args.predict}"]


def run(args: argparse.Namespace) -> tuple[Evaluation, dict[str, Any], list[str]]:
    """Load, check, evaluate and (with ``--predict``) write; return the evaluation, the facts
    printed with it and notes for stderr."""
    if args.predict is not None:
        check_predict_path(args.predict)  # refuse before the work, not after it
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    ckpt = checkpoint.load(args.checkpoint)
    model, flat = model_of(ckpt)
    path = data_path(args, ckpt)
    info = data.open_dataset(path)
    notes = check_fits(ckpt, list(model.sizes), info)
    source, which = split_source(path, args.split, ckpt, info.n_train, info.n_features,
                                 file_has_val=bool(data.val_rows(path)))
    ev = evaluate_pieces(model, flat, with_progress(chunks(source, max(args.batch, EVAL_ROWS)),
                                                    len(source)), args.batch)
    facts = model_facts(args, ckpt, model)
    facts.update(dataset=str(path), dataset_name=info.name, split=which)
    if args.predict is not None:
        about = {k: facts[k] for k in ("checkpoint", "step", "dataset", "split")}
        about.update(accuracy=ev.accuracy, loss=ev.loss)
        write_predictions(args.predict, ev, about)
        notes.append(f"wrote predictions for {ev.n} rows to {args.predict}")
    return ev, facts, notes


def run_embedding(args: argparse.Namespace, ckpt: checkpoint.Checkpoint
                  ) -> tuple[dict[str, Any], list[str]]:
    """Score an embedding model's checkpoint (``checkpoint.h5`` and the table files beside
    it, :mod:`hpcps.io.tables`) on a categorical split: AUC and log loss, with ``--predict``
    each row's P(y = 1) (as two classes, 0 and 1). A row the table files do not hold reads
    as its initial values, as in training's evaluations, or as zeros when the run admitted
    rows after several sightings (``--admit-after`` > 1: what its shards read too)."""
    path = data_path(args, ckpt)
    info = data.open_categorical(path)
    trained = [list(f) for f in (ckpt.dataset or {}).get("fields", [])]
    fields = [[f.name, f.width, f.vocab] for f in info.fields]
    if trained and trained != fields:
        raise DataError(f"{path}'s fields {fields} are not those the checkpoint was trained "
                        f"on, {trained}: its ids would look up other rows")
    model, flat = embedding_net(args.checkpoint, ckpt, info.fields, info.n_dense,
                                f"{path}'s fields")
    stores, files = table_stores(args.checkpoint, ckpt, model)
    # the split in pieces of consecutive rows, each read and checked in turn (a held-out
    # validation split: the rows the run held out of /train): only the table rows and, per
    # row, its label and logit stay
    source, which = split_source(path, args.split, ckpt, info.n_train, info.row_width,
                                 data.CategoricalRows.of(info),
                                 sizes={"train": info.n_train, "test": info.n_test})
    ys = []

    def pieces():
        for (all_ids, all_dense), y in with_progress(chunks(source, max(args.batch, EVAL_ROWS)),
                                                     len(source)):
            ys.append(y)
            yield Features(all_ids, all_dense)

    z = embedding_logits(model, flat, stores, pieces(), args.batch)
    y = np.concatenate(ys)
    figures = binary_metrics(y, z)
    facts = {"checkpoint": str(args.checkpoint), "step": ckpt.step, "model": model.spec_text,
             "dataset": str(path), "dataset_name": info.name, "split": which,
             "n": len(z), "auc": figures["auc"], "log_loss": figures["log_loss"],
             "rows_held": [len(s) for s in stores], "table_files": len(files)}
    notes = []
    if args.predict is not None:
        predicted, probs = click_rows(z)
        write_rows(args.predict, predicted, probs, y,
                   {**{k: facts[k] for k in ("checkpoint", "step", "dataset", "split")},
                    "auc": facts["auc"], "loss": facts["log_loss"]})
        notes.append(f"wrote predictions for {len(z)} rows to {args.predict}")
    return facts, notes


def embedding_net(ckpt_path: str | os.PathLike, ckpt: checkpoint.Checkpoint, fields,
                  n_dense: int, on: str) -> tuple[CtrModel, np.ndarray]:
    """The embedding model of ``ckpt``'s config on ``fields`` (and ``n_dense`` dense
    features) and its flat fc parameters; ``on`` says whose fields, for the refusal."""
    model = CtrModel.for_fields(ckpt.config["model"], fields, n_dense,
                                ckpt.config.get("activation", "relu"))
    try:
        return model, model.flatten(ckpt.params)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_path}: its parameters are not those of "
                              f"{model.spec_text} on {on}: {exc}") from None


def embedding_logits(model: CtrModel, flat: np.ndarray, stores: list[EmbeddingStore], pieces,
                     batch: int) -> np.ndarray:
    """The logit (float64) of every row of ``pieces`` (an iterable of :class:`Features`),
    ``batch`` rows at a time: the rows of the ids looked up in ``stores``, then the fc
    layers."""
    zs = []
    for piece in pieces:
        z = np.empty(len(piece), dtype=np.float64)
        for lo in range(0, len(z), batch):
            ids, dense = piece[lo:lo + batch]
            looked_up = model.lookup(ids)
            pulled = [s.peek(u) for s, u in zip(stores, looked_up.uniq)]
            z[lo:lo + len(ids)] = model.logits(flat, pulled, looked_up, dense)
        zs.append(z)
    return np.concatenate(zs) if zs else np.empty(0, dtype=np.float64)


def click_rows(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class int64 (N,), probabilities float32 (N, 2): P(y = 0), P(y = 1)) of
    logits ``z``, as ``--predict`` writes an embedding model's rows."""
    p = 1.0 / (1.0 + np.exp(-z))
    return (p >= 0.5).astype(np.int64), np.stack([1.0 - p, p], axis=1).astype(np.float32)


def table_stores(ckpt_path: str | os.PathLike, ckpt: checkpoint.Checkpoint, model: CtrModel
                 ) -> tuple[list[EmbeddingStore], list[Path]]:
    """An embedding model's tables as the run left them: one store per table, holding the rows
    of the table files beside ``ckpt_path`` (:mod:`hpcps.io.tables`), and those files. A
    store's :meth:`~EmbeddingStore.peek` reads an id the files do not hold as its initial row,
    or as zeros when the run admitted rows after several sightings (``--admit-after`` > 1:
    what its shards read too)."""
    cfg = ckpt.config
    files = tables.table_files(Path(ckpt_path).parent / tables.TABLES_DIR, ckpt.step,
                               model.n_tables, model.dim)
    stores = []
    absent = "zeros" if int(cfg.get("admit_after") or 1) > 1 else "initial"
    for t in range(model.n_tables):
        ids, rows, _, _ = tables.read(files, t)
        store = EmbeddingStore(model.dim, table=t, seed=int(cfg.get("seed", 0)),
                               optimizer="sgd", init_scale=cfg.get("row_init_scale"),
                               capacity=max(1, len(ids)), absent=absent)
        store.load(ids, rows)
        stores.append(store)
    return stores, files


def describe_embedding(facts: dict[str, Any]) -> str:
    return "\n".join([
        f"checkpoint  {facts['checkpoint']} (step {facts['step']}, model {facts['model']}; "
        f"rows from {facts['table_files']} table file(s), {sum(facts['rows_held'])} rows)",
        f"dataset     {facts['dataset']} ({facts['dataset_name']}), {facts['split']} split: "
        f"{facts['n']} examples",
        f"AUC         {facts['auc']:.4f}",
        f"log loss    {facts['log_loss']:.4f} (mean binary cross-entropy, nats)"])


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0, or the refusing error's code)."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.evaluate",
        description=(
            "Evaluate an hpcps checkpoint on a dataset split (the test split unless --split "
            "says otherwise): print the accuracy, the mean cross-entropy loss and the confusion "
            "matrix, and with --predict write each row's predicted class and class "
            "probabilities. One process; no MPI launcher needed."
        ),
        epilog=f"Exit status: 0 on success, {CheckpointError.exit_code} for a missing, corrupt "
        f"or non-finite checkpoint, {DataError.exit_code} for a missing or unreadable dataset "
        f"or one whose features or classes do not fit the model, {ConfigError.exit_code} for "
        "bad options.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file written by hpcps")
    parser.add_argument("--data", metavar="PATH",
                        help="hpcps dataset file (HDF5; default: the one the checkpoint's run "
                        "was trained on, from its config)")
    parser.add_argument("--split", choices=(*data.SPLITS, "val"), default="test",
                        help="which split to evaluate on (default: test; val: the file's "
                        "validation split /val, else the rows the run held out of /train "
                        "with --validation-fraction)")
    parser.add_argument("--predict", metavar="OUT", default=None,
                        help="write per-row predictions to OUT: .csv (row, label, predicted, "
                        "p_0..p_{C-1}), .npy (a structured array of those fields) or .h5/.hdf5 "
                        "(datasets label, predicted, probabilities)")
    parser.add_argument("--input", metavar="FILE", default=None,
                        help="score the unlabelled rows of FILE instead of a split (needs "
                        "--predict): a CSV with a header whose every column is a feature, an "
                        "HDF5 file with /x (or /SPLIT/x), or a .npy; for an embedding model, "
                        "a .npy of int ids (N, C) or an HDF5 file with /ids (N, C) and "
                        "/dense (N, D) when it has dense features (or /SPLIT/ids, /SPLIT/dense)")
    parser.add_argument("--batch", type=int, default=2000,
                        help="rows per forward pass (bounds memory; default 2000)")
    parser.add_argument("--json", action="store_true",
                        help="print the figures (accuracy, loss, confusion matrix, ...) as one "
                        "JSON object instead of text")
    args = parser.parse_args(argv)
    if args.input is not None:
        return _main_input(parser, args)
    try:
        if args.predict is not None:
            check_predict_path(args.predict)
        if args.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {args.batch}")
        ckpt = checkpoint.load(args.checkpoint)
        if is_embedding_spec(ckpt.config.get("model")):
            facts, notes = run_embedding(args, ckpt)
            for note in notes:
                print(f"{parser.prog.split()[-1]}: {note}", file=sys.stderr)
            print(json.dumps(facts, indent=2) if args.json else describe_embedding(facts),
                  flush=True)
            return 0
        ev, facts, notes = run(args)
    except HpcpsError as exc:
        print(f"{parser.prog.split()[-1]}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for note in notes:
        print(f"{parser.prog.split()[-1]}: {note}", file=sys.stderr)
    if args.json:
        text = json.dumps({**facts, "n": ev.n, "accuracy": ev.accuracy, "loss": ev.loss,
                           "confusion": ev.confusion.tolist()}, indent=2)
    else:
        text = describe(ev, facts)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left; the evaluation itself succeeded
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _main_input(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--input FILE --predict OUT``: score unlabelled rows; print what was written."""
    prog = parser.prog.split()[-1]
    try:
        if args.predict is None:
            raise ConfigError("--input FILE needs --predict OUT: where to write the "
                              "predictions of its rows")
        if args.data is not None:
            raise ConfigError("--input and --data exclude each other: --input scores "
                              "unlabelled rows, --data a labelled dataset's split")
        check_predict_path(args.predict)
        if args.batch < 1:
            raise ConfigError(f"--batch must be >= 1, got {args.batch}")
        facts, notes = score_input(args)
    except HpcpsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for note in notes:
        print(f"{prog}: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(facts, indent=2), flush=True)
    else:
        print(f"checkpoint  {facts['checkpoint']} (step {facts['step']}, {model_words(facts)})\n"
              f"input       {facts['input']}: {facts['n']} rows scored\n"
              f"predicted   " + " ".join(f"{c}:{n}" for c, n in
                                         enumerate(facts["predicted_counts"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
