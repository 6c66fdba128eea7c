"""The fingerprint of a saved model: what ``run.json`` records and ``traceprop verify`` checks.

Plain hashing, no torch: verifying a run (the app's Audit page, ``traceprop verify``) needs no
model loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the saved weight files (name + content), in name order."""
    h = hashlib.sha256()
    for p in sorted(model_dir.rglob("*")):
        if p.suffix in (".safetensors", ".bin") and p.is_file():
            h.update(str(p.relative_to(model_dir)).encode())
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()
