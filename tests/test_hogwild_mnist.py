"""Hogwild converges on real MNIST with T = 1, 2 and 4 threads (issue 6).

The default model (784-512-512-10, relu) is trained lock-free by ``HogwildEngine`` on a
fixed subset, the first 20,000 rows of MNIST's training split, for two passes (lr 0.1 then
0.02, batch 32), and scored on the full 10,000-image test set. Data comes from the
``mnist_h5`` fixture (conftest.py): data/mnist.h5, or a cached download.

Measured on the 2-core development machine (AVX-512, OPENBLAS_NUM_THREADS=1), with this
test's seeds (T=1 is deterministic; T>1 varies run to run with the threads' interleaving;
other jobs were sharing the machine for most runs):

    T=1   0.9516 / 0.9520 (two builds of the extension)
    T=2   0.9507-0.9542 over 22 runs
    T=4   0.9481-0.9530 over 37 runs, mean 0.951 (T=4 oversubscribes the 2 cores)

14 runs each of T=2 and T=4 had two extra busy-looping processes on the machine and stayed
in the same range. With other init/order seeds (0-7, same schedule) all T gave 0.950-0.955.
Training takes 1.5-5 s per T, up to 15 s under that load; the file runs in 6-13 s.

What a broken learner reaches with the same schedule: the same network trained on only
half the subset gets 0.930-0.935 (as if half of all updates were lost), on a quarter
0.912-0.916, and a linear softmax model 0.905. The bar, 0.94, is 0.8 points (6.5
standard deviations of the T=4 runs) below the worst run measured and half a point above
the half-data runs.
"""
import numpy as np
import pytest

from hpcps.io import data
from hpcps.engine.hogwild import HogwildEngine
from hpcps.model.mlp import MLP

SIZES = (784, 512, 512, 10)
N_TRAIN = 20_000
BATCH = 32
LRS = (0.1, 0.02)        # one pass each; the lower second rate steadies the final weights
MIN_ACCURACY = 0.94      # see the module docstring for what it was set from


@pytest.fixture(scope="module")
def mnist_subset(mnist_h5):
    """First 20,000 training rows and the full test set, as float32/int64 arrays."""
    info = data.open_dataset(mnist_h5)
    # load_split reads one contiguous block: shard 0 of 3 is rows 0..19,999 of 60,000.
    xtr, ytr = data.load_split(mnist_h5, "train", shard=0, n_shards=info.n_train // N_TRAIN)
    xte, yte = data.load_split(mnist_h5, "test")
    assert xtr.shape == (N_TRAIN, 784) and xte.shape == (10_000, 784)
    return xtr, ytr, xte, yte


# func_only: the timeout bounds the training, not the fixture's one-time MNIST download
# (pip's own timeout bounds that). The runs take seconds; 120 s only catches a hang.
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_hogwild_converges_on_mnist(mnist_subset, threads):
    xtr, ytr, xte, yte = mnist_subset
    model = MLP(SIZES, "relu")
    params = model.init_params(0)
    init_train_loss, _ = model.evaluate(params, xtr, ytr)
    init_test_loss, init_acc = model.evaluate(params, xte, yte)
    engine = HogwildEngine(SIZES, "relu", threads=threads, batch=BATCH, backend="threads")
    rng = np.random.default_rng(1)
    pass_losses = []
    for lr in LRS:
        loss_sum, n = engine.train(params, xtr, ytr, rng.permutation(N_TRAIN), lr)
        assert n == N_TRAIN            # the T threads' parts cover every example once
        assert np.isfinite(loss_sum)
        pass_losses.append(loss_sum / n)
    assert np.isfinite(params).all()
    test_loss, acc = model.evaluate(params, xte, yte)
    # the loss went down: each pass's mean training loss (each example at the weights its
    # step saw) is below the last, and the test loss fell from ~2.4 at init to ~0.15
    assert init_train_loss > pass_losses[0] > pass_losses[1], (init_train_loss, pass_losses)
    assert test_loss < 0.5 * init_test_loss, (init_test_loss, test_loss)
    assert acc > MIN_ACCURACY, (threads, acc, init_acc)   # chance is 0.1
