"""Curate and prove: pick training examples (a query's top proponents or opponents, a ranking's
top, rows by hand), write a cleaned copy of the training data without them, retrain on it with
the run's own settings, and compare the two runs on the queries that motivated the change.

The stages, one module each: :mod:`.select` (what to remove and why), :mod:`.clean_copy` (the
copy and its manifest, lineage checked), :mod:`.retrain` (the tracked retrain), :mod:`.prove`
(the side-by-side comparison). :func:`curate` runs the first two on a run.
"""

from __future__ import annotations

import os
from pathlib import Path

from .clean_copy import (
    MANIFEST,
    check_out,
    load_manifest,
    verify_clean_copy,
    write_clean_copy,
)
from .prove import PROOF, load_proof, prove
from .retrain import prepare_base_model, retrain, retrain_settings
from .select import CurateQuery, Removal, Selection, select_examples

__all__ = [
    "MANIFEST",
    "PROOF",
    "CurateQuery",
    "Removal",
    "Selection",
    "check_out",
    "curate",
    "load_manifest",
    "load_proof",
    "preview",
    "prove",
    "retrain",
    "retrain_settings",
    "select_examples",
    "verify_clean_copy",
    "write_clean_copy",
]


def preview(run_dir: str | os.PathLike, selection: Selection) -> tuple[list[Removal], list[dict]]:
    """What ``selection`` removes from ``run_dir``, without writing anything."""
    from ..attribution import open_run

    run = open_run(run_dir)
    try:
        return select_examples(run, selection)
    finally:
        run.close()


def curate(
    run_dir: str | os.PathLike,
    selection: Selection,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> dict:
    """Select the examples, write the cleaned copy to ``out`` (and, for the tiny model, the
    initial model a retrain starts from); returns the manifest.

    Raises:
        ConfigError, DataError, QueryError, RunError: see :func:`select_examples` and
            :func:`write_clean_copy`; nothing is written when one is raised before the copy.
    """
    from ..attribution import open_run
    from ..run import RunManifest
    from .clean_copy import data_root

    run_dir = Path(run_dir)
    m = RunManifest.load(run_dir)
    check_out(Path(out), run_dir, data_root(run_dir, m), overwrite)  # before any query work
    run = open_run(run_dir)
    try:
        removals, queries = select_examples(run, selection)
        examples = run.examples()
    finally:
        run.close()
    doc = write_clean_copy(
        run_dir,
        removals,
        out,
        examples=examples,
        selection=selection.to_dict(),
        queries=queries,
        overwrite=overwrite,
    )
    prepare_base_model(out, examples)
    return doc
