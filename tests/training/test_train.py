"""The train loop's run lifecycle and its errors on bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import facts_data, fast_settings, free_text_data

from traceprop_engine import ConfigError, DataError, RunError, Store
from traceprop_engine.capture.free_text import FREE_TEXT_TARGETS, free_text_note
from traceprop_engine.run import read_manifest, read_progress
from traceprop_engine.settings import TrackSettings, TrainSettings
from traceprop_engine.training.command import train_argv
from traceprop_engine.training.loop import StopFlag, train
from traceprop_engine.training.prepare import MIN_COVARIANCE_BATCHES, short_run_track


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return facts_data(tmp_path_factory.mktemp("data"))


def test_completed_run_writes_everything(data, tmp_path):
    run = train(fast_settings(data, tmp_path / "run", epochs=2))
    m = read_manifest(run)
    assert m["status"] == "completed"
    assert (run / "model" / "model.safetensors").exists() and (
        run / "model" / "tokenizer.json"
    ).exists()
    store = Store(run / "store.h5")
    n_train = m["data"]["n_train"]
    assert store.n_records == 2 * n_train and not store.is_partial
    rec = store.records()
    # every training example has exactly one record per epoch
    ids, counts = np.unique(rec["example_index"], return_counts=True)
    assert len(ids) == n_train and set(counts) == {2}
    assert np.all(rec["lr"] > 0) and np.all(np.isfinite(rec["loss"]))
    ex = store.examples()
    assert (
        set(ex["split"]) == {"train", "eval"} and len(ex["source"]) == n_train + m["data"]["n_eval"]
    )
    # lineage: source relative to the data root, editor line numbers, and the exact tokens
    assert ex["source"][0].endswith(".jsonl") and "/" not in ex["source"][0] and ex["row"][0] >= 1
    toks, mask = store.tokens(0)
    assert len(toks) == len(mask) and mask.sum() >= 1 and mask[0] == 0
    assert len(read_progress(run)) == m["timings"]["n_steps"]
    assert store.covariance(0).n_tokens > 0
    assert m["model"]["fingerprint"] and m["data"]["files"]
    # a short run takes K-FAC statistics from at least MIN_COVARIANCE_BATCHES of its batches; the
    # manifest says which stride was used and which one was asked for
    n_steps = m["timings"]["n_steps"]
    asked = m["config"]["track"]["covariance_stride"]
    assert asked == TrackSettings().covariance_stride
    assert m["tracking"]["covariance_stride"] == min(
        asked, max(1, n_steps // MIN_COVARIANCE_BATCHES)
    )


def test_short_run_track_only_ever_lowers_the_stride():
    t = TrackSettings()
    assert short_run_track(t, 60).covariance_stride == 3
    assert short_run_track(t, 5).covariance_stride == 1
    assert short_run_track(t, 10_000) is t  # long runs keep every 32nd batch
    assert short_run_track(TrackSettings(covariance_stride=2), 60).covariance_stride == 2
    off = TrackSettings(covariance=False)
    assert short_run_track(off, 60) is off
    lowered = short_run_track(t, 60)
    assert lowered.k_in == t.k_in and lowered.covariance_tokens == t.covariance_tokens


def test_free_text_note_only_for_rank_1_records_kept_on_many_targets(caplog):
    """Answers of a few tokens: no note. Free text (more than FREE_TEXT_TARGETS targets an
    example, median) with the free-text rank turned off: a logged note with the median and the
    setting that recovers the quality; none when the records take a higher rank (explicitly, or
    the free-text rank of the default)."""
    short = [np.arange(4)] * 9 + [np.arange(200)]  # the median decides, not the longest
    text = [np.arange(FREE_TEXT_TARGETS + 1)] * 5 + [np.arange(2)]
    off = TrackSettings(free_text_rank=0)
    assert free_text_note(off, short) is None
    assert free_text_note(off, []) is None
    assert free_text_note(TrackSettings(rank=16), text) is None
    assert free_text_note(TrackSettings(), text) is None  # the default takes rank 16 there
    with caplog.at_level("INFO", logger="traceprop_engine"):
        note = free_text_note(off, text)
    assert f"median of {FREE_TEXT_TARGETS + 1} target tokens" in note
    assert "--free-text-rank 16" in note and note in caplog.text


def test_a_free_text_run_takes_the_free_text_rank_and_a_facts_run_does_not(data, tmp_path, caplog):
    """Through `train`: the facts data's completions are short, every token of a text row is
    a target."""
    with caplog.at_level("INFO", logger="traceprop_engine"):
        train(fast_settings(data, tmp_path / "facts"))
    assert "free text" not in caplog.text
    texts = free_text_data(tmp_path / "texts")
    caplog.clear()
    with caplog.at_level("INFO", logger="traceprop_engine"):
        run = train(fast_settings(texts, tmp_path / "text"))
    assert "free text" in caplog.text and "rank 16 instead of 1" in caplog.text
    # the free-text rank, clamped to the layers' k = 4; the facts run kept rank 1
    assert read_manifest(run)["tracking"]["rank"] == 16
    with Store(run / "store.h5") as store:
        assert {info.rank for info in store.layers} == {4}
    assert read_manifest(tmp_path / "facts")["tracking"]["rank"] == 1


def test_no_track_runs_the_same_loop_without_a_store(data, tmp_path):
    run = train(fast_settings(data, tmp_path / "plain", track=None))
    assert read_manifest(run)["status"] == "completed"
    assert not (run / "store.h5").exists()


def test_stop_flag_leaves_a_readable_partial_store(data, tmp_path):
    stop = StopFlag()

    def on_progress(line):
        if line["step"] == 3:
            stop.requested, stop.reason = True, "test"

    run = train(
        fast_settings(data, tmp_path / "cancel", epochs=3), on_progress=on_progress, stop=stop
    )
    m = read_manifest(run)
    assert m["status"] == "cancelled"
    store = Store(run / "store.h5")
    assert store.is_partial and store.status == "cancelled"
    assert store.n_records == 3 * 8
    assert "partial" in store.describe_partial()
    assert (run / "model" / "model.safetensors").exists()


def _long_train_cmd(data, out, *extra: str) -> list[str]:
    """A `traceprop train` of 50 epochs on the tiny model: long enough to be stopped."""
    flags = {
        "data": data / "train",
        "out": out,
        "epochs": 50,
        "tiny_layers": 1,
        "tiny_width": 32,
        "tiny_vocab": 300,
        "max_length": 48,
        "threads": 1,
    }
    return train_argv(flags) + list(extra)


@pytest.mark.slow
def test_sigterm_cancels_a_cli_run(data, tmp_path):
    out = tmp_path / "sig"
    cmd = _long_train_cmd(data, out)
    # stderr goes to a file: an unread pipe fills up and blocks the run inside write().
    with open(tmp_path / "sig.log", "wb") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.time() + 180  # left as soon as done; room for a loaded box
        while time.time() < deadline and len(read_progress(out)) < 2:
            time.sleep(0.2)
        assert read_progress(out), "the run never made progress"
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
    err = (tmp_path / "sig.log").read_text()
    assert p.returncode == 130, err[-2000:]
    m = read_manifest(out)
    assert m["status"] == "cancelled" and m["cancel_reason"] == "SIGTERM"
    store = Store(out / "store.h5")
    assert store.status == "cancelled" and store.n_records > 0


@pytest.mark.slow
def test_sigkill_keeps_the_flushed_records_readable(data, tmp_path):
    """A run killed with SIGKILL (no handler runs: OOM killer, preempted node) leaves a store
    that opens, says it is partial, and holds every record flushed before the kill; the run
    then lists as failed and its records can be indexed and queried."""
    from traceprop_engine.attribution.query import open_run
    from traceprop_engine.settings import IndexSettings

    out = tmp_path / "killed"
    # a flush every 2 steps, a checkpoint every 4
    cmd = _long_train_cmd(data, out, "--buffer-records", "16", "--checkpoint-every", "4")
    p = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ckpt = out / "checkpoint" / "checkpoint.json"
    deadline = time.time() + 180  # left as soon as done; room for a loaded box
    while time.time() < deadline and (len(read_progress(out)) < 6 or not ckpt.exists()):
        time.sleep(0.2)
    assert len(read_progress(out)) >= 6, "the run never made progress"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    with Store(out / "store.h5") as store:
        assert store.status == "running" and store.is_partial  # nobody could mark it
        assert store.n_records >= 16
        assert np.all(np.isfinite(store.sketches(0)))
    run = open_run(out)
    run.index(IndexSettings(preconditioner="identity"))  # the flushed records are usable
    assert run.store.n_records >= 16
    # and queried (round 2, "silently wrong" item 7): on the model of the last checkpoint
    assert not (out / "model").exists()
    res = run.query(eval_example=0, top_k=3, settings=IndexSettings(preconditioner="identity"))
    meta = json.loads((out / "checkpoint" / "checkpoint.json").read_text())
    assert res.rows.height > 0 and res.model_fingerprint == meta["model_fingerprint"]
    assert any(f"last checkpoint (step {meta['step']})" in n for n in res.notes)
    run.close()


def test_existing_run_is_not_overwritten(data, tmp_path):
    train(fast_settings(data, tmp_path / "r"))
    with pytest.raises(RunError, match="already holds a run"):
        train(fast_settings(data, tmp_path / "r"))
    train(fast_settings(data, tmp_path / "r"), overwrite=True)


def test_bad_data_fails_with_file_and_line_and_marks_the_run(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.jsonl").write_text(
        '{"prompt": "Q", "completion": " A"}\n{"prompt": "Q2", "completion": \n'
    )
    with pytest.raises(DataError, match=r"a\.jsonl:2"):
        train(TrainSettings(data=str(d), out=str(tmp_path / "run"), track=TrackSettings()))
    assert read_manifest(tmp_path / "run")["status"] == "failed"
    assert "a.jsonl:2" in read_manifest(tmp_path / "run")["error"]


def test_bad_settings_are_rejected_with_allowed_values(tmp_path):
    with pytest.raises(ConfigError, match="sketch must be one of"):
        TrackSettings(sketch="sparse")
    with pytest.raises(ConfigError, match="scope"):
        TrackSettings(scope="(unclosed")
    with pytest.raises(ConfigError, match="k_in must be a positive integer"):
        TrackSettings(k_in=0)


def test_scope_matching_nothing_lists_the_layers(data, tmp_path):
    with pytest.raises(
        ConfigError, match="matches no trainable linear layer; layers are: gpt_neox"
    ):
        train(fast_settings(data, tmp_path / "x", track=TrackSettings(scope="nothing_like_this")))


def test_lora_run_tracks_adapters_and_saves_the_adapter(data, tmp_path):
    run = train(
        fast_settings(data, tmp_path / "lora", lora_rank=2, track=TrackSettings(k_in=4, k_out=4))
    )
    m = read_manifest(run)
    names = [layer["name"] for layer in m["tracking"]["layers"]]
    assert names and all("lora_" in n for n in names)
    assert (run / "model" / "adapter_config.json").exists() and (
        run / "model" / "base" / "config.json"
    ).exists()
    assert m["model"]["trainable"] < m["model"]["parameters"]


def test_progress_lines_have_eta(data, tmp_path):
    run = train(fast_settings(data, tmp_path / "p"))
    lines = [json.loads(x) for x in (run / "progress.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == lines[-1]["total"] and lines[-1]["eta_s"] == 0
    assert all({"loss", "examples_per_s", "epoch"} <= set(x) for x in lines)


def test_an_error_mid_run_marks_it_failed_and_keeps_a_readable_store(data, tmp_path):
    def boom(line):
        if line["step"] == 3:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        train(fast_settings(data, tmp_path / "crash", epochs=2), on_progress=boom)
    m = read_manifest(tmp_path / "crash")
    assert m["status"] == "failed" and "disk on fire" in m["error"]
    store = Store(tmp_path / "crash" / "store.h5")
    assert store.status == "failed" and store.is_partial and store.n_records == 3 * 8
    assert store.covariance(0).n_tokens > 0  # what was accumulated is kept


def test_a_killed_run_reads_as_failed(data, tmp_path):
    run = train(fast_settings(data, tmp_path / "k"))
    m = json.loads((run / "run.json").read_text())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer exists
    m.update(status="running", pid=p.pid)
    (run / "run.json").write_text(json.dumps(m))
    got = read_manifest(run)
    assert got["status"] == "failed" and "without updating its status" in got["error"]
