"""The text of a model spec (``--model``): its grammar, presets and parsing. Pure: no NumPy.

Kept apart from :mod:`hpcps.model.convnet` so that :mod:`hpcps.config`, which sits above the
model in
the module layers, can refuse a bad spec and the options a conv model cannot take when the
command line is read, before any rank loads data. The grammar is described in
:mod:`hpcps.model.convnet` and ``docs/conv.md``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from hpcps.errors import ConfigError

PRESETS = {
    # Project Adam, section 5.1: two 5x5 convolution layers of 10 and 20 maps, each followed by
    # 2x2 max-pooling, two fully connected layers of 400 units, a 10-way softmax
    "adam-mnist": "conv5x5x10,pool2,conv5x5x20,pool2,fc400,fc400,fc10",
}

_CONV = re.compile(r"conv(\d+)x(\d+)x(\d+)(?:s(\d+))?(?:p(\d+))?")
_POOL = re.compile(r"(?:max)?pool(\d+)(?:s(\d+))?")
_FC = re.compile(r"fc(\d+)")


@dataclass(frozen=True)
class LayerSpec:
    """One token of a spec: ``kind`` is conv, pool, flatten or fc."""

    kind: str
    text: str
    out: int = 0        # conv: output maps; fc: units
    kh: int = 0
    kw: int = 0
    stride: int = 1
    pad: int = 0


def resolve(spec: str) -> str:
    """A preset's spec, or ``spec`` itself (normalised: no blanks, lower case)."""
    text = str(spec).strip().lower()
    return PRESETS.get(text, text.replace(" ", ""))


@functools.lru_cache(maxsize=256)
def parse_spec(spec: str) -> tuple[LayerSpec, ...]:
    """The layers of a spec or preset name; ConfigError naming the bad token. Pure, so
    cached: every config check parses ``--model`` again."""
    text = resolve(spec)
    if not text:
        raise ConfigError("--model is empty: give layers such as "
                          f"{PRESETS['adam-mnist']!r} or a preset ({', '.join(PRESETS)})")
    layers = []
    for tok in text.split(","):
        if m := _CONV.fullmatch(tok):
            kh, kw, n = (int(g) for g in m.groups()[:3])
            s, p = (int(g) if g is not None else None for g in m.groups()[3:])
            layer = LayerSpec("conv", tok, n, kh, kw, s or 1, p or 0)
            if min(kh, kw, n, layer.stride) < 1:
                raise ConfigError(f"--model layer {tok!r}: kernel, maps and stride must be >= 1")
        elif m := _POOL.fullmatch(tok):
            k, s = int(m.group(1)), int(m.group(2) or m.group(1))
            if min(k, s) < 1:
                raise ConfigError(f"--model layer {tok!r}: pool size and stride must be >= 1")
            layer = LayerSpec("pool", tok, 0, k, k, s, 0)
        elif tok == "flatten":
            layer = LayerSpec("flatten", tok)
        elif m := _FC.fullmatch(tok):
            layer = LayerSpec("fc", tok, int(m.group(1)))
            if layer.out < 1:
                raise ConfigError(f"--model layer {tok!r}: an fc layer needs >= 1 unit")
        else:
            raise ConfigError(
                f"--model: cannot read layer {tok!r}; layers are convKHxKWxN[sS][pP] (e.g. "
                "conv5x5x10, conv3x3x16s1p1), poolK[sS] (e.g. pool2), flatten, fcN (e.g. "
                f"fc400); presets: {', '.join(PRESETS)}")
        layers.append(layer)
    if layers[-1].kind != "fc":
        raise ConfigError(f"--model {text!r} must end with an fc layer of the dataset's "
                          "classes (e.g. fc10)")
    seen_flat = False
    for layer in layers:
        if layer.kind in ("fc", "flatten"):
            seen_flat = True
        elif seen_flat:
            raise ConfigError(f"--model {text!r}: {layer.text} after a flatten or fc layer; "
                              "conv and pool layers work on images and come first")
    return tuple(layers)


def is_conv_spec(spec: str | None) -> bool:
    """True when ``spec`` (``--model``) holds a conv or pool layer (not a pure MLP)."""
    return spec is not None and any(l.kind in ("conv", "pool") for l in parse_spec(spec))
