"""The run directory: manifest (run.json), progress log, status, and listing runs.

::

    RUN/
      run.json         manifest: status, configuration, data files + hashes, model fingerprint,
                       library versions, timings, metrics (written atomically)
      progress.jsonl   one JSON line per step while training: step, total, loss, examples/s, ETA
      store.h5         the attribution store (docs/store-format.md)
      model/           the final model + tokenizer (save_pretrained), or the peft adapter
      index/           the FAISS index and preconditioner (traceprop index)
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from pathlib import Path

from . import constants as C
from .errors import RunError


def library_versions() -> dict[str, str]:
    import faiss
    import h5py
    import numpy
    import torch
    import transformers

    from . import __version__

    out = {
        "traceprop": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "faiss": getattr(faiss, "__version__", "unknown"),
    }
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:  # pragma: no cover
        pass
    return out


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """Atomic write: a reader never sees half a run.json."""
    tmp = run_dir / (C.MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(tmp, run_dir / C.MANIFEST_FILE)


def relative_paths(obj, run_dir: Path, root: Path):
    """``obj`` (a manifest) with every absolute path string under ``root`` rewritten relative to
    ``run_dir``: for a run that travels with its data (the committed sample run), so that no
    path of the machine that made it is kept. Readers resolve data relative to the run first."""
    if isinstance(obj, dict):
        return {k: relative_paths(v, run_dir, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [relative_paths(v, run_dir, root) for v in obj]
    if isinstance(obj, str) and os.path.isabs(obj):
        p = Path(obj).resolve()
        if p == root or root in p.parents:
            return os.path.relpath(p, run_dir.resolve())
    return obj


def read_manifest(run_dir: str | os.PathLike) -> dict:
    """The run's manifest; a run still marked 'running' whose process is gone reads as 'failed'."""
    run_dir = Path(run_dir)
    p = run_dir / C.MANIFEST_FILE
    if not p.exists():
        raise RunError(
            f"{run_dir} is not a Traceprop run (no {C.MANIFEST_FILE}); runs are made by 'traceprop train'"
        )
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{p} is not valid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"cannot read {p} ({e})") from e
    if not isinstance(m, dict):
        raise RunError(
            f"{p} holds a JSON {type(m).__name__}, not a run manifest (an object); "
            "the file is damaged or not written by Traceprop"
        )
    if (
        m.get("status") == C.STATUS_RUNNING
        and m.get("pid")
        and m.get("host") == platform.node()
        and not pid_alive(int(m["pid"]))
    ):
        m["status"] = C.STATUS_FAILED
        m.setdefault("error", "the training process ended without updating its status (killed?)")
    return m


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (a finished child nobody waited for) counts as ended."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own finished child
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child (another process launched it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill(0) said it exists
        return True


def read_progress(run_dir: str | os.PathLike, last: int = 0) -> list[dict]:
    """Progress lines written so far (the last ``last`` lines when ``last > 0``)."""
    p = Path(run_dir) / C.PROGRESS_FILE
    if not p.exists():
        return []
    lines = p.read_text().splitlines()
    if last:
        lines = lines[-last:]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return out


def list_runs(root: str | os.PathLike) -> list[Path]:
    """Run directories (with a run.json) directly under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if (p / C.MANIFEST_FILE).is_file()]
    return sorted(runs, key=lambda p: (p / C.MANIFEST_FILE).stat().st_mtime, reverse=True)
