"""Click-through models: embedding tables, then fully connected layers, logistic loss. No MPI.

The model of an ``embedD[:sum|:mean],fcN,...,fc1`` spec (:func:`hpcps.model.spec.parse_ctr_spec`,
``docs/ctr.md``) on a categorical dataset (``hpcps.io.data.categorical``: a batch is an int64
id matrix, one column per position, a multi-valued field a fixed-width block padded with
-1, plus optional dense float features and 0/1 labels):

- every field f has its own table (ids 0..V_f-1 of that field; table number f); the rows
  of a field's ids are pooled (sum or mean over its non-padding positions; zeros when it
  has none) into one d-vector;
- the F pooled vectors and the D dense features are concatenated, (B, F*d + D), and go
  through the fc layers (the activation after every one but the last);
- the last layer is one unit, its output the logit z: P(y = 1) = sigmoid(z), the loss the
  mean binary cross-entropy over the batch.

Split the way the parameter server needs it: the embedding rows are not in the flat dense
vector. The flat vector holds the fc layers exactly as :class:`hpcps.model.mlp.MLP` lays them
out (``layer0/W`` (F*d + D, n1), ``layer0/b``, ...), so the dense layers keep the strategies'
path. A step first turns the batch's ids into the unique ids of each table
(:meth:`CtrModel.lookup`, the kernel ``unique_ids``), the caller pulls those rows (from
shards, or from local stores), and :meth:`CtrModel.loss_and_grad` takes them and returns
the loss, the dense gradient (flat) and each table's row gradients for its unique ids:
the gradient of the mean loss, summed over the positions that used the row
(``segment_sum``), what a replica pushes.

Float32 runs the compiled kernels of :mod:`hpcps.kernels.embedding` (their NumPy references
where the extension is not built); float64 (the finite-difference tests) runs the NumPy
references directly, since the kernels take float32 only.

:class:`LocalTrainer` trains a model in one process on tables it is handed (the shard's
``hpcps.ps.embedding_store.EmbeddingStore``, one per table: the model layer does not import
the server): the NumPy reference a replica with one shard is compared against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hpcps.errors import ConfigError
from hpcps.kernels import embedding, reference
from hpcps.model.layers import fc_backward, fc_forward
from hpcps.model.metrics import binary_labels, binary_metrics, sigmoid
from hpcps.model.mlp import ACTIVATIONS, MLP
from hpcps.model.optim import Adagrad
from hpcps.model.spec import parse_ctr_spec


@dataclass(frozen=True)
class BatchIds:
    """A batch's ids as the tables see them (:meth:`CtrModel.lookup`).

    Attributes
    ----------
    uniq : tuple of numpy.ndarray
        Per table, its unique ids in the batch (int64, first-seen order): the rows to pull.
    inverse : numpy.ndarray
        (B, P) int64: position (b, c)'s row in the tables' pulled rows stacked in table
        order (``starts[t] + k`` for ``uniq[t][k]``), -1 at padding.
    starts : numpy.ndarray
        (T + 1,) int64: where each table's rows start in that stack.
    """

    uniq: tuple[np.ndarray, ...]
    inverse: np.ndarray
    starts: np.ndarray

    @property
    def size(self) -> int:
        """Examples in the batch."""
        return int(self.inverse.shape[0])

    @property
    def n_rows(self) -> int:
        """Unique rows over all tables."""
        return int(self.starts[-1])


class CtrModel:
    """An embedding model of ``spec`` on fields of ``widths`` positions.

    Parameters
    ----------
    spec : str
        ``embedD[:sum|:mean],fcN,...,fc1`` or a preset (``ctr-dnn``, ``movielens``).
    widths : sequence of int
        Positions (id columns) of each field, in column order: 1 for a single-valued field.
    n_dense : int, optional
        Dense float features per example, concatenated after the embeddings.
    vocab : sequence of int, optional
        Ids each field's table holds (0..V-1); ids at or past V are refused. None: no bound
        (ids are any int64 >= 0, as the server's tables take them).
    activation : str, optional
        After every fc layer but the last: relu (default), tanh or sigmoid.

    Raises
    ------
    ConfigError
        A bad spec, no field, a width or vocabulary below 1, ``n_dense < 0``, an unknown
        activation.
    """

    def __init__(self, spec: str, widths: Sequence[int], n_dense: int = 0,
                 vocab: Sequence[int] | None = None, activation: str = "relu"):
        self.spec = parse_ctr_spec(spec)
        self.spec_text = self.spec.text
        widths = tuple(int(w) for w in widths)
        if not widths or min(widths) < 1:
            raise ConfigError(f"an embedding model needs at least one field, each at least one "
                              f"position wide; got widths {list(widths)}")
        if int(n_dense) < 0:
            raise ConfigError(f"n_dense must be >= 0, got {n_dense}")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {activation!r}; choose one of {ACTIVATIONS}")
        self.widths = widths
        self.n_fields = self.n_tables = len(widths)
        self.n_dense = int(n_dense)
        self.dim = self.spec.dim
        self.pooling = self.spec.pooling
        self.offsets = embedding.field_offsets(widths)
        self.n_columns = int(self.offsets[-1])
        self.vocab: tuple[int, ...] | None = None
        if vocab is not None:
            self.vocab = tuple(int(v) for v in vocab)
            if len(self.vocab) != self.n_fields or min(self.vocab) < 1:
                raise ConfigError(f"vocab must give >= 1 ids for each of the {self.n_fields} "
                                  f"fields, got {list(self.vocab)}")
            self._col_vocab = np.repeat(np.array(self.vocab, dtype=np.int64), widths)
        self.activation = activation
        self.dot = self.spec.dot
        # DLRM's dot interaction: the dot product of every pair of fields' pooled embeddings
        self._pairs = np.triu_indices(self.n_fields, 1)
        self.n_pairs = len(self._pairs[0]) if self.dot else 0
        self.input_width = self.n_fields * self.dim + self.n_dense + self.n_pairs
        self.mlp = MLP((self.input_width,) + self.spec.fc, activation)
        self.sizes = self.mlp.sizes
        self.layout = self.mlp.layout
        self.n_params = self.mlp.n_params
        self.n_layers = self.mlp.n_layers

    @classmethod
    def for_fields(cls, spec: str, fields: Sequence[Any], n_dense: int = 0,
                   activation: str = "relu") -> "CtrModel":
        """The model of ``spec`` on a dataset's fields (objects with ``width`` and ``vocab``,
        as ``hpcps.io.data.categorical.Field``)."""
        return cls(spec, [f.width for f in fields], n_dense, [f.vocab for f in fields],
                   activation)

    def __repr__(self) -> str:
        return (f"CtrModel({self.spec_text!r}, {self.n_fields} fields, {self.n_dense} dense, "
                f"{self.n_params} dense parameters)")

    # -- the dense parameters ----------------------------------------------------------------
    def init_params(self, seed: int) -> np.ndarray:
        """The fc layers' fresh weights, as :meth:`MLP.init_params` draws them."""
        return self.mlp.init_params(seed)

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return self.mlp.views(flat)

    def flatten(self, named: dict[str, np.ndarray]) -> np.ndarray:
        return self.mlp.flatten(named)

    # -- ids -> rows to pull -------------------------------------------------------------------
    def lookup(self, ids: np.ndarray) -> BatchIds:
        """The unique ids of each table in a batch and where each position's row is.

        Parameters
        ----------
        ids : numpy.ndarray
            (B, P) integer ids, P the model's columns; -1 is padding (no value).

        Raises
        ------
        ValueError
            Not a 2-D integer array of P columns, an id below -1, or past its field's
            vocabulary (the message names the first bad row, column and field).
        """
        if not isinstance(ids, np.ndarray) or ids.ndim != 2 or ids.shape[1] != self.n_columns:
            shape = getattr(ids, "shape", type(ids).__name__)
            raise ValueError(f"ids must be a (batch, {self.n_columns}) array (the fields' "
                             f"widths {list(self.widths)}), got {shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be integers (int64), got {ids.dtype}")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        bad = ids < -1
        if self.vocab is not None:
            bad |= ids >= self._col_vocab
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            f = int(np.searchsorted(self.offsets, c, side="right")) - 1
            bound = "" if self.vocab is None else f" and below {self.vocab[f]}"
            raise ValueError(f"{int(bad.sum())} id(s) out of range: ids are >= 0{bound} "
                             f"(-1: padding); the first is row {r}, column {c} (field {f}): "
                             f"{ids[r, c]}")
        inverse = np.empty_like(ids)
        uniq, starts = [], [0]
        for f in range(self.n_fields):
            c0, c1 = int(self.offsets[f]), int(self.offsets[f + 1])
            u, inv = embedding.unique_ids(np.ascontiguousarray(ids[:, c0:c1]))
            inverse[:, c0:c1] = np.where(inv >= 0, inv + starts[-1], -1)
            uniq.append(u)
            starts.append(starts[-1] + u.shape[0])
        return BatchIds(tuple(uniq), inverse, np.array(starts, dtype=np.int64))

    # -- computation -------------------------------------------------------------------------
    def _stack(self, rows: Sequence[np.ndarray], batch: BatchIds, dtype) -> np.ndarray:
        if len(rows) != self.n_tables:
            raise ValueError(f"rows must hold one array per table ({self.n_tables}), "
                             f"got {len(rows)}")
        for t, (r, u) in enumerate(zip(rows, batch.uniq)):
            if not isinstance(r, np.ndarray) or r.shape != (u.shape[0], self.dim):
                raise ValueError(f"rows[{t}] must be ({u.shape[0]}, {self.dim}): the rows of "
                                 f"table {t}'s unique ids, got "
                                 f"{getattr(r, 'shape', type(r).__name__)}")
        return np.ascontiguousarray(np.concatenate(rows, axis=0), dtype=dtype)

    def _input(self, flat: np.ndarray, rows, batch: BatchIds, dense) -> np.ndarray:
        """(B, F*d + D): the pooled embeddings of every field, then the dense features."""
        dtype = flat.dtype
        stacked = self._stack(rows, batch, dtype)
        B = batch.size
        if self.n_dense:
            if dense is None or np.shape(dense) != (B, self.n_dense):
                raise ValueError(f"dense must be ({B}, {self.n_dense}), got "
                                 f"{None if dense is None else np.shape(dense)}")
        elif dense is not None and np.size(dense):
            raise ValueError(f"the model takes no dense features, got {np.shape(dense)}")
        pooled = np.empty((B, self.n_fields, self.dim), dtype=dtype)
        if dtype == np.float32:
            embedding.gather(stacked, batch.inverse, self.offsets, self.pooling, out=pooled)
        else:
            reference.gather_pooled(stacked, batch.inverse, self.offsets,
                                    self.pooling == "mean", pooled)
        if not self.n_dense and not self.dot:
            return pooled.reshape(B, -1)      # (B, F, d) is (B, F*d) already: no copy
        x = np.empty((B, self.input_width), dtype=dtype)
        emb = self.n_fields * self.dim
        x[:, :emb] = pooled.reshape(B, -1)
        x[:, emb:emb + self.n_dense] = dense if self.n_dense else 0.0
        if self.dot:
            x[:, emb + self.n_dense:] = self._dots(pooled)
        return x

    def _dots(self, pooled: np.ndarray) -> np.ndarray:
        """(B, F(F-1)/2): e_i . e_j of every pair i < j of the fields' pooled embeddings."""
        gram = np.matmul(pooled, pooled.transpose(0, 2, 1))
        return gram[:, self._pairs[0], self._pairs[1]]

    def _forward(self, flat: np.ndarray, x: np.ndarray):
        caches, a = [], x
        for i, (W, b) in enumerate(self.mlp.layers(flat)):
            last = i == self.n_layers - 1
            a, cache = fc_forward(a, W, b, self.activation, last)
            caches.append(cache)
        return a[:, 0], caches

    def logits(self, flat: np.ndarray, rows: Sequence[np.ndarray], batch: BatchIds,
               dense: np.ndarray | None = None) -> np.ndarray:
        """(B,) logits z of the batch: P(y = 1) = sigmoid(z)."""
        return self._forward(flat, self._input(flat, rows, batch, dense))[0]

    def loss_and_grad(self, flat: np.ndarray, rows: Sequence[np.ndarray], batch: BatchIds,
                      y: np.ndarray, dense: np.ndarray | None = None,
                      grad: np.ndarray | None = None
                      ) -> tuple[float, np.ndarray, list[np.ndarray]]:
        """Mean binary cross-entropy of the batch, its dense gradient and its row gradients.

        Parameters
        ----------
        flat : numpy.ndarray
            (n_params,) the fc layers; float32, or float64 for finite-difference checks.
        rows : sequence of numpy.ndarray
            ``rows[t]`` (len(batch.uniq[t]), d): table t's rows of its unique ids, as
            pulled (cast to ``flat``'s dtype).
        batch : BatchIds
            From :meth:`lookup`.
        y : numpy.ndarray
            (B,) labels 0/1.
        dense : numpy.ndarray, optional
            (B, D) dense features, when the model has them.
        grad : numpy.ndarray, optional
            Receives the dense gradient (overwritten).

        Returns
        -------
        loss : float
        grad : numpy.ndarray
            (n_params,) gradient of the mean loss with respect to ``flat``.
        row_grads : list of numpy.ndarray
            ``row_grads[t]`` (len(batch.uniq[t]), d): the gradient of the mean loss with
            respect to each of table t's pulled rows, summed over the positions that used
            it. Views of one array, each C-contiguous.

        Raises
        ------
        ValueError
            Labels not 0/1 or not one per example, rows or dense features of the wrong shape.
        """
        if flat.shape != (self.n_params,):
            raise ValueError(f"flat has shape {flat.shape}, the model needs ({self.n_params},)")
        B = batch.size
        t = binary_labels(y, B).astype(flat.dtype)
        x = self._input(flat, rows, batch, dense)
        z, caches = self._forward(flat, x)
        loss = float(np.mean(np.logaddexp(0.0, z) - t * z))
        delta = ((sigmoid(z) - t) / B).astype(flat.dtype).reshape(B, 1)
        if grad is None:
            grad = np.empty(self.n_params, dtype=flat.dtype)
        params = self.mlp.layers(flat)
        gviews = self.mlp.layers(grad)
        for i in range(self.n_layers - 1, -1, -1):
            gW, gb = gviews[i]
            _, delta = fc_backward(caches[i], delta, self.activation, i == self.n_layers - 1,
                                   gW, gb, params[i][0])
        # delta: (B, F*d + D), the error at the input; its embedding part goes to the rows
        d_emb = np.ascontiguousarray(delta[:, :self.n_fields * self.dim]).reshape(
            B, self.n_fields, self.dim)
        if self.dot:  # d(e_i . e_j) = g_ij e_j for e_i, g_ij e_i for e_j
            F = self.n_fields
            pooled = x[:, :F * self.dim].reshape(B, F, self.dim)
            g = np.zeros((B, F, F), dtype=flat.dtype)
            g[:, self._pairs[0], self._pairs[1]] = delta[:, F * self.dim + self.n_dense:]
            d_emb += np.matmul(g + g.transpose(0, 2, 1), pooled)
        stacked = np.empty((batch.n_rows, self.dim), dtype=flat.dtype)
        if flat.dtype == np.float32:
            embedding.segment_sum(d_emb, batch.inverse, batch.n_rows, self.offsets,
                                  self.pooling, out=stacked)
        else:
            reference.segment_sum(d_emb, batch.inverse, self.offsets, self.pooling == "mean",
                                  stacked)
        s = batch.starts
        row_grads = [stacked[s[k]:s[k + 1]] for k in range(self.n_tables)]
        return loss, grad, row_grads

    def loss(self, flat: np.ndarray, rows: Sequence[np.ndarray], batch: BatchIds,
             y: np.ndarray, dense: np.ndarray | None = None) -> float:
        """The mean binary cross-entropy alone (no backward pass)."""
        z = self.logits(flat, rows, batch, dense)
        t = binary_labels(y, batch.size).astype(z.dtype)
        return float(np.mean(np.logaddexp(0.0, z) - t * z))


