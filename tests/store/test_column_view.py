"""A store read through the first columns of its rank-r records (``IndexSettings.columns``):
the same numbers as the stored factors' first columns on every read path (the store, the
re-rank's record cache), an index and scorer equal to those of a store that holds only those
columns, and the per-query choice of the columns."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import write_factor_store

from traceprop_engine import constants as C
from traceprop_engine.attribution.index.run_indexes import RunIndexes
from traceprop_engine.attribution.overview import resolve_settings
from traceprop_engine.attribution.score import record_cache
from traceprop_engine.attribution.score.record_cache import RecordCache
from traceprop_engine.settings import IndexSettings
from traceprop_engine.store.column_view import ColumnView, column_view, query_columns

SHAPES = [(20, 12), (12, 20)]
N_EX, EPOCHS, RANK = 40, 2, 3
# the same float32 factors through two index builds: their products in another order
F32_SCORE_RTOL = 1e-5


def _arrays(rng, n, rank=RANK):
    return [rng.normal(size=(n, ko + ki, rank)).astype(np.float32) for ko, ki in SHAPES]


@pytest.fixture()
def stores(tmp_path):
    """A rank-3 float32 store, and a rank-1 store of its first columns (same records)."""
    rng = np.random.default_rng(3)
    ex = np.concatenate([rng.permutation(N_EX) for _ in range(EPOCHS)])
    arrays = _arrays(rng, len(ex))
    whole = write_factor_store(
        tmp_path / "whole.h5", SHAPES, arrays, ex, np.random.default_rng(7), "cols", RANK, "float32"
    )
    first = write_factor_store(
        tmp_path / "first.h5",
        SHAPES,
        [a[..., :1] for a in arrays],
        ex,
        np.random.default_rng(7),  # the same statistics
        "cols",
        1,
        "float32",
    )
    return whole, first


def test_every_read_is_the_first_columns_of_the_stored_factors(tmp_path):
    rng = np.random.default_rng(0)
    ex = np.arange(30)
    store = write_factor_store(tmp_path / "s.h5", SHAPES, _arrays(rng, 30), ex, rng, "v", RANK)
    view = column_view(store, 2)
    assert isinstance(view, ColumnView) and [i.rank for i in view.layers] == [2, 2]
    assert view.fingerprint != store.fingerprint and view.n_records == store.n_records
    recs = np.array([1, 4, 5, 29])
    for li in range(len(SHAPES)):
        u, v = store.factors(li)
        vu, vv = view.factors(li)
        np.testing.assert_array_equal(vu, u[..., :2])
        np.testing.assert_array_equal(vv, v[..., :2])
        au, av = view.factors_at(li, recs)
        np.testing.assert_array_equal(au, u[recs, :, :2])
        np.testing.assert_array_equal(av, v[recs, :, :2])
        np.testing.assert_allclose(
            view.sketches_at(li, recs), u[recs, :, :2] @ v[recs, :, :2].transpose(0, 2, 1)
        )
    # the re-rank's memory map of the view: the view's records, byte for byte
    record_cache.write_record_cache(view, tmp_path)
    cache = RecordCache(tmp_path, view)
    for li in range(len(SHAPES)):
        cu, cv = cache.factors_at(li, recs)
        au, av = view.factors_at(li, recs)
        np.testing.assert_array_equal(cu, au)
        np.testing.assert_array_equal(cv, av)
    # nothing to cut: the store itself
    assert column_view(store, 0) is store and column_view(store, RANK) is store


def test_an_index_of_the_first_column_scores_as_a_store_of_that_column(stores, tmp_path):
    whole, first = stores
    rng = np.random.default_rng(11)
    queries = [rng.normal(size=(2, ko, ki)).astype(np.float32) for ko, ki in SHAPES]
    for pre in ("identity", "kfac"):
        for cosine in (False, True):
            s = IndexSettings(preconditioner=pre, cosine=cosine, columns=1)
            got = RunIndexes(tmp_path / "w", whole).scorer(s)
            want = RunIndexes(tmp_path / "f", first).scorer(IndexSettings(pre, cosine=cosine))
            np.testing.assert_array_equal(got.ids, want.ids)
            a = got.scores(got.pullbacks(queries))
            b = want.scores(want.pullbacks(queries))
            np.testing.assert_allclose(
                a, b, rtol=F32_SCORE_RTOL, atol=F32_SCORE_RTOL * abs(b).max()
            )
    # and its own folder beside the index of every column
    assert (tmp_path / "w" / C.INDEX_DIR / "kfac-cos-c1").is_dir()


def test_a_short_query_takes_the_first_column_of_records_above_rank_1(stores):
    whole, first = stores
    assert query_columns(whole.layers, 1) == 1  # a label, an answer
    assert query_columns(whole.layers, C.FREE_TEXT_TARGETS) == 1
    assert query_columns(whole.layers, C.FREE_TEXT_TARGETS + 1) == 0  # free text: every column
    assert query_columns(whole.layers, None) == 0
    assert query_columns(first.layers, 1) == 0  # rank 1: nothing to choose
    assert (
        IndexSettings(columns=2).name.endswith("-c2") and "columns" not in IndexSettings().to_dict()
    )
    # columns no narrower than the records: every column, the one index (no "-c1" copy)
    assert resolve_settings(first, IndexSettings(columns=1)).columns == 0
    assert resolve_settings(whole, IndexSettings(columns=RANK)).columns == 0
    assert resolve_settings(whole, IndexSettings(columns=1)).columns == 1
    assert resolve_settings(whole, IndexSettings()).columns is None  # the query decides


def test_a_column_view_of_a_sharded_store_reads_the_shards_first_columns(tmp_path):
    """A DDP run's shards read as one store: the view's factors are the shards' first columns,
    one shard after the other, also for a range that spans both or holds none."""
    from traceprop_engine.store.sharded import ShardedStore

    rng = np.random.default_rng(4)
    shapes = [(32, 32)]  # k = d: no projection, which shards must share
    paths = []
    for r, n in enumerate((17, 11)):
        arrays = [rng.normal(size=(n, 64, RANK)).astype(np.float32)]
        write_factor_store(tmp_path / f"s{r}.h5", shapes, arrays, np.arange(n), rng, "sh", RANK)
        paths.append(tmp_path / f"s{r}.h5")
    sharded = ShardedStore(paths)
    view = column_view(sharded, 1)
    for li in range(len(shapes)):
        u, v = sharded.factors(li)
        for start, stop in ((0, None), (10, 20), (28, 28)):
            vu, vv = view.factors(li, start, stop)
            np.testing.assert_array_equal(vu, u[start:stop, :, :1])
            np.testing.assert_array_equal(vv, v[start:stop, :, :1])


def test_a_column_view_reads_scattered_records_first_columns(tmp_path):
    """The re-rank's gather of scattered records (a point selection, not one contiguous read)
    reads the first columns too, and an empty gather has the view's shape."""
    rng = np.random.default_rng(6)
    store = write_factor_store(
        tmp_path / "s.h5", SHAPES, _arrays(rng, 400), np.arange(400), rng, "g", RANK
    )
    view = column_view(store, 2)
    for recs in (np.array([3, 250, 399]), np.zeros(0, np.int64)):
        for li, (ko, ki) in enumerate(SHAPES):
            u, v = store.factors_at(li, recs)
            vu, vv = view.factors_at(li, recs)
            assert vu.shape == (len(recs), ko, 2) and vv.shape == (len(recs), ki, 2)
            np.testing.assert_array_equal(vu, u[..., :2])
            np.testing.assert_array_equal(vv, v[..., :2])
