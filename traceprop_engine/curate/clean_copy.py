"""The cleaned copy of a run's training data: the same files, formats and folder layout, without
the removed rows, and a manifest (``curate.json``) that lists each removed row's source, row,
sha256 and why it was removed.

Layout of ``OUT/``::

    OUT/<every data file of the run, at its relative path>   kept rows, byte for byte
    OUT/curate.json          the manifest (ignored by the data readers: not a data suffix)
    OUT/.heldout/...         only when the run split its eval set off its data: those rows, so
                             a retrain holds out the same examples (hidden: not training data)
    OUT/.base_model/         the run's initial model, when it was the tiny model (its
                             tokenizer is trained on the data; a retrain starts from the same)

Lineage is checked while writing: the data files must still hash as the run recorded, and
every removed row's sha256 (recomputed from its raw record in the source file) must equal the
run's. The copy is built in a temporary folder beside ``OUT`` and moved into place, so a
failure leaves no half-written copy.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .. import constants as C
from ..errors import ConfigError, DataError, RunError
from ..run import RunManifest, bundled_roots
from ..training.data import sha256_file
from .files import read_records, rebuilt_bytes, write_only, write_without
from .select import Removal

MANIFEST = "curate.json"
HELDOUT_DIR = ".heldout"
BASE_MODEL_DIR = ".base_model"
KIND = "traceprop-curated-data"


def data_root(run_dir: Path, m: RunManifest, which: str = "root") -> Path:
    from ..verify import _data_root  # the one owner of "where a run's data is now"

    return _data_root(run_dir, m.data, which)


def check_out(out: Path, run_dir: Path, source_root: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is bundled, inside a run or the source data, read-only, or a
    non-empty folder (without ``overwrite``; and never one that is not a curated copy).

    Raises:
        ConfigError: what is wrong with ``out`` and what to do.
    """
    out = out.resolve()
    for root, what in [(r, "the bundled sample runs") for r in bundled_roots()] + [
        (run_dir.resolve(), "the run"),
        (source_root, "the run's data"),
    ]:
        if out == root or root in out.parents or (what != "the run" and out in root.parents):
            raise ConfigError(
                f"--out {out} is inside (or holds) {what} ({root}): bundled runs and the source "
                "data stay read-only; write the cleaned copy somewhere else"
            )
    for p in [out, *out.parents]:
        if (p / C.MANIFEST_FILE).is_file():
            raise ConfigError(f"--out {out} is inside the run {p}: choose a folder of its own")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out {out} is not empty: choose a new folder or pass --overwrite")
        if not (out / MANIFEST).is_file():
            raise ConfigError(
                f"--out {out} holds files but no {MANIFEST}: --overwrite replaces only a "
                "cleaned copy written by 'traceprop curate'; choose a new folder"
            )
    parent = next((p for p in [out, *out.parents] if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        raise ConfigError(f"--out {out}: {parent} is not writable")


def _heldout_rows(examples, files: dict) -> dict[str, set[int]]:
    """Eval rows split off the training data (``eval_fraction``), by source file."""
    ev = examples.filter(examples["split"] == C.SPLIT_EVAL)
    out: dict[str, set[int]] = {}
    for r in ev.iter_rows(named=True):
        if r["source"] in files:
            out.setdefault(r["source"], set()).add(int(r["row"]))
    return out


# long: one pass over the run's files, each checked, copied and accounted for in the manifest
def write_clean_copy(
    run_dir: str | os.PathLike,
    removals: list[Removal],
    out: str | os.PathLike,
    *,
    examples,
    selection: dict,
    queries: list[dict],
    overwrite: bool = False,
) -> dict:
    """Write ``run_dir``'s training data without ``removals`` to ``out``; returns the manifest.

    Args:
        examples: the run's example table (``AttributionRun.examples()``).
        selection / queries: what picked the removals (recorded in the manifest).

    Raises:
        ConfigError: a refused ``out`` (see :func:`check_out`), or nothing left to train on.
        DataError: the data files changed since training, or a removed row's hash differs.
        RunError: the run is not complete or records no data files.
    """
    run_dir = Path(run_dir)
    m = RunManifest.load(run_dir)
    if not m.completed:
        raise RunError(f"{run_dir} is not a completed run (status {m.status!r})")
    if not m.data.files:
        raise RunError(f"{run_dir} records no data files (a run made by a Tracker in own code?)")
    root = data_root(run_dir, m)
    out = Path(out).resolve()
    check_out(out, run_dir, root, overwrite)
    task = m.model.task or m.config.get("task") or "causal-lm"
    for name, want in m.data.files.items():
        if not (root / name).is_file() or sha256_file(root / name) != want:
            raise DataError(
                f"{root / name} is missing or changed since the run was trained (its sha256 "
                "differs from run.json): the cleaned copy must come from the data the run saw"
            )
    by_file: dict[str, dict[int, Removal]] = {}
    for r in removals:
        by_file.setdefault(r.source, {})[r.row] = r
    held = _heldout_rows(examples, m.data.files)
    n_train = int(m.data.n_train or 0)
    if n_train and len(removals) >= n_train:
        raise ConfigError(f"removing {len(removals)} of {n_train} examples leaves none to train on")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files_doc = {}
    try:
        for name in sorted(m.data.files):
            rec = read_records(root / name, name, task)
            drop = set(by_file.get(name, {}))
            for row, r in by_file.get(name, {}).items():
                if rec.sha256.get(row) != r.sha256:
                    raise DataError(
                        f"{name}:{row}: the raw record hashes to {rec.sha256.get(row)}, the run "
                        f"recorded {r.sha256}: lineage does not check out"
                    )
            ho = held.get(name, set())
            write_without(root / name, tmp / name, rec, drop | ho)
            if ho:
                write_only(root / name, tmp / HELDOUT_DIR / name, rec, ho)
            files_doc[name] = {
                "sha256_source": m.data.files[name],
                "sha256": sha256_file(tmp / name),
                "rows_source": len(rec.spans),
                "rows_removed": len(drop),
                "rows_held_out": len(ho),
                "held_out_rows": sorted(ho),
                "rows": len(rec.spans) - len(drop) - len(ho),
            }
        doc = {
            "kind": KIND,
            "version": 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "source_run": {"run_id": m.run_id, "path": str(run_dir.resolve())},
            "source_data": {"root": str(root), "files": dict(m.data.files), "task": task},
            "selection": selection,
            "queries": queries,
            "removed": [r.to_dict() for r in removals],
            "files": files_doc,
            "held_out": HELDOUT_DIR if held else None,
            "what": "every data file of the run without the removed rows (kept lines byte for "
            "byte); 'removed' lists each removed row's source, row, the sha256 of its raw "
            "record (as the data readers hash it) and why it was removed",
        }
        (tmp / MANIFEST).write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        if out.exists():
            shutil.rmtree(out)  # check_out allowed it: a cleaned copy, --overwrite given
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return doc


def load_manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of a cleaned copy.

    Raises:
        ConfigError: ``data_dir`` holds no readable ``curate.json``.
    """
    p = Path(data_dir) / MANIFEST
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p} is missing or unreadable ({e}): not a cleaned copy") from e
    if doc.get("kind") != KIND:
        raise ConfigError(f"{p} is not a manifest written by 'traceprop curate'")
    return doc


def update_manifest(data_dir: str | os.PathLike, **sections) -> dict:
    """Add or replace top-level sections of the manifest (written atomically)."""
    from ..evaluate.lds_settings import atomic_write_text

    doc = {**load_manifest(data_dir), **sections}
    atomic_write_text(Path(data_dir) / MANIFEST, json.dumps(doc, indent=1, ensure_ascii=False))
    return doc


def verify_clean_copy(data_dir: str | os.PathLike) -> dict:
    """Re-check a cleaned copy against its source files: each removed row's sha256 against its
    raw record, each copied file against its source rebuilt without the removed rows.

    Returns:
        ``{"ok": bool, "problems": [...], "files": n, "removed": n}``.
    """
    data_dir = Path(data_dir)
    doc = load_manifest(data_dir)
    root, task = Path(doc["source_data"]["root"]), doc["source_data"]["task"]
    problems = []
    removed: dict[str, set[int]] = {}
    for r in doc["removed"]:
        removed.setdefault(r["source"], set()).add(int(r["row"]))
    for name, info in doc["files"].items():
        src = root / name
        if not src.is_file() or sha256_file(src) != info["sha256_source"]:
            problems.append(f"{src}: missing or changed since the copy was made")
            continue
        rec = read_records(src, name, task)
        for r in (x for x in doc["removed"] if x["source"] == name):
            if rec.sha256.get(int(r["row"])) != r["sha256"]:
                problems.append(f"{name}:{r['row']}: sha256 differs from the raw record")
        if sha256_file(data_dir / name) != info["sha256"]:
            problems.append(f"{data_dir / name}: changed since it was written")
        drop = removed.get(name, set()) | set(info.get("held_out_rows") or [])
        if not _same_kept(src, data_dir / name, rec, drop):
            problems.append(f"{name}: not the source file without the removed rows")
    return {
        "ok": not problems,
        "problems": problems,
        "files": len(doc["files"]),
        "removed": len(doc["removed"]),
    }


def _same_kept(src: Path, copy: Path, rec, drop: set[int]) -> bool:
    """The copy is the source without the rows ``drop``: byte for byte (text formats), row for
    row with the same schema (Parquet)."""
    if rec.suffix != ".parquet":
        return copy.read_bytes() == rebuilt_bytes(rec, drop)
    import polars as pl

    frame = pl.read_parquet(src)
    mask = pl.Series([i + 1 not in drop for i in range(frame.height)])
    return frame.filter(mask).equals(pl.read_parquet(copy))
