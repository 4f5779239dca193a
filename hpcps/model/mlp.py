"""A multilayer perceptron on NumPy arrays: forward, backward, softmax cross-entropy. No MPI.

All parameters live in one flat float32 vector, layer by layer (``layer0/W``, ``layer0/b``,
``layer1/W``, ...), with ``W`` of shape (fan_in, fan_out) so a layer computes
``act(x @ W + b)``. The flat vector is what the strategies ship around: server shards hold
contiguous slices of it, ``sync`` allreduces it whole, and the named views are what a
checkpoint stores. :meth:`MLP.views` gives the per-layer arrays without copying.
"""
from __future__ import annotations

import numpy as np

from hpcps.blocks import block_range
from hpcps.errors import ConfigError

ACTIVATIONS = ("relu", "tanh", "sigmoid")


def _act(name: str, z: np.ndarray) -> np.ndarray:
    """Activation, in place on z (z is a scratch buffer owned by the model)."""
    if name == "relu":
        np.maximum(z, 0.0, out=z)
    elif name == "tanh":
        np.tanh(z, out=z)
    else:  # sigmoid: exp(-z) may overflow to inf for very negative z, giving the right 0
        np.negative(z, out=z)
        with np.errstate(over="ignore"):
            np.exp(z, out=z)
        z += 1.0
        np.reciprocal(z, out=z)
    return z


def dense(a: np.ndarray, W: np.ndarray, b: np.ndarray, activation: str | None) -> np.ndarray:
    """A fully connected layer's ``a @ W + b``, activated in place (``activation`` None: the
    output layer, whose outputs are the logits)."""
    z = a @ W
    z += b
    if activation is not None:
        _act(activation, z)
    return z


def _act_grad_inplace(name: str, a: np.ndarray, delta: np.ndarray) -> None:
    """delta *= act'(z), expressed through the activation's output a = act(z)."""
    if name == "relu":
        delta[a <= 0.0] = 0.0
    elif name == "tanh":
        delta *= 1.0 - a * a
    else:
        delta *= a * (1.0 - a)


def flatten_named(model, named: dict[str, np.ndarray]) -> np.ndarray:
    """A new flat float32 vector of ``model`` (anything with ``n_params``, ``layout`` of
    ``(name, shape, offset)`` and ``views``) from its named arrays, each checked for shape."""
    flat = np.empty(model.n_params, dtype=np.float32)
    views = model.views(flat)
    for name, shape, _ in model.layout:
        if name not in named:
            raise ValueError(f"missing parameter {name}")
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name} has shape {named[name].shape}, expected {shape}")
        views[name][...] = named[name]
    return flat


