"""run_record.RunRecord, run.json's one writer: what each method writes, read back through
RunManifest (the end-to-end manifests of train, resume and Tracker.finish: tests/training,
tests/capture)."""

from __future__ import annotations

import json
import os

import pytest

from traceprop_engine import RunError
from traceprop_engine import constants as C
from traceprop_engine.run import RunManifest
from traceprop_engine.run_record import RunRecord
from traceprop_engine.settings import TrackSettings, TrainSettings
from traceprop_engine.training.distributed import DistContext


def _new(tmp_path, **kw) -> RunRecord:
    settings = TrainSettings(data=str(tmp_path), out=str(tmp_path / "run"), **kw)
    (tmp_path / "run").mkdir()
    return RunRecord.new_training(tmp_path / "run", settings, DistContext())


def test_a_training_record_is_written_once_saved_and_reads_back_typed(tmp_path):
    rec = _new(tmp_path, track=TrackSettings(k_in=4, k_out=4))
    assert not (rec.run_dir / C.MANIFEST_FILE).exists()  # updates are in memory until save()
    rec.set_data(tmp_path, tmp_path, {"a.jsonl": "ab"}, {}, n_train=3, n_eval=0)
    rec.set_model(
        source="tiny", task="causal-lm", parameters=5, trainable=5, lora_rank=0, labels=None
    )
    rec.add_note("n1")
    rec.set_timings(n_steps=2, median_step_ms=1.5, total_s=0.1)
    rec.set_model_saved("f" * 64)
    rec.set_store(C.STORE_FILE, 6)
    rec.finished(C.STATUS_COMPLETED)
    rec.save()
    m = RunManifest.load(rec.run_dir)
    assert m.completed and m.pid is None and m.tracked and m.notes == ["n1"]
    assert m.data.root_relative == ".." and m.data.files == {"a.jsonl": "ab"}
    assert (m.model.fingerprint, m.model.saved) == ("f" * 64, C.MODEL_DIR)
    assert m.store.n_records == 6 and m.timings.total_s == 0.1
    assert not (rec.run_dir / (C.MANIFEST_FILE + ".tmp")).exists()
    # the typed view and as_dict are copies: changing them changes nothing in the record
    rec.as_dict()["status"] = "x"
    m.raw["status"] = "x"
    assert rec.manifest.status == C.STATUS_COMPLETED


def test_absent_values_stay_absent(tmp_path):
    rec = _new(tmp_path, track=None)
    rec.set_store(C.STORE_FILE)
    rec.set_timings(n_steps=1, median_step_ms=None)
    raw = rec.as_dict()
    assert raw["store"] == {"file": C.STORE_FILE}  # no "n_records": null
    assert raw["timings"] == {"n_steps": 1, "median_step_ms": None}
    assert raw["tracked"] is False and "shards" not in raw and "distributed" not in raw


def test_the_first_error_is_kept_when_asked(tmp_path):
    rec = _new(tmp_path)
    rec.failed("ValueError: first")
    rec.failed("closing the store failed: later", replace=False)
    assert rec.manifest.error == "ValueError: first"
    rec.failed("disk full: now")
    assert rec.manifest.error == "disk full: now"


def test_resumed_forgets_the_last_attempt_and_records_it(tmp_path):
    rec = _new(tmp_path)
    rec.set_model(
        source="tiny", task="causal-lm", parameters=5, trainable=5, lora_rank=0, labels=None
    )
    rec.set_model_saved("f" * 64)
    rec.set_metrics(last_train_loss=1.0, eval_loss=2.0)
    rec.cancelled("SIGTERM")
    rec.finished(C.STATUS_CANCELLED)
    rec.save()
    again = RunRecord.reopen(rec.run_dir)
    again.resumed(from_step=4, n_records_kept=32)
    m = again.manifest
    assert m.status == C.STATUS_RUNNING and m.pid == os.getpid() and m.cancel_reason is None
    assert m.metrics == {} and m.model.fingerprint is None and m.model.source == "tiny"
    (entry,) = m.resumed
    assert entry["previous_status"] == C.STATUS_CANCELLED and entry["previous_error"] == "SIGTERM"
    assert (entry["from_step"], entry["n_records_kept"]) == (4, 32)


def test_reopen_reads_as_written(tmp_path):
    rec = _new(tmp_path)
    raw = rec.as_dict()
    raw.update(pid=2**22 + 12345)  # a process that is gone: readers see failed, reopen running
    (rec.run_dir / C.MANIFEST_FILE).write_text(json.dumps(raw))
    assert RunManifest.load(rec.run_dir).status == C.STATUS_FAILED
    assert RunRecord.reopen(rec.run_dir).manifest.status == C.STATUS_RUNNING
    (rec.run_dir / C.MANIFEST_FILE).write_text("[]")
    with pytest.raises(RunError, match="not a run manifest"):
        RunRecord.reopen(rec.run_dir)


def test_relative_to_rewrites_paths_under_the_root(tmp_path):
    rec = _new(tmp_path)
    rec.set_data(tmp_path / "d", tmp_path / "d", {}, {}, n_train=0, n_eval=0)
    rec.relative_to(tmp_path)
    data = rec.manifest.data
    assert data.root == os.path.join("..", "d") and not os.path.isabs(rec.manifest.config["data"])
