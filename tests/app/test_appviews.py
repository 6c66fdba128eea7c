"""Issue 13 items 2, 4, 6 in the app: Compare, the score histogram and Rankings, and Find
(filter, sort, page, export names and contents). AppTest on the bundled sample run; every
number shown is checked against the engine's own."""

from __future__ import annotations

import base64
import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import services
from services import compare, distributions, find
from streamlit.testing.v1 import AppTest

from traceprop_engine.attribution.query import open_run
from traceprop_engine.attribution.reports import compare as engine_compare
from traceprop_engine.attribution.reports.distributions import score_histogram
from traceprop_engine.attribution.reports.outliers import rank_examples
from traceprop_engine.settings import IndexSettings

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_runs" / "facts"
MAIN = str(REPO / "app" / "navigation.py")  # the pages (main.py: the server, st.App)
TIMEOUT = 90


def _decode(arr):
    if isinstance(arr, dict) and "bdata" in arr:
        return np.frombuffer(base64.b64decode(arr["bdata"]), dtype=np.dtype(arr["dtype"]))
    return np.asarray(arr)


def _charts(at) -> dict:
    return {c.proto.id.rsplit("-", 1)[-1]: json.loads(c.proto.spec) for c in at.get("plotly_chart")}


TABLES = {  # AppTest gives dataframes no key: tell them apart by their columns
    "infl_find_table": {"kind", "rank", "location"},
    "rank_table": {"rank", "example_id"},
    "cmp_overlap": {"jaccard"},
    "cmp_changes": {"status"},
    "cmp_sides": {"rank", "score", "source", "row"},
}


def _table(at, key: str, nth: int = 0):
    hits = [d.value for d in at.dataframe if TABLES[key] <= set(d.value.columns)]
    assert len(hits) > nth, f"no dataframe {key}"
    return hits[nth]


@pytest.fixture(scope="module")
def engine():
    run = open_run(SAMPLE)
    yield run
    run.close()


@pytest.fixture
def at(app_env):
    a = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    a.run()
    assert not a.exception, a.exception
    return a


def _goto(at, page):
    at.switch_page(f"views/{page}.py")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


# -- Find: the service functions on a real result ------------------------------------------------
def test_find_filters_sorts_pages_and_names(engine):
    ev = int(engine.eval_examples()["example_id"][0])
    res = engine.query(eval_example=ev, top_k=100)
    rows = services.shown_rows(res)
    assert rows.height > 100  # enough to page through more than 100
    hit = find.filter_rows(rows, "ETHMOR")
    assert hit.height and all("ethmor" in t.lower() for t in hit["text"])
    assert hit.height == sum("ethmor" in t.lower() for t in rows["text"])
    src = find.filter_rows(rows, sources=["rivers.jsonl"], kinds=["opponent"])
    assert set(src["source"]) == {"rivers.jsonl"} and set(src["kind"]) == {"opponent"}
    assert find.filter_rows(rows, "no such words at all").is_empty()
    hi = find.sort_rows(rows, "score, highest first")["score"].to_numpy()
    assert (np.diff(hi) <= 0).all()
    mag = np.abs(find.sort_rows(rows, "|score|, largest first")["score"].to_numpy())
    assert (np.diff(mag) <= 0).all()
    by_rank = find.sort_rows(rows, "rank")
    n_pro = res.proponents.height
    assert by_rank["kind"][:n_pro].to_list() == ["proponent"] * n_pro
    assert by_rank["rank"][:n_pro].to_list() == list(range(1, n_pro + 1))
    pages = [find.page_of(by_rank, p, 25) for p in range(1, find.n_pages(rows.height, 25) + 1)]
    assert pl.concat(pages).equals(by_rank) and pages[1]["rank"][0] == 26
    with pytest.raises(ValueError, match="between 1 and"):
        find.page_of(rows, 99, 25)
    with pytest.raises(ValueError, match="sort"):
        find.sort_rows(rows, "colour")
    rid = res.query["run_id"]  # e.g. 20261130-230704-7424f6c4
    assert find.export_name(res.query, "csv") == f"influencers-{rid}-eval{ev}-kfac.csv"
    typed = {"run_id": "my run/1", "prompt": "Q: Which colour?\nA:", "completion": " violet"}
    assert find.export_name(typed, "json") == "influencers-my-run-1-q-which-colour-a-violet.json"
    # the export of the found rows records the query inside
    got = list(csv.DictReader(io.StringIO(services.export_bytes(res, "csv", hit).decode())))
    assert len(got) == hit.height and {r["query_eval_example"] for r in got} == {str(ev)}
    assert {r["query_run_id"] for r in got} == {rid}
    js = json.loads(services.export_bytes(res, "json", hit))
    assert js["query"]["eval_example"] == ev and len(js["rows"]) == hit.height


