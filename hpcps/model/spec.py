"""The text of a model spec (``--model``): its grammar, presets and parsing. Pure: no NumPy.

Kept apart from :mod:`hpcps.model.convnet` so that :mod:`hpcps.config`, which sits above the
model in
the module layers, can refuse a bad spec and the options a conv model cannot take when the
command line is read, before any rank loads data. The grammar is described in
:mod:`hpcps.model.convnet` and ``docs/conv.md``.

Embedding (click-through) models have a grammar of their own, :func:`parse_ctr_spec`
(``docs/ctr.md``): an ``embedD[:sum|:mean]`` stage first, then fc layers, the last one
``fc1`` (logistic loss). :func:`parse_spec` refuses such a spec with one message, since the
conv and MLP code cannot run it and no strategy trains it yet.
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

def preset_name(model: str | None) -> str | None:
    """``model`` (``--model``) as a preset's name, or None when it is not one."""
    name = str(model).strip().lower() if model is not None else None
    return name if name in PRESETS or name in CTR_PRESETS else None


_CONV = re.compile(r"conv(\d+)x(\d+)x(\d+)(?:s(\d+))?(?:p(\d+))?")
_POOL = re.compile(r"(?:max)?pool(\d+)(?:s(\d+))?")
_FC = re.compile(r"fc(\d+)")
_EMBED = re.compile(r"embed(\d+)(?::([a-z]*))?")

# Embedding models (docs/ctr.md), kept apart from PRESETS, which name conv networks (the
# --model help lists PRESETS as models that need images).
CTR_PRESETS = {
    # Paddle's CTR-DNN (PaddlePaddle/models, fluid/PaddleRec/ctr/network_conf.py and train.py:
    # --embedding_size 10, one embedding per sparse slot, concatenated with the dense
    # features, fc 400-400-400 relu, a 2-way softmax; here one logistic unit, the same model)
    "ctr-dnn": "embed10,fc400,fc400,fc400,fc1",
    # MovieLens-100k's 8 fields (genres multi-valued, hence mean pooling): small embeddings,
    # one hidden fc layer, one logistic unit
    # and the pairwise dot products of the fields' embeddings (DLRM's interaction), which
    # carry the user-item affinity
    "movielens": "embed16:mean,dot,fc64,fc1",
}
POOLINGS = ("sum", "mean")


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
    return PRESETS.get(text, CTR_PRESETS.get(text, text.replace(" ", "")))


def is_embedding_spec(spec: str | None) -> bool:
    """True when ``spec`` (``--model``) starts with an embedding stage (``embed...``): a
    click-through model (:func:`parse_ctr_spec`), not a conv network or an MLP."""
    return spec is not None and resolve(spec).startswith("embed")


@dataclass(frozen=True)
class CtrSpec:
    """An embedding model: every categorical field embedded in ``dim`` dimensions (a
    multi-valued field pooled by ``pooling``), concatenated with the dense features, then
    fully connected layers of ``fc`` units, the last of 1 unit (logistic loss)."""

    dim: int
    pooling: str
    fc: tuple[int, ...]
    dot: bool = False  # DLRM's interaction: every pair of fields' dot product joins the input

    @property
    def text(self) -> str:
        """The spec in canonical form (``:sum``, the default pooling, left out):
        ``parse_ctr_spec(s.text) == s``."""
        pool = "" if self.pooling == "sum" else f":{self.pooling}"
        return ",".join([f"embed{self.dim}{pool}"] + (["dot"] if self.dot else [])
                        + [f"fc{n}" for n in self.fc])


_CTR_GRAMMAR = ("an embedding model is embedD[:sum|:mean], optionally dot (the pairwise dot "
                "products of the fields' embeddings), then fc layers ending with fc1, "
                f"e.g. {CTR_PRESETS['ctr-dnn']!r} or {CTR_PRESETS['movielens']!r}; presets: "
                f"{', '.join(CTR_PRESETS)}")


@functools.lru_cache(maxsize=256)
def parse_ctr_spec(spec: str) -> CtrSpec:
    """The embedding model of a spec or preset name (``docs/ctr.md``).

    Raises
    ------
    ConfigError
        One message naming the bad token and the grammar: no embedding stage first, a bad
        dimension or pooling, a second embedding stage, a conv, pool or flatten layer, no fc
        layer, or a last layer other than ``fc1``.
    """
    text = resolve(spec)
    toks = text.split(",") if text else []
    if not toks or not toks[0].startswith("embed"):
        raise ConfigError(f"--model {text!r}: {_CTR_GRAMMAR}")
    m = _EMBED.fullmatch(toks[0])
    if m is None:
        raise ConfigError(f"--model {text!r}: cannot read {toks[0]!r}; {_CTR_GRAMMAR}")
    dim, pooling = int(m.group(1)), m.group(2)
    if pooling is None:
        pooling = "sum"
    if dim < 1:
        raise ConfigError(f"--model {text!r}: {toks[0]} embeds in {dim} dimensions; give "
                          "embedD with D >= 1")
    if pooling not in POOLINGS:
        raise ConfigError(f"--model {text!r}: {toks[0]} pools by {pooling!r}; multi-valued "
                          f"fields are pooled by {' or '.join(POOLINGS)} (embed{dim}:mean)")
    fc = []
    dot = len(toks) > 1 and toks[1] == "dot"
    for tok in toks[1 + dot:]:
        f = _FC.fullmatch(tok)
        if f is None:
            what = ("a second embedding stage" if tok.startswith("embed") else
                    "an interaction after the first layer (dot comes right after embed)"
                    if tok == "dot" else
                    "not an fc layer (conv, pool and flatten are for images)")
            raise ConfigError(f"--model {text!r}: {tok!r} is {what}; {_CTR_GRAMMAR}")
        if int(f.group(1)) < 1:
            raise ConfigError(f"--model {text!r}: layer {tok!r}: an fc layer needs >= 1 unit")
        fc.append(int(f.group(1)))
    if not fc or fc[-1] != 1:
        last = f"ends with {toks[-1]!r}" if fc else "has no fc layer"
        raise ConfigError(f"--model {text!r} {last}: an embedding model ends with fc1, one "
                          "logistic unit (sigmoid and binary cross-entropy on 0/1 labels)")
    return CtrSpec(dim, pooling, tuple(fc), dot)


@functools.lru_cache(maxsize=256)
def parse_spec(spec: str) -> tuple[LayerSpec, ...]:
    """The layers of a spec or preset name; ConfigError naming the bad token. Pure, so
    cached: every config check parses ``--model`` again."""
    text = resolve(spec)
    if is_embedding_spec(text):
        parse_ctr_spec(text)     # a bad embedding spec: its own message
        name = str(spec).strip()
        shown = repr(text) if name.lower() == text else f"{name!r} ({text})"
        raise ConfigError(
            f"--model {shown} is an embedding (click-through) model: no strategy trains "
            "embedding models yet (the parameter server's embedding tables come next, "
            "docs/ctr.md); hpcps.model.ctr holds the model and a single-process trainer")
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
                f"fc400); presets: {', '.join(PRESETS)} (conv), {', '.join(CTR_PRESETS)} "
                "(embedding models, on a categorical dataset)")
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
