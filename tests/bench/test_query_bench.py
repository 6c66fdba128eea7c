"""``traceprop bench query``'s synthetic run: the vectors it indexes are those a run of that size
holds (reduced to ``index_dims`` principal directions), and its exact rows are exact."""

from __future__ import annotations

import numpy as np

from traceprop_engine.bench.query import ReducedGenerator, SketchGenerator, run_query_bench


def _base(n: int = 300, dim: int = 512) -> np.ndarray:
    rng = np.random.default_rng(0)
    low = rng.standard_normal((n, 12)) @ rng.standard_normal((12, dim))
    return (low + 0.1 * rng.standard_normal((n, dim))).astype(np.float32)


def test_the_bench_indexes_the_reduced_vectors_a_large_run_holds():
    base = _base()
    rows = run_query_bench(
        sizes=(3000,), n_queries=20, kinds=("flat", "ivf"), base_vectors=base, index_dims=64
    )
    assert [r["dim"] for r in rows] == [64, 64]
    assert all(r["generator"] == "fitted, reduced to 64" for r in rows)
    flat, ivf = rows
    assert flat["recall_at_10"] == 1.0  # exact search against the streamed brute force
    assert 0.0 < ivf["recall_at_10"] <= 1.0
    full = run_query_bench(
        sizes=(3000,), n_queries=5, kinds=("flat",), base_vectors=base, index_dims=0
    )
    assert full[0]["dim"] == 512 and full[0]["generator"] == "fitted"


def test_the_reduction_keeps_the_generated_vectors_principal_directions():
    gen = SketchGenerator.fit(_base(), seed=0)
    red = ReducedGenerator.fit(gen, 16, seed=0)
    b = red.basis
    np.testing.assert_allclose(b.T @ b, np.eye(16), atol=1e-4)  # orthonormal columns
    x = gen.sample(4000, np.random.default_rng(1))
    kept = np.linalg.norm((x - x.mean(0)) @ b) ** 2 / np.linalg.norm(x - x.mean(0)) ** 2
    assert kept > 0.9  # 12 directions carry the base vectors; 16 keep nearly all of it
    y = red.sample(10, np.random.default_rng(2))
    np.testing.assert_allclose(
        y, gen.sample(10, np.random.default_rng(2)) @ b, rtol=1e-5, atol=1e-5
    )


def test_vectors_only_is_the_faiss_alone_mode_of_the_command(tmp_path):
    """``traceprop bench query --vectors-only``: FAISS over generated vectors (no store, no
    re-rank); ``--end-to-end`` and ``--vectors-only`` exclude each other."""
    import json

    import pytest

    from traceprop_engine.cli.main import main

    out = tmp_path / "q.json"
    argv = ["bench", "query", "--vectors-only", "--sizes", "2000", "--queries", "5"]
    assert main([*argv, "--index-dims", "32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["n"] for r in rows} == {2000} and all(r["dim"] == 32 for r in rows)
    assert all("max_abs_score_error" not in r for r in rows)  # no exact re-rank here
    with pytest.raises(SystemExit):
        main(["bench", "query", "--vectors-only", "--end-to-end"])
