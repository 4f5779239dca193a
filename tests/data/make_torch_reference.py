"""Write tests/data/adam_mnist_torch.npz: Project Adam's MNIST network's loss and gradient
on one fixed mini-batch, computed by PyTorch. Run once, by hand, where torch is installed
(the test extra has no torch; CI compares against the stored file)::

    pip install torch==2.13.0
    PYTHONPATH=. python tests/data/make_torch_reference.py

made with torch 2.13.0 (CPU), float32. Inputs, labels and weights come from NumPy's
generator with fixed seeds (not from hpcps's initialiser, so the reference does not move
when that does); hpcps gives only the parameter layout (``ConvNet.views``), which the
reference checks too: conv kernels (out, in, kh, kw) as PyTorch's conv2d takes them, fc
weights (in, out), the flattening in C, H, W order. Gradients of arrays up to SMALL elements
are stored whole, larger ones every STRIDE-th element (the file stays about 100 kB).
"""
from pathlib import Path

import numpy as np

from hpcps.model.convnet import ConvNet

OUT = Path(__file__).with_name("adam_mnist_torch.npz")
SMALL, STRIDE, BATCH = 5000, 13, 8


def inputs():
    """The mini-batch and the weights, the same in the test (tests/test_convnet.py)."""
    model = ConvNet("adam-mnist", (1, 28, 28))
    rng = np.random.default_rng(20261126)
    p = (rng.standard_normal(model.n_params) * 0.05).astype(np.float32)
    x = rng.random((BATCH, 784)).astype(np.float32)
    y = rng.integers(0, 10, BATCH)
    return model, p, x, y


def main():
    import torch  # only here: the test imports inputs() from this file without torch
    F = torch.nn.functional
    model, p, x, y = inputs()
    t = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in model.views(p).items()}
    h = torch.tensor(x).reshape(BATCH, 1, 28, 28)
    for i in range(2):   # kernels (out, in, kh, kw) go to conv2d as they are
        h = F.max_pool2d(F.relu(F.conv2d(h, t[f"layer{i}/W"], t[f"layer{i}/b"])), 2)
    h = h.flatten(1)     # C, H, W order
    for i in range(2, 5):
        h = h @ t[f"layer{i}/W"] + t[f"layer{i}/b"]
        h = F.relu(h) if i < 4 else h
    loss = F.cross_entropy(h, torch.tensor(y))
    loss.backward()
    out = {"loss": np.float64(loss.item()), "torch_version": np.str_(torch.__version__)}
    for k, v in t.items():
        g = v.grad.numpy().ravel()
        out["grad/" + k] = g if g.size <= SMALL else g[::STRIDE]
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes), loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
