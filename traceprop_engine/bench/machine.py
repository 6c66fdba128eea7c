"""The machine a benchmark ran on, for its printed and saved figures."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """``lscpu``'s model name (e.g. "AMD EPYC"), else ``platform.processor()``, else "unknown"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"
