"""Files and folders Traceprop writes follow the user's umask, like any other program's.

Two writers do not on their own: ``tempfile.mkdtemp`` creates its folder 0700 (an index is
built in one and renamed into place) and safetensors writes its files 0600. A run on a shared
machine must be as readable by the team as the umask allows, whatever wrote its files.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named folder in ``parent``, with the umask's permissions (not 0700)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(0o777)  # the umask applies
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary folder name {prefix}* in {parent}")


def follow_umask(folder: Path) -> None:
    """Give every plain file under ``folder`` the mode a new file gets under the umask
    (0644 under umask 022), and every folder the mode a new folder gets."""
    mask = current_umask()
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)
