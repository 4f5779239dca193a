"""The documentation names the options the code has: every option of ``python -m
hpcps.train`` has a row in docs/options.md, and every option the README or docs/options.md
names exists."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from hpcps import config

ROOT = Path(__file__).resolve().parents[1]


def parser_options() -> set[str]:
    return {s for a in config.build_parser()._actions for s in a.option_strings
            if s.startswith("--") and s != "--help"}


def named(path: Path) -> set[str]:
    """The ``--options`` a Markdown file names in code spans."""
    return set(re.findall(r"`(--[a-z0-9][a-z0-9-]*)", path.read_text()))


def test_every_option_has_a_row_in_options_md():
    rows = {m for line in (ROOT / "docs/options.md").read_text().splitlines()
            if line.startswith("| `--") for m in re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1])}
    assert parser_options() - rows == set()


def test_the_docs_name_only_options_that_exist():
    for doc in ("README.md", "docs/options.md"):
        assert named(ROOT / doc) - parser_options() == set(), doc


def _render():
    """bench/render.py, imported from its file (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render", ROOT / "bench" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measurement_tables_are_what_bench_results_render():
    """Every table between ``<!-- results: ... -->`` markers is what ``bench/render.py``
    makes of its file in bench/results/: a table edited by hand, or a results file changed
    without rendering again, fails here (``python bench/render.py`` rewrites them)."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "render.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_check_names_a_table_edited_by_hand():
    render = _render()
    ref = "bench_hogwild-2026-11-26-amd-epyc#ratios"
    text = f"<!-- results: {ref} -->\n" + render.render_block(ref) + "<!-- /results -->\n"
    assert render.render_text(text) == (text, [])
    edited = text.replace("1.59x", "1.95x")
    assert edited != text
    assert render.render_text(edited) == (text, [ref])


def test_a_fresh_bench_hogwild_file_renders_through_its_view():
    """A file bench_hogwild wrote (figures, no ready-made tables) renders both tables."""
    render = _render()
    model = {"paired_ratios_median": {"hogwild_over_torch_T1": 1.5, "hogwild_T2_over_T1": 1.8},
             "results": {"hogwild_T1": {"examples_per_s": 12345.6},
                         "torch_T1": {"examples_per_s": 8000.0}}}
    tables = render.tables_of({"bench": "bench_hogwild",
                               "figures": {"repeats": 7, "models": {"784-512-512-10": model}}})
    ratios = render.markdown_table(tables["ratios"])
    assert "| hpcps / PyTorch, T = 1 | 1.50x |" in ratios
    assert "| hpcps T = 2 / T = 1 | 1.80x |" in ratios
    assert "| 784-512-512-10 | 1 | 12,350 |  |  | 8,000 |" in render.markdown_table(
        tables["examples"])
