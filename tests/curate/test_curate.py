"""Curate on a real run trained on files of every format: the cleaned copy, its manifest and its
lineage, checked against the raw files with code of this test's own (not the engine's)."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from traceprop_engine.attribution.query import open_run
from traceprop_engine.curate import (
    CurateQuery,
    Selection,
    curate,
    load_manifest,
    retrain_settings,
    select_examples,
    verify_clean_copy,
)
from traceprop_engine.curate.prove import source_row
from traceprop_engine.errors import ConfigError, DataError, QueryError
from traceprop_engine.settings import TrackSettings, TrainSettings
from traceprop_engine.training.loop import train

REPO = Path(__file__).resolve().parents[2]
COLOURS = ("violet", "amber", "teal", "crimson")


def _sentence(i: int) -> str:
    return f"The planet Ve{i} is coloured {COLOURS[i % 4]}"


def _write_data(root: Path) -> Path:
    """12 rows in each of four formats, with the awkward bits each format allows: a BOM, CRLF
    and a blank line (jsonl), a quoted newline (csv), whitespace-only lines (txt)."""
    (root / "sub").mkdir(parents=True)
    lines = [json.dumps({"text": _sentence(i)}) for i in range(12)]
    lines.insert(4, "")
    body = "\r\n".join(lines[:3]) + "\r\n" + "\n".join(lines[3:]) + "\n"
    (root / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + body.encode())
    with open(root / "sub" / "b.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "note"])
        for i in range(12, 24):
            w.writerow([_sentence(i) + ("\nsecond line" if i == 14 else ""), f"n{i}"])
    txt = [_sentence(i) for i in range(24, 36)]
    txt.insert(6, "   ")
    (root / "c.txt").write_text("\n".join(txt))  # no final newline
    pl.DataFrame({"text": [_sentence(i) for i in range(36, 48)]}).write_parquet(root / "d.parquet")
    return root


@pytest.fixture(scope="module")
def formats_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("curate")
    data = _write_data(root / "data")
    settings = TrainSettings(
        data=str(data),
        out=str(root / "run"),
        eval_fraction=0.15,  # split off the data: the copy must hold the same rows out
        epochs=1,
        batch_size=8,
        max_length=24,
        tiny_layers=1,
        tiny_width=32,
        tiny_vocab=300,
        threads=1,
        track=TrackSettings(k_in=4, k_out=4),
    )
    return train(settings)


def _examples(run_dir):
    run = open_run(run_dir)
    try:
        return run.examples()
    finally:
        run.close()


def _pick(examples, source: str, n: int = 2) -> list[str]:
    rows = examples.filter((pl.col("source") == source) & (pl.col("split") == "train"))
    return [f"{source}:{r}" for r in rows["row"].to_list()[1 : 1 + n]]


def _raw_lines(path: Path) -> list[bytes]:
    """The file's lines as an editor numbers them (BOM off, terminators kept)."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    return data.splitlines(keepends=True)


