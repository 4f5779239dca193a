"""Every import in hpcps/ points down the layers of docs/layout.md (read from the source, no
import run). Imports under ``if TYPE_CHECKING:`` (annotations only) are exempt."""
from __future__ import annotations

import ast

from mpirun import ROOT

# Lowest first; a module belongs to the longest prefix that matches it.
LAYERS = [
    ["hpcps", "hpcps.errors", "hpcps.options", "hpcps.blocks", "hpcps.trace",
     "hpcps.procfs"],
    ["hpcps.kernels"],
    ["hpcps.model", "hpcps.compress"],
    ["hpcps.engine", "hpcps.io"],
    ["hpcps.mpi"],
    ["hpcps.runtime"],
    ["hpcps.ps"],
    ["hpcps.strategies"],
    ["hpcps.tools", "hpcps.config", "hpcps.job"],
    ["hpcps.train", "hpcps.join", "hpcps.__main__", "hpcps.data", "hpcps.evaluate", "hpcps.export",
     "hpcps.inspect", "hpcps.report", "hpcps.scaling", "hpcps.keeper", "hpcps.stacks"],
]


def layer(module: str) -> int:
    best, length = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    assert best is not None, module
    return best


def imports(tree: ast.Module):
    """Every hpcps module imported, outside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpcps"):
            if node.module == "hpcps":
                yield from (f"hpcps.{a.name}" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("hpcps"))


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_import_points_down():
    up = []
    for path in sorted((ROOT / "hpcps").rglob("*.py")):
        me = module_name(path)
        for target in imports(ast.parse(path.read_text())):
            if layer(target) > layer(me):
                up.append(f"{me} imports {target}")
    assert not up, up


def test_the_check_sees_an_upward_import():
    tree = ast.parse("from hpcps.strategies.registry import strategies\n"
                     "from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from hpcps.config import Config\n")
    assert list(imports(tree)) == ["hpcps.strategies.registry"]
    assert layer("hpcps.strategies.registry") > layer("hpcps.model.mlp")
    assert layer("hpcps.strategies.sync.replica") == layer("hpcps.strategies")


def test_declarations_import_no_mpi():
    """A strategy's declaration module (its package's __init__) imports nothing that loads
    MPI: the role modules do that, when a rank runs them."""
    mpi_layers = {layer("hpcps.mpi"), layer("hpcps.runtime"), layer("hpcps.ps")}
    for init in sorted((ROOT / "hpcps" / "strategies").glob("*/__init__.py")):
        source = init.read_text()
        tree = ast.parse(source)
        assert "mpi4py" not in source, init
        for target in imports(tree):
            assert layer(target) not in mpi_layers, (init, target)


def test_the_start_up_judgement_loads_neither_numpy_nor_mpi():
    """:mod:`hpcps.config` (the options, every strategy's declaration, the layout plan) loads
    neither NumPy nor MPI nor h5py: :func:`hpcps.train.refuse_early` judges a command line with
    it before a rank loads them."""
    import subprocess
    import sys
    code = ("import sys, hpcps.config; print(sorted(m for m in ('numpy', 'mpi4py.MPI', "
            "'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_strategy_tags_stay_above_the_shared_ones():
    """The shared protocol's tags end below where strategies' own begin, and every declared
    strategy's tags are its own range (the registry refuses others)."""
    from hpcps.mpi.protocol import Tag
    from hpcps.strategies.registry import STRATEGY_TAGS_START, message_tags, strategies
    assert max(Tag) < STRATEGY_TAGS_START
    for spec in strategies().values():
        if spec.tags is not None:
            assert min(spec.tags) >= STRATEGY_TAGS_START, spec.name
    made = message_tags("x", "A", "B")
    assert [int(t) for t in made] == [STRATEGY_TAGS_START, STRATEGY_TAGS_START + 1]


def test_cost_models_import_no_mpi():
    """A strategy's cost model (``cost.py``, and the shared ``strategies/cost.py``) is pure
    math: no mpi4py, nothing of the MPI layers but the protocol's message sizes (a module
    without mpi4py). Its ``calibrate`` hook, which may run role code, lives apart."""
    mpi_layers = {layer("hpcps.mpi"), layer("hpcps.runtime"), layer("hpcps.ps")}
    strategies = ROOT / "hpcps" / "strategies"
    for path in [strategies / "cost.py", *sorted(strategies.glob("*/cost.py"))]:
        source = path.read_text()
        assert "mpi4py" not in source, path
        for target in imports(ast.parse(source)):
            if target == "hpcps.mpi.protocol":
                continue
            assert layer(target) not in mpi_layers, (path, target)
            assert not target.endswith((".replica", ".server", ".coordinator")), (path, target)
    assert "mpi4py" not in (ROOT / "hpcps" / "mpi" / "protocol.py").read_text()


def test_mpi_is_spoken_only_in_its_layer():
    """mpi4py is imported only under hpcps/mpi/: every other layer sends, receives and waits
    through hpcps.mpi.comm (its Transport, timed waits and collectives)."""
    outside = []
    for path in (ROOT / "hpcps").rglob("*.py"):
        if path.parent.name == "mpi":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "mpi4py" for n in names):
                outside.append(str(path.relative_to(ROOT)))
    assert not outside, outside