def test_all_scores_are_the_engines_scores(engine, app_env):
    ev = int(engine.eval_examples()["example_id"][1])
    res, by_source = services.run_query(SAMPLE, eval_example=ev, preconditioner="kfac")
    df = distributions.all_scores(SAMPLE, res, "kfac")
    want = engine.scores(eval_example=ev, settings=IndexSettings(preconditioner="kfac"))
    np.testing.assert_allclose(
        df.sort("example_id")["score"].to_numpy(),
        want[df["example_id"].sort().to_numpy()],
        rtol=1e-6,
        atol=1e-12,
    )
    # the by-source totals are sums of the same scores
    tot = df.group_by("source").agg(pl.col("score").sum()).sort("source")
    bs = by_source.sort("source")
    np.testing.assert_allclose(tot["score"].to_numpy(), bs["total"].to_numpy(), rtol=1e-6)


# -- Compare: the service on two preconditioners and on two runs --------------------------------
def test_compare_two_runs_and_two_preconditioners(engine, app_env):
    ev = int(engine.eval_examples()["example_id"][0])
    c = compare.compare_sides((SAMPLE, "identity"), (SAMPLE, "kfac"), {"eval_example": ev}, 8)
    want = engine_compare.overlap(c.a.rows, c.b.rows, 8)
    assert c.overlap.equals(want)
    assert c.a.query["preconditioner"] == "identity" and c.b.query["preconditioner"] == "kfac"
    # a copy of the run (another run trained identically) answers the same text identically
    other = app_env["runs"] / "facts-copy"
    shutil.copytree(SAMPLE, other)
    q = compare.query_text(SAMPLE, ev)
    assert q["prompt"] and q["completion"]
    c2 = compare.compare_sides((SAMPLE, "identity"), (other, "identity"), q, 8)
    assert c2.overlap["jaccard"].to_list() == [1.0, 1.0]
    assert set(c2.changes["status"]) == {"both"} and set(c2.changes["rank_change"]) == {0}
    with pytest.raises(ValueError, match="share no example ids"):
        compare.compare_sides((SAMPLE, "identity"), (other, "identity"), {"eval_example": ev})
    with pytest.raises(services.TracepropError, match="not an eval example"):
        compare.query_text(SAMPLE, 10_000)


# -- AppTest -------------------------------------------------------------------------------------
def test_influencers_find_filters_and_pages(at, engine):
    _goto(at, "influencers")
    at.slider(key="infl_topk").set_value(100)
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    ev = int(engine.eval_examples()["example_id"][0])
    rows = services.shown_rows(engine.query(eval_example=ev, top_k=100))
    page1 = _table(at, "infl_find_table")
    assert len(page1) == 25  # the default page size
    assert page1["rank"].tolist() == list(range(1, 26))
    at.number_input(key="infl_find_page").set_value(2).run()
    page2 = _table(at, "infl_find_table")
    assert page2["rank"].tolist() == list(range(26, 51))
    # the example details follow the page
    assert [e.label.split(" · ")[0] for e in at.expander][:2] == ["proponent #26", "proponent #27"]
    last = find.n_pages(rows.height, 25)
    at.number_input(key="infl_find_page").set_value(last).run()
    assert len(_table(at, "infl_find_table")) == rows.height - 25 * (last - 1)
    # text and source filters
    at.number_input(key="infl_find_page").set_value(1).run()
    at.text_input(key="infl_find_text").input("ethmor").run()
    shown = _table(at, "infl_find_table")
    want = find.filter_rows(rows, "ethmor")
    assert (
        len(shown) == min(25, want.height)
        and shown["text"].str.lower().str.contains("ethmor").all()
    )
    assert f"{want.height} of {rows.height} rows match" in " ".join(c.value for c in at.caption)
    at.text_input(key="infl_find_text").input("").run()
    at.multiselect(key="infl_find_sources").set_value(["rivers.jsonl"]).run()
    at.multiselect(key="infl_find_kinds").set_value(["opponent"]).run()
    at.selectbox(key="infl_find_sort").set_value("score, lowest first").run()
    shown = _table(at, "infl_find_table")
    want = find.sort_rows(
        find.filter_rows(rows, sources=["rivers.jsonl"], kinds=["opponent"]), "score, lowest first"
    )
    assert set(shown["location"].str.split(":").str[0]) == {"rivers.jsonl"}
    np.testing.assert_allclose(
        shown["score"].to_numpy(), want["score"].head(25).to_numpy(), rtol=1e-6
    )
    at.text_input(key="infl_find_text").input("zzz-nothing").run()
    assert any("No influencer matches" in i.value for i in at.info)


