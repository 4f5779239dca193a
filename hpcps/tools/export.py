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

Both files are written atomically (a temporary file renamed onto OUT). Refusals: exit code 4
for a checkpoint that is missing, corrupt or non-finite, 2 for options (no output named, an
unknown suffix, a missing directory, ``onnx`` not installed) and for an embedding model's
checkpoint (its rows are in the shards' table files, and an id never trained reads as its
initial row: ``hpcps.evaluate --predict`` scores such a model).
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
from hpcps.model.mlp import MLP
from hpcps.model.spec import is_embedding_spec
from hpcps.tools.evaluate import model_of

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
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        raise ConfigError("--onnx needs the onnx package, the optional extra 'export': "
                          "pip install 'hpcps[export]' (or pip install onnx)") from exc
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
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="hpcps", producer_version=__version__,
                              doc_string=doc)
    # the IR version of the oldest onnxruntime that runs opset 17, not the newest onnx's
    proto.ir_version = min(onnx.IR_VERSION, 8)
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
    spec = ckpt.config.get("model")
    if is_embedding_spec(spec):
        raise ConfigError(
            f"{ckpt_path} holds an embedding model (--model {spec}), which export does not "
            "write: its rows live in the server shards' table files beside the checkpoint "
            "(tables/shard-<s>-of-<S>.h5, readable with h5py: docs/formats.md), and ids "
            "never trained read as their initial rows, which no ONNX graph or array file "
            "would hold. Score rows with python -m hpcps.evaluate CHECKPOINT --data FILE "
            "--predict OUT.npy")
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
        arrays: dict[str, Any] = dict(named)
        arrays["architecture"] = np.array(json.dumps(arch, indent=1))
        _atomic(outs["npz"], lambda f: np.savez(f, **arrays))
        notes.append(f"wrote {outs['npz']} ({len(named)} arrays by layer name + architecture)")
    return notes


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0, or the refusing error's code)."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.export",
        description="Export an hpcps checkpoint (MLP or conv net) for inference elsewhere: an "
                    "ONNX model (input x: rows as in the dataset; outputs logits and "
                    "probabilities) and/or an .npz of every weight by layer name plus the "
                    "architecture as JSON. One process; no MPI launcher needed.",
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
