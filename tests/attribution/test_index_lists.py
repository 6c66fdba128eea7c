"""The factor lists (a second candidate search over the dominant layer's own records) against
brute force: every entry's score, the rows a full scan proposes, the ranking of a query, and
when lists are built, skipped or refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from helpers import store_only_run, write_factor_store

from traceprop_engine.attribution.index import lists as index_lists
from traceprop_engine.attribution.index.lists import (
    FactorLists,
    file_names,
    list_layers,
    open_lists,
    wants_lists,
)
from traceprop_engine.attribution.index.run_indexes import RunIndexes
from traceprop_engine.attribution.query import AttributionRun
from traceprop_engine.attribution.score import ranking, record_cache
from traceprop_engine.errors import ConfigError
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.reader import Store

SHAPES = [(12, 10), (10, 12), (24, 16)]  # (k_out, k_in); the last layer dominates (the "head")
N_EX = 400
N_ANSWERS = 12  # groups of records whose output factors point the same way (answer tokens)
F32_RTOL = 2e-5  # entries are stored in float32: their scores against float64 brute force
INT8_RTOL = 0.03  # int8 entries: each side rounded to 1/254 of its largest coordinate


@pytest.fixture(autouse=True)
def _small(monkeypatch):
    monkeypatch.setattr(record_cache, "MIN_RECORDS", 0)  # the re-rank's cache on these stores
    monkeypatch.setattr(index_lists, "ROWS_PER_LIST", 8)  # a few dozen lists, not one


def _store(path: Path, epochs: int = 1, rank: int = 1, head: float = 10.0) -> Store:
    """Records whose output factors cluster by "answer"; the last layer ``head`` times larger."""
    rng = np.random.default_rng(3)
    ex = np.concatenate([rng.permutation(N_EX) for _ in range(epochs)])
    n = len(ex)
    answer = rng.integers(0, N_ANSWERS, N_EX)[ex]
    arrays = []
    for li, (ko, ki) in enumerate(SHAPES):
        bu = rng.normal(size=(N_ANSWERS, ko, rank))
        u = bu[answer] + 0.2 * rng.normal(size=(n, ko, rank))
        v = rng.normal(size=(n, ki, rank))
        scale = head if li == len(SHAPES) - 1 else 1.0
        arrays.append(np.concatenate([u * scale, v], axis=1).astype(np.float32))
    return write_factor_store(path, SHAPES, arrays, ex, rng, "lists-test", rank)


def _run(ix: RunIndexes) -> AttributionRun:
    return store_only_run(ix)


def _queries(rng, q: int = 1, rank: int = 2) -> list[np.ndarray]:
    """Low-rank test sketches, as a query's are (rank ≤ its loss tokens)."""
    return [
        np.einsum("qor,qir->qoi", rng.normal(size=(q, ko, rank)), rng.normal(size=(q, ki, rank)))
        for ko, ki in SHAPES
    ]


@pytest.mark.parametrize(
    ("kind", "cosine", "epochs", "int8"),
    [("identity", True, 3, False), ("kfac", False, 1, False), ("identity", True, 3, True)],
)
def test_every_entry_scores_exactly_its_record_at_the_dominant_layer(
    tmp_path, monkeypatch, kind, cosine, epochs, int8
):
    """With every principal direction kept, an entry's score is its record's exact score at
    the dominant layer (lr-weighted, over the row's norm): summed by row, the brute force's;
    int8 entries (the default) within their rounding."""
    monkeypatch.setattr(index_lists, "ENERGY_KEEP", 1.0)
    monkeypatch.setattr(index_lists, "INT8_ENTRIES", int8)
    store = _store(tmp_path / "store.h5", epochs)
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(preconditioner=kind, cosine=cosine, lists=True)
    ix.build(s)
    both = ix.scorer(s).lists
    energy = np.asarray(ix.row_layer_sq_norms(s)).sum(0)
    # the dominant layer, then the next by energy
    assert [x.layer for x in both] == [2, int(np.argmax(energy[:2]))]
    assert all(isinstance(x, FactorLists) for x in both)
    lists = both[0]
    assert lists.n_entries == store.n_records  # one entry per record
    assert sorted(np.bincount(np.asarray(lists.rows))) == [epochs] * N_EX
    rng = np.random.default_rng(7)
    run = _run(ix)
    scorer = ix.scorer(s)
    for _ in range(3):
        tests = _queries(rng)
        li = lists.layer
        t = scorer.pre.layers[li].pullback(tests[li])[0]  # T' of the dominant layer
        e = np.asarray(lists.entries, np.float64)
        assert e.dtype == np.float64 and lists.entries.dtype == (np.int8 if int8 else np.float32)
        mu = lists.basis_u.shape[1]
        reduced = lists.basis_u.T @ t @ lists.basis_w  # T' in the entries' bases
        entry = np.einsum("ni,ni->n", e[:, :mu] @ reduced, e[:, mu:])
        if int8:
            entry *= np.asarray(lists.scales, np.float64)
        per_row = np.zeros(N_EX)
        np.add.at(per_row, np.asarray(lists.rows), entry)
        want = run.exact_scores(tests, s, per_layer=True)[0, li]
        if cosine:  # exact_scores divides by the query's norm too; the entries do not
            want = want * np.sqrt(scorer.query_sq_norm(tests)[0])
        tol = INT8_RTOL if int8 else F32_RTOL
        np.testing.assert_allclose(per_row, want, rtol=tol, atol=tol * abs(want).max())


