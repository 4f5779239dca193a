"""Evaluate a trained checkpoint on a dataset: accuracy, loss, confusion matrix, predictions.

Usage::

    python -m hpcps.evaluate runs/mnist/checkpoint.h5 --data data/mnist.h5
    python -m hpcps.evaluate CKPT --data data/mnist.h5 --predict predictions.csv
    python -m hpcps.evaluate CKPT --data data/mnist.h5 --json        # the figures as JSON

One process, no MPI launcher (mpi4py is not even imported): every checkpoint holds the whole
model, whatever layout of servers, replicas and partitions wrote it, so the network is rebuilt
as one :class:`hpcps.model.mlp.MLP` and run over the split in batches. The test split's accuracy
and loss are what training reports for the same checkpoint (the same rows, the same forward
pass).

Predictions (``--predict OUT``), one row per example of the split, in the split's order:

``OUT.csv``
    A header line ``row,label,predicted,p_0,...,p_{C-1}``, then one line per example: its row
    number in the split, its true class, the predicted class (the largest output) and the
    softmax probability of each class (``%.6g``).
``OUT.h5`` or ``OUT.hdf5``
    Datasets ``/label`` and ``/predicted`` (int64, (N,)) and ``/probabilities`` (float32,
    (N, C)), each with a ``description``; root attributes name the checkpoint, its step, the
    dataset and split, and the accuracy and loss.

Either file is written atomically (a temporary file renamed onto OUT).

Refusals end with ``hpcps.evaluate: error: <reason>`` on stderr and the exit code of the
error's class (:mod:`hpcps.errors`): 4 for a checkpoint that is missing, corrupt, not an hpcps
checkpoint or holds NaN/infinity; 3 for a dataset that is missing or unreadable, or whose
features or classes do not fit the checkpoint's model; 2 for options (``--predict`` with an
unknown suffix or in a directory that does not exist; argparse's own usage errors are 2 too).

Reading and checking the checkpoint is :mod:`hpcps.io.checkpoint`'s job and reading the dataset
:mod:`hpcps.io.data`'s; this module rebuilds the model, runs it and presents the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcps.io import checkpoint, data
from hpcps.errors import CheckpointError, ConfigError, DataError, HpcpsError
from hpcps.model.mlp import ACTIVATIONS, MLP

PREDICTION_SUFFIXES = (".csv", ".h5", ".hdf5")


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


def model_of(ckpt: checkpoint.Checkpoint) -> tuple[MLP, np.ndarray]:
    """The network a checkpoint holds, as an :class:`MLP` and its flat parameter vector.

    Raises
    ------
    CheckpointError
        If the parameters hold NaN or infinity, or the config names an unknown activation.
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


def evaluate(model: MLP, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
             batch: int = 2000) -> Evaluation:
    """Run ``model`` over ``x`` in batches of ``batch`` rows and score it against ``y``.

    The predicted class is the argmax of the logits and the loss is computed as
    :meth:`MLP.evaluate` does (the probability of the true class floored at 1e-30), so
    accuracy and loss are exactly what training reports.
    """
    n_classes = model.sizes[-1]
    probs = np.empty((len(y), n_classes), dtype=np.float32)
    predicted = np.empty(len(y), dtype=np.int64)
    total = 0.0
    for lo in range(0, len(y), batch):
        logits = model.forward(flat, x[lo:lo + batch])[-1]
        hi = lo + len(logits)
        predicted[lo:hi] = np.argmax(logits, axis=1)
        p = logits - logits.max(axis=1, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=1, keepdims=True)
        probs[lo:hi] = p
        total += float(-np.sum(np.log(np.maximum(p[np.arange(hi - lo), y[lo:hi]], 1e-30)),
                               dtype=np.float64))
    confusion = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(confusion, (y, predicted), 1)
    n = max(1, len(y))
    return Evaluation(accuracy=int(np.trace(confusion)) / n, loss=total / n, confusion=confusion,
                      labels=np.asarray(y, dtype=np.int64), predicted=predicted,
                      probabilities=probs)


# ---------------------------------------------------------------------------------------------
# predictions file


