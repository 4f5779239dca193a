"""Where the report's outputs go: output directories checked and created before anything is
written, and each file written whole (:func:`_publish`)."""

from __future__ import annotations

import os
from pathlib import Path

from hpcps.errors import ConfigError


def _publish(path: Path, write) -> None:
    """``write(tmp)`` beside ``path``, then rename it over ``path``, so a reader never sees a
    half-written file; ConfigError naming ``path`` if either fails."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {exc}") from exc


def _output_dir(path: str | os.PathLike, option: str) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option} {out} exists and is not a directory")
    return out


def _make_dir(out: Path, option: str) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {option} {out}: {exc}") from exc
