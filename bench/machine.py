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
