"""The replica-side math of deadreckon, without MPI."""
import numpy as np
import pytest

from hpcps.strategies.deadreckon.replica import Reckoner
from hpcps.compress.threshold import UNIT_DIVISOR


def random_messages(rng, n, k, count):
    msgs = []
    for _ in range(count):
        idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.uint32)
        msgs.append((idx << 1) | rng.integers(0, 2, k).astype(np.uint32))
    return msgs


@pytest.mark.parametrize("changing_tau", [False, True])
def test_order_of_messages_does_not_change_the_weights(changing_tau):
    """Replicas receive the same deltas in different orders; their weights must be equal
    bit for bit (plain float32 += would round differently), also when every message carries
    another tau (``--tau auto``: each sender's tau in units)."""
    rng = np.random.default_rng(0)
    n, tau = 5000, 3e-3
    unit = tau / UNIT_DIVISOR
    start = rng.standard_normal(n).astype(np.float32)
    msgs = random_messages(rng, n, 400, 60)
    multiples = (rng.integers(300, 3000, 60) if changing_tau
                 else np.full(60, UNIT_DIVISOR)).tolist()
    results = []
    for order in (range(60), reversed(range(60)), rng.permutation(60)):
        r = Reckoner(start.copy(), unit)
        for i in order:
            r.apply(msgs[i], multiples[i])
        results.append(r.params)
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)
    # and the value is what the deltas add up to
    net = np.zeros(n)
    for m, k in zip(msgs, multiples):
        np.add.at(net, (m >> 1).astype(np.intp), k * (1 - 2 * (m & 1).astype(np.float64)))
    np.testing.assert_allclose(results[0], start + unit * net, rtol=0, atol=1e-5)




def test_naive_float32_updates_do_depend_on_order():
    """The hazard Reckoner avoids: the same deltas added to float32 weights in another order
    give other weights (so the test above would catch a naive implementation)."""
    rng = np.random.default_rng(0)
    n, tau = 5000, np.float32(3e-3)
    start = rng.standard_normal(n).astype(np.float32)
    msgs = random_messages(rng, n, 400, 60)
    finals = []
    for order in (range(60), reversed(range(60))):
        w = start.copy()
        for i in order:
            m = msgs[i]
            w[(m >> 1).astype(np.intp)] += tau * (1 - 2 * (m & 1).astype(np.float32))
        finals.append(w)
    assert np.any(finals[0] != finals[1])
