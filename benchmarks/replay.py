"""Offline replay of tracking and scoring choices on an LDS evaluation, without retraining.

An evaluation folder of ``traceprop eval lds`` run with ``--config x1:k_in=1048576,
k_out=1048576,factor_dtype=float32`` holds, in ``runs/x1``, the *exact* rank-1 factors of
every record (``u = s·û``, ``v = Gᵀû`` per layer, no projection, float32) and the exact query
gradients on the final model. Every projection (kind, k per layer and side), number format,
record weighting, normalisation and preconditioner of the default rank-1 records is a function
of those, so this module computes the LDS of any of them from the evaluation's own subset
losses in seconds: the engine's numbers are reproduced (:func:`engine_projections` with the
main run's matrices; checked to 1e-3 against ``results.csv``), then other choices are scored the
same way.

Usage::

    python benchmarks/replay.py /tmp/q/facts24-s0 /tmp/q/hard60-s0 ...   # prints the table

or ``from replay import load, lds_of`` in a notebook-like script.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traceprop_engine import constants as C
from traceprop_engine.evaluate.lds_report import lds_scores

X_RUN = "x1"
CACHE = "replay-cache.npz"


@dataclass
class Data:
    """One evaluation's exact rank-1 records, queries and subset losses."""

    name: str
    masks: np.ndarray  # (m, n_train) bool
    losses: np.ndarray  # (m, n_eval)
    n_train: int
    example: np.ndarray  # (n_rec,) example id of each record
    epoch: np.ndarray
    lr: np.ndarray
    names: list[str]
    U: list[np.ndarray]  # per layer (n_rec, d_out) float64: s·û (the loss scale folded in)
    V: list[np.ndarray]  # per layer (n_rec, d_in): Gᵀû
    Q: list[np.ndarray]  # per layer (n_eval, d_out, d_in): the exact query gradients
    A: list[np.ndarray | None]  # per layer full-width K-FAC sums (the run's statistics batches)
    S: list[np.ndarray | None]
    n_tok: list[float]
    ref: dict[str, np.ndarray] = field(default_factory=dict)  # engine rows: per-example LDS
    groups: list[np.ndarray] = field(default_factory=list)  # record ids of each example

    def __post_init__(self) -> None:
        order = np.argsort(self.example, kind="stable")
        b = np.searchsorted(self.example[order], np.arange(self.n_train + 1))
        self.groups = [order[b[i] : b[i + 1]] for i in range(self.n_train)]


def load(ev: str | Path, run: str = X_RUN) -> Data:
    """Read (or the cached copy of) evaluation ``ev``'s replay data."""
    ev = Path(ev)
    sub = json.loads((ev / "subsets.json").read_text())
    n_train = sub["n_train"]
    masks = np.zeros((len(sub["subsets"]), n_train), bool)
    for j, s in enumerate(sub["subsets"]):
        masks[j, s["members"]] = True
    losses = np.load(ev / "losses.npy")
    ref = _reference_rows(ev)
    cache = ev / CACHE
    if cache.exists():
        z = np.load(cache, allow_pickle=True)
        n = int(z["n_layers"])
        return Data(
            ev.name, masks, losses, n_train, z["example"], z["epoch"], z["lr"],
            list(z["names"]), [z[f"U{i}"] for i in range(n)], [z[f"V{i}"] for i in range(n)],
            [z[f"Q{i}"] for i in range(n)],
            [z.get(f"A{i}") for i in range(n)],
            [z.get(f"S{i}") for i in range(n)],
            list(z["n_tok"]), ref,
        )  # fmt: skip
    from traceprop_engine.attribution import open_run

    r = open_run(ev / "runs" / run)
    st = r.store
    ex = r.examples()
    eval_ids = ex.filter(ex["split"] == C.SPLIT_EVAL)["example_id"].to_list()
    qs = [r.query_sketches(r.encode(eval_example=e)[0])[0] for e in eval_ids]
    rec = st.records()
    U, V, Q, A, S, nt = [], [], [], [], [], []
    for li, info in enumerate(st.layers):
        if info.k_in != info.d_in or info.k_out != info.d_out:
            raise SystemExit(f"{ev}/runs/{run}: layer {info.name} is projected; not exact")
        u, v = st.factors(li)
        U.append(u[:, :, 0].astype(np.float64))
        V.append(v[:, :, 0].astype(np.float64))
        Q.append(np.concatenate([q[li] for q in qs]).astype(np.float64))
        cov = st.covariance(li)
        A.append(None if cov is None else cov.A)
        S.append(None if cov is None else cov.S)
        nt.append(0.0 if cov is None else float(cov.n_tokens))
    names = [info.name for info in st.layers]
    d = Data(
        ev.name, masks, losses, n_train, rec[C.REC_EXAMPLE].astype(np.int64),
        rec[C.REC_EPOCH].astype(np.int64), rec[C.REC_LR].astype(np.float64), names, U, V, Q,
        A, S, nt, ref,
    )  # fmt: skip
    arrays = {f"U{i}": x for i, x in enumerate(U)} | {f"V{i}": x for i, x in enumerate(V)}
    arrays |= {f"Q{i}": x for i, x in enumerate(Q)}
    arrays |= {f"A{i}": x for i, x in enumerate(A) if x is not None}
    arrays |= {f"S{i}": x for i, x in enumerate(S) if x is not None}
    np.savez(
        cache, n_layers=len(names), example=d.example, epoch=d.epoch, lr=d.lr,
        names=np.array(names), n_tok=np.array(nt), **arrays,
    )  # fmt: skip
    r.close()
    return d


