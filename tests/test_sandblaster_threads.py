"""Sandblaster with ``--threads T``: replicas sum each portion's gradient with T threads.

No Hogwild updates happen there, so the run must still compute the same L-BFGS as the
one-process NumPy reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpcps.engine import hogwild
from mpirun import train
from test_train import SB, records, reference_lbfgs, sb_losses

pytestmark = pytest.mark.skipif(not hogwild.HAVE_EXTENSION,
                                reason="--threads needs the compiled engine")


@pytest.mark.parametrize("threads", [2, 3])
def test_sandblaster_threads_compute_the_same_lbfgs(threads, digits_h5, tmp_path):
    run = train(4, "--data", str(digits_h5), "--run-dir", str(tmp_path), "--steps", "12",
                "--portions", "8", "--threads", str(threads), *SB)
    assert run.returncode == 0, run.output
    got = sb_losses(tmp_path)
    ref = reference_lbfgs(digits_h5, len(got) + 2)
    # the threads' sums are added in another order than NumPy's, hence rounding
    np.testing.assert_allclose(got[:6], ref[:6], rtol=1e-4)
    s = records(tmp_path, "summary")[-1]
    assert s["loss_monotone"] is True and s["test_accuracy"] > 0.85
