"""Compact-storage benchmark (LoRIF factors) — produces the tables in benchmarks/compact.md."""

import os

os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from scipy.stats import spearmanr

torch.set_num_threads(1)
from traceprop_engine import constants as C
from traceprop_engine.attribution import open_run
from traceprop_engine.attribution.precondition.woodbury import fit_woodbury
from traceprop_engine.attribution.score.factor_scores import factor_scores, sketch_scores
from traceprop_engine.samples.data import generate_sample_data
from traceprop_engine.settings import IndexSettings, TrackSettings, TrainSettings
from traceprop_engine.store.compact import compact_store
from traceprop_engine.store.factor_file import FactorStore
from traceprop_engine.store.reader import Store
from traceprop_engine.store.writer import StoreWriter
from traceprop_engine.training.loop import train

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cbench")
N_BIG, REPEATS = 8192, 9
CS = {8: [1, 2, 4, 8], 16: [1, 2, 4, 8, 16], 32: [1, 2, 4, 8, 32]}
data = ROOT / "data"
if not (data / "train").exists():
    generate_sample_data(data, seed=0)
out = {"runs": {}}


def metrics(f, s):
    rel = np.linalg.norm(f - s, axis=1) / np.linalg.norm(s, axis=1)
    sp = [spearmanr(a, b).statistic for a, b in zip(f, s, strict=False)]
    top = [
        len(set(np.argsort(-a)[:10]) & set(np.argsort(-b)[:10])) / 10
        for a, b in zip(f, s, strict=False)
    ]
    return {
        "rel_err": float(np.median(rel)),
        "spearman": float(np.median(sp)),
        "top10": float(np.mean(top)),
    }


