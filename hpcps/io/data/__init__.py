"""Datasets, from download to mini-batch; one job per module.

:mod:`hpcps.io.data.sources`
    Where datasets come from: fetch and verify MNIST or scikit-learn's digits and write them
    as a dataset file (:func:`prepare`); the command line (``python -m hpcps.data prepare
    mnist|digits``, ``... info PATH``). Not called ``prepare.py``: the module would then share
    its name with the function :func:`prepare` re-exported here, and
    ``import hpcps.io.data.prepare as m`` would hand back the function.
:mod:`hpcps.io.data.h5format`
    The HDF5 dataset layout: its constants, writing it, checking a file against it
    (:func:`open_dataset`, :class:`DatasetInfo`) and reading a rank's shard (:func:`load_split`).
:mod:`hpcps.io.data.batches`
    :class:`Batches` over a shard in memory and the background :class:`Prefetcher`.

The names below are re-exported so that ``from hpcps.io.data import load_split`` and
``hpcps.io.data.prepare(...)`` keep working. ``block_range`` lives in :mod:`hpcps.blocks`; it is
re-exported here for modules that still import it from ``hpcps.io.data``.
"""

from hpcps.blocks import block_range
from hpcps.io.data.batches import Batches, Prefetcher
from hpcps.io.data.h5format import (
    FORMAT,
    LAYOUT_VERSION,
    SPLITS,
    DatasetInfo,
    load_split,
    open_dataset,
    write_dataset,
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

__all__ = [
    "Batches",
    "DEFAULT_DATA",
    "DatasetInfo",
    "FORMAT",
    "LAYOUT_VERSION",
    "MNIST_WHEEL_ENV",
    "MNIST_WHEEL_NAME",
    "NumpyOnlyUnpickler",
    "Prefetcher",
    "SPLITS",
    "block_range",
    "load_split",
    "main",
    "open_dataset",
    "prepare",
    "prepare_digits",
    "prepare_mnist",
    "write_dataset",
]
