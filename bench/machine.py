"""What every benchmark records about the machine it ran on (imported by the bench scripts)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path


def cpu_model() -> str | None:
    """The CPU model name from /proc/cpuinfo, or platform.processor() elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# the flags that decide which kernels run (ext/zero_skip.h) and how fast BLAS is
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_features() -> list[str] | None:
    """The SIMD flags of SIMD_FLAGS this CPU has (/proc/cpuinfo), or None off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in SIMD_FLAGS if flag in have]
    except OSError:
        pass
    return None


RESULTS = Path(__file__).resolve().parent / "results"


def slug(text: str | None) -> str:
    """``text`` lower-cased, runs of anything but letters and digits as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", (text or "unknown-cpu").lower()).strip("-")[:48]


def git_commit() -> str | None:
    """The checkout's commit (with ``-dirty`` when files differ), or None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "hpcps", "ext", "bench"], text=True, capture_output=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def save(name: str, figures: dict, argv: list[str] | None = None) -> Path | None:
    """Write one run's figures to ``bench/results/<name>-<date>-<cpu slug>.json``.

    Every bench calls this once, where it prints its JSON; ``bench/render.py`` turns the files
    into the tables of docs/ and the README. The file holds ``figures`` (what the bench
    printed) and what makes them comparable: the date, the CPU and its SIMD features, the
    core count, the exact command line and the git commit. A second run on the same day and
    CPU gets ``-2``, ``-3``, ... rather than replacing the first.

    ``HPCPS_BENCH_RESULTS=DIR`` writes into DIR instead, ``HPCPS_BENCH_RESULTS=off`` writes
    nothing, and a ``--quick`` run (a smoke test, not a measurement) is never saved.

    Parameters
    ----------
    name : the bench's name, e.g. ``"bench_hogwild"``
    figures : the JSON object the bench printed
    argv : the command line (default ``sys.argv``)

    Returns the path written, or None when nothing was.
    """
    argv = list(sys.argv if argv is None else argv)
    where = os.environ.get("HPCPS_BENCH_RESULTS", "")
    if where.lower() == "off" or "--quick" in argv:
        return None
    folder = Path(where) if where else RESULTS
    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = cpu_model()
    doc = {
        "bench": name,
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%H:%M:%S"),
        "machine": {"cpu": cpu, "cpu_features": cpu_features(), "cores": os.cpu_count(),
                    "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "command": shlex.join(["python", *argv]),
        "git_commit": git_commit(),
        "figures": figures,
    }
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{doc['date']}-{slug(cpu)}"
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr)
    return path
