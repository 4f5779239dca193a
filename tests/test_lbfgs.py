"""L-BFGS on named vectors: the algorithm Sandblaster's coordinator drives through the shards."""
import numpy as np
import pytest
from scipy.optimize import minimize

from hpcps.model import optim
from hpcps.errors import ConfigError
from hpcps.model.mlp import MLP


def rosen(x, g):
    x64 = x.astype(np.float64)
    f = np.sum(100.0 * (x64[1:] - x64[:-1] ** 2) ** 2 + (1 - x64[:-1]) ** 2)
    gr = np.zeros_like(x64)
    gr[:-1] = -400 * x64[:-1] * (x64[1:] - x64[:-1] ** 2) - 2 * (1 - x64[:-1])
    gr[1:] += 200 * (x64[1:] - x64[:-1] ** 2)
    g[...] = gr
    return f


def test_rosenbrock_converges_with_monotone_loss():
    n = 6
    space = optim.ArraySpace(rosen, n, optim.LBFGS.vector_names(5))
    space.v["x"][...] = -1.0
    opt = optim.LBFGS(space, m=5)
    losses = [opt.start()]
    for _ in range(200):
        losses.append(opt.step()["f"])
        if losses[-1] < 1e-8:
            break
    assert losses[-1] < 1e-6, losses[-5:]
    assert all(b <= a for a, b in zip(losses, losses[1:]))  # Wolfe: sufficient decrease
    np.testing.assert_allclose(space.v["x"], 1.0, atol=1e-2)


def test_mlp_objective_tracks_scipy():
    """Same objective and start as scipy's L-BFGS-B: the loss falls about as fast."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    model = MLP((8, 12, 3), "tanh")
    p0 = model.init_params(0)

    def objective(p, g):
        loss, _ = model.loss_and_grad(p, x, y, grad=g)
        return loss

    space = optim.ArraySpace(objective, model.n_params, optim.LBFGS.vector_names(10))
    space.v["x"][...] = p0
    opt = optim.LBFGS(space, m=10)
    ours = [opt.start()] + [opt.step()["f"] for _ in range(30)]

    def fg(p):
        p32 = p.astype(np.float32)
        loss, grad = model.loss_and_grad(p32, x, y)
        return loss, grad.astype(np.float64)

    ref = minimize(fg, p0.astype(np.float64), jac=True, method="L-BFGS-B",
                   options={"maxiter": 30, "maxcor": 10})
    assert ours[0] == pytest.approx(fg(p0)[0], rel=1e-6)
    assert all(b <= a for a, b in zip(ours, ours[1:]))
    # both methods end within 20% of each other's loss, far below the start
    assert ours[-1] < 0.5 * ours[0] and ref.fun < 0.5 * ours[0]
    assert ours[-1] < 1.2 * ref.fun + 1e-3 and ref.fun < 1.2 * ours[-1] + 1e-3


def test_state_round_trip_gives_the_same_next_step():
    space = optim.ArraySpace(rosen, 4, optim.LBFGS.vector_names(3))
    space.v["x"][...] = [-1.2, 1.0, -0.5, 0.3]
    opt = optim.LBFGS(space, m=3)
    opt.start()
    for _ in range(4):
        opt.step()
    saved_vectors = {k: v.copy() for k, v in space.v.items()}
    saved = opt.state()
    expected = opt.step()["f"]
    space2 = optim.ArraySpace(rosen, 4, optim.LBFGS.vector_names(3))
    for k, v in saved_vectors.items():
        space2.v[k][...] = v
    again = optim.LBFGS(space2, m=3)
    again.load_state(saved)
    assert again.step()["f"] == expected
    with pytest.raises(ConfigError, match="history"):
        optim.LBFGS(space2, m=4).load_state(saved)
