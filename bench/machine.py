"""What every benchmark records about the machine it ran on (imported by the bench scripts)."""
from __future__ import annotations

import platform


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