class LocalTrainer:
    """A :class:`CtrModel` trained in one process: the NumPy reference of a replica and
    its shards.

    Each step looks the batch's ids up, pulls the unique rows from ``tables``, computes the
    loss and gradients, applies the dense gradient with ``optimizer`` and pushes each
    table's row gradients to it (``table.push``, the table's own row optimizer: per-row
    Adagrad by default in ``EmbeddingStore``). What a replica with one shard does, without
    the messages.

    Parameters
    ----------
    model : CtrModel
    tables : sequence
        One per table (``model.n_tables``), each with ``dim``, ``pull(ids) -> rows`` (rows
        created on first touch) and ``push(ids, grads, lr)``: an
        ``hpcps.ps.embedding_store.EmbeddingStore(model.dim, table=t, seed=...)``.
    seed : int
        The fc layers' initial weights (:meth:`CtrModel.init_params`).
    lr : float
        The dense optimizer's rate (default optimizer: Adagrad, as a shard applies it).
    row_lr : float, optional
        The rate handed to ``push``; ``lr`` by default.
    optimizer : optional
        Anything with ``init_state(n)`` and ``apply(w, g, state)``
        (``hpcps.model.optim``); ``Adagrad(lr)`` by default.

    Attributes
    ----------
    flat : numpy.ndarray
        The fc layers' parameters (float32).
    steps : int
        Steps taken.
    """

    def __init__(self, model: CtrModel, tables: Sequence[Any], *, seed: int = 0,
                 lr: float = 0.05, row_lr: float | None = None, optimizer: Any = None,
                 row_l2: float = 0.0):
        if len(tables) != model.n_tables:
            raise ValueError(f"the model has {model.n_tables} tables, {len(tables)} given")
        for t, table in enumerate(tables):
            if getattr(table, "dim", model.dim) != model.dim:
                raise ValueError(f"table {t} holds rows of {table.dim}, the model embeds in "
                                 f"{model.dim}")
        self.model, self.tables = model, list(tables)
        self.flat = model.init_params(seed)
        self.optimizer = optimizer if optimizer is not None else Adagrad(lr)
        self.state = self.optimizer.init_state(model.n_params)
        self.row_lr = float(lr if row_lr is None else row_lr)
        self.row_l2 = float(row_l2)
        self._grad = np.empty(model.n_params, dtype=np.float32)
        self.steps = 0

    def pull(self, batch: BatchIds) -> list[np.ndarray]:
        """Each table's rows of the batch's unique ids (created on first touch)."""
        return [table.pull(u) for table, u in zip(self.tables, batch.uniq)]

    def step(self, ids: np.ndarray, y: np.ndarray, dense: np.ndarray | None = None) -> float:
        """One SGD step on a batch; returns its loss (before the update)."""
        batch = self.model.lookup(ids)
        loss, grad, row_grads = self.model.loss_and_grad(self.flat, self.pull(batch), batch,
                                                         y, dense, grad=self._grad)
        self.optimizer.apply(self.flat, grad, self.state)
        for table, u, g in zip(self.tables, batch.uniq, row_grads):
            table.push(u, g, self.row_lr, l2=self.row_l2) if self.row_l2 else \
                table.push(u, g, self.row_lr)
        self.steps += 1
        return loss

    def logits(self, ids: np.ndarray, dense: np.ndarray | None = None,
               batch_size: int = 4096) -> np.ndarray:
        """(N,) logits of every row, in batches (ids not seen yet get their initial rows)."""
        out = np.empty(ids.shape[0], dtype=np.float32)
        for lo in range(0, ids.shape[0], batch_size):
            hi = min(ids.shape[0], lo + batch_size)
            batch = self.model.lookup(ids[lo:hi])
            out[lo:hi] = self.model.logits(self.flat, self.pull(batch), batch,
                                           None if dense is None else dense[lo:hi])
        return out

    def evaluate(self, ids: np.ndarray, y: np.ndarray,
                 dense: np.ndarray | None = None) -> dict[str, float]:
        """``{"auc", "log_loss"}`` over the rows (:func:`hpcps.model.metrics.binary_metrics`)."""
        return binary_metrics(y, self.logits(ids, dense).astype(np.float64))