class MLP:
    """A fully connected network ``sizes[0] -> ... -> sizes[-1]`` with softmax output.

    Parameters
    ----------
    sizes : layer widths, input first (e.g. ``(784, 512, 512, 10)``).
    activation : hidden activation, ``relu``, ``tanh`` or ``sigmoid``.
    """

    def __init__(self, sizes, activation: str = "relu"):
        sizes = tuple(int(n) for n in sizes)
        if len(sizes) < 2 or min(sizes) < 1:
            raise ConfigError(f"an MLP needs at least two positive layer widths, got {sizes}")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {activation!r}; choose one of {ACTIVATIONS}")
        self.sizes = sizes
        self.activation = activation
        self.n_layers = len(sizes) - 1
        # (name, shape, offset) for each parameter array in the flat vector.
        self.layout: list[tuple[str, tuple[int, ...], int]] = []
        off = 0
        for i in range(self.n_layers):
            for name, shape in ((f"layer{i}/W", (sizes[i], sizes[i + 1])),
                                (f"layer{i}/b", (sizes[i + 1],))):
                self.layout.append((name, shape, off))
                off += int(np.prod(shape))
        self.n_params = off

    # -- parameters -----------------------------------------------------------------------
    def init_params(self, seed: int) -> np.ndarray:
        """Fresh weights: He-normal for relu, Glorot-uniform otherwise; zero biases."""
        return initial_slice(self.sizes, self.activation, 1, seed, 0, self.n_params)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named views (no copy) into a flat vector of this model's length."""
        if flat.shape != (self.n_params,):
            raise ValueError(f"flat vector has shape {flat.shape}, model needs ({self.n_params},)")
        return {name: flat[off:off + int(np.prod(shape))].reshape(shape)
                for name, shape, off in self.layout}

    def layers(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        v = self.views(flat)
        return [(v[f"layer{i}/W"], v[f"layer{i}/b"]) for i in range(self.n_layers)]

    def flatten(self, named: dict[str, np.ndarray]) -> np.ndarray:
        """The inverse of :meth:`views`: a new flat vector from named arrays."""
        return flatten_named(self, named)

    # -- computation ----------------------------------------------------------------------
    def forward(self, flat: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
        """Activations of every layer, input first; the last entry holds the logits."""
        acts = [x]
        for i, (W, b) in enumerate(self.layers(flat)):
            acts.append(dense(acts[-1], W, b,
                              self.activation if i < self.n_layers - 1 else None))
        return acts

    @staticmethod
    def _softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Mean cross-entropy and the softmax probabilities (computed stably)."""
        z = logits - logits.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        picked = z[np.arange(len(y)), y]
        loss = float(-np.mean(np.log(np.maximum(picked, 1e-30))))
        return loss, z

    @staticmethod
    def _softmax_xent_grad(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Mean cross-entropy and its gradient with respect to the logits (B, classes)."""
        loss, delta = MLP._softmax_xent(logits, y)
        delta[np.arange(len(y)), y] -= 1.0
        delta /= delta.dtype.type(len(y))
        return loss, delta

    def loss_and_parts(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray):
        """(mean loss, inputs, errors): ``inputs[l]`` is what layer l received (B, n_l) and
        ``errors[l]`` the error at its output (B, n_{l+1}), already divided by B, so that
        layer l's gradient is ``inputs[l].T @ errors[l]`` for W and ``errors[l].sum(0)`` for
        b. What Project Adam's workers send a parameter server instead of the gradient."""
        acts = self.forward(flat, x)
        loss, delta = self._softmax_xent_grad(acts[-1], y)
        params = self.layers(flat)
        errors = [delta]
        for i in range(self.n_layers - 1, 0, -1):
            delta = delta @ params[i][0].T
            _act_grad_inplace(self.activation, acts[i], delta)
            errors.append(delta)
        return loss, acts[:-1], errors[::-1]

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """Mean softmax cross-entropy over the batch and its gradient (flat, float32).

        ``grad``, when given, receives the gradient (it is overwritten, not accumulated).
        """
        if grad is None:
            grad = np.empty(self.n_params, dtype=np.float32)
        loss, inputs, errors = self.loss_and_parts(flat, x, y)
        for (gW, gb), a, e in zip(self.layers(grad), inputs, errors):
            np.matmul(a.T, e, out=gW)
            np.sum(e, axis=0, out=gb)
        return loss, grad

    def loss(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        return self._softmax_xent(self.forward(flat, x)[-1], y)[0]

    def evaluate(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch: int = 2000) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole split, in batches to bound memory."""
        total_loss, correct = 0.0, 0
        for lo in range(0, len(y), batch):
            logits = self.forward(flat, x[lo:lo + batch])[-1]
            loss, _ = self._softmax_xent(logits, y[lo:lo + batch])
            total_loss += loss * len(logits)
            correct += int(np.sum(np.argmax(logits, axis=1) == y[lo:lo + batch]))
        n = max(1, len(y))
        return total_loss / n, correct / n


# Rows of a weight matrix drawn at a time: bounds the float64 temporary of a fresh start.
_INIT_CHUNK = 1 << 20


def initial_slice(sizes, activation: str, parts: int, seed: int, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of the *global vector* of a fresh model: every partition's local
    vector (:class:`PartitionedMLP` layout) one after the other; with ``parts == 1``, the
    :class:`MLP` flat vector. Values are those of :meth:`MLP.init_params` whatever ``parts``.

    The weights are drawn from one generator, layer after layer, a block of rows at a time,
    and only the elements in [lo, hi) are kept: a rank holding 1/P of the model, or a server
    shard holding 1/S of it, needs memory for its slice, not for the whole model (drawing
    every value costs time, not memory).
    """
    sizes = tuple(int(n) for n in sizes)
    cols = [partition_widths(sizes[l + 1], parts, l) for l in range(len(sizes) - 1)]
    part_sizes = [sum((sizes[l] + 1) * (c[q][1] - c[q][0]) for l, c in enumerate(cols))
                  for q in range(parts)]
    if not 0 <= lo <= hi <= sum(part_sizes):
        raise ValueError(f"slice [{lo}, {hi}) outside the model's {sum(part_sizes)} values")
    out = np.zeros(hi - lo, dtype=np.float32)
    rng = np.random.default_rng(seed)
    base = np.cumsum([0] + part_sizes)  # where each partition's local vector starts
    offset = [0] * parts                # where layer l's W starts inside partition q
    for l in range(len(sizes) - 1):
        fan_in, fan_out = sizes[l], sizes[l + 1]
        rows = max(1, _INIT_CHUNK // fan_out)
        for r0 in range(0, fan_in, rows):
            r1 = min(fan_in, r0 + rows)
            if activation == "relu":
                block = rng.standard_normal((r1 - r0, fan_out)) * np.sqrt(2.0 / fan_in)
            else:
                lim = np.sqrt(6.0 / (fan_in + fan_out))
                block = rng.uniform(-lim, lim, (r1 - r0, fan_out))
            for q, (c0, c1) in enumerate(cols[l]):
                # partition q's W is (fan_in, c1 - c0), row-major: these rows are contiguous
                g0 = int(base[q]) + offset[q] + r0 * (c1 - c0)
                g1 = g0 + (r1 - r0) * (c1 - c0)
                a, b = max(g0, lo), min(g1, hi)
                if a < b:
                    out[a - lo:b - lo] = block[:, c0:c1].ravel()[a - g0:b - g0]
        for q, (c0, c1) in enumerate(cols[l]):  # past W and the (zero) biases
            offset[q] += (fan_in + 1) * (c1 - c0)
    return out


class InitialWeights:
    """The global vector of a fresh model (see :func:`initial_slice`), drawn slice by slice
    when indexed: a server shard takes ``weights[lo:hi]`` without the whole model ever
    existing on its rank. Only contiguous slices (step 1) are supported."""

    def __init__(self, sizes, activation: str, parts: int, seed: int):
        self.sizes, self.activation, self.parts, self.seed = sizes, activation, parts, seed
        self.n = sum(PartitionedMLP(sizes, activation, parts, 0).part_sizes)
        self.shape, self.dtype = (self.n,), np.dtype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("InitialWeights takes a contiguous slice, e.g. weights[lo:hi]")
        lo, hi, _ = key.indices(self.n)
        return initial_slice(self.sizes, self.activation, self.parts, self.seed, lo,
                             max(lo, hi))


def partition_widths(width: int, parts: int, layer: int) -> list[tuple[int, int]]:
    """Columns [lo, hi) of a layer of ``width`` neurons held by each of ``parts`` partitions.

    Split by :func:`hpcps.blocks.block_range` (sizes differ by at most one, the first
    partitions larger); a layer narrower than ``parts`` cannot give every partition a neuron
    and is refused.
    """
    if width < parts:
        raise ConfigError(f"layer {layer} has {width} neurons, fewer than --partitions {parts}: "
                          "every partition must hold at least one neuron of every layer")
    return [block_range(width, parts, p) for p in range(parts)]


def local_views(model, flat: np.ndarray, q: int) -> dict[str, np.ndarray]:
    """Named views (no copy) of partition ``q``'s local vector of a partitioned ``model``
    (its arrays ``model._shapes(q)`` one after the other)."""
    if flat.shape != (model.part_sizes[q],):
        raise ValueError(f"local vector has shape {flat.shape}, partition {q} needs "
                         f"({model.part_sizes[q]},)")
    out, off = {}, 0
    for name, shape in model._shapes(q):
        size = int(np.prod(shape))
        out[name] = flat[off:off + size].reshape(shape)
        off += size
    return out


class SingleExchange:
    """The exchange of an unpartitioned replica (P = 1): nothing crosses a boundary."""

    bytes_sent = 0
    wait_s = 0.0

    @staticmethod
    def gather(local_t: np.ndarray, widths) -> np.ndarray:
        return local_t

    @staticmethod
    def scatter_sum(partial_t: np.ndarray, widths) -> np.ndarray:
        return partial_t


class PartitionedMLP:
    """Partition ``part`` of ``parts`` of an :class:`MLP` (DistBelief-style model parallelism).

    This rank holds, for every layer, the columns of W and entries of b of its own slice of
    the layer's output neurons, and computes only those. Between layers the activations are
    exchanged inside the replica: ``exchange.gather`` concatenates every partition's block
    (each value goes once to each rank that needs it: in a fully connected layer, all of
    them). In the backward pass each partition's error terms contribute to every input
    neuron's error; ``exchange.scatter_sum`` sums those contributions and gives each partition
    the rows it owns. Blocks travel transposed, (neurons, batch), so each is contiguous.

    ``exchange`` is any object with ``gather(local_t, widths)`` and
    ``scatter_sum(partial_t, widths)``; this class does no communication itself. With
    ``parts == 1`` and :class:`SingleExchange` it computes exactly what :class:`MLP` does.

    Parameters
    ----------
    sizes, activation : as for :class:`MLP`.
    parts, part : number of partitions P and this rank's partition p.
    exchange : the replica's exchange (see above).
    """

    def __init__(self, sizes, activation: str, parts: int, part: int, exchange=SingleExchange):
        self.full = MLP(sizes, activation)
        self.sizes = self.full.sizes
        self.activation = activation
        self.n_layers = self.full.n_layers
        if not 0 <= part < parts:
            raise ValueError(f"partition {part} outside 0..{parts - 1}")
        self.parts, self.part = parts, part
        self.exchange = exchange
        # cols[l][q] = columns of layer l's output held by partition q
        self.cols = [partition_widths(self.sizes[l + 1], parts, l) for l in range(self.n_layers)]
        self.widths = [[hi - lo for lo, hi in c] for c in self.cols]
        self.part_sizes = [self._local_size(q) for q in range(parts)]
        self.n_params = self.part_sizes[part]

    def _local_size(self, q: int) -> int:
        return sum((self.sizes[l] + 1) * self.widths[l][q] for l in range(self.n_layers))

    def _shapes(self, q: int):
        for l in range(self.n_layers):
            w = self.widths[l][q]
            yield f"layer{l}/W", (self.sizes[l], w)
            yield f"layer{l}/b", (w,)

    def views(self, flat: np.ndarray, q: int | None = None) -> dict[str, np.ndarray]:
        """Named views of a partition's local vector (this rank's unless ``q`` is given)."""
        return local_views(self, flat, self.part if q is None else q)

    def layers(self, flat: np.ndarray):
        v = self.views(flat)
        return [(v[f"layer{i}/W"], v[f"layer{i}/b"]) for i in range(self.n_layers)]

    # -- whole layers <-> partition slices (checkpoints hold whole layers) -------------------
    def local_from_full(self, named: dict[str, np.ndarray], q: int | None = None) -> np.ndarray:
        """Partition ``q``'s local vector cut out of whole-layer arrays."""
        q = self.part if q is None else q
        flat = np.empty(self.part_sizes[q], dtype=np.float32)
        mine = self.views(flat, q)
        for l in range(self.n_layers):
            lo, hi = self.cols[l][q]
            mine[f"layer{l}/W"][...] = named[f"layer{l}/W"][:, lo:hi]
            mine[f"layer{l}/b"][...] = named[f"layer{l}/b"][lo:hi]
        return flat

    def full_from_parts(self, locals_) -> np.ndarray:
        """The unpartitioned flat vector (MLP layout) assembled from every partition's local."""
        flat = np.empty(self.full.n_params, dtype=np.float32)
        whole = self.full.views(flat)
        for q, local in enumerate(locals_):
            part = self.views(local, q)
            for l in range(self.n_layers):
                lo, hi = self.cols[l][q]
                whole[f"layer{l}/W"][:, lo:hi] = part[f"layer{l}/W"]
                whole[f"layer{l}/b"][lo:hi] = part[f"layer{l}/b"]
        return flat

    def init_params(self, seed: int) -> np.ndarray:
        """This partition's slice of the weights MLP.init_params(seed) would give: the same
        model whatever P is, drawn without holding the whole model."""
        lo = sum(self.part_sizes[:self.part])
        return initial_slice(self.sizes, self.activation, self.parts, seed, lo,
                             lo + self.n_params)

    # -- computation -------------------------------------------------------------------------
    def forward(self, flat: np.ndarray, x: np.ndarray):
        """(full activations of every layer, this partition's activated outputs per layer).

        The last full activation is the whole logits matrix, the same on every partition.
        """
        full, own = [x], []
        a = x
        for l, (W, b) in enumerate(self.layers(flat)):
            z = dense(a, W, b, self.activation if l < self.n_layers - 1 else None)
            own.append(z)
            whole_t = self.exchange.gather(np.ascontiguousarray(z.T), self.widths[l])
            a = whole_t.T
            full.append(a)
        return full, own

    def loss_and_grad(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """Mean softmax cross-entropy of the whole replica and this partition's gradient."""
        if grad is None:
            grad = np.empty(self.n_params, dtype=np.float32)
        full, own = self.forward(flat, x)
        loss, probs = MLP._softmax_xent_grad(full[-1], y)
        lo, hi = self.cols[-1][self.part]
        delta = probs[:, lo:hi]
        gviews = self.layers(grad)
        params = self.layers(flat)
        for l in range(self.n_layers - 1, -1, -1):
            gW, gb = gviews[l]
            np.matmul(full[l].T, delta, out=gW)
            np.sum(delta, axis=0, out=gb)
            if l > 0:
                # this partition's share of every input neuron's error, summed across
                # partitions; each gets back the rows (neurons) it owns
                partial_t = params[l][0] @ delta.T
                mine_t = self.exchange.scatter_sum(partial_t, self.widths[l - 1])
                delta = np.ascontiguousarray(mine_t.T)
                _act_grad_inplace(self.activation, own[l - 1], delta)
        return loss, grad

    def evaluate(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch: int = 2000) -> tuple[float, float]:
        """(mean loss, accuracy) computed jointly by the replica's partitions."""
        total_loss, correct = 0.0, 0
        for lo in range(0, len(y), batch):
            logits = self.forward(flat, x[lo:lo + batch])[0][-1]
            loss, _ = MLP._softmax_xent(logits, y[lo:lo + batch])
            total_loss += loss * len(logits)
            correct += int(np.sum(np.argmax(logits, axis=1) == y[lo:lo + batch]))
        n = max(1, len(y))
        return total_loss / n, correct / n
