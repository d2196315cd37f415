"""What machine a benchmark ran on, for its report."""

from __future__ import annotations

import os
import platform

__all__ = ["hardware"]


def hardware() -> str:
    """CPU model, visible logical CPUs and OS, for a benchmark report."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs visible, {platform.system()} {platform.release()}"
