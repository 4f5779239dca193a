"""Run the multi-rank tests (tests/mpi) under mpiexec at 1, 2, 3 and 4 ranks.

pytest-mpi runs its marked tests only inside ``mpiexec ... python -m pytest --with-mpi``, so
the one test command launches them from here, each launch with a timeout that fails the test
instead of hanging CI.
"""
import pytest

from mpirun import ROOT, run_mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_multi_rank_suite(n):
    run = run_mpi(n, ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "-n", "0",
                      str(ROOT / "tests" / "mpi")], timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.output[-6000:]
    assert "passed" in run.output and "failed" not in run.output
