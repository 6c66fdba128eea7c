"""End-to-end query benchmark: the product's whole ranking path over a store of N examples.

``traceprop bench query --end-to-end`` measures what a user waits for after the query's sketches
are taken: the FAISS candidate search (both ends) and the exact re-rank of every candidate from
the stored records (:meth:`AttributionRun.rank`), on a run whose store holds N examples.

The store is synthetic but written like a real one (:class:`StoreWriter`, in chunks, the same
layers, widths and factor storage as the base run): example ``i`` gets one record, the record
``j`` of the base run (drawn at random; the same ``j`` for every layer, so the layers stay
correlated as in a real record), its factors perturbed by Gaussian noise of ``noise`` times the
per-coordinate spread of the base run's factors, then re-quantised by the writer (int8 for the
default). Learning rates and losses are those of ``j``. Queries are real: the sketches of the
base run's own examples (eval examples first) on its final model.

The index is built by the product (:meth:`AttributionRun.build_index`: vectors, record cache,
exact norms, FAISS with nprobe tuning). Recall@10 compares the returned top-10 proponents (and
opponents) with brute force: the exact cosine scores of every example
(:meth:`AttributionRun.exact_scores` over all rows). Every returned score is checked against the
brute-force score of its example.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil

from .. import constants as C
from ..attribution.score.two_hands import hands
from ..run import RunManifest
from ..settings import IndexSettings

_CHUNK = 50_000
_K = 10


def write_synthetic_run(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    n: int,
    seed: int = 0,
    noise: float = 0.5,
) -> Path:
    """A run folder (manifest + store) of ``n`` examples resampled from the base run's records."""
    from ..store.sharded import open_run_store
    from ..store.writer import StoreWriter

    base_dir, out = Path(base_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(base_dir / C.MANIFEST_FILE, out / C.MANIFEST_FILE)
    base = open_run_store(base_dir, RunManifest.load(base_dir).shards)
    try:
        layers = [
            SimpleNamespace(
                name=i.name,
                kind=i.kind,
                d_in=i.d_in,
                d_out=i.d_out,
                k_in=i.k_in,
                k_out=i.k_out,
                rank=i.rank,
                factor_dtype=i.factor_dtype,
                P_in=None,
                P_out=None,
                record_shape=i.record_shape,
                output_head=i.output_head,
            )  # fmt: skip
            for i in base.layers
        ]
        if not all(i.rank for i in base.layers):
            raise ValueError("the end-to-end bench needs a base run stored as factors")
        fac = [base.factors(li) for li in range(len(base.layers))]  # [(U, V)] float32
        # the base run's K-FAC statistics: the default (K-FAC) index is what gets measured
        cov = [base.covariance(li) for li in range(len(base.layers))]
        rec = base.records()
        ex = base.examples()
    finally:
        base.close()
    spread = [(u.std(0), v.std(0)) for u, v in fac]
    w = StoreWriter(out / C.STORE_FILE, layers, {"run_id": f"synthetic-{n}"}, "factored")
    if any(c is not None for c in cov):
        w.write_covariance(cov)
    rng = np.random.default_rng(seed)
    src_all = rng.integers(0, len(rec[C.REC_EXAMPLE]), size=n)
    for s0 in range(0, n, _CHUNK):
        src = src_all[s0 : s0 + _CHUNK]
        m = len(src)
        arrays = []
        for (u, v), (su, sv) in zip(fac, spread, strict=True):
            uu = u[src] + noise * su * rng.standard_normal(u[src].shape, dtype=np.float32)
            vv = v[src] + noise * sv * rng.standard_normal(v[src].shape, dtype=np.float32)
            arrays.append(np.concatenate([uu, vv], axis=1))
        meta = {
            C.REC_EXAMPLE: np.arange(s0, s0 + m),
            C.REC_STEP: np.arange(s0, s0 + m) // 8,
            C.REC_EPOCH: np.zeros(m, np.int64),
            C.REC_LR: rec[C.REC_LR][src],
            C.REC_LOSS: rec[C.REC_LOSS][src],
        }
        w.append(arrays, meta)
    src_ex = rec[C.REC_EXAMPLE][src_all]
    empty = np.zeros(0, np.int32)
    w.write_examples(
        {
            C.EX_SOURCE: ex[C.EX_SOURCE][src_ex],
            C.EX_ROW: np.arange(n),
            C.EX_SHA256: [""] * n,
            C.EX_SPLIT: [C.SPLIT_TRAIN] * n,
            C.EX_TEXT: [""] * n,
        },
        [empty] * n,
        [empty] * n,
    )
    w.close(C.STATUS_COMPLETED)
    return out


def real_queries(base_dir: str | os.PathLike, n_queries: int) -> list[list[np.ndarray]]:
    """Per-layer sketches of the base run's examples (eval first) on its final model."""
    from ..attribution import AttributionRun

    run = AttributionRun(base_dir)
    try:
        ex = run.examples()
        order = list(ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"])
        order += list(ex.filter(ex["split"] != C.SPLIT_EVAL)["example_id"])
        out = []
        for e in order[:n_queries]:
            enc, _, _ = run.encode(eval_example=int(e))
            out.append(run.query_sketches(enc)[0])
        return out
    finally:
        run.close()


def emit(row: dict, json_path: str | None) -> None:
    """A benchmark script's result row: one JSON line on stdout, and indented into
    ``json_path`` when given."""
    print(json.dumps(row))
    if json_path:
        Path(json_path).write_text(json.dumps(row, indent=2) + "\n")


def with_layer_norms(run, s) -> None:
    """Give the index ``s`` of an open run the per-layer row norms of the layer-by-layer re-rank
    (``layer_norms.npy``) in memory when it was built before they were kept: the same numbers a
    build writes, without rebuilding a large index for a benchmark."""
    from ..attribution.score.rerank import as_bounds

    if run.indexes.row_layer_sq_norms(s) is None:
        scorer = run.indexes.scorer(s)
        scorer.layer_sq_norms = as_bounds(scorer.example_sq_norms())


def _recall(got: np.ndarray, ref: np.ndarray) -> float:
    return len(set(got.tolist()) & set(ref.tolist())) / max(1, len(ref))


def measure(
    run_dir: str | os.PathLike,
    queries: list[list[np.ndarray]],
    s: IndexSettings | None = None,
    recall_queries: int | None = None,
) -> dict:
    """Build the index of ``run_dir``, time :meth:`AttributionRun.rank` per query, and compare the
    top 10 of the first ``recall_queries`` (default all) with brute force (one pass over the
    store per 16 queries: ``2 · n · L · k²`` flops a query)."""
    from ..attribution import AttributionRun

    run = AttributionRun(run_dir)
    s = run.settings(s)
    try:
        stages: dict[str, float] = {}
        t_stage = [time.perf_counter(), None]

        def progress(stage, done, total):
            if stage != t_stage[1]:
                now = time.perf_counter()
                if t_stage[1] is not None:
                    stages[t_stage[1]] = round(now - t_stage[0], 2)
                t_stage[:] = [now, stage]

        t0 = time.perf_counter()
        index = run.build_index(s, progress)
        build_s = time.perf_counter() - t0
        if t_stage[1] is not None:
            stages[t_stage[1]] = round(time.perf_counter() - t_stage[0], 2)
        run.rank(queries[0], s)  # warm-up: loads the example table, norms, record maps
        lat, rows = [], []
        for sk in queries:
            t = time.perf_counter()
            r, _ = run.rank(sk, s, _K, True)
            lat.append(time.perf_counter() - t)
            rows.append(r)
        rec_p, rec_o, max_err = [], [], 0.0
        n_rec = len(queries) if recall_queries is None else min(recall_queries, len(queries))
        for i in range(0, n_rec, 16):  # brute force, 16 queries per pass over the store
            batch = queries[i : min(i + 16, n_rec)]
            sk = [np.concatenate([q[li] for q in batch]) for li in range(len(batch[0]))]
            exact = run.exact_scores(sk, s)  # (q, n) in row order = example order here
            for j, r in enumerate(rows[i : i + len(batch)]):
                sc = exact[j]
                ref_p = np.argsort(-sc, kind="stable")[:_K]
                ref_o = np.argsort(sc, kind="stable")[:_K]
                pro = r.filter(r["kind"] == "proponent")
                opp = r.filter(r["kind"] == "opponent")
                rec_p.append(_recall(pro["example_id"].to_numpy(), ref_p[sc[ref_p] > 0]))
                rec_o.append(_recall(opp["example_id"].to_numpy(), ref_o[sc[ref_o] < 0]))
                got = r["score"].to_numpy()
                want = sc[r["example_id"].to_numpy()]
                max_err = max(max_err, float(np.max(np.abs(got - want), initial=0.0)))
        lat_ms = np.asarray(lat) * 1e3
        return {
            "n": int(index.n),
            "dim": int(index.dim),
            "kind": index.kind.value,
            "nprobe": index.nprobe,
            "threads": index.threads,
            "query_threads": hands(),
            "build_s": round(build_s, 2),
            "build_stages_s": stages,
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
            "recall_at_10": round(float(np.mean(rec_p)), 4),
            "opponent_recall_at_10": round(float(np.mean(rec_o)), 4),
            "max_abs_score_error": max_err,
            "lists": run.indexes.scorer(s).lists is not None,
            "n_queries": len(queries),
            "n_recall_queries": n_rec,
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        }
    finally:
        run.close()


def run_end_to_end(
    base_dir: str | os.PathLike,
    sizes: tuple[int, ...],
    work_dir: str | os.PathLike,
    n_queries: int = 100,
    seed: int = 0,
    noise: float = 0.5,
    progress: Callable[[str], None] | None = None,
    recall_queries: int | None = None,
    settings: list[IndexSettings] | None = None,
) -> list[dict]:
    """One row per size and index setting (see :func:`measure`; default ``IndexSettings()``);
    each synthetic run is deleted after it is measured."""
    queries = real_queries(base_dir, n_queries)
    rows = []
    for n in sizes:
        d = Path(work_dir) / f"e2e-{n}"
        try:
            t = time.perf_counter()
            if progress:
                progress(f"writing a store of {n} examples")
            write_synthetic_run(base_dir, d, n, seed, noise)
            write_s = time.perf_counter() - t
            if progress:
                progress(f"building the index and querying ({n} examples)")
            for s in settings or [IndexSettings()]:
                row = measure(d, queries, s, recall_queries=recall_queries)
                row.update(
                    index=s.name,
                    store_write_s=round(write_s, 1),
                    base_run=str(base_dir),
                    noise=noise,
                    records_per_example=1,
                    store_mb=round((d / C.STORE_FILE).stat().st_size / 2**20, 1),
                )
                rows.append(row)
                if progress:
                    progress(json.dumps(row))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return rows