def tiled(run_dir, n_big):
    """A larger store: the run's records repeated, each copy a new set of examples (for timing)."""
    path = run_dir / "tiled" / C.STORE_FILE
    with Store(run_dir / C.STORE_FILE) as st:
        layers = [
            SimpleNamespace(
                name=l.name,
                kind=l.kind,
                d_in=l.d_in,
                d_out=l.d_out,
                k_in=l.k_in,
                k_out=l.k_out,
                P_in=None,
                P_out=None,
                record_shape=l.record_shape,
            )
            for l in st.layers
        ]
        w = StoreWriter(path, layers, {"run_id": "tiled"}, "factored")
        rec, n = st.records(), st.n_records
        sk = [st.sketches(li) for li in range(len(layers))]
        n_ex = int(rec[C.REC_EXAMPLE].max()) + 1
        for j in range(0, n_big, n):
            m = min(n, n_big - j)
            meta = {k: v[:m] for k, v in rec.items()}
            meta[C.REC_EXAMPLE] = rec[C.REC_EXAMPLE][:m] + (j // n) * n_ex
            w.append([x[:m] for x in sk], meta)
        w.close(C.STATUS_COMPLETED)
    return path


for k in (8, 16, 32):
    run_dir = ROOT / f"run-k{k}"
    if not (run_dir / C.STORE_FILE).exists():
        t0 = time.perf_counter()
        train(
            TrainSettings(
                data=str(data / "train"),
                eval_data=str(data / "eval"),
                out=str(run_dir),
                tiny_layers=1,
                tiny_width=64,
                epochs=2,
                threads=1,
                track=TrackSettings(k_in=k, k_out=k),
            ),
            overwrite=True,
        )
        print(f"trained k={k} in {time.perf_counter() - t0:.1f}s", flush=True)
    run = open_run(run_dir)
    st = run.store
    ev = run.eval_examples()["example_id"].to_list()
    sks = [run.query_sketches(run.encode(eval_example=int(e))[0])[0] for e in ev]
    tests = [
        np.concatenate([s[li] for s in sks]) for li in range(len(st.layers))
    ]  # (q, k_out, k_in)
    rec = st.records()
    r = {
        "n_records": st.n_records,
        "n_examples": int(len(np.unique(rec[C.REC_EXAMPLE]))),
        "n_queries": len(ev),
        "layers": [[l.name, l.k_out, l.k_in] for l in st.layers],
        "full_bytes_per_record": sum(4 * l.k_out * l.k_in for l in st.layers),
        "store_file_bytes": os.path.getsize(run_dir / C.STORE_FILE),
        "c": {},
    }
    pres = {
        kind: run.fit_preconditioner(IndexSettings(preconditioner=kind))
        for kind in ("identity", "kfac", "ekfac")
    }
    full = {kind: sketch_scores(tests, st, p, dtype=np.float64).scores for kind, p in pres.items()}
    for c in CS[k]:
        fpath = compact_store(st, c, out=run_dir / f"factors-c{c}.h5")
        with FactorStore(fpath) as fs:
            row = {
                "bytes_per_record": fs.nbytes_per_record(),
                "file_bytes": os.path.getsize(fpath),
                "lossless": fs.lossless,
                "rel_residual": [round(l.relative_residual, 4) for l in fs.layers],
            }
            for kind, p in pres.items():
                got = factor_scores(tests, fs, p, dtype=np.float64)
                row[kind] = metrics(got.scores, full[kind])
                row[kind]["bound_rel"] = float(
                    np.median(
                        np.linalg.norm(got.bound, axis=1) / np.linalg.norm(full[kind], axis=1)
                    )
                )
        r["c"][c] = row
        print(k, c, json.dumps(row), flush=True)
    # Woodbury vs explicit dense damped inverse on the same layers (identity-normalised vectors)
    if k == 32:
        wb = {}
        G = [st.sketches(li).reshape(st.n_records, -1) for li in range(len(st.layers))]
        dense = [
            fit_woodbury(g, g.shape[1], 0.1, shape=l.record_shape, name=l.name)
            for g, l in zip(G, st.layers, strict=False)
        ]
        ref = sketch_scores(tests, st, dense, dtype=np.float64).scores
        for rr in (16, 64, 256):
            wps = [
                fit_woodbury(g, rr, 0.1, shape=l.record_shape, name=l.name)
                for g, l in zip(G, st.layers, strict=False)
            ]
            got = sketch_scores(tests, st, wps, dtype=np.float64).scores
            wb[rr] = {
                **metrics(got, ref),
                "floats_per_layer": [int(w.basis.size + w.rank) for w in wps],
                "dense_floats_per_layer": [int(g.shape[1] ** 2) for g in G],
                "trace_captured": [round(w.info["trace_captured"], 3) for w in wps],
            }
            print("woodbury", rr, json.dumps(wb[rr]), flush=True)
        r["woodbury"] = wb
    # timing on a tiled store (same per-record data, N_BIG records), one query, K-FAC, interleaved
    tpath = tiled(run_dir, N_BIG)
    big = Store(tpath)
    pre = pres["kfac"]
    t1 = [t[:1] for t in tests]
    fss = {
        c: FactorStore(compact_store(big, c, out=tpath.parent / f"factors-c{c}.h5")) for c in CS[k]
    }
    times = {"full": []} | {c: [] for c in CS[k]}
    for rep in range(REPEATS + 1):
        order = ["full", *CS[k]] if rep % 2 == 0 else [*CS[k], "full"][::-1]
        for key in order:
            t0 = time.perf_counter()
            if key == "full":
                sketch_scores(t1, big, pre)
            else:
                factor_scores(t1, fss[key], pre, with_bound=False)
            if rep:  # first round is warm-up (page cache, BLAS init)
                times[key].append(time.perf_counter() - t0)
    med = {str(key): float(np.median(v)) for key, v in times.items()}
    r["timing"] = {
        "n_records": N_BIG,
        "median_s": med,
        "ratio_full_over_factored": {str(c): med["full"] / med[str(c)] for c in CS[k]},
        "spread": {str(key): [float(np.min(v)), float(np.max(v))] for key, v in times.items()},
        "full_file_bytes": os.path.getsize(tpath),
        "factor_file_bytes": {str(c): os.path.getsize(fss[c].path) for c in CS[k]},
    }
    print(k, "timing", json.dumps(r["timing"]), flush=True)
    for fs in fss.values():
        fs.close()
    big.close()
    run.close()
    out["runs"][k] = r
    (ROOT / "results.json").write_text(json.dumps(out, indent=1))
