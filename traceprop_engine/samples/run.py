"""The bundled sample run: generated facts data -> tracked tiny fine-tune -> indexes.

``traceprop sample`` regenerates ``sample_runs/`` deterministically (seeded data, model init,
data order and projections; one torch thread). The data set has ground truth a person can check
by eye: every eval question paraphrases a fact stated in one or two training examples, and
``rumours.jsonl`` plants contradicting answers (see :mod:`traceprop_engine.samples.data`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from .. import constants as C
from ..attribution import open_run
from ..run_record import RunRecord
from ..settings import IndexSettings, TrackSettings, TrainSettings
from ..training.loop import train
from .data import generate_sample_data

log = logging.getLogger(__name__)

SAMPLE_NAME = "facts"
SAMPLE_DATA = "facts-data"

# sized so that the committed run stays a few MB and trains in about a minute on 2 CPU cores
SAMPLE_SETTINGS = dict(
    epochs=12, lr=3e-3, batch_size=8, max_length=64, tiny_layers=2, tiny_width=128, tiny_vocab=768
)
SAMPLE_TRACK: dict = {}  # the default tracking configuration (TrackSettings())
SAMPLE_PRECONDITIONERS = ("identity", "kfac", "ekfac")
# raw (not cosine) indexes: self-influence and the Rankings page read them (|v|^2 = 1 under cosine)
SAMPLE_RAW_INDEXES = ("identity", "kfac")


def default_root() -> Path:
    return C.REPO_ROOT / "sample_runs"


def build_sample_run(root: Path | None = None, seed: int = 0) -> Path:
    """(Re)generate ``root/facts-data`` and ``root/facts`` (run + indexes); returns the run dir."""
    root = root or default_root()
    root.mkdir(parents=True, exist_ok=True)
    data = root / SAMPLE_DATA
    run_dir = root / SAMPLE_NAME
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    generate_sample_data(data, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(
            TrainSettings(
                data=str(data / "train"),
                eval_data=str(data / "eval"),
                out=str(run_dir),
                seed=seed,
                track=TrackSettings(seed=seed, **SAMPLE_TRACK),
                **SAMPLE_SETTINGS,
            )
        )
    finally:
        torch.set_num_threads(threads)
    # committed beside its data: keep no absolute path of the machine that built it
    record = RunRecord.reopen(run_dir)
    record.relative_to(root)
    record.save()
    index_sample_run(run_dir, data)
    return run_dir


def index_sample_run(run_dir: Path, data: Path) -> dict:
    """(Re)build the sample run's indexes (every preconditioner, cosine and, for the app, raw
    identity and K-FAC) with the current defaults, and write its ``sample_quality.json``;
    returns that report. Also what refreshes a committed sample after an index default changes."""
    run = open_run(run_dir)
    try:
        for pc in SAMPLE_PRECONDITIONERS:
            run.index(IndexSettings(preconditioner=pc), rebuild=True)
        for pc in SAMPLE_RAW_INDEXES:  # so the app opens on them without building
            run.index(IndexSettings(preconditioner=pc, cosine=False), rebuild=True)
        report = ground_truth_hits(run, data)
    finally:
        run.close()
    (run_dir / "sample_quality.json").write_text(json.dumps(report, indent=2))
    log.info("sample run quality: %s", report["summary"])
    return report


def ground_truth_hits(run, data_dir: Path, k: int = 3) -> dict:
    """For each eval question: does a training example stating its fact appear in the top k?"""
    gt = json.loads((data_dir / "ground_truth.json").read_text())
    ex = run.examples()
    eval_rows = ex.filter(ex["split"] == "eval")
    summary = {}
    details = []
    entries = gt.get("eval", gt.get("questions", []))
    by_row = (
        {int(e["row"]): e for e in entries}
        if isinstance(entries, list)
        else {int(r): e for r, e in entries.items()}
    )
    for pc in SAMPLE_PRECONDITIONERS:
        hits = 0
        n = 0
        for r in eval_rows.iter_rows(named=True):
            truth = by_row.get(int(r["row"]))
            if not truth:
                continue
            support = {(s["source"], int(s["row"])) for s in truth.get("supporting", [])}
            res = run.query(
                eval_example=int(r["example_id"]),
                top_k=k,
                opponents=False,
                settings=IndexSettings(preconditioner=pc),
            )
            got = {(s, int(w)) for s, w in zip(res.rows["source"], res.rows["row"], strict=True)}
            hit = bool(got & support)
            hits += hit
            n += 1
            if pc == "kfac":
                details.append({"eval_row": int(r["row"]), "hit": hit})
        summary[pc] = {"hit_at_k": hits / max(n, 1), "k": k, "n": n}
    return {"summary": summary, "kfac_details": details}
