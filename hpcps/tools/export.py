"""Export a trained checkpoint for inference elsewhere: ONNX, or NumPy arrays plus JSON.

Usage::

    python -m hpcps.export runs/mnist/checkpoint.h5 --onnx model.onnx
    python -m hpcps.export runs/mnist/checkpoint.h5 --npz model.npz
    python -m hpcps.export CKPT --onnx model.onnx --npz model.npz     # both

One process, no MPI. The model is rebuilt as :mod:`hpcps.tools.evaluate` rebuilds it (an MLP,
or the conv net the checkpoint's config names), so what is exported computes what
``python -m hpcps.evaluate`` reports.

``--onnx OUT.onnx`` (the ``onnx`` package: ``pip install 'hpcps[export]'``)
    One input ``x``, float32 (N, D): rows as in the dataset (an image flattened C, H, W).
    Two outputs: ``logits`` (N, C) and ``probabilities`` (N, C, their softmax). An MLP is
    Gemm and its activation (Relu, Tanh, Sigmoid) per layer; a conv net starts with a Reshape
    to (N, C, H, W), then Conv (hpcps's kernels are already ONNX's (out, in, kh, kw)
    cross-correlation) and MaxPool, a Flatten before the first fully connected layer (ONNX's
    NCHW flattens C, H, W, the order hpcps's fc layers read: hpcps computes NHWC inside and
    flattens C, H, W too, so no transpose is needed), then Gemm. Opset 17.
``--npz OUT.npz``
    Every weight by its layer name (``layer0/W``, ``layer0/b``, ... as in the checkpoint:
    conv kernels (out, in, kh, kw), fc weights (fan_in, fan_out) with y = act(x @ W + b)) and
    ``architecture``: a 0-d string array holding JSON (layers in order, their shapes and
    activation, the input layout), read with ``json.loads(str(np.load(OUT)["architecture"]))``.
    ``np.load`` needs no pickle for it.

An embedding model (``--model embed...``) is exported with whole tables, a row for every id of
each field's vocabulary: the table files' rows, and for an id they do not hold the row the run
would have read (its initial row, or zeros with ``--admit-after`` > 1), so the export computes
what ``hpcps.evaluate`` computes on any id. Its ONNX model takes ``ids`` int64 (N, P), -1 for
no value, and ``dense`` float32 (N, D) when the data have dense features, and gives ``logits``
(N, 1) and ``probabilities`` (N, 2); tables past :data:`INLINE_BYTES` go to ``OUT.onnx.data``
(ONNX external data). Its .npz holds ``table<f>`` (V_f, d) beside the fc layers.

Every file is written atomically (a temporary file renamed onto OUT). Refusals: exit code 4
for a checkpoint that is missing, corrupt or non-finite, or whose table files are missing; 2
for options (no output named, an unknown suffix, a missing directory, ``onnx`` not
installed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcps import __version__
from hpcps.errors import CheckpointError, ConfigError, HpcpsError
from hpcps.io import checkpoint
from hpcps.model.convnet import ConvNet
from hpcps.model.ctr import CtrModel
from hpcps.model.mlp import MLP
from hpcps.model.spec import is_embedding_spec
from hpcps.tools.evaluate import model_of, table_stores

OPSET = 17
_ONNX_ACT = {"relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid"}


def architecture(model: MLP | ConvNet, ckpt: checkpoint.Checkpoint) -> dict[str, Any]:
    """The model as plain JSON-able data: kind, input layout, layers in order."""
    act = model.activation
    layers: list[dict[str, Any]] = []
    if isinstance(model, ConvNet):
        for op in model.ops:
            s = op.spec
            entry: dict[str, Any] = {"op": s.kind, "text": s.text,
                                     "in_shape": list(op.in_shape),
                                     "out_shape": list(op.out_shape)}
            if s.kind == "conv":
                entry.update(name=f"layer{op.param}", kernel=[s.kh, s.kw], maps=s.out,
                             stride=s.stride, pad=s.pad, activation=act,
                             weights="W (out_maps, in_maps, kh, kw), cross-correlation; b")
            elif s.kind == "pool":
                entry.update(kind="max", size=s.kh, stride=s.stride)
            elif s.kind == "fc":
                entry.update(name=f"layer{op.param}", units=s.out,
                             activation=None if op.last else act,
                             weights="W (fan_in, fan_out), y = act(x @ W + b); the input is "
                                     "the maps flattened C, H, W")
            layers.append(entry)
        kind = "conv"
        extra: dict[str, Any] = {"spec": model.spec_text, "input_shape": list(model.input_shape)}
        rows = (f"rows of {model.n_features} values: one {'x'.join(map(str, model.input_shape))}"
                " image each, flattened C, H, W")
    else:
        for i in range(len(model.sizes) - 1):
            last = i == len(model.sizes) - 2
            layers.append({"op": "fc", "name": f"layer{i}", "in": model.sizes[i],
                           "units": model.sizes[i + 1], "activation": None if last else act,
                           "weights": "W (fan_in, fan_out), y = act(x @ W + b)"})
        kind = "mlp"
        extra = {"layer_sizes": list(model.sizes)}
        rows = f"rows of {model.sizes[0]} features"
    return {"format": "hpcps-model", "hpcps_version": __version__, "kind": kind, **extra,
            "input": rows, "n_features": int(model.sizes[0]), "n_classes": int(model.sizes[-1]),
            "activation": act, "layers": layers,
            "output": "logits; the softmax of them gives the class probabilities",
            "step": int(ckpt.step), "trained_on": ckpt.dataset.get("name")}


def onnx_model(model: MLP | ConvNet, named: dict[str, np.ndarray], doc: str = ""):
    """An ``onnx.ModelProto`` computing ``logits`` and ``probabilities`` from ``x``."""
    onnx, helper, numpy_helper, TensorProto = _onnx()
    nodes: list = []
    inits: list = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def act(h: str, out: str) -> str:
        nodes.append(helper.make_node(_ONNX_ACT[model.activation], [h], [out]))
        return out

    h = "x"
    if isinstance(model, ConvNet):
        c, hh, ww = model.input_shape
        shape = const("image_shape", np.array([-1, c, hh, ww], dtype=np.int64))
        nodes.append(helper.make_node("Reshape", [h, shape], ["images"]))
        h, four_d = "images", True
        for i, op in enumerate(model.ops):
            s = op.spec
            if s.kind == "conv":
                W, b = named[f"layer{op.param}/W"], named[f"layer{op.param}/b"]
                out = f"conv{op.param}"
                nodes.append(helper.make_node(
                    "Conv", [h, const(f"layer{op.param}/W", W), const(f"layer{op.param}/b", b)],
                    [out], kernel_shape=[s.kh, s.kw], strides=[s.stride, s.stride],
                    pads=[s.pad] * 4))
                h = act(out, f"{out}_{model.activation}")
            elif s.kind == "pool":
                out = f"pool{i}"
                nodes.append(helper.make_node("MaxPool", [h], [out], kernel_shape=[s.kh, s.kh],
                                              strides=[s.stride, s.stride]))
                h = out
            if s.kind in ("flatten", "fc") and four_d:
                nodes.append(helper.make_node("Flatten", [h], [f"flat{i}"], axis=1))
                h, four_d = f"flat{i}", False
            if s.kind == "fc":
                h = _gemm(nodes, const, named, op.param, h, op.last, act)
    else:
        n = len(model.sizes) - 1
        for i in range(n):
            h = _gemm(nodes, const, named, i, h, i == n - 1, act)
    nodes.append(helper.make_node("Identity", [h], ["logits"]))
    nodes.append(helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1))
    n_in, n_out = int(model.sizes[0]), int(model.sizes[-1])
    graph = helper.make_graph(
        nodes, "hpcps",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_out]),
         helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", n_out])],
        inits)
    return _finished(onnx, helper, graph, doc)


def _onnx():
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        raise ConfigError("--onnx needs the onnx package, the optional extra 'export': "
                          "pip install 'hpcps[export]' (or pip install onnx)") from exc
    return onnx, helper, numpy_helper, TensorProto


def _finished(onnx, helper, graph, doc: str, check: bool = True):
    """The model of ``graph``, checked (``check``: a model too large for one protobuf message
    is checked from its file instead, :func:`_external`)."""
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="hpcps", producer_version=__version__,
                              doc_string=doc)
    # the IR version of the oldest onnxruntime that runs opset 17, not the newest onnx's
    proto.ir_version = min(onnx.IR_VERSION, 8)
    if check:
        onnx.checker.check_model(proto)
    return proto


def _gemm(nodes: list, const, named: dict, layer: int, h: str, last: bool, act) -> str:
    from onnx import helper
    out = f"fc{layer}"
    nodes.append(helper.make_node(
        "Gemm", [h, const(f"layer{layer}/W", named[f"layer{layer}/W"]),
                 const(f"layer{layer}/b", named[f"layer{layer}/b"])], [out]))
    return out if last else act(out, f"{out}_act")


def _atomic(path: Path, write) -> Path:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_out(path: str, suffix: str, option: str) -> Path:
    """Refuse (ConfigError) an output with another suffix or in a missing directory."""
    p = Path(path)
    if p.suffix.lower() != suffix:
        raise ConfigError(f"{option} {p}: the name must end in {suffix}")
    if not p.parent.is_dir():
        raise ConfigError(f"{option} {p}: directory {p.parent} does not exist")
    if p.is_dir():
        raise ConfigError(f"{option} {p} is a directory; name a file")
    return p


def export(ckpt_path: str | os.PathLike, onnx_path: str | None = None,
           npz_path: str | None = None) -> list[str]:
    """Write the requested files; return one note per file written."""
    if onnx_path is None and npz_path is None:
        raise ConfigError("name an output: --onnx OUT.onnx and/or --npz OUT.npz")
    outs = {"onnx": check_out(onnx_path, ".onnx", "--onnx") if onnx_path else None,
            "npz": check_out(npz_path, ".npz", "--npz") if npz_path else None}
    ckpt = checkpoint.load(ckpt_path)
    if is_embedding_spec(ckpt.config.get("model")):
        return _export_embedding(ckpt_path, ckpt, outs)
    model, flat = model_of(ckpt)
    named = {k: np.asarray(v, dtype=np.float32) for k, v in model.views(flat).items()}
    arch = architecture(model, ckpt)
    notes = []
    if outs["onnx"] is not None:
        proto = onnx_model(model, named, doc=f"hpcps checkpoint {ckpt_path}, step {ckpt.step}: "
                           + json.dumps({k: arch[k] for k in ("kind", "input", "output")}))
        _atomic(outs["onnx"], lambda f: f.write(proto.SerializeToString()))
        notes.append(f"wrote {outs['onnx']} (ONNX opset {OPSET}: input x (N, "
                     f"{model.sizes[0]}), outputs logits and probabilities (N, "
                     f"{model.sizes[-1]}))")
    if outs["npz"] is not None:
        _write_npz(outs["npz"], named, arch)
        notes.append(f"wrote {outs['npz']} ({len(named)} arrays by layer name + architecture)")
    return notes


def _write_npz(path: Path, named: dict[str, np.ndarray], arch: dict[str, Any]) -> None:
    arrays: dict[str, Any] = dict(named)
    arrays["architecture"] = np.array(json.dumps(arch, indent=1))
    _atomic(path, lambda f: np.savez(f, **arrays))


# -- embedding models ------------------------------------------------------------------------
# Tables larger than this (bytes, all together) go to an external data file beside the ONNX
# model (protobuf cannot hold a message of 2 GiB)
INLINE_BYTES = 1 << 30


def embedding_model(ckpt_path, ckpt: checkpoint.Checkpoint
                    ) -> tuple[CtrModel, np.ndarray, list[np.ndarray], list[str]]:
    """An embedding model's checkpoint as whole tables: (model, flat fc layers, one
    (V_f, d) float32 array per field holding every id's row, field names). A row the table
    files do not hold is the row the run would have read for it (its initial row, or zeros
    with ``--admit-after`` > 1), so the tables compute what ``hpcps.evaluate`` computes."""
    cfg, ds = ckpt.config, ckpt.dataset or {}
    try:
        fields = [(str(n), int(w), int(v)) for n, w, v in ds["fields"]]
        n_dense = int(ds.get("n_dense", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_path}: its dataset record names no categorical fields "
                              f"({exc!r}); it was not written by an embedding run") from None
    model = CtrModel(cfg["model"], [w for _, w, _ in fields], n_dense,
                     [v for _, _, v in fields], cfg.get("activation", "relu"))
    try:
        flat = model.flatten(ckpt.params)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_path}: its parameters are not those of "
                              f"{model.spec_text} on its fields: {exc}") from None
    stores, _ = table_stores(ckpt_path, ckpt, model)
    full = [store.peek(np.arange(v, dtype=np.int64)) for store, (_, _, v) in zip(stores, fields)]
    return model, flat, full, [n for n, _, _ in fields]


def embedding_architecture(model: CtrModel, names: list[str], ckpt: checkpoint.Checkpoint
                           ) -> dict[str, Any]:
    """An embedding model as plain JSON-able data: fields and their tables, the input, the
    fc layers, the output."""
    act = model.activation
    cols = [int(c) for c in model.offsets]
    fields = [{"name": n, "table": f"table{f}", "columns": [cols[f], cols[f + 1]],
               "width": model.widths[f], "vocab": int((model.vocab or ())[f])}
              for f, n in enumerate(names)]
    n = model.n_layers
    layers = [{"op": "fc", "name": f"layer{i}", "in": model.sizes[i], "units": model.sizes[i + 1],
               "activation": None if i == n - 1 else act,
               "weights": "W (fan_in, fan_out), y = act(x @ W + b)"} for i in range(n)]
    inputs = ["the pooled rows of every field in field order (F x d)"]
    if model.n_dense:
        inputs.append(f"the {model.n_dense} dense features")
    if model.dot:
        inputs.append("the dot product of every pair i < j of the fields' pooled rows, in "
                      "row-major order of (i, j)")
    pooled = "averaged" if model.pooling == "mean" else "summed"
    return {"format": "hpcps-model", "hpcps_version": __version__, "kind": "embedding",
            "spec": model.spec_text, "dim": model.dim, "pooling": model.pooling,
            "dot": bool(model.dot), "n_dense": model.n_dense, "fields": fields,
            "input": f"ids int64 (N, {model.n_columns}): a field's ids in its columns, -1 for "
                     "no value (padding), ids 0..vocab-1; dense float32 (N, n_dense)",
            "pooling_rule": f"a field's rows are {pooled} over its ids that are not -1 "
                            "(zeros when it has none)",
            "fc_input": " then ".join(inputs), "activation": act, "layers": layers,
            "output": "the logit z; P(y = 1) = sigmoid(z)",
            "step": int(ckpt.step), "trained_on": (ckpt.dataset or {}).get("name")}


def embedding_onnx(model: CtrModel, named: dict[str, np.ndarray], tables: list[np.ndarray],
                   doc: str = "", check: bool = True):
    """An ``onnx.ModelProto`` computing ``logits`` (N, 1) and ``probabilities`` (N, 2:
    P(y = 0), P(y = 1)) from ``ids`` (and ``dense`` when the model has dense features).
    Each field's ids are its columns of ``ids``; an id of -1 is padding (Where turns it into
    0 for the Gather, and its row is weighted 0 in the pooling)."""
    onnx, helper, numpy_helper, TensorProto = _onnx()
    nodes: list = []
    inits: list = []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    def act(h: str, out: str) -> str:
        return node(_ONNX_ACT[model.activation], [h], out)

    zero = const("zero_id", np.array(0, dtype=np.int64))
    axis1 = const("axis1", np.array([1], dtype=np.int64))
    axis2 = const("axis2", np.array([2], dtype=np.int64))
    one = const("one", np.array(1.0, dtype=np.float32))
    pooled = []
    for f in range(model.n_fields):
        c0, c1 = int(model.offsets[f]), int(model.offsets[f + 1])
        ids = node("Slice", ["ids", const(f"cols{f}_start", np.array([c0], dtype=np.int64)),
                             const(f"cols{f}_end", np.array([c1], dtype=np.int64)), axis1],
                   f"ids{f}")
        valid = node("GreaterOrEqual", [ids, zero], f"valid{f}")
        safe = node("Where", [valid, ids, zero], f"safe_ids{f}")
        rows = node("Gather", [const(f"table{f}", tables[f]), safe], f"rows{f}", axis=0)
        weight = node("Cast", [valid], f"weight{f}", to=TensorProto.FLOAT)
        kept = node("Mul", [rows, node("Unsqueeze", [weight, axis2], f"weight{f}_3d")],
                    f"kept{f}")
        pool = node("ReduceSum", [kept, axis1], f"sum{f}", keepdims=0)
        if model.pooling == "mean":
            count = node("ReduceSum", [weight, axis1], f"count{f}", keepdims=1)
            pool = node("Div", [pool, node("Max", [count, one], f"count{f}_1")], f"mean{f}")
        pooled.append(pool)
    parts = [node("Concat", pooled, "embedded", axis=1)]
    if model.n_dense:
        parts.append("dense")
    if model.dot:
        F = model.n_fields
        stack = node("Concat", [node("Unsqueeze", [p, axis1], f"{p}_3d") for p in pooled],
                     "stacked", axis=1)
        gram = node("MatMul", [stack, node("Transpose", [stack], "stacked_t", perm=[0, 2, 1])],
                    "gram")
        flat_gram = node("Reshape", [gram, const("gram_shape", np.array([-1, F * F],
                                                                         dtype=np.int64))],
                         "gram_flat")
        i, j = np.triu_indices(F, 1)
        parts.append(node("Gather", [flat_gram, const("pairs", (i * F + j).astype(np.int64))],
                          "dots", axis=1))
    h = node("Concat", parts, "fc_input", axis=1) if len(parts) > 1 else parts[0]
    for i in range(model.n_layers):
        h = _gemm(nodes, const, named, i, h, i == model.n_layers - 1, act)
    node("Identity", [h], "logits")
    p1 = node("Sigmoid", ["logits"], "p1")
    node("Concat", [node("Sub", [one, p1], "p0"), p1], "probabilities", axis=1)
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", model.n_columns])]
    if model.n_dense:
        inputs.append(helper.make_tensor_value_info("dense", TensorProto.FLOAT,
                                                    ["N", model.n_dense]))
    graph = helper.make_graph(
        nodes, "hpcps", inputs,
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1]),
         helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 2])], inits)
    return _finished(onnx, helper, graph, doc, check)


def _export_embedding(ckpt_path, ckpt: checkpoint.Checkpoint, outs: dict) -> list[str]:
    model, flat, full, names = embedding_model(ckpt_path, ckpt)
    named = {k: np.asarray(v, dtype=np.float32) for k, v in model.views(flat).items()}
    arch = embedding_architecture(model, names, ckpt)
    table_bytes = sum(t.nbytes for t in full)
    notes = []
    if outs["onnx"] is not None:
        external = table_bytes > INLINE_BYTES
        proto = embedding_onnx(model, named, full,
                               doc=f"hpcps checkpoint {ckpt_path}, step {ckpt.step}: "
                               + json.dumps({k: arch[k] for k in ("kind", "input", "output")}),
                               check=not external)
        out = outs["onnx"]
        shape = (f"ids (N, {model.n_columns})"
                 + (f" and dense (N, {model.n_dense})" if model.n_dense else ""))
        if external:
            data_name = out.name + ".data"
            _external(proto, out, data_name)
            where = f"; its {len(full)} tables ({table_bytes / 2**20:.0f} MiB) in {data_name}"
        else:
            _atomic(out, lambda f: f.write(proto.SerializeToString()))
            where = ""
        notes.append(f"wrote {out} (ONNX opset {OPSET}: inputs {shape}, outputs logits (N, 1) "
                     f"and probabilities (N, 2){where})")
    if outs["npz"] is not None:
        _write_npz(outs["npz"], {**named, **{f"table{f}": t for f, t in enumerate(full)}}, arch)
        notes.append(f"wrote {outs['npz']} ({len(named)} fc arrays, {len(full)} tables "
                     f"({table_bytes / 2**20:.1f} MiB) + architecture)")
    return notes


def _external(proto, out: Path, data_name: str) -> None:
    """Save ``proto`` to ``out`` with its tables' bytes in ``data_name`` beside it (ONNX
    external data; the small constants stay in the model, where shape inference reads them):
    the data first, then the model renamed onto ``out``, so a model file never names data
    that is not there."""
    import onnx
    from onnx import TensorProto, external_data_helper

    def write_tables(f) -> None:
        for tensor in proto.graph.initializer:
            if not tensor.name.startswith("table"):
                continue
            offset = f.tell()
            f.write(tensor.raw_data)
            external_data_helper.set_external_data(tensor, data_name, offset,
                                                   len(tensor.raw_data))
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL

    _atomic(out.with_name(data_name), write_tables)
    _atomic(out, lambda f: f.write(proto.SerializeToString()))
    onnx.checker.check_model(str(out))


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0, or the refusing error's code)."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.export",
        description="Export an hpcps checkpoint (MLP, conv net or embedding model) for "
                    "inference elsewhere: an ONNX model (input x: rows as in the dataset, or "
                    "ids and dense for an embedding model; outputs logits and probabilities) "
                    "and/or an .npz of every weight by layer name (and an embedding model's "
                    "whole tables) plus the architecture as JSON. One process; no MPI "
                    "launcher needed.",
        epilog=f"Exit status: 0 on success, {CheckpointError.exit_code} for a missing, corrupt "
               f"or non-finite checkpoint, {ConfigError.exit_code} for bad options or onnx "
               "missing (pip install 'hpcps[export]').")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file written by hpcps")
    parser.add_argument("--onnx", metavar="OUT.onnx", help="write an ONNX model")
    parser.add_argument("--npz", metavar="OUT.npz",
                        help="write the weights by layer name and the architecture (JSON)")
    args = parser.parse_args(argv)
    try:
        notes = export(args.checkpoint, args.onnx, args.npz)
    except HpcpsError as exc:
        print(f"hpcps.export: error: {exc}", file=sys.stderr)
        return exc.exit_code
    for note in notes:
        print(f"hpcps.export: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