def _reference_rows(ev: Path) -> dict[str, np.ndarray]:
    """The engine's per-example LDS of every row of ``results.json`` (by method name)."""
    f = ev / "results.json"
    if not f.exists():
        return {}
    out = {}
    for row in json.loads(f.read_text()).get("rows", []):
        per = row.get("per_example")
        if per is not None:
            out[row["method"]] = np.array([np.nan if x is None else x for x in per], float)
    return out


# -- projections ------------------------------------------------------------------------------
def orthogonal(k: int, d: int, rng: np.random.Generator) -> np.ndarray | None:
    """√(d/k) times k orthonormal rows of a random subspace (None when k >= d)."""
    if k >= d:
        return None
    g = rng.standard_normal((d, k))
    q, _ = np.linalg.qr(g)
    return (q.T * np.sqrt(d / k)).astype(np.float64)


def countsketch(k: int, d: int, rng: np.random.Generator, nnz: int = 1) -> np.ndarray | None:
    """A (k, d) sparse sign matrix: ``nnz`` entries ±1/√nnz per column at random rows
    (E[PᵀP] = I); None when k >= d."""
    if k >= d:
        return None
    p = np.zeros((k, d))
    for _ in range(nnz):
        rows = rng.integers(0, k, d)
        p[rows, np.arange(d)] += rng.choice([-1.0, 1.0], d) / np.sqrt(nnz)
    return p


def engine_projections(ev: str | Path, run: str = "k126") -> list[tuple]:
    """The ``(P_out, P_in)`` matrices the engine's run ``run`` recorded with (None: exact)."""
    from traceprop_engine.store.reader import Store

    with Store(Path(ev) / "runs" / run / C.STORE_FILE) as st:
        return [
            (
                None if (p := st.projection(li, "out")) is None else p.astype(np.float64),
                None if (q := st.projection(li, "in")) is None else q.astype(np.float64),
            )
            for li in range(len(st.layers))
        ]


# -- records and scores -----------------------------------------------------------------------
@dataclass
class Records:
    """Per layer rank-1 records ``U_r V_rᵀ`` and query matrices in some (projected) space."""

    U: list[np.ndarray]
    V: list[np.ndarray]
    Q: list[np.ndarray]


def project(d: Data, projs: list[tuple], int8: bool = True) -> Records:
    """Records and queries through per-layer ``(P_out, P_in)`` (None: that side exact), the
    records' factors rounded to int8 as the engine stores them when ``int8``."""
    U, V, Q = [], [], []
    for li, (po, pi) in enumerate(projs):
        u = d.U[li] if po is None else d.U[li] @ po.T
        v = d.V[li] if pi is None else d.V[li] @ pi.T
        q = d.Q[li]
        if po is not None:
            q = np.matmul(po[None], q)
        if pi is not None:
            q = q @ pi.T
        if int8:
            u, v = _int8(u), _int8(v)
        U.append(u)
        V.append(v)
        Q.append(q)
    return Records(U, V, Q)


def _int8(x: np.ndarray) -> np.ndarray:
    s = np.abs(x).max(1, keepdims=True) / 127.0
    s[s == 0] = 1.0
    return np.round(x / s) * s


def record_products(rec: Records) -> list[np.ndarray]:
    """Per layer ``(n_eval, n_rec)``: ``⟨Q_e, U_r V_rᵀ⟩ = U_rᵀ Q_e V_r``."""
    out = []
    for u, v, q in zip(rec.U, rec.V, rec.Q, strict=True):
        uq = np.matmul(u[None], q)  # (n_eval, n_rec, k_in)
        out.append(np.einsum("nrb,rb->nr", uq, v))
    return out


def weights(d: Data, kind: str = "lr") -> np.ndarray:
    if kind == "lr":
        return d.lr.copy()
    if kind == "uniform":
        return np.ones_like(d.lr)
    if kind == "last":
        return d.lr * (d.epoch == d.epoch.max())
    raise ValueError(kind)


