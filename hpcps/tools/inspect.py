"""Print what an hpcps checkpoint holds.

Usage::

    python -m hpcps.inspect runs/mnist/ckpt.h5          # human-readable summary
    python -m hpcps.inspect runs/mnist/ckpt.h5 --json   # the same facts as one JSON object

The whole file is read and verified (checksums, layout version), so this is also the way to
check that a checkpoint is intact before resuming from it. A bad file prints
``hpcps.inspect: error: <reason>`` on stderr and exits with code 4 (``CheckpointError``).

Run it with ``-m``: run as ``python hpcps/tools/inspect.py`` this file would shadow the standard
library's ``inspect`` module.

:func:`summarize` and :func:`describe` are the same facts for programs and for people. This
module only reads and presents; reading, checking and writing the file is
:mod:`hpcps.io.checkpoint`'s job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcps.io.checkpoint import (PARAM_NAME, architecture_sizes, conv_model, flatten_keys,
                              load_with_header)
from hpcps.errors import CheckpointError
from hpcps.io import tables
from hpcps.model.spec import is_embedding_spec, parse_ctr_spec


def _stats(a: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": list(a.shape), "dtype": str(a.dtype)}
    if a.size == 0:
        return out
    finite = np.isfinite(a)
    n_bad = int(a.size - np.count_nonzero(finite))
    good = a if n_bad == 0 else a[finite]
    if good.size:
        out.update(min=float(good.min()), max=float(good.max()),
                   mean=float(good.mean(dtype=np.float64)), std=float(good.std(dtype=np.float64)))
    if n_bad:
        out["non_finite"] = n_bad
    return out


def summarize(path: str | os.PathLike) -> dict[str, Any]:
    """The facts :func:`describe` prints, as a JSON-able dict (non-finite floats as strings)."""
    ckpt, header = load_with_header(path)
    sizes = architecture_sizes(ckpt.params, ckpt.config, ckpt.dataset)
    conv = conv_model(ckpt.config, ckpt.dataset)
    n_params = sum(int(v.size) for v in ckpt.params.values())
    facts = {
        "path": str(path),
        **header,
        "step": ckpt.step,
        "layer_sizes": sizes,
        "model": None if conv is None else {"spec": conv.spec_text,
                                            "input_shape": list(conv.input_shape),
                                            "layers": conv.describe()},
        "n_params": n_params,
        "params": {k: _stats(ckpt.params[k]) for k in sorted(ckpt.params, key=_param_order)},
        "optimizer": ckpt.optimizer,
        "opt_state": {k: _stats(v) for k, v in sorted(ckpt.opt_state.items())},
        "config": ckpt.config,
        "dataset": ckpt.dataset,
        "metrics": ckpt.metrics,
        "tables": embedding_tables(path, ckpt),
    }
    return _json_safe(facts)


def embedding_tables(path: str | os.PathLike, ckpt) -> dict[str, Any] | None:
    """An embedding model's tables (:mod:`hpcps.io.tables`): the files of its step beside
    it and the rows each table holds over them; None for other models. A checkpoint whose
    table files are missing says so instead of failing: what it holds is still shown."""
    spec = ckpt.config.get("model") if isinstance(ckpt.config, dict) else None
    if not is_embedding_spec(spec):
        return None
    fields = (ckpt.dataset or {}).get("fields") or []
    dim = parse_ctr_spec(spec).dim
    directory = Path(path).parent / tables.TABLES_DIR
    try:
        files = tables.table_files(directory, ckpt.step, len(fields), dim)
    except CheckpointError as exc:
        return {"missing": str(exc)}
    rows = []
    for t in range(len(fields)):
        n, optimizer = tables.count(files, t)
        rows.append({"table": t, "field": fields[t][0], "rows": n,
                     "vocab": fields[t][2], "optimizer": optimizer})
    return {"directory": str(directory), "files": len(files), "dim": dim, "per_table": rows}


def _param_order(name: str) -> tuple[int, str]:
    m = PARAM_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else (-1, name)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf": strict JSON has no such numbers
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _fmt_stats(name: str, s: dict[str, Any], width: int) -> str:
    shape = "(" + ", ".join(map(str, s["shape"])) + ("," if len(s["shape"]) == 1 else "") + ")"
    line = f"  {name:<{width}}  {shape:<14} {s['dtype']:<8}"
    if "min" in s:
        line += "  " + " ".join(f"{k} {s[k]: <11.4g}" for k in ("min", "max", "mean", "std"))
    if "non_finite" in s:
        line += f"  NON-FINITE {s['non_finite']}"
    return line.rstrip()


def _fmt_size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    exp = min(int(math.log10(n)) // 3, 3)
    return f"{n / 1000 ** exp:.1f} {'KMG'[exp - 1]}B"


def describe(path: str | os.PathLike) -> str:
    """Return a multi-line, human-readable summary of the checkpoint at ``path``.

    Raises
    ------
    CheckpointError
        As :func:`load`.
    """
    s = summarize(path)
    lines = [
        f"hpcps checkpoint {s['path']}",
        f"  format        {s['format']}, layout_version {s['layout_version']}",
        f"  written by    hpcps {s['hpcps_version']} at {s['created']}",
        f"  file size     {_fmt_size(s['file_size'])}",
        f"  step          {s['step']}",
        f"  layer sizes   {' -> '.join(map(str, s['layer_sizes']))}  ({s['n_params']:,} "
        "parameters)",
    ]
    if s["model"] is not None:
        lines.append(f"  model         {s['model']['spec']} on "
                     f"{'x'.join(map(str, s['model']['input_shape']))} images "
                     "(conv kernels (out, in, kh, kw))")
        lines += [f"    {line}" for line in s["model"]["layers"]]
    lines.append("params")
    width = max(len(k) for k in list(s["params"]) + list(s["opt_state"]))
    lines += [_fmt_stats(k, v, width) for k, v in s["params"].items()]
    lines.append(f"optimizer {s['optimizer']}" + ("" if s["opt_state"] else " (no state)"))
    lines += [_fmt_stats(k, v, width) for k, v in s["opt_state"].items()]
    t = s.get("tables")
    if t is not None and "missing" in t:
        lines.append(f"tables: {t['missing']}")
    elif t is not None:
        lines.append(f"tables  {t['directory']}: {t['files']} file(s), rows of {t['dim']} "
                     f"dimensions, {sum(r['rows'] for r in t['per_table']):,} rows")
        lines += [f"  table{r['table']:<3} {r['field']:<14} {r['rows']:>10,} rows of "
                  f"{r['vocab']:,} ids ({r['optimizer']})" for r in t["per_table"]]
    for section in ("config", "dataset", "metrics"):
        lines.append(section + ("" if s[section] else " (empty)"))
        for k, v in flatten_keys(s[section]).items():
            lines.append(f"  {k} = {json.dumps(v, ensure_ascii=False)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0, or CheckpointError.exit_code)."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcps.inspect",
        description=(
            "Summarize an hpcps checkpoint (HDF5): format and layout version, step, when and by "
            "which hpcps it was written, layer sizes, the shape and min/max/mean/std of every "
            "parameter and optimizer-state array, the run's config, the dataset identity and the "
            "metrics. The whole file is read and its checksums verified."
        ),
        epilog=f"Exit status: 0 if the checkpoint is intact, {CheckpointError.exit_code} if it is "
        "missing, truncated, corrupt or not an hpcps checkpoint.",
    )
    parser.add_argument("path", metavar="PATH", help="checkpoint file written by hpcps")
    parser.add_argument("--json", action="store_true",
                        help="print the facts as one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        if args.json:
            text = json.dumps(summarize(args.path), indent=2)
        else:
            text = describe(args.path)
    except CheckpointError as exc:
        print(f"{parser.prog.split()[-1]}: error: {exc}", file=sys.stderr)
        return CheckpointError.exit_code
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left; not an error of the checkpoint
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