def test_influencers_score_histogram_is_the_engines(at, engine):
    _goto(at, "influencers")
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error
    ev = int(engine.eval_examples()["example_id"][0])
    _, ids, _ = engine.index(IndexSettings())
    scores = engine.scores(eval_example=ev)[ids]  # the training examples (eval ones score 0)
    want = score_histogram(scores, 40)
    assert set(_charts(at)) == {"infl_by_source"}  # the histogram's tab is not open yet
    at.session_state["infl_charts"] = "Score distribution"
    at.run()
    fig = _charts(at)["infl_dist_hist"]
    traces = {t["name"]: t for t in fig["data"]}
    assert set(traces) == {"proponents", "opponents"}
    for name in ("proponents", "opponents"):
        np.testing.assert_array_equal(_decode(traces[name]["y"]), want[name].to_numpy())
        np.testing.assert_allclose(_decode(traces[name]["x"]), want["center"].to_numpy(), rtol=1e-6)
    assert sum(_decode(traces["proponents"]["y"])) == (scores > 0).sum()
    assert sum(_decode(traces["opponents"]["y"])) == (scores < 0).sum()
    cap = f"{len(scores)} examples · {(scores > 0).sum()} with a positive score"
    assert any(cap in c.value for c in at.caption)
    at.slider(key="infl_dist_bins").set_value(10).run()
    fig = _charts(at)["infl_dist_hist"]
    assert len(_decode(fig["data"][0]["y"])) == 10


def test_compare_page_shows_the_engines_overlap(at, engine):
    _goto(at, "compare")
    assert at.selectbox(key="cmp_pre_A").value == "kfac"  # the default, against identity
    assert at.selectbox(key="cmp_pre_B").value == "identity"
    at.slider(key="cmp_topk").set_value(12)
    at.button(key="cmp_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    ev = int(engine.eval_examples()["example_id"][0])
    a = engine.query(eval_example=ev, top_k=12)
    b = engine.query(eval_example=ev, top_k=12, settings=IndexSettings(preconditioner="identity"))
    want = engine_compare.overlap(a.rows, b.rows, 12)
    shown = _table(at, "cmp_overlap")
    assert shown["shared"].tolist() == want["shared"].to_list()
    np.testing.assert_allclose(shown["jaccard"], want["jaccard"].to_numpy())
    ch = _table(at, "cmp_changes")
    wch = engine_compare.rank_changes(a.rows, b.rows)
    assert len(ch) == wch.height and ch["status"].tolist() == wch["status"].to_list()
    pa = _table(at, "cmp_sides", 0)  # proponents of A, of B, then opponents of A, of B
    pb = _table(at, "cmp_sides", 1)
    ob = _table(at, "cmp_sides", 3)
    np.testing.assert_allclose(ob["score"], b.opponents["score"].to_numpy(), rtol=1e-6)
    np.testing.assert_allclose(pa["score"], a.proponents["score"].to_numpy(), rtol=1e-6)
    np.testing.assert_allclose(pb["score"], b.proponents["score"].to_numpy(), rtol=1e-6)
    scatter = {t["name"]: t for t in _charts(at)["cmp_scatter"]["data"]}
    both = wch.filter((pl.col("status") == "both") & (pl.col("kind_a") == "proponent"))
    np.testing.assert_array_equal(_decode(scatter["proponents"]["x"]), both["rank_a"].to_numpy())


def test_compare_page_typed_query_needs_a_prompt(at):
    _goto(at, "compare")
    at.radio(key="cmp_mode").set_value("typed").run()
    at.button(key="cmp_go").click().run()
    assert not at.exception
    assert at.error and "empty" in at.error[0].value


def test_rankings_page_is_traceprop_rank(at, engine):
    _goto(at, "rankings")
    want = rank_examples(engine, "self-influence", IndexSettings())
    shown = _table(at, "rank_table")
    assert len(shown) == 25
    assert shown["example_id"].tolist() == want["example_id"].head(25).to_list()
    np.testing.assert_allclose(
        shown["self_influence"], want["self_influence"].head(25).to_numpy(), rtol=1e-6
    )
    ys = np.concatenate([_decode(t["y"]) for t in _charts(at)["rank_chart"]["data"]])
    np.testing.assert_allclose(np.sort(ys), np.sort(want["self_influence"].to_numpy()), rtol=1e-6)
    at.number_input(key="rank_page").set_value(2).run()
    assert _table(at, "rank_table")["rank"].tolist() == list(range(26, 51))
    at.number_input(key="rank_page").set_value(1)
    at.selectbox(key="rank_by").set_value("loss").run()
    at.multiselect(key="rank_src").set_value(["planets.jsonl"]).run()
    wl = rank_examples(engine, "loss").filter(pl.col("source") == "planets.jsonl")
    shown = _table(at, "rank_table")
    assert shown["example_id"].tolist() == wl["example_id"].head(25).to_list()
    assert (np.diff(shown["loss"].to_numpy()) <= 0).all()


def test_per_token_view_follows_the_preconditioner(at):
    """The per-token view is cached per query: switching the preconditioner (same prompt, same
    influencer) used to show the previous preconditioner's token shares."""

    def token_sum() -> str:
        return next(c.value for c in at.caption if c.value.startswith("Sum over tokens"))

    _goto(at, "influencers")
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error
    first = token_sum()
    at.selectbox(key="infl_pre").set_value("identity")
    at.button(key="infl_go").click().run()
    assert not at.exception and not at.error
    assert token_sum() != first
    at.selectbox(key="infl_pre").set_value("kfac")
    at.button(key="infl_go").click().run()
    assert token_sum() == first