def _pairs(d: Data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ordered pair ``(r, s)`` of records of one example, and that example."""
    if not hasattr(d, "_pair_cache"):
        rs, ss, es = [], [], []
        for i, g in enumerate(d.groups):
            rs.append(np.repeat(g, len(g)))
            ss.append(np.tile(g, len(g)))
            es.append(np.full(len(g) ** 2, i))
        d._pair_cache = (np.concatenate(rs), np.concatenate(ss), np.concatenate(es))
    return d._pair_cache


def example_sq_norms(d: Data, rec: Records, w: np.ndarray) -> np.ndarray:
    """``(L, n_train)``: ‖Σ_r w_r U_r V_rᵀ‖² per layer and example."""
    r, s_, e = _pairs(d)
    out = np.zeros((len(rec.U), d.n_train))
    for li, (u, v) in enumerate(zip(rec.U, rec.V, strict=True)):
        val = w[r] * w[s_] * np.einsum("pa,pa->p", u[r], u[s_]) * np.einsum("pb,pb->p", v[r], v[s_])
        out[li] = np.bincount(e, val, minlength=d.n_train)
    return out


def scores(
    d: Data,
    rec: Records,
    w: np.ndarray | None = None,
    norm: str = "cosine",
    prods: list[np.ndarray] | None = None,
    layer_w: np.ndarray | None = None,
) -> np.ndarray:
    """``(n_eval, n_train)`` scores of weighted rank-1 records: ``dot``, ``cosine`` (one over
    all layers) or ``layer`` (each layer unit-normalised, summed)."""
    w = d.lr if w is None else w
    prods = record_products(rec) if prods is None else prods
    L = len(prods)
    dots = np.zeros((L, prods[0].shape[0], d.n_train))
    for li, p in enumerate(prods):
        np.add.at(dots[li].T, d.example, (p * w).T)
    if layer_w is not None:
        dots = dots * layer_w[:, None, None]
    if norm == "dot":
        return dots.sum(0)
    sq = example_sq_norms(d, rec, w)
    if layer_w is not None:
        sq = sq * layer_w[:, None] ** 2
    if norm == "cosine":
        return dots.sum(0) / np.sqrt(np.maximum(sq.sum(0), 1e-300))[None]
    if norm == "layer":
        qn = np.stack([np.sqrt((q.reshape(len(q), -1) ** 2).sum(1)) for q in rec.Q])  # (L, q)
        return (
            dots / np.maximum(qn, 1e-300)[:, :, None] / np.sqrt(np.maximum(sq, 1e-300))[:, None]
        ).sum(0)
    raise ValueError(norm)


def lds_of(d: Data, sc: np.ndarray) -> float:
    per = lds_scores(sc, d.masks, d.losses)
    return float(np.nanmean(per))


def per_example(d: Data, sc: np.ndarray) -> np.ndarray:
    return lds_scores(sc, d.masks, d.losses)


def main(argv: list[str]) -> None:
    for ev in argv:
        d = load(ev)
        rec = project(d, engine_projections(ev))
        sc = scores(d, rec)
        ref = d.ref.get("cosine")
        print(
            f"{d.name}: replayed default cosine {lds_of(d, sc):.4f}, engine "
            f"{np.nanmean(ref) if ref is not None else float('nan'):.4f}; exact rank-1 cosine "
            f"{lds_of(d, scores(d, project(d, [(None, None)] * len(d.U), int8=False))):.4f} "
            f"(engine x1 {np.nanmean(d.ref.get('x1 cosine', np.nan)):.4f})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])


# -- preconditioners ---------------------------------------------------------------------------
def inv_sqrt(m: np.ndarray, lam: float) -> np.ndarray:
    w, q = np.linalg.eigh((m + m.T) / 2)
    return (q / np.sqrt(np.clip(w, 0, None) + lam)) @ q.T


def record_factors(rec: Records, li: int, w: np.ndarray | None = None) -> tuple:
    """Per-example Kronecker factors of layer ``li`` from the records: ``(S̄, Ā)`` =
    ``mean_r w_r u uᵀ``, ``mean_r w_r v vᵀ`` (the per-example Fisher's factors)."""
    u, v = rec.U[li], rec.V[li]
    w = np.ones(len(u)) if w is None else w
    s = (u * w[:, None]).T @ u / w.sum()
    a = (v * w[:, None]).T @ v / w.sum()
    return s, a


def kron_precondition(
    rec: Records, factors: list[tuple | None], damping: float = 0.1, normalise: bool = True
) -> Records:
    """K-FAC ``(S̄ + λ_S)^{-1/2} · (Ā + λ_A)^{-1/2}`` per layer (``factors[li] = (S̄, Ā)``;
    None: identity), damping a fraction of each factor's mean eigenvalue; with ``normalise``
    each layer keeps its records' mean squared norm (the engine's per-layer trace
    normalisation)."""
    U, V, Q = [], [], []
    for li, f in enumerate(factors):
        u, v, q = rec.U[li], rec.V[li], rec.Q[li]
        if f is None:
            U.append(u), V.append(v), Q.append(q)
            continue
        s, a = f
        L = inv_sqrt(s, damping * np.trace(s) / len(s))
        R = inv_sqrt(a, damping * np.trace(a) / len(a))
        u2, v2 = u @ L, v @ R
        if normalise:
            before = ((u**2).sum(1) * (v**2).sum(1)).mean()
            after = ((u2**2).sum(1) * (v2**2).sum(1)).mean()
            c = np.sqrt(before / max(after, 1e-300))
            u2 = u2 * c
            L = L * c
        U.append(u2)
        V.append(v2)
        Q.append(np.matmul(np.matmul(L[None], q), R))
    return Records(U, V, Q)