def check_predict_path(path: str | os.PathLike) -> Path:
    """Refuse (ConfigError) an output path with an unknown suffix or in a missing directory,
    before any work is done."""
    path = Path(path)
    if path.suffix.lower() not in PREDICTION_SUFFIXES:
        raise ConfigError(f"--predict {path}: the name must end in "
                          f"{', '.join(PREDICTION_SUFFIXES)} (CSV or HDF5)")
    if not path.parent.is_dir():
        raise ConfigError(f"--predict {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"--predict {path} is a directory; name a file")
    return path


def write_predictions(path: str | os.PathLike, ev: Evaluation, about: dict[str, Any]) -> Path:
    """Write ``ev``'s predictions as CSV or HDF5 (by ``path``'s suffix), atomically.

    ``about`` (checkpoint, step, dataset, split, ...) goes into the HDF5 file's root
    attributes; the CSV file holds the rows only.
    """
    path = check_predict_path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix.lower() == ".csv":
            _write_csv(tmp, ev)
        else:
            _write_h5(tmp, ev, about)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write predictions to {path}: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_csv(path: Path, ev: Evaluation) -> None:
    n_classes = ev.probabilities.shape[1]
    header = "row,label,predicted," + ",".join(f"p_{c}" for c in range(n_classes))
    with open(path, "w", newline="") as f:
        f.write(header + "\n")
        for i in range(ev.n):
            probs = ",".join(f"{p:.6g}" for p in ev.probabilities[i])
            f.write(f"{i},{ev.labels[i]},{ev.predicted[i]},{probs}\n")
        f.flush()
        os.fsync(f.fileno())


def _write_h5(path: Path, ev: Evaluation, about: dict[str, Any]) -> None:
    with h5py.File(path, "w") as f:
        f.attrs["description"] = ("hpcps predictions: one row per example of the split, in its "
                                  "order; written by python -m hpcps.evaluate")
        for key, value in about.items():
            f.attrs[key] = value
        for name, values, text in (
                ("label", ev.labels, "true class of each row"),
                ("predicted", ev.predicted, "predicted class (largest output) of each row"),
                ("probabilities", ev.probabilities,
                 "softmax probability of each class (columns) for each row")):
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
        f"checkpoint  {facts['checkpoint']} (step {facts['step']}, layers "
        f"{' -> '.join(map(str, facts['layer_sizes']))}, {facts['activation']}; trained on "
        f"{facts['trained_on']})",
        f"dataset     {facts['dataset']} ({facts['dataset_name']}), {facts['split']} split: "
        f"{ev.n} examples",
        f"accuracy    {100 * ev.accuracy:.2f}% ({correct} of {ev.n})",
        f"loss        {ev.loss:.4f} (mean cross-entropy, nats)",
        "confusion matrix (rows: true class, columns: predicted class)",
        *("  " + line for line in format_confusion(ev.confusion)),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[Evaluation, dict[str, Any], list[str]]:
    """Load, check, evaluate and (with ``--predict``) write; return the evaluation, the facts
    printed with it and notes for stderr."""
    if args.predict is not None:
        check_predict_path(args.predict)  # refuse before the work, not after it
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    ckpt = checkpoint.load(args.checkpoint)
    model, flat = model_of(ckpt)
    info = data.open_dataset(args.data)
    notes = check_fits(ckpt, list(model.sizes), info)
    x, y = data.load_split(args.data, args.split)
    ev = evaluate(model, flat, x, y, args.batch)
    facts = {
        "checkpoint": str(args.checkpoint), "step": ckpt.step, "layer_sizes": list(model.sizes),
        "activation": model.activation,
        "trained_on": ckpt.dataset.get("name", "an unnamed dataset"),
        "dataset": str(args.data), "dataset_name": info.name, "split": args.split,
    }
    if args.predict is not None:
        about = {k: facts[k] for k in ("checkpoint", "step", "dataset", "split")}
        about.update(accuracy=ev.accuracy, loss=ev.loss)
        write_predictions(args.predict, ev, about)
        notes.append(f"wrote predictions for {ev.n} rows to {args.predict}")
    return ev, facts, notes


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
    parser.add_argument("--data", required=True, metavar="PATH", help="hpcps dataset file (HDF5)")
    parser.add_argument("--split", choices=data.SPLITS, default="test",
                        help="which split to evaluate on (default: test)")
    parser.add_argument("--predict", metavar="OUT", default=None,
                        help="write per-row predictions to OUT: .csv (row, label, predicted, "
                        "p_0..p_{C-1}) or .h5/.hdf5 (datasets label, predicted, probabilities)")
    parser.add_argument("--batch", type=int, default=2000,
                        help="rows per forward pass (bounds memory; default 2000)")
    parser.add_argument("--json", action="store_true",
                        help="print the figures (accuracy, loss, confusion matrix, ...) as one "
                        "JSON object instead of text")
    args = parser.parse_args(argv)
    try:
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


if __name__ == "__main__":
    sys.exit(main())