@pytest.mark.parametrize("chunk", [5, 1024])
def test_a_scan_of_scattered_lists_scores_each_entry_as_its_reduced_product(
    tmp_path, monkeypatch, chunk
):
    """``_scan`` fills its float32 buffer across list boundaries and runs of non-adjacent
    lists: every entry's score is ``(ū Qu)ᵀ(Quᵀ A) · (w Qw)ᵀ(Qwᵀ B)`` summed over the query's
    columns, times the entry's scale, in list order."""
    monkeypatch.setattr(index_lists, "SCAN_CHUNK", chunk)
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(lists=True)
    ix.build(s)
    lists = ix.scorer(s).lists[0]
    rng = np.random.default_rng(11)
    n_lists = len(lists.starts) - 1
    mu = lists.basis_u.shape[1]
    e = np.asarray(lists.entries, np.float64)
    for _ in range(3):
        chosen = np.sort(rng.choice(n_lists, n_lists // 3, replace=False))
        a = rng.normal(size=(mu, 2)).astype(np.float32)
        b = rng.normal(size=(e.shape[1] - mu, 2)).astype(np.float32)
        ref_all = np.einsum("nr,nr->n", e[:, :mu] @ a, e[:, mu:] @ b)
        ref_all *= np.asarray(lists.scales, np.float64)
        want = np.concatenate([ref_all[lists.starts[i] : lists.starts[i + 1]] for i in chosen])
        got = lists._scan(chosen, a, b)
        np.testing.assert_allclose(got, want, rtol=F32_RTOL, atol=F32_RTOL * abs(want).max())
        rows = np.concatenate([lists.rows[lo:hi] for lo, hi in lists._runs(chosen)])
        want_rows = np.concatenate(
            [lists.rows[lists.starts[i] : lists.starts[i + 1]] for i in chosen]
        )
        np.testing.assert_array_equal(rows, want_rows)
    # a scan that chose nothing, or only empty lists, proposes nothing
    a = np.ones((lists.basis_u.shape[0], 1), np.float32)
    b = np.ones((lists.basis_w.shape[0], 1), np.float32)
    s = lists.starts
    monkeypatch.setattr(lists, "starts", np.r_[0, 0, s[1], s[1:]])  # lists 0 and 2 now empty
    for chosen in (np.zeros(0, np.int64), np.array([0, 2])):
        monkeypatch.setattr(lists, "_scan_order", lambda *_, c=chosen: c)
        assert lists.candidates(a, b).shape == (0,)


def _top(score: np.ndarray, k: int, sign: float, rtol: float = F32_RTOL) -> tuple[set, set]:
    """Rows surely in the top ``k`` of ``sign · score`` (above the k-th by more than the
    entries' rounding, ``rtol`` of the largest score) and rows possibly in it (within it),
    among those of that sign."""
    x = sign * score
    kth = np.sort(x)[::-1][k - 1]
    tol = rtol * np.abs(score).max()
    sure = set(np.flatnonzero((x > kth + tol) & (x > 0)).tolist())
    maybe = set(np.flatnonzero((x >= kth - tol) & (x > 0)).tolist())
    return sure, maybe


@pytest.mark.parametrize("int8", [False, True])
def test_a_full_scan_proposes_the_dominant_layers_top_rows_of_both_signs(
    tmp_path, monkeypatch, int8
):
    monkeypatch.setattr(index_lists, "SCAN_FRACTION", (1.0, 1.0))
    monkeypatch.setattr(index_lists, "INT8_ENTRIES", int8)
    tol = INT8_RTOL if int8 else F32_RTOL
    monkeypatch.setattr(index_lists, "CANDIDATES", 20)
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(lists=True)
    ix.build(s)
    scorer = ix.scorer(s)
    monkeypatch.setattr(scorer, "lists", scorer.lists[:1])  # the dominant layer's alone
    lists = scorer.lists[0]
    rng = np.random.default_rng(8)
    for _ in range(3):
        tests = _queries(rng)
        head = _run(ix).exact_scores(tests, s, per_layer=True)[0, lists.layer]
        got = set(index_lists.list_candidates(scorer, tests, opponents=True).tolist())
        only = set(index_lists.list_candidates(scorer, tests, opponents=False).tolist())
        (ps, pm), (os_, om) = _top(head, 20, 1.0, tol), _top(head, 20, -1.0, tol)
        assert ps | os_ <= got <= pm | om
        assert len(got) == 40
        assert ps <= only <= pm


def test_lists_find_the_top_rows_that_few_faiss_candidates_miss(tmp_path, monkeypatch):
    """A query decided by the dominant layer: a coarse summary (2 × 2 a layer, 4 dims) and a
    handful of FAISS candidates miss much of the true top 10; the lists' candidates restore
    it, every score exact."""
    monkeypatch.setattr(ranking, "MIN_CANDIDATES", 12)
    monkeypatch.setattr(ranking, "CANDIDATE_FRACTION", 10**9)
    monkeypatch.setattr(index_lists, "SCAN_FRACTION", (0.5, 0.5))
    store = _store(tmp_path / "store.h5", head=30.0)
    ix = RunIndexes(tmp_path, store)
    coarse = {"index_side": 2, "index_dims": 4}
    with_lists, without = IndexSettings(lists=True, **coarse), IndexSettings(lists=False, **coarse)
    for s in (with_lists, without):
        ix.build(s)
    run = _run(ix)
    rng = np.random.default_rng(9)
    found = {True: [], False: []}
    for _ in range(6):
        tests = [t.astype(np.float32) for t in _queries(rng)]
        exact = run.exact_scores(tests, with_lists)[0]
        for s in (with_lists, without):
            index, _, pre = ix.get(s)
            res = index.search_both(pre.apply(tests), ranking.n_candidates(10, index.n))
            cand = np.unique(np.concatenate([res.proponent_ids[0], res.opponent_ids[0]]))
            if s.lists:
                cand = np.union1d(cand, index_lists.list_candidates(ix.scorer(s), tests))
            got = run.exact_scores(tests, s, rows=cand)[0]
            # exact whatever proposed them (float32 queries: the float32 factored route)
            tol = F32_RTOL * abs(exact).max()
            np.testing.assert_allclose(got, exact[cand], rtol=F32_RTOL, atol=tol)
            for sign in (1, -1):
                top = set(np.argsort(-sign * exact)[:10].tolist())
                mine = set(cand[np.argsort(-sign * got)[:10]].tolist())
                found[bool(s.lists)].append(len(top & mine) / 10)
    assert np.mean(found[True]) >= 0.95
    assert np.mean(found[True]) > np.mean(found[False]) + 0.2


def test_an_ivf_index_with_lists_calibrates_faiss_to_the_lists_margin(tmp_path, monkeypatch):
    """FAISS alone is not the recall of an index with lists: its nprobe is tuned to the
    smaller margin, that of one without them to the usual one."""
    from traceprop_engine.attribution.index import build, run_indexes

    margins = []
    real = run_indexes.build_index

    def spy(*a, **k):
        margins.append(k["recall_margin"])
        return real(*a, **k)

    monkeypatch.setattr(run_indexes, "build_index", spy)
    ix = RunIndexes(tmp_path, _store(tmp_path / "store.h5"))
    for lists in (True, False):
        s = IndexSettings(lists=lists, kind="ivf")
        index = ix.build(s)
        assert index.kind.value == "ivf" and (ix.scorer(s).lists is not None) == lists
    assert margins == [index_lists.LISTS_RECALL_MARGIN, build.RECALL_MARGIN]
    assert index_lists.LISTS_RECALL_MARGIN < build.RECALL_MARGIN


def test_when_lists_are_built(tmp_path, monkeypatch):
    assert "lists" not in IndexSettings().to_dict()  # the default's fingerprint is unchanged
    assert IndexSettings().name == "kfac-cos"
    assert IndexSettings(lists=True).name == "kfac-cos-lists"
    assert IndexSettings(lists=False).name == "kfac-cos-nolists"
    with pytest.raises(ConfigError, match="lists"):
        IndexSettings(lists="yes")
    assert not wants_lists(None, index_lists.MIN_ROWS - 1)
    assert wants_lists(None, index_lists.MIN_ROWS)
    assert wants_lists(True, 10) and not wants_lists(False, 10**9)
    # no one layer dominates, or the dominant one's records are not rank 1: no lists
    assert list_layers(np.ones((5, 3)), [True] * 3) == []
    assert list_layers(np.array([[1.0, 1.0, 8.0]]), [True, True, False]) == []
    assert list_layers(np.array([[1.0, 2.0, 8.0]]), [True] * 3) == [2, 1]
    assert list_layers(np.array([[1.0, 2.0, 8.0]]), [True, False, True]) == [2, 0]
    store = _store(tmp_path / "store.h5", head=0.3)  # no layer holds half the energy
    ix = RunIndexes(tmp_path, store)
    ix.build(IndexSettings(lists=True))
    assert ix.scorer(IndexSettings(lists=True)).lists is None
    assert not list(ix.dir(IndexSettings(lists=True)).glob("lists-*"))
    # the auto default on a small run: none either
    (tmp_path / "b").mkdir()
    ix2 = RunIndexes(tmp_path / "b", _store(tmp_path / "b" / "store.h5"))
    ix2.build(IndexSettings())
    assert ix2.scorer(IndexSettings()).lists is None


def _swapped(d: Path) -> None:
    """Open layer 2's lists file under layer 0's name (a file moved by hand)."""
    import shutil

    other = d.parent / "swapped"
    shutil.copytree(d, other)
    (other / file_names(0)[0]).unlink(missing_ok=True)
    shutil.copy(d / file_names(2)[0], other / file_names(0)[0])
    FactorLists(other, 0)


def test_cli_flag_and_a_damaged_or_foreign_lists_file(tmp_path, caplog):
    from traceprop_engine.flags import add_index_flags, index_settings

    p = argparse.ArgumentParser()
    add_index_flags(p)
    assert index_settings(p.parse_args([])).lists is None
    assert index_settings(p.parse_args(["--lists"])).lists is True
    assert index_settings(p.parse_args(["--no-lists"])).lists is False
    store = _store(tmp_path / "store.h5")
    ix = RunIndexes(tmp_path, store)
    s = IndexSettings(lists=True)
    ix.build(s)
    d = ix.dir(s)
    with pytest.raises(ValueError, match="rows"):
        open_lists(d, N_EX + 1)  # another index's lists
    with pytest.raises(ValueError, match="layer 2"):
        _swapped(d)
    entries = file_names(2)[2]
    # a changed byte: the index's digests catch it and the index is rebuilt, lists included
    w = np.load(d / entries)
    before = w[0, 0].copy()
    w[0, 0] = 0 if w[0, 0] else 1
    np.save(d / entries, w)
    ix2 = RunIndexes(tmp_path, Store(tmp_path / "store.h5"))
    with caplog.at_level("WARNING"):
        ix2.get(s)
    assert "rebuilding" in caplog.text
    np.testing.assert_array_equal(np.load(d / entries)[0, 0], before)


def test_principal_basis_keeps_the_asked_share_of_the_energy():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 20)) + 1e-3 * rng.normal(size=(500, 20))
    q = index_lists.principal_basis(x, 0.999)
    assert q.shape == (20, 6)  # the six directions that carry it, and not the noise
    np.testing.assert_allclose(q.T @ q, np.eye(6), atol=1e-6)
    kept = ((x @ q) ** 2).sum() / (x**2).sum()
    assert 0.999 <= kept <= 1.0
    assert index_lists.principal_basis(np.zeros((4, 3))).shape == (3, 1)  # nothing to keep


