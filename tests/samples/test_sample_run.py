"""The committed sample run opens with the current schema, its indexes are fresh (not rebuilt),
its inputs verify, and the regeneration command reproduces its data byte for byte."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

from traceprop_engine import constants as C
from traceprop_engine.attribution.query import open_run
from traceprop_engine.samples.data import generate_sample_data
from traceprop_engine.samples.run import SAMPLE_PRECONDITIONERS, default_root
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.reader import Store
from traceprop_engine.verify import verify_run

SAMPLE = default_root() / "facts"


def test_sample_store_has_the_current_schema_and_is_complete():
    with Store(SAMPLE / C.STORE_FILE) as s:
        assert s.attrs()["schema_version"] == C.SCHEMA_VERSION
        assert s.status == C.STATUS_COMPLETED and s.n_records > 0 and s.has_covariance


def test_sample_indexes_are_fresh(monkeypatch):
    run = open_run(SAMPLE)

    def no_rebuild(*a, **k):
        raise AssertionError("the committed index was stale and got rebuilt")

    monkeypatch.setattr(run.indexes, "build", no_rebuild)
    for pc in SAMPLE_PRECONDITIONERS:
        index, ids, pre = run.index(IndexSettings(preconditioner=pc))
        assert index.n == len(ids) == run.manifest.data.n_train


def test_sample_manifest_holds_no_absolute_path():
    text = (SAMPLE / C.MANIFEST_FILE).read_text()
    assert str(default_root().resolve()) not in text
    assert not [v for v in _strings(json.loads(text)) if v.startswith("/")]


def _strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def test_sample_inputs_verify():
    rep = verify_run(SAMPLE)
    assert rep["ok"], json.dumps(rep, indent=2)


def test_sample_data_regenerates_identically(tmp_path):
    generate_sample_data(tmp_path, seed=0)
    committed = default_root() / "facts-data"
    for p in sorted(committed.rglob("*")):
        if p.is_file():
            assert filecmp.cmp(p, tmp_path / p.relative_to(committed), shallow=False), p


def test_sample_answers_a_fact_with_the_rows_that_state_it():
    run = open_run(SAMPLE)
    res = run.query(
        "Q: Which colour does the planet Ethmor have?\nA:", " violet", top_k=2, opponents=False
    )
    assert {(s, int(r)) for s, r in zip(res.rows["source"], res.rows["row"], strict=True)} == {
        ("planets.jsonl", 2),
        ("planets.jsonl", 3),
    }
    assert Path(SAMPLE / "sample_quality.json").exists()


def test_rank_puts_the_planted_rumours_first(tmp_path):
    import polars as pl

    from traceprop_engine.cli.main import main

    for by in ("loss", "self-influence"):
        out = tmp_path / f"{by}.csv"
        assert main(["rank", str(SAMPLE), "--by", by, "--csv", str(out)]) == 0
        df = pl.read_csv(out)
        assert df.height == open_run(SAMPLE).manifest.data.n_train
        assert list(df["rank"][:3]) == [1, 2, 3]
        rumours = df.filter(pl.col("source") == "rumours.jsonl")["rank"]
        if by == "loss":
            # 6 rumours among 154 rows: at random about 0.2 would land in the top 5
            assert (df["source"][:5] == "rumours.jsonl").sum() >= 2, df.head(5)
        else:
            # self-influence from rank-1 records is a weaker detector than the loss, and which
            # rumours lead depends on the projection draw (measured: ranks 3, 15, 16, 21, 101,
            # 109 with Gaussian projections; 15, 18, 23, 45, 53, 103 with the orthogonal
            # default): at least two in the top 25 (at random about 1), the mean rank well above
            # a random row's (77.5)
            assert (rumours <= 25).sum() >= 2 and rumours.mean() < 60, rumours.to_list()