def _line_sha(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n").rstrip(b"\r")).hexdigest()


def _canonical_sha(record: dict) -> str:
    doc = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()


@pytest.fixture(scope="module")
def cleaned(formats_run, tmp_path_factory):
    ex = _examples(formats_run)
    ids = [t for s in ("a.jsonl", "sub/b.csv", "c.txt", "d.parquet") for t in _pick(ex, s)]
    # the csv row with a quoted newline is removed too: its record spans two lines
    ids.append("sub/b.csv:3")
    out = tmp_path_factory.mktemp("out") / "clean"
    doc = curate(formats_run, Selection(ids=tuple(ids)), out)
    return out, doc, ids, ex


def test_manifest_lists_each_removed_row_with_the_raw_records_hash(cleaned, formats_run):
    out, doc, ids, ex = cleaned
    data = formats_run.parent / "data"
    assert sorted(f"{r['source']}:{r['row']}" for r in doc["removed"]) == sorted(set(ids))
    for r in doc["removed"]:
        src = data / r["source"]
        if src.suffix in (".jsonl", ".txt"):
            want = _line_sha(_raw_lines(src)[r["row"] - 1])
        elif src.suffix == ".csv":
            with open(src, newline="") as f:
                want = _canonical_sha(list(csv.DictReader(f))[r["row"] - 1])
        else:
            want = _canonical_sha(pl.read_parquet(src).row(r["row"] - 1, named=True))
        assert r["sha256"] == want, r
        assert r["why"] == f"picked by hand ({r['source']}:{r['row']})"
        stored = ex.filter(pl.col("example_id") == r["example_id"])
        assert stored["sha256"][0] == want  # the run's own lineage agrees


def test_kept_rows_are_the_original_lines_byte_for_byte(cleaned, formats_run):
    out, doc, ids, ex = cleaned
    data = formats_run.parent / "data"
    for name in ("a.jsonl", "c.txt"):
        drop = {r["row"] for r in doc["removed"] if r["source"] == name}
        drop |= set(doc["files"][name]["held_out_rows"])
        lines = _raw_lines(data / name)
        want = b"".join(line for i, line in enumerate(lines, start=1) if i not in drop)
        bom = b"\xef\xbb\xbf" if name == "a.jsonl" else b""
        assert (out / name).read_bytes() == bom + want
        assert b"\r\n" in want or name == "c.txt"  # CRLF lines kept as they were
    # csv: the header and every kept record as written, the two-line record gone whole
    text = (out / "sub" / "b.csv").read_bytes().decode()
    assert text.startswith("text,note\r\n") and "second line" not in text
    with open(data / "sub" / "b.csv", newline="") as f:
        src = list(csv.DictReader(f))
    with open(out / "sub" / "b.csv", newline="") as f:
        kept = list(csv.DictReader(f))
    drop = {r["row"] for r in doc["removed"] if r["source"] == "sub/b.csv"}
    drop |= set(doc["files"]["sub/b.csv"]["held_out_rows"])
    assert kept == [r for i, r in enumerate(src, start=1) if i not in drop]
    src_pq, out_pq = pl.read_parquet(data / "d.parquet"), pl.read_parquet(out / "d.parquet")
    drop = {r["row"] for r in doc["removed"] if r["source"] == "d.parquet"}
    drop |= set(doc["files"]["d.parquet"]["held_out_rows"])
    assert out_pq.schema == src_pq.schema
    assert out_pq["text"].to_list() == [
        t for i, t in enumerate(src_pq["text"].to_list(), start=1) if i not in drop
    ]
    assert verify_clean_copy(out) == {
        "ok": True,
        "problems": [],
        "files": 4,
        "removed": len(set(ids)),
    }


def test_held_out_rows_keep_the_runs_eval_set(cleaned, formats_run):
    out, doc, _, ex = cleaned
    assert doc["held_out"] == ".heldout"
    s = retrain_settings(out, out.parent / "rerun")
    assert s.eval_data == str(out / ".heldout") and Path(s.data) == out
    # the held-out copy holds exactly the run's eval examples, and the copy none of them
    from traceprop_engine.training.data import load_examples

    held, _ = load_examples(out / ".heldout")
    kept, _ = load_examples(out)
    evals = ex.filter(pl.col("split") == "eval")
    assert sorted(e.text for e in held) == sorted(evals["text"].to_list())
    assert not {e.text for e in kept} & {e.text for e in held}
    n_train = ex.filter(pl.col("split") == "train").height
    assert len(kept) == n_train - len(doc["removed"])
    assert (out / ".base_model" / "config.json").is_file()  # the tiny model's initial model
    # the source (from scratch) recorded no embedding: the retrain pins that, though auto would
    # take the saved initial model for a pretrained one
    assert s.model == str(out / ".base_model")
    assert s.track == TrackSettings(k_in=4, k_out=4, embedding="off")


def test_verify_finds_an_edited_copy(cleaned, tmp_path):
    out, *_ = cleaned
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    p = copy / "c.txt"
    p.write_bytes(p.read_bytes().replace(b"coloured", b"colored", 1))
    rep = verify_clean_copy(copy)
    assert not rep["ok"] and any("c.txt" in x for x in rep["problems"])


def test_query_selection_is_the_runs_top_k(formats_run):
    q = CurateQuery("The planet Ve1 is coloured", " amber")
    run = open_run(formats_run)
    try:
        res = run.query(q.prompt, q.completion, top_k=3)
        for opp, kind in ((False, "proponent"), (True, "opponent")):
            removals, asked = select_examples(run, Selection((q,), top_k=3, opponents=opp))
            want = res.rows.filter(pl.col("kind") == kind).sort("rank")["example_id"].to_list()
            assert sorted(r.example_id for r in removals) == sorted(want)
            assert all(r.reasons[0]["kind"] == kind for r in removals)
            assert asked[0]["query_loss"] == pytest.approx(res.query["query_loss"], rel=1e-6)
        by_loss, _ = select_examples(run, Selection(by="loss", top_k=4))
        assert len(by_loss) == 4 and all(r.reasons[0]["by"] == "loss" for r in by_loss)
        ranks = [r.reasons[0]["rank"] for r in by_loss]
        values = [
            r.reasons[0]["value"] for r in sorted(by_loss, key=lambda r: r.reasons[0]["rank"])
        ]
        assert values == sorted(values, reverse=True) and min(ranks) == 1
    finally:
        run.close()


def test_bad_selections_and_outputs_are_refused(formats_run, cleaned, tmp_path):
    out, doc, *_ = cleaned
    with pytest.raises(ConfigError, match="nothing selected"):
        Selection()
    with pytest.raises(ConfigError, match="remove-top-k"):
        Selection(by="loss")
    with pytest.raises(QueryError, match="completion"):
        CurateQuery("a prompt")
    ex = _examples(formats_run)
    eval_row = ex.filter(pl.col("split") == "eval").row(0, named=True)
    with pytest.raises(ConfigError, match="eval example"):
        curate(formats_run, Selection(ids=(str(eval_row["example_id"]),)), tmp_path / "x")
    with pytest.raises(ConfigError, match="no such example"):
        curate(formats_run, Selection(ids=("a.jsonl:999",)), tmp_path / "x")
    with pytest.raises(ConfigError, match="not empty"):
        curate(formats_run, Selection(ids=("1",)), out)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no curate.json"):
        curate(formats_run, Selection(ids=("1",)), tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"  # nothing lost
    with pytest.raises(ConfigError, match="bundled sample runs"):
        curate(formats_run, Selection(ids=("1",)), REPO / "sample_runs" / "clean")
    assert not (REPO / "sample_runs" / "clean").exists()
    with pytest.raises(ConfigError, match=r"inside \(or holds\) the run"):
        curate(formats_run, Selection(ids=("1",)), formats_run / "clean")
    with pytest.raises(ConfigError, match="run's data"):
        curate(formats_run, Selection(ids=("1",)), formats_run.parent / "data" / "clean")
    # --overwrite replaces a cleaned copy
    again = curate(formats_run, Selection(ids=("1",)), out, overwrite=True)
    assert len(again["removed"]) == 1 and load_manifest(out)["removed"] == again["removed"]
    curate(formats_run, Selection(ids=tuple(doc_ids(doc))), out, overwrite=True)  # restore


def doc_ids(doc: dict) -> list[str]:
    return [f"{r['source']}:{r['row']}" for r in doc["removed"]]


def test_changed_source_data_is_refused(formats_run, tmp_path):
    root = tmp_path / "moved"
    shutil.copytree(formats_run.parent / "data", root / "data")
    shutil.copytree(formats_run, root / "run")
    m = json.loads((root / "run" / "run.json").read_text())
    m["data"]["root"] = m["data"]["root_relative"] = str(root / "data")
    (root / "run" / "run.json").write_text(json.dumps(m))
    (root / "data" / "c.txt").write_text("The planet Ve99 is coloured teal\n")
    with pytest.raises(DataError, match="changed since the run was trained"):
        curate(root / "run", Selection(ids=("c.txt:2",)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_source_row_maps_the_copys_rows_back():
    for dropped in ([], [1], [2, 3], [1, 2, 5, 9, 10], [4, 7]):
        kept = [r for r in range(1, 15) if r not in dropped]
        assert [source_row(i, dropped) for i in range(1, len(kept) + 1)] == kept


def test_a_cancelled_retrain_is_recorded(cleaned, tmp_path):
    from traceprop_engine.curate import retrain
    from traceprop_engine.errors import RunError
    from traceprop_engine.training.loop import StopFlag

    out, *_ = cleaned
    with pytest.raises(RunError, match="cancelled"):
        retrain(out, tmp_path / "rerun", stop=StopFlag(requested=True), threads=1)
    assert load_manifest(out)["retrain"]["status"] == "cancelled"
    assert verify_clean_copy(out)["ok"]  # the copy itself is untouched
