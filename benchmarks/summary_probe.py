"""How much of the true top 10 a candidate summary can find, before any IVF: probe shapes.

    python benchmarks/summary_probe.py RUN_DIR --variant 8:32:8 --variant 8:64:16/256 \\
        [--ivf 64,128] [--queries 48] [--exact-cache F.npy]

RUN_DIR is a real run of many examples (``benchmarks/query_real_run.py``), one record per
example, rank-1 int8 factors, with its default index built (its record cache is read). A
variant ``L:a:b[+L:a:b...][/dims]`` projects layer ``L`` (``all``: every layer) onto the top
``a`` output-side and ``b`` input-side principal directions of its records (the moments of
``fit_index_projection``, each layer's records at unit norm), concatenates the layers' ``a·b``
products, optionally reduces them to their top ``dims`` principal directions, and normalises.
For each held-out question it prints recall@10 of the proponents / opponents (against
brute-force exact scores over every example) when the candidates are the variant's top 1000,
4000 or 16000 by exhaustive search, and with ``--ivf`` by a FAISS IVF (1024 lists, flat
storage, ``--nlist``; ``--spill 2``: every vector also in its second-nearest list) probing that many lists,
and with ``--hnsw M`` by a FAISS HNSW graph (1000 candidates, each ``--ef``).

This is a probe, not the index: it reads every example's factors into memory (≈ 1 GB a layer at
10⁶) and searches exhaustively. Measured with it: benchmarks/README.md §2b (stop 14).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import faiss
import numpy as np

from traceprop_engine import constants as C
from traceprop_engine.attribution import AttributionRun
from traceprop_engine.attribution.index.projection import side_moments
from traceprop_engine.attribution.score.record_cache import RecordCache
from traceprop_engine.bench import query_e2e as e2e
from traceprop_engine.settings import IndexSettings

CANDIDATES = (1000, 4000, 16000)
SAMPLE = 131_072  # records the side moments are estimated from


def _exact(run, queries, s, cache: Path | None) -> np.ndarray:
    if cache is not None and cache.exists():
        return np.load(cache)
    out = np.concatenate(
        [
            run.exact_scores([np.concatenate([q[li] for q in b]) for li in range(len(b[0]))], s)
            for b in (queries[i : i + 12] for i in range(0, len(queries), 12))
        ]
    )
    if cache is not None:
        np.save(cache, out)
    return out


class Probe:
    def __init__(self, run_dir: str, n_queries: int, exact_cache: Path | None):
        self.queries = e2e.real_queries(run_dir, n_queries)
        self.run = AttributionRun(run_dir)
        s = IndexSettings()
        _, ids, _ = self.run.index(s)
        if not np.array_equal(ids, np.arange(len(ids))):
            raise SystemExit("the probe needs one vector row per example id 0..n-1")
        self.exact = _exact(self.run, self.queries, s, exact_cache)
        self.cache = RecordCache(self.run.index_dir(s), self.run.store)
        rec_ex = self.run.store.records()[C.REC_EXAMPLE]
        if len(np.unique(rec_ex)) != len(rec_ex):
            raise SystemExit("the probe needs one record per example (one epoch)")
        self.rec_ex = rec_ex
        scorer = self.run.indexes.scorer(s)
        self.pullbacks = [scorer.pullbacks(q) for q in self.queries]
        self.factors: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def layer(self, li: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank-1 factors (n, k_out), (n, k_in) of layer ``li``, in record order."""
        if li not in self.factors:
            n = self.run.store.n_records
            info = self.run.store.layers[li]
            if info.rank != 1:
                raise SystemExit(f"layer {li} is not rank-1")
            u, v = np.empty((n, info.k_out), np.float32), np.empty((n, info.k_in), np.float32)
            for a in range(0, n, SAMPLE):
                uu, vv = self.cache.factors_at(li, np.arange(a, min(a + SAMPLE, n)))
                u[a : a + len(uu)], v[a : a + len(vv)] = uu[:, :, 0], vv[:, :, 0]
            self.factors[li] = (u, v)
        return self.factors[li]

    def directions(self, li: int) -> tuple[np.ndarray, np.ndarray]:
        """Output- and input-side principal directions (rows, largest first) of layer ``li``,
        from the moments ``fit_index_projection`` uses."""
        u, v = self.layer(li)
        step = max(1, len(u) // SAMPLE)
        ml, mr = side_moments(
            u[::step, :, None].astype(np.float64), v[::step, :, None].astype(np.float64)
        )
        return np.linalg.eigh(ml)[1][:, ::-1].T, np.linalg.eigh(mr)[1][:, ::-1].T

    def vectors(self, spec: str) -> tuple[np.ndarray, np.ndarray]:
        """Normalised (n, d) example vectors (example-id order) and (q, d) query vectors."""
        shape, _, dims = spec.partition("/")
        alloc: dict[int, tuple[int, int]] = {}
        for part in shape.split("+"):
            who, a, b = part.split(":")
            layers = range(len(self.run.store.layers)) if who == "all" else [int(who)]
            alloc.update({li: (int(a), int(b)) for li in layers})
        n = self.run.store.n_records
        blocks, qblocks = [], []
        for li, (a, b) in sorted(alloc.items()):
            left, right = self.directions(li)
            left, right = left[:a].astype(np.float32), right[:b].astype(np.float32)
            u, v = self.layer(li)
            x = np.empty((n, len(left) * len(right)), np.float32)
            for s0 in range(0, n, SAMPLE):
                pu, pv = u[s0 : s0 + SAMPLE] @ left.T, v[s0 : s0 + SAMPLE] @ right.T
                x[s0 : s0 + len(pu)] = (pu[:, :, None] * pv[:, None, :]).reshape(len(pu), -1)
            blocks.append(x)
            qblocks.append(
                np.stack(
                    [
                        (left @ pb[li][0].astype(np.float32) @ right.T).ravel()
                        for pb in self.pullbacks
                    ]
                )
            )
        x, q = np.concatenate(blocks, 1), np.concatenate(qblocks, 1)
        del blocks
        if dims and int(dims) < x.shape[1]:
            smp = x[:: max(1, n // 8192)]
            smp = smp / np.maximum(np.linalg.norm(smp, axis=1, keepdims=True), 1e-30)
            basis = np.linalg.eigh(smp.T.astype(np.float64) @ smp)[1][:, ::-1][:, : int(dims)]
            x, q = x @ basis.astype(np.float32), q @ basis.astype(np.float32)
        out = np.empty_like(x)
        out[self.rec_ex] = x  # example-id order, as the exact scores
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-30)
        return out, q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-30)

    def truth(self, j: int, sign: int) -> np.ndarray:
        e = sign * self.exact[j]
        top = np.argsort(-e, kind="stable")[:10]
        return top[e[top] > 0]

    def flat(self, x: np.ndarray, q: np.ndarray) -> dict:
        out = {}
        for name, sign in (("proponents", 1), ("opponents", -1)):
            rec = []
            for j in range(len(q)):
                s = -sign * (x @ q[j])
                top = self.truth(j, sign)
                rec.append([np.mean(s[top] < np.partition(s, c)[c]) for c in CANDIDATES])
            out[name] = np.round(np.mean(rec, 0), 3).tolist()
        return out

    def ivf(
        self, x: np.ndarray, q: np.ndarray, nprobes: list[int], spill: int = 1, nlist: int = 1024
    ) -> list[dict]:
        index = faiss.IndexIVFFlat(
            faiss.IndexFlatIP(x.shape[1]), x.shape[1], nlist, faiss.METRIC_INNER_PRODUCT
        )
        index.train(x[:: max(1, len(x) // 50_000)])
        if spill == 1:
            index.add(x)
        else:  # every vector in its `spill` nearest lists (same id: results deduplicated)
            _, lists = index.quantizer.search(x, spill)
            ids = np.arange(len(x), dtype=np.int64)
            for j in range(spill):
                assign = np.ascontiguousarray(lists[:, j], dtype=np.int64)
                index.add_core(
                    len(x), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(assign)
                )
        rows = []
        for nprobe in nprobes:
            index.nprobe = nprobe
            for cand in CANDIDATES[:2]:
                lat, rec = [], {"proponents": [], "opponents": []}
                for j in range(len(q)):
                    t = time.perf_counter()
                    _, hp = index.search(q[j : j + 1], cand * spill)
                    _, ho = index.search(-q[j : j + 1], cand * spill)
                    hp, ho = (_first_unique(h[0], cand)[None] for h in (hp, ho))
                    lat.append(time.perf_counter() - t)
                    for name, sign, got in (("proponents", 1, hp[0]), ("opponents", -1, ho[0])):
                        rec[name].append(np.isin(self.truth(j, sign), got).mean())
                rows.append(
                    {
                        "nlist": nlist,
                        "spill": spill,
                        "nprobe": nprobe,
                        "candidates": cand,
                        "search_p50_ms": round(float(np.median(lat)) * 1e3, 1),
                        **{k: round(float(np.mean(v)), 3) for k, v in rec.items()},
                    }
                )
        return rows


def _hnsw(probe: Probe, x: np.ndarray, q: np.ndarray, m: int, efs: list[int]) -> list[dict]:
    """Recall of a FAISS HNSW graph (``m`` links a node, inner product) for 1000 candidates a
    side, searched with each ``efSearch`` of ``efs`` (at least the candidates)."""
    index = faiss.IndexHNSWFlat(x.shape[1], m, faiss.METRIC_INNER_PRODUCT)
    t = time.perf_counter()
    index.add(x)
    build_s = time.perf_counter() - t
    rows = []
    for ef in efs:
        index.hnsw.efSearch = max(ef, CANDIDATES[0])
        lat, rec = [], {"proponents": [], "opponents": []}
        for j in range(len(q)):
            t = time.perf_counter()
            _, hp = index.search(q[j : j + 1], CANDIDATES[0])
            _, ho = index.search(-q[j : j + 1], CANDIDATES[0])
            lat.append(time.perf_counter() - t)
            for name, sign, got in (("proponents", 1, hp[0]), ("opponents", -1, ho[0])):
                rec[name].append(np.isin(probe.truth(j, sign), got).mean())
        rows.append(
            {
                "hnsw_m": m,
                "ef_search": index.hnsw.efSearch,
                "build_s": round(build_s),
                "candidates": CANDIDATES[0],
                "search_p50_ms": round(float(np.median(lat)) * 1e3, 1),
                **{k: round(float(np.mean(v)), 3) for k, v in rec.items()},
            }
        )
    return rows


def _factored_ivf(
    probe: Probe, x: np.ndarray, q: np.ndarray, li: int, nlist: int, nprobes: list[int]
) -> list[dict]:
    """Lists made from layer ``li``'s OUTPUT factor alone (spherical k-means of the records'
    normalised ``u``: on an LM head, the token the record pushes), probed in the order of the
    query's inner product with each list's mean summary vector, the probed rows ranked by
    ``x``. Reports recall@10 of 1000 / 4000 candidates and the share of rows scanned."""
    u, _ = probe.layer(li)
    ue = np.empty_like(u)
    ue[probe.rec_ex] = u
    ue /= np.maximum(np.linalg.norm(ue, axis=1, keepdims=True), 1e-30)
    km = faiss.Kmeans(ue.shape[1], nlist, niter=20, spherical=True, seed=1)
    km.train(ue[:: max(1, len(ue) // 100_000)])
    assign = km.index.search(ue, 1)[1][:, 0]
    order = np.argsort(assign, kind="stable")
    bounds = np.searchsorted(assign[order], np.arange(nlist + 1))
    centre = np.zeros((nlist, x.shape[1]), np.float64)
    np.add.at(centre, assign, x)
    rows = []
    for nprobe in nprobes:
        rec = {c: {"proponents": [], "opponents": []} for c in CANDIDATES[:2]}
        scanned = []
        for j in range(len(q)):
            cs = centre @ q[j]
            for name, sign in (("proponents", 1), ("opponents", -1)):
                lists = np.argsort(-sign * cs)[:nprobe]
                cand = np.concatenate([order[bounds[c] : bounds[c + 1]] for c in lists])
                scanned.append(len(cand) / len(x))
                s = sign * (x[cand] @ q[j])
                top = probe.truth(j, sign)
                for c in CANDIDATES[:2]:
                    got = cand[np.argsort(-s)[:c]]
                    rec[c][name].append(np.isin(top, got).mean())
        for c in CANDIDATES[:2]:
            rows.append(
                {
                    "factored_lists": nlist,
                    "nprobe": nprobe,
                    "candidates": c,
                    "scanned": round(float(np.mean(scanned)), 3),
                    **{k: round(float(np.mean(v)), 3) for k, v in rec[c].items()},
                }
            )
    return rows


def _multi_index(probe: Probe, li: int, cu: int, cv: int, shares: list[float]) -> list[dict]:
    """Cells by BOTH factors of layer ``li``'s rank-1 records: spherical k-means of the
    normalised output factors ``û`` (``cu`` centres ``c_a``) and input factors ``v̂`` (``cv``
    centres ``d_b``); a record lives in cell ``(a, b)``. A query scores every cell by the
    bilinear form at its centres, ``c_aᵀ T' d_b`` (one ``cu × cv`` product of the query's
    low-rank ``T'``), visits the cells in that order (descending for proponents, ascending for
    opponents) until ``share`` of the rows are scanned, and ranks the scanned rows by their
    exact cosine at that layer, ``ûᵀ T' v̂``. Reports recall@10 of 1000 / 4000 candidates; the
    ``oracle`` rows rank every row by that layer's exact cosine (no cells): the most a search
    on that layer alone can find."""
    u, v = probe.layer(li)
    un, vn = np.empty_like(u), np.empty_like(v)
    un[probe.rec_ex], vn[probe.rec_ex] = u, v  # example-id order, as the exact scores
    un /= np.maximum(np.linalg.norm(un, axis=1, keepdims=True), 1e-30)
    vn /= np.maximum(np.linalg.norm(vn, axis=1, keepdims=True), 1e-30)
    centres, assign = [], []
    for x, c in ((un, cu), (vn, cv)):
        km = faiss.Kmeans(x.shape[1], c, niter=20, spherical=True, seed=1)
        km.train(x[:: max(1, len(x) // 100_000)])
        centres.append(km.centroids.astype(np.float64))
        assign.append(km.index.search(x, 1)[1][:, 0])
    cell = assign[0].astype(np.int64) * cv + assign[1]
    order = np.argsort(cell, kind="stable")
    bounds = np.searchsorted(cell[order], np.arange(cu * cv + 1))
    sizes = np.diff(bounds)
    n = len(un)
    rows = []
    rec = {key: {"proponents": [], "opponents": []} for key in ["oracle", *shares]}
    for j in range(len(probe.queries)):
        t = probe.pullbacks[j][li][0].astype(np.float64)
        w, sv, vt = np.linalg.svd(t, full_matrices=False)
        keep = sv > sv[0] * 1e-6
        a, b = (w[:, keep] * sv[keep]).astype(np.float32), vt[keep].T.astype(np.float32)
        exact = np.einsum("nr,nr->n", un @ a, vn @ b)  # every row's cosine at this layer
        m = (centres[0] @ a) @ (centres[1] @ b).T  # (cu, cv) cell scores
        for name, sign in (("proponents", 1), ("opponents", -1)):
            top = probe.truth(j, sign)
            e = sign * exact
            rec["oracle"][name].append(
                [np.isin(top, np.argsort(-e)[:c]).mean() for c in CANDIDATES[:2]]
            )
            cells = np.argsort(-sign * m.ravel())
            reach = np.cumsum(sizes[cells])
            for share in shares:
                last = int(np.searchsorted(reach, share * n)) + 1
                cand = np.concatenate([order[bounds[c] : bounds[c + 1]] for c in cells[:last]])
                got = cand[np.argsort(-e[cand])]
                rec[share][name].append([np.isin(top, got[:c]).mean() for c in CANDIDATES[:2]])
    for key, r in rec.items():
        rows.append(
            {
                "multi_index": f"{cu}x{cv}",
                "scanned": key,
                **{k: np.round(np.mean(v, 0), 3).tolist() for k, v in r.items()},
            }
        )
    return rows


def _first_unique(ids: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` distinct ids of a result list, in order."""
    ids = ids[ids >= 0]
    _, first = np.unique(ids, return_index=True)
    return ids[np.sort(first)][:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--variant", action="append", default=[], help="L:a:b[+L:a:b...][/dims]")
    ap.add_argument("--ivf", default="", help="IVF lists probed, comma-separated (default: none)")
    ap.add_argument("--spill", type=int, default=1, help="lists each vector is added to")
    ap.add_argument("--nlist", type=int, default=1024, help="IVF lists")
    ap.add_argument(
        "--factored", default="", help="LAYER:NLIST:P1,P2,..: lists from that layer's output factor"
    )
    ap.add_argument(
        "--multi", default="", help="LAYER:CU:CV:S1,S2,..: cells by both factors, shares scanned"
    )
    ap.add_argument("--hnsw", type=int, default=0, help="also an HNSW graph with this many links")
    ap.add_argument("--ef", default="1000,2000,4000", help="HNSW efSearch values")
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument("--exact-cache", type=Path, help="reuse / write the brute-force scores here")
    a = ap.parse_args()
    probe = Probe(a.run_dir, a.queries, a.exact_cache)
    if a.multi:
        li, cu, cv, ss = a.multi.split(":")
        for row in _multi_index(
            probe, int(li), int(cu), int(cv), [float(x) for x in ss.split(",")]
        ):
            print("multi", row, flush=True)
    for spec in a.variant:
        x, q = probe.vectors(spec)
        print(
            spec, "dims", x.shape[1], "flat recall@10 at", CANDIDATES, probe.flat(x, q), flush=True
        )
        if a.ivf:
            for row in probe.ivf(x, q, [int(p) for p in a.ivf.split(",")], a.spill, a.nlist):
                print(spec, "IVF", row, flush=True)
        if a.factored:
            li, nl, ps = a.factored.split(":")
            for row in _factored_ivf(
                probe, x, q, int(li), int(nl), [int(p) for p in ps.split(",")]
            ):
                print(spec, "factored", row, flush=True)
        if a.hnsw:
            for row in _hnsw(probe, x, q, a.hnsw, [int(e) for e in a.ef.split(",")]):
                print(spec, "HNSW", row, flush=True)
        del x


if __name__ == "__main__":
    main()
