"""Shared fixtures: a small real dataset (scikit-learn's digits) prepared once per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def digits_h5(tmp_path_factory):
    """data/digits.h5-like file: 1437 train / 360 test 8x8 images, 10 classes."""
    from hpcps import data
    path = tmp_path_factory.mktemp("data") / "digits.h5"
    data.prepare_digits(path, log=lambda s: None)
    return path


def pytest_ignore_collect(collection_path, config):
    """tests/mpi runs only under mpiexec with --with-mpi (test_mpi_suites.py launches it)."""
    if collection_path.name == "mpi" and collection_path.parent.name == "tests":
        return not config.getoption("--with-mpi", default=False)
    return None