def test_an_index_built_before_lists_says_so_only_where_it_would_have_them(tmp_path, monkeypatch):
    from traceprop_engine.attribution.index import run_indexes as index_store

    store = _store(tmp_path / "store.h5")
    with monkeypatch.context() as m:  # as the previous release built them: no lists
        m.setattr(index_store, "BUILD_FORMAT", 2)
        m.setattr(index_store, "wants_lists", lambda setting, n: False)
        ix = RunIndexes(tmp_path, store)
        for s in (IndexSettings(), IndexSettings(lists=True)):
            ix.build(s)
    ix = RunIndexes(tmp_path, Store(tmp_path / "store.h5"))
    for s in (IndexSettings(), IndexSettings(lists=True)):
        ix.get(s)
    assert index_store.OLD_BUILD_NOTE not in ix.notes(IndexSettings())  # small: none expected
    assert ix.scorer(IndexSettings(lists=True)).lists is None  # reused as built, without lists
    assert index_store.OLD_BUILD_NOTE in ix.notes(IndexSettings(lists=True))
    ix.build(IndexSettings(lists=True))  # a rebuild adds them and the note goes
    assert ix.scorer(IndexSettings(lists=True)).lists
    assert index_store.OLD_BUILD_NOTE not in ix.notes(IndexSettings(lists=True))


def test_sorted_unique_equals_numpys_unique():
    from traceprop_engine.attribution.index.lists import sorted_unique

    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, n).astype(dt) for n, dt in ((300, np.int64), (0, np.int64),
                                                            (41, np.int32), (1, np.int64))]  # fmt: skip
    got = sorted_unique(*parts)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.unique(np.concatenate(parts).astype(np.int64)))
    for few in ([], [np.array([7])], [np.array([3, 3, 3])], [np.zeros(0, np.int32)]):
        want = np.unique(np.concatenate([np.zeros(0, np.int64), *few]))
        np.testing.assert_array_equal(sorted_unique(*few), want)
        assert sorted_unique(*few).dtype == np.int64
