"""The run directory of ``traceprop train``: lock it, clear an old run, save the model atomically.

One training process owns a run directory at a time (an ``flock`` on :data:`LOCK_FILE`); a folder
that already holds a run is refused unless the caller asked to overwrite it, and Traceprop never
deletes or writes through a symbolic link there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from .. import constants as C
from ..errors import RunError
from ..permissions import follow_umask
from ..run import RunManifest
from . import distributed
from .checkpoint import CHECKPOINT_DIR, CHECKPOINT_OLD, CHECKPOINT_TMP
from .models import save_model

LOCK_FILE = ".traceprop.lock"  # flock'ed by the training process for the whole run
_MODEL_TMP = ".model.tmp"  # the final model is saved here, then renamed to model/
# what a run directory holds (a folder with any of these looks like a run)
_RUN_ENTRIES = (
    C.MANIFEST_FILE,
    C.STORE_FILE,
    C.PROGRESS_FILE,
    C.MODEL_DIR,
    C.INDEX_DIR,
    C.MANIFEST_FILE + ".tmp",
    C.STORE_FILE + ".tmp",
    _MODEL_TMP,
    CHECKPOINT_DIR,
    CHECKPOINT_TMP,
    CHECKPOINT_OLD,
)


def lock_run_dir(run_dir: Path) -> int:
    """Create ``run_dir`` and take its exclusive lock (held until the returned fd is closed)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--out {run_dir} is a file, not a directory; choose a directory path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted as the lock file is refused, not written through
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise RunError(
            f"cannot create the run directory {run_dir} ({e.strerror or e}); choose an --out "
            "you can write to"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunError(
            f"{run_dir} is in use by another 'traceprop train' (it holds {LOCK_FILE}); wait for "
            "it to finish or choose another --out"
        ) from None
    return fd


def prepare_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that looks like a run unless ``overwrite``; then empty it of run files.

    Never deletes or writes through a symbolic link (a link among the run's files is refused).
    Called with the run directory's lock held.
    """
    shards = sorted(run_dir.glob(distributed.shard_file(0).replace("0", "*")))
    found = [
        run_dir / n for n in _RUN_ENTRIES if (run_dir / n).exists() or (run_dir / n).is_symlink()
    ] + shards
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found)
        raise RunError(
            f"{run_dir} already holds a run (or what is left of one: {names}); choose another "
            "--out or pass --overwrite"
        )
    links = [p for p in found if p.is_symlink()]
    if links:
        raise RunError(
            f"{links[0]} is a symbolic link: Traceprop never deletes or writes through a link "
            "in a run directory; remove it yourself or choose another --out"
        )
    try:
        status = RunManifest.load(run_dir).status
    except RunError:
        status = None  # no or unreadable run.json: nothing says it is running
    if status == C.STATUS_RUNNING:
        raise RunError(f"{run_dir} holds a run that is still running; cancel it first")
    try:
        for p in found:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    except OSError as e:
        raise RunError(f"cannot clear the old run in {run_dir} ({e}); remove it yourself") from None


def save_model_atomically(loaded, run_dir: Path, state_dict: dict | None = None) -> dict:
    """Save to RUN/.model.tmp, then rename to RUN/model: an interrupted save leaves no model/."""
    tmp, final = run_dir / _MODEL_TMP, run_dir / C.MODEL_DIR
    for p in (tmp, final):
        if p.is_symlink():
            raise RunError(f"{p} is a symbolic link; Traceprop does not write through links")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = save_model(loaded, tmp, state_dict=state_dict)
        follow_umask(tmp)  # safetensors writes 0600: a shared run must be readable as umask says
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


_FULL_CODES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# how libraries that do their own I/O say it: safetensors' SafetensorError (a Rust io::Error),
# torch.save's RuntimeError ("file write failed" from its zip writer)
_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "File too large")


def disk_full(e: BaseException, run_dir: Path | None = None) -> BaseException | None:
    """The error in ``e`` or its causes that says the disk (or a quota, or the file-size limit)
    is full, else None. A write error without a reason (torch's "file write failed") counts
    when ``run_dir``'s file system has less than the store's reserve free right now."""
    seen, chain = 0, []
    while e is not None and seen < 8:
        chain.append(e)
        e, seen = e.__cause__ or e.__context__, seen + 1
    for x in chain:
        if isinstance(x, OSError) and x.errno in _FULL_CODES:
            return x
        if any(w in str(x) for w in _FULL_WORDS):
            return x
    if run_dir is not None and any("write failed" in str(x) for x in chain):
        from ..store.space import RESERVE_BYTES

        try:
            st = os.statvfs(run_dir)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < RESERVE_BYTES:
            return chain[0]
    return None
