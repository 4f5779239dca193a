"""The documentation names the options the code has: every option of ``python -m
hpcps.train`` has a row in docs/options.md, and every option the README or docs/options.md
names exists."""
import re
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
