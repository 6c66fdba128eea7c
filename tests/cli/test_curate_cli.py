"""``traceprop curate`` end to end on a tiny run: select → cleaned copy → tracked retrain with the
run's settings → proof (loss and answer before/after, rankings moved, eval set)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from helpers import fast_settings

from traceprop_engine.attribution.query import open_run
from traceprop_engine.cli.main import main
from traceprop_engine.training.loop import train


@pytest.fixture(scope="module")
def tiny_run(facts, tmp_path_factory) -> Path:
    return train(fast_settings(facts, tmp_path_factory.mktemp("cli-curate") / "run", epochs=2))


def _query(run_dir: Path, i: int = 0) -> tuple[str, str]:
    run = open_run(run_dir)
    try:
        r = run.eval_examples().row(i, named=True)
    finally:
        run.close()
    return r["prompt"], r["completion"]


@pytest.fixture(scope="module")
def curated(tiny_run, tmp_path_factory):
    prompt, completion = _query(tiny_run)
    out = tmp_path_factory.mktemp("cli-curate-out") / "clean"
    second = _query(tiny_run, 1)  # a second query: repeatable --prompt/--completion
    args = ["curate", str(tiny_run), "--prompt", prompt, "--completion", completion]
    args += ["--prompt", second[0], "--completion", second[1]]
    rc = main(
        [*args, "--remove-top-k", "3", "--remove-ids", "1,2", "--out", str(out), "--retrain"]
        + ["--threads", "1", "--compare-top-k", "5"]
    )
    assert rc == 0
    return out, prompt, completion


def test_retrain_uses_the_runs_settings(tiny_run, curated):
    out, *_ = curated
    doc = json.loads((out / "curate.json").read_text())
    before = json.loads((tiny_run / "run.json").read_text())
    after = json.loads((Path(doc["retrain"]["run"]) / "run.json").read_text())
    assert after["status"] == "completed" and after["tracked"]
    swapped = {"data", "eval_data", "out", "model", "threads"}
    same = {k: v for k, v in before["config"].items() if k not in swapped}
    # embedding='auto' is pinned to what the source decided (off: a tiny model from scratch)
    same["track"] = {**same["track"], "embedding": "off"}
    assert before["tracking"]["embedding"] == "off"
    assert {k: after["config"][k] for k in same} == same
    assert Path(after["config"]["data"]) == out.resolve()
    assert after["data"]["n_train"] == before["data"]["n_train"] - len(doc["removed"])
    assert after["data"]["n_eval"] == before["data"]["n_eval"]
    assert after["data"]["eval_files"] == before["data"]["eval_files"]  # the same eval set


def test_proof_compares_the_motivating_query(tiny_run, curated, capsys):
    out, prompt, completion = curated
    proof = json.loads((out / "proof.json").read_text())
    doc = json.loads((out / "curate.json").read_text())
    assert len(proof["queries"]) == 2 and len(doc["queries"]) == 2
    q = proof["queries"][0]
    assert q["query"] == {"prompt": prompt, "completion": completion, "label": None}
    # "before" is the run's own answer to the query
    run = open_run(tiny_run)
    try:
        res = run.query(prompt, completion, top_k=5)
    finally:
        run.close()
    assert q["before"]["loss"] == pytest.approx(res.query["query_loss"], rel=1e-5)
    assert q["loss_change"] == pytest.approx(q["after"]["loss"] - q["before"]["loss"])
    # the removed proponents are marked removed; nothing removed is ranked after
    ch = pl.DataFrame(q["changes"])
    removed = {(r["source"], r["row"]) for r in doc["removed"]}
    top = res.proponents.sort("rank").head(3)
    for r in top.iter_rows(named=True):
        hit = ch.filter((pl.col("source") == r["source"]) & (pl.col("row") == r["row"]))
        assert hit["status"][0] == "removed" and hit["rank_b"][0] is None
    after = ch.filter(pl.col("rank_b").is_not_null())
    assert not {(s, r) for s, r in zip(after["source"], after["row"], strict=True)} & removed
    assert [o["kind"] for o in q["overlap"]] == ["proponent", "opponent"]
    assert proof["eval"]["eval_loss_before"] > 0 and proof["eval"]["eval_loss_after"] > 0
    reasons = sorted({r["reasons"][0]["by"] for r in doc["removed"]})
    assert reasons == ["hand", "query"]


def test_refusals_exit_1_with_a_message(tiny_run, curated, capsys):
    out, prompt, completion = curated
    base = ["curate", str(tiny_run), "--remove-ids", "3"]
    assert main([*base, "--out", str(out)]) == 1
    assert "not empty" in capsys.readouterr().err
    repo = Path(__file__).resolve().parents[2]
    assert main([*base, "--out", str(repo / "sample_runs" / "facts" / "clean")]) == 1
    assert "bundled sample runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one completion per prompt
        main(["curate", str(tiny_run), "--prompt", prompt, "--out", str(out)])


def test_help_names_the_flags():
    p = subprocess.run(
        [sys.executable, "-m", "traceprop_engine", "curate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0
    for flag in ("--remove-top-k", "--opponents", "--remove-ids", "--by", "--retrain", "--out"):
        assert flag in p.stdout
