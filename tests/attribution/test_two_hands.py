"""A query's stages side by side (``score/two_hands.py``): results in order, errors raised, the
one-thread switch, no pool thread waiting on the pool; and a ranked query with its FAISS search,
list scans and split re-rank on two threads equal to the same query on one."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import facts_data, fast_settings

from traceprop_engine.attribution.index import lists as index_lists
from traceprop_engine.attribution.query import open_run
from traceprop_engine.attribution.score import record_cache, two_hands
from traceprop_engine.attribution.score.two_hands import both, hands, split_rows
from traceprop_engine.settings import IndexSettings
from traceprop_engine.training.loop import train

SCORE_RTOL = 1e-9  # the same float64 products, in parts or whole: summation order only


@pytest.fixture
def two(monkeypatch):
    monkeypatch.setenv("TRACEPROP_QUERY_THREADS", "2")


def test_jobs_run_on_two_threads_and_return_in_order(two):
    seen, gate = [], threading.Barrier(2, timeout=10)

    def job(i):
        gate.wait() if i < 2 else None  # the first two must run at once, or the barrier breaks
        seen.append(threading.get_ident())
        return i * 10

    assert both(*[lambda i=i: job(i) for i in range(3)]) == [0, 10, 20]
    assert len(set(seen)) == 2
    assert seen.count(threading.get_ident()) >= 1  # the caller's thread worked too


def test_an_error_is_raised_after_every_taken_job_finished(two):
    done = []

    def bad():
        raise ValueError("boom")

    def slow():
        time.sleep(0.2)
        done.append(1)
        return 1

    with pytest.raises(ValueError, match="boom"):
        both(slow, bad)
    assert done == [1]  # whichever hand took it, the error waited for it


def test_one_thread_runs_everything_inline_in_order(monkeypatch):
    monkeypatch.setenv("TRACEPROP_QUERY_THREADS", "1")
    me, order = threading.get_ident(), []
    assert both(*[lambda i=i: order.append((i, threading.get_ident())) or i for i in range(3)]) == [
        0,
        1,
        2,
    ]
    assert order == [(0, me), (1, me), (2, me)]


def test_a_job_on_a_pool_thread_runs_its_own_jobs_inline(two):
    def outer():
        return {threading.get_ident()} | set(both(threading.get_ident, threading.get_ident))

    on_pool = two_hands._get_pool().submit(outer).result()
    assert len(on_pool) == 1  # its jobs stayed on its thread: no pool thread waits on another


def test_the_thread_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TRACEPROP_QUERY_THREADS", "two")
    with pytest.raises(ValueError, match="TRACEPROP_QUERY_THREADS"):
        hands()
    monkeypatch.setenv("TRACEPROP_QUERY_THREADS", "64")
    assert hands() == two_hands.MAX_WORKERS


@pytest.mark.parametrize("n", [10, 5000])
def test_split_rows_equals_one_call(two, n):
    rows = np.arange(n) * 3
    calls = []

    def fn(r):
        calls.append(len(r))
        return np.stack([r * 2.0, r + 0.5])  # (2, len(r)): columns follow rows

    np.testing.assert_array_equal(split_rows(fn, rows), fn(rows))
    assert calls[:-1] == ([n] if n < two_hands.MIN_SPLIT_ROWS else [n // 2, n - n // 2])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = facts_data(tmp_path_factory.mktemp("data"))
    d = train(fast_settings(data, tmp_path_factory.mktemp("runs") / "r"))
    r = open_run(d)
    yield r
    r.close()


def test_a_ranked_query_on_two_threads_equals_one_thread(run, monkeypatch):
    """A trained run's queries with factor lists on (FAISS proposes every row of this small
    run, so the top 10 are exact), the lists' scans and FAISS side by side and the re-rank split
    into parts of 4 rows or more: the same proponents and opponents with the same scores and
    shares as on one thread, brute force's top 10, and the work really ran on a second thread."""
    monkeypatch.setattr(record_cache, "MIN_RECORDS", 0)
    monkeypatch.setattr(index_lists, "ROWS_PER_LIST", 8)
    monkeypatch.setattr(index_lists, "MIN_QUERY_SHARE", 0.0)  # every list layer scans
    monkeypatch.setattr(two_hands, "MIN_SPLIT_ROWS", 8)
    s = IndexSettings(lists=True)
    _, ids, _ = run.index(s, rebuild=True)
    assert run.indexes.scorer(s).lists
    calls = []  # per call of both(): its jobs' count and the threads that ran them
    real = two_hands.both

    def spy(*jobs):
        threads = set()
        calls.append((len(jobs), threads))

        def timed(job):  # 5 ms each: a second hand has long started before the first is done
            threads.add(threading.get_ident())
            time.sleep(0.005)
            return job()

        return real(*[lambda j=j: timed(j) for j in jobs])

    monkeypatch.setattr(two_hands, "both", spy)
    monkeypatch.setattr("traceprop_engine.attribution.index.candidates.both", spy)
    for ev in run.eval_examples()["example_id"][:4]:
        q = run.query_sketches(run.encode(eval_example=int(ev))[0])[0]
        got = {}
        for n in ("1", "2"):
            monkeypatch.setenv("TRACEPROP_QUERY_THREADS", n)
            got[n] = run.rank(q, s, 10, True)[0]
        one, two_ = got["1"], got["2"]
        assert one["example_id"].to_list() == two_["example_id"].to_list()
        assert one["kind"].to_list() == two_["kind"].to_list()
        np.testing.assert_allclose(two_["score"], one["score"], rtol=SCORE_RTOL, atol=0)
        exact = run.exact_scores(q, s)[0]  # both are brute force's top 10 proponents
        pro = one.filter(one["kind"] == "proponent")["example_id"].to_list()
        assert set(pro) == set(np.asarray(ids)[np.argsort(-exact)[:10]].tolist())
    assert max(n for n, _ in calls) >= 3  # two list layers and FAISS in one call
    assert max(len(t) for _, t in calls) == 2  # two hands, never more
