"""Memory per rank: fresh weights drawn slice by slice, and the per-role figures."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hpcps.model.mlp as model_mod
from hpcps.runtime import memory
from hpcps.model.mlp import MLP, InitialWeights, PartitionedMLP, initial_slice

ROOT = Path(__file__).resolve().parents[1]


def _reference_init(sizes, activation, seed):
    """The whole model drawn at once, layer by layer (what initial_slice must reproduce)."""
    m = MLP(sizes, activation)
    rng = np.random.default_rng(seed)
    flat = np.zeros(m.n_params, np.float32)
    for W, _ in m.layers(flat):
        fan_in, fan_out = W.shape
        if activation == "relu":
            W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / fan_in)
        else:
            lim = np.sqrt(6.0 / (fan_in + fan_out))
            W[...] = rng.uniform(-lim, lim, W.shape)
    return flat


@pytest.mark.parametrize("activation", ["relu", "tanh"])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_slices_match_the_whole_model_in_small_row_blocks(monkeypatch, activation, parts):
    monkeypatch.setattr(model_mod, "_INIT_CHUNK", 37)  # blocks of a few rows, uneven
    sizes = (13, 7, 11, 5)
    whole = MLP(sizes, activation)
    ref = _reference_init(sizes, activation, 4)
    np.testing.assert_array_equal(whole.init_params(4), ref)
    locals_ = [PartitionedMLP(sizes, activation, parts, q).init_params(4) for q in range(parts)]
    for q, local in enumerate(locals_):
        want = PartitionedMLP(sizes, activation, parts, q).local_from_full(whole.views(ref))
        np.testing.assert_array_equal(local, want)
    glob = np.concatenate(locals_)
    weights = InitialWeights(sizes, activation, parts, 4)
    assert len(weights) == len(glob)
    for lo, hi in [(0, len(glob)), (5, 60), (91, 92), (len(glob) - 3, len(glob)), (7, 7)]:
        np.testing.assert_array_equal(weights[lo:hi], glob[lo:hi])
        np.testing.assert_array_equal(initial_slice(sizes, activation, parts, 4, lo, hi),
                                      glob[lo:hi])


def test_initial_weights_refuse_what_is_not_a_slice():
    weights = InitialWeights((4, 3, 2), "relu", 1, 0)
    with pytest.raises(TypeError):
        weights[3]
    with pytest.raises(TypeError):
        weights[0:6:2]
    with pytest.raises(ValueError):
        initial_slice((4, 3, 2), "relu", 1, 0, 0, 10_000)


PEAK_PROBE = """
import json, sys
import numpy as np
from hpcps.runtime import memory
before = memory.peak_rss_bytes()
block = np.ones(int(sys.argv[1]) * memory.MIB // 4, np.float32)  # every page written
after = memory.peak_rss_bytes()
print(json.dumps({"before": before, "after": after, "sum": float(block[::4096].sum())}))
"""


def test_peak_grows_by_the_block_the_process_touches():
    """In a fresh process (whose peak is still its start-up's, far below the block), the
    peak grows by about the block's size: not at all if the block's pages were never
    touched, and not by more than the block and a few MiB of NumPy's own."""
    mib = 64
    done = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(mib)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    grew = (got["after"] - got["before"]) / memory.MIB
    assert 0.95 * mib <= grew <= mib + 8, (grew, got)


def test_by_role_takes_the_largest_peak_of_each_role():
    results = [{"role": "replica", "peak_rss_bytes": 100 * memory.MIB},
               {"role": "replica", "peak_rss_bytes": 300 * memory.MIB},
               {"role": "server", "peak_rss_bytes": 200 * memory.MIB}]
    fig = memory.by_role(results)
    assert fig["peak_rss_mib"] == {"replica": 300.0, "server": 200.0}
    assert fig["peak_rss_mib_by_rank"] == [["replica", 100.0], ["replica", 300.0],
                                           ["server", 200.0]]
    assert "replica 300 MiB (largest of 2)" in memory.describe(fig)


def test_bytes_per_param_add_up_and_refuse_what_they_do_not_cover():
    server = memory.bytes_per_param("server", "adagrad")
    assert server["total"] == 16 and server["optimizer_state"] == 4
    assert memory.bytes_per_param("server", "sgd")["total"] == 12
    assert memory.bytes_per_param("replica")["total"] == 28
    with pytest.raises(ValueError):
        memory.bytes_per_param("coordinator")
    with pytest.raises(ValueError):
        memory.bytes_per_param("server", "lbfgs")
