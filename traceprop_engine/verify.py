"""Run-level verification: do the data files, the saved model and the store still match run.json?

``traceprop verify`` and the app's Audit page call :func:`verify_run`. It re-hashes what the
manifest recorded at training time; it says nothing about whether attribution scores are right
(see docs/audit.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from . import constants as C
from .errors import StoreError
from .run import DataInfo, RunManifest
from .training.data import sha256_file
from .training.fingerprint import model_fingerprint


def _data_root(run_dir: Path, d: DataInfo, root_key: str) -> Path:
    """Where a run's data files are now: relative to the run first (the run and its data moved
    together, as in the bundled sample), then the absolute path recorded at training time."""
    rel, recorded = getattr(d, f"{root_key}_relative"), getattr(d, root_key)
    candidates = ([run_dir / rel] if rel else []) + ([Path(recorded)] if recorded else [])
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    return (candidates[0] if candidates else run_dir).resolve()


def _check_data(run_dir: Path, d: DataInfo) -> tuple[list[dict], dict[str, Path]]:
    """``(one entry per recorded file, the data roots used)``: each file re-hashed."""
    out = []
    roots = {}
    for root_key, files in (("root", d.files), ("eval_root", d.eval_files)):
        if not files:
            continue
        root = roots[root_key] = _data_root(run_dir, d, root_key)
        for name, want in sorted(files.items()):
            p = root / name
            if not p.is_file():
                out.append({"file": str(p), "status": "missing", "expected": want, "actual": None})
                continue
            got = sha256_file(p)
            out.append(
                {
                    "file": str(p),
                    "status": "ok" if got == want else "changed",
                    "expected": want,
                    "actual": got,
                }
            )
    return out, roots


def _check_model(run_dir: Path, m: RunManifest) -> dict:
    want = m.model.fingerprint
    md = run_dir / C.MODEL_DIR
    if not want:
        return {"dir": str(md), "status": "absent", "expected": None, "actual": None}
    got = model_fingerprint(md) if md.is_dir() else None
    return {
        "dir": str(md),
        "status": "ok" if got == want else ("missing" if got is None else "changed"),
        "expected": want,
        "actual": got,
    }


def _check_store(run_dir: Path, m: RunManifest, problems: list[str]) -> dict:
    """The store's content digest (every shard of a DDP run); appends to ``problems``."""
    from .store.sharded import open_run_store

    if not (m.tracked or (run_dir / C.STORE_FILE).exists()):
        return {"status": "absent"}
    if m.status == C.STATUS_RUNNING:  # alive: RunManifest reads a killed run as failed
        return {
            "status": "in progress",
            "store_status": C.STATUS_RUNNING,
            "detail": "a train is still writing this store; its content digest is recorded "
            "when the run completes",
        }
    try:
        with open_run_store(run_dir, m.shards) as st:
            parts = getattr(st, "shards", [st])
            checks = [{"file": str(sh.path), **sh.verify_content()} for sh in parts]
            worst = next((c for c in checks if c["status"] != "ok"), checks[0])
            store = {"status": worst["status"], "store_status": st.status, "files": checks}
            if st.status != C.STATUS_COMPLETED:
                problems.append(f"the store's status is {st.status!r}, not 'completed'")
    except StoreError as e:
        store = {"status": "unreadable", "detail": str(e)}
    if store["status"] not in ("ok", "unchecked"):
        detail = store.get("detail") or next(
            (c.get("detail") or c["file"] for c in store.get("files", []) if c["status"] != "ok"),
            "",
        )
        problems.append(f"the store is {store['status']}: {detail}".rstrip(": "))
    return store


def verify_run(run_dir: str | os.PathLike) -> dict:
    """Re-hash every data file, the saved model and the store's content against the manifest.

    Data and model paths are resolved relative to the run directory (so a moved run checks the
    files beside it, not those of the machine that made it). ``ok`` is true only when the run
    completed, records data files and a saved model, every recorded file is there and matches,
    and the store's content digest matches (a store written before digests existed is reported
    ``unchecked``). ``problems`` says, in words, what else made ``ok`` false (beyond the per-file and model
    statuses).

    Returns:
        ``{"ok": bool, "run_id", "status", "problems": [str], "roots": {...},
        "files": [{"file", "status": ok|changed|missing, "expected", "actual"}],
        "model": {...}, "store": {...}}``

    Raises:
        RunError: no readable run.json.
    """
    run_dir = Path(run_dir)
    m = RunManifest.load(run_dir)
    problems: list[str] = []
    if m.status == C.STATUS_RUNNING:
        problems.append(
            "the run is still training: verify cannot vouch for a run before it completes; "
            "run it again once the train has finished"
        )
    elif not m.completed:
        problems.append(
            f"the run's status is {m.status!r}, not 'completed': verify cannot vouch for a run "
            "that did not finish" + (f" ({m.error})" if m.error else "")
        )
    if not m.data.files:
        problems.append("run.json records no training data files, so there is nothing to check")
    files, roots = _check_data(run_dir, m.data)
    model = _check_model(run_dir, m)
    if model["status"] == "absent":
        problems.append("run.json records no saved model (the run never reached the save step)")
    store = _check_store(run_dir, m, problems)
    # per-file and model mismatches are in "files" / "model"; "problems" says the rest
    ok = not problems and model["status"] == "ok" and all(f["status"] == "ok" for f in files)
    return {
        "ok": ok,
        "run_id": m.run_id,
        "status": m.status,
        "problems": problems,
        "roots": {k: str(v) for k, v in roots.items()},
        "files": files,
        "model": model,
        "store": store,
    }
