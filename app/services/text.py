"""Text from data or the file system, made safe and short for the pages."""

from __future__ import annotations

import re

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>#~|$])")


def md_escape(text: object) -> str:
    """Text from data or the file system made safe for Streamlit's markdown-rendering elements."""
    return _MD_SPECIAL.sub(r"\\\1", str(text))


def one_line(text: str, limit: int = 120) -> str:
    """A text as one readable line for a dropdown: line breaks shown as ' ⏎ ', cut at
    ``limit`` characters with an ellipsis (no Python repr quotes or escapes)."""
    flat = " ⏎ ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
