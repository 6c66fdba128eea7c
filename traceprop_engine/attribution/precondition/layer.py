"""One layer's preconditioner and what fits it: :class:`LayerPreconditioner` (``apply`` /
``pullback`` of one layer's ``H^{-1/2}``, saved as plain arrays), :class:`LayerStats` (a layer's
K-FAC sums and record moments, as the store gives them), :class:`EkfacMoments`, and the checks of a
kind and a damping. The kinds and formulas:
:mod:`~traceprop_engine.attribution.precondition.preconditioner`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np

from traceprop_engine.errors import ConfigError, StoreError
from traceprop_engine.settings import DEFAULT_DAMPING, PreconditionerKind, parse_choice

from ..score.two_hands import both, hands

__all__ = [
    "DEFAULT_DAMPING",
    "EkfacMoments",
    "LayerPreconditioner",
    "LayerStats",
    "check_damping",
    "fit_reads",
    "fit_sample",
    "parse_kind",
    "symmetrize",
]


FIT_COLUMNS = 131_072
"""Record columns (records × rank) the statistics fitted from a layer's records are estimated
from, at most: the EK-FAC eigenvalues and K-FAC's trace calibration (``vectors.fit_preconditioner``)
and the index projection's moments (``index/projection.py``). Above it, evenly spaced blocks:
131 072 rank-1 records (a 10⁶ store's fit reads 13 % of them), 8192 rank-16 ones (a free-text
run's), whose full pass took 72 % of a 10⁴ build and grew with the store (benchmarks/README.md
§2c)."""
FIT_BLOCKS = 64
"""The fewest blocks a sample is spread over: records are in training order, and a store may
repeat a pattern along it (few long blocks read 1–4 % off the full pass's calibration on a
resampled 10⁴ store; 64 short ones keep to its noise)."""


def fit_sample(n: int, rank: int, chunk: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` blocks of at most ``chunk`` records: every one of ``n`` records
    when their columns fit :data:`FIT_COLUMNS`, else evenly spaced blocks holding about that many
    (at least :data:`FIT_BLOCKS` of them). Deterministic: a rebuild fits the same records."""
    budget = max(FIT_COLUMNS // max(int(rank), 1), 1)
    if n <= budget:
        return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    block = max(1, min(chunk, budget // FIT_BLOCKS))
    starts = np.linspace(0, n - block, max(budget // block, 1)).astype(np.int64)
    return [(int(a), int(a) + block) for a in starts]


def fit_reads(read, n: int, rank: int, chunk: int):
    """``read(a, b)``'s arrays over :func:`fit_sample`'s blocks, joined up to ``chunk`` records a
    yield (short blocks are read alone and computed on together)."""
    parts, size = [], 0
    for a, b in fit_sample(n, rank, chunk):
        parts.append(read(a, b))
        size += b - a
        if size >= chunk:
            yield _joined(parts)
            parts, size = [], 0
    if parts:
        yield _joined(parts)


def _joined(parts: list[tuple]) -> tuple:
    return (
        parts[0] if len(parts) == 1 else tuple(np.concatenate(x) for x in zip(*parts, strict=True))
    )


def parse_kind(kind: PreconditionerKind | str) -> PreconditionerKind:
    """The fitted kind (``auto`` is K-FAC here: :attr:`PreconditionerKind.fitted`)."""
    return parse_choice(PreconditionerKind, kind, "preconditioner").fitted


def check_damping(damping: float | None) -> float:
    d = DEFAULT_DAMPING if damping is None else float(damping)
    if not np.isfinite(d) or d < 0:
        raise ConfigError(
            f"damping must be a finite number >= 0 (a fraction of the mean eigenvalue), got "
            f"{damping!r}; the default is {DEFAULT_DAMPING}"
        )
    return d


class EkfacMoments:
    """Streamed second moments of sketches in the K-FAC eigenbasis (the EK-FAC correction).

    Construct it from the layer's covariance (:meth:`from_factors`) or with ``q_s = q_a = None``
    for a dense sketch layer (coordinate basis), then feed the stored sketches chunk by chunk
    with :meth:`update`. :attr:`mean` is ``Λ = mean_i (Q_Sᵀ Ŝ_i Q_A)²`` (or ``mean_i x_i²``).
    Because the rotation is orthogonal, ``Λ.sum()`` is also ``mean_i ‖Ŝ_i‖²_F``
    (:attr:`mean_sq_norm`), which K-FAC's trace calibration needs.
    """

    def __init__(self, q_s: np.ndarray | None, q_a: np.ndarray | None, shape: tuple[int, ...]):
        self.q_s = None if q_s is None else np.asarray(q_s, dtype=np.float64)
        self.q_a = None if q_a is None else np.asarray(q_a, dtype=np.float64)
        self.shape = tuple(int(s) for s in shape)
        self.sum_sq = np.zeros(self.shape, dtype=np.float64)
        self.count = 0

    @classmethod
    def from_factors(cls, a: np.ndarray, s: np.ndarray) -> EkfacMoments:
        """Eigenbases of the K-FAC factors (scaling by ``n_tokens`` does not change them)."""
        _, q_a = np.linalg.eigh(symmetrize(a))
        _, q_s = np.linalg.eigh(symmetrize(s))
        return cls(q_s, q_a, (q_s.shape[0], q_a.shape[0]))

    @classmethod
    def dense(cls, k: int) -> EkfacMoments:
        """Per-coordinate second moments of a dense (n, k) sketch layer."""
        return cls(None, None, (int(k),))

    def update(self, sketch_chunk: np.ndarray) -> None:
        """Add a chunk of records: (n, k_out, k_in) for factored, (n, k) for dense layers."""
        x = np.asarray(sketch_chunk, dtype=np.float64)
        if x.shape[1:] != self.shape:
            raise StoreError(
                f"sketch chunk has per-record shape {x.shape[1:]}, expected {self.shape}; "
                "the chunk comes from another layer or the store is inconsistent"
            )
        if self.q_s is not None:
            x = stack_matmul(self.q_s.T, x, self.q_a)  # Q_Sᵀ X Q_A
        self.sum_sq += (x * x).sum(axis=0)
        self.count += x.shape[0]

    def update_factors(self, u: np.ndarray, v: np.ndarray) -> None:
        """Add a chunk of rank-r records ``X = U Vᵀ`` (u (n, k_out, r), v (n, k_in, r)). For
        rank 1, ``(Q_Sᵀ u vᵀ Q_A)² = (Q_Sᵀ u)² (Q_Aᵀ v)²ᵀ`` elementwise, so the chunk's sum of
        squares is one (k_out, n) · (n, k_in) product and no sketch is rebuilt."""
        if (u.shape[1], v.shape[1]) != self.shape:
            raise StoreError(
                f"factor chunk has per-record shape {(u.shape[1], v.shape[1])}, expected "
                f"{self.shape}; the chunk comes from another layer or the store is inconsistent"
            )
        if self.q_s is None:
            self.update(record_product(u, v))
            return
        if u.shape[2] != 1:  # rank r: rotate the factors, then (Q_Sᵀ U)(Q_Aᵀ V)ᵀ a block at a time
            q_s_t, q_a_t = self.q_s.T, self.q_a.T

            def part(a: int, b: int) -> np.ndarray:
                qu = np.matmul(q_s_t, np.asarray(u[a:b], np.float64))
                return _rebuilt_sq(qu, np.matmul(q_a_t, np.asarray(v[a:b], np.float64)))

            self.sum_sq += sum(on_parts(part, len(u)))
            self.count += u.shape[0]
            return
        qu = np.asarray(u[:, :, 0], np.float64) @ self.q_s  # rows: (Q_Sᵀ u)ᵀ
        qv = np.asarray(v[:, :, 0], np.float64) @ self.q_a
        self.sum_sq += (qu * qu).T @ (qv * qv)
        self.count += qu.shape[0]

    @property
    def mean(self) -> np.ndarray:
        if self.count == 0:
            raise StoreError(
                "no sketches were accumulated for the EK-FAC correction; the layer has no "
                "records — check the store or use the identity preconditioner"
            )
        return self.sum_sq / self.count

    @property
    def mean_sq_norm(self) -> float:
        return float(self.mean.sum())


_SQ_BLOCK = 128
"""Records rebuilt at a time by :meth:`EkfacMoments.update_factors` at rank > 1 (16 MB of
float64 at k 126: the block stays in the cache while it is squared)."""


_PART_MIN = 256
"""Records below which :func:`on_parts` makes one call."""


def on_parts(fn, n: int, rank: int = 0) -> list:
    """``[fn(a, b), ...]`` over contiguous parts ``a:b`` of ``n`` records, side by side on the
    query threads (``score/two_hands.both``; callers write into one output's slices or sum the
    parts). numpy runs a stack's small products one after another on one BLAS thread: two
    parts on two cores took 0.54× the time (benchmarks/README.md §2c). ``fn`` must treat the
    records independently. Rank-1 records (``rank`` 1) stay one part: their products are 2-D
    GEMMs (:func:`left_multiply`) on BLAS's own threads, which parts only oversubscribe."""
    parts = 1 if rank == 1 else min(hands(), max(1, n // _PART_MIN))
    cut = np.linspace(0, n, parts + 1).astype(np.int64)
    return both(
        *[lambda a=a, b=b: fn(int(a), int(b)) for a, b in zip(cut[:-1], cut[1:], strict=True)]
    )


def left_multiply(m: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``m @ x[i]`` for every factor of a stack (n, k, r), into ``out`` where given: at rank 1
    one 2-D GEMM of the columns as rows (on the stack it would be n GEMVs), above it
    ``np.matmul`` on the stack (one small GEMM a record, split by :func:`on_parts`)."""
    if x.shape[2] != 1:
        return np.matmul(m, x, out=out)
    y = (x[:, :, 0] @ m.T)[:, :, None]
    if out is None:
        return y
    out[...] = y
    return out


def factor_grams(x: np.ndarray) -> np.ndarray:
    """``XᵀX`` of every factor of a stack (n, k, r) -> (n, r, r). ``np.matmul`` on the stack:
    ``np.einsum("nkr,nks->nrs")`` took 10× longer at r 16 (benchmarks/README.md §2c)."""
    if x.shape[2] == 1:  # rank 1: the squared norms
        return np.einsum("nk,nk->n", x[:, :, 0], x[:, :, 0])[:, None, None]
    out = np.empty((len(x), x.shape[2], x.shape[2]), x.dtype)
    on_parts(lambda a, b: np.matmul(x[a:b].transpose(0, 2, 1), x[a:b], out=out[a:b]), len(x))
    return out


def _rebuilt_sq(qu: np.ndarray, qv: np.ndarray) -> np.ndarray:
    """``(k_out, k_in)``: ``Σ (qu qvᵀ)²`` over a stack of factors, :data:`_SQ_BLOCK` records
    rebuilt at a time."""
    out = np.zeros((qu.shape[1], qv.shape[1]))
    for a in range(0, len(qu), _SQ_BLOCK):
        x = np.matmul(qu[a : a + _SQ_BLOCK], qv[a : a + _SQ_BLOCK].transpose(0, 2, 1))
        out += np.einsum("nij,nij->ij", x, x)
    return out


def stack_matmul(
    left: np.ndarray | None, x: np.ndarray, right: np.ndarray | None = None
) -> np.ndarray:
    """``left @ x[i] @ right`` for every matrix of a stack ``x`` (n, a, b), as two plain 2-D
    GEMMs: numpy's stacked ``matmul`` loops over the stack and ran 10× slower than one GEMM for
    (256, 126, 126) float32 here, which made an EK-FAC index of the sample take minutes.
    ``left`` / ``right`` None: that side is left as it is."""
    n, a, b = x.shape
    if right is not None:
        x = (x.reshape(n * a, b) @ right.astype(x.dtype, copy=False)).reshape(n, a, right.shape[1])
    if left is not None:
        # (a', a) · (a, n·b) → (a', n, b) → (n, a', b)
        b = x.shape[2]
        flat = np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(a, n * b)
        x = (
            (left.astype(x.dtype, copy=False) @ flat)
            .reshape(left.shape[0], n, b)
            .transpose(1, 0, 2)
        )
    return x


def record_product(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``U Vᵀ`` of each rank-r record (u (n, k_out, r), v (n, k_in, r)) as (n, k_out, k_in);
    rank 1 as a broadcast outer product (numpy's stacked matmul is slow on (k, 1) × (1, k))."""
    if u.shape[2] == 1:
        return u * v[:, None, :, 0]
    return np.matmul(u, v.transpose(0, 2, 1))


def symmetrize(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return (m + m.T) / 2


@dataclass(frozen=True, eq=False)
class LayerPreconditioner:
    """The ``H^{-1/2}`` side of one layer: ``v = ((left @ Ŝ @ right) * scale).ravel()``.

    - identity: all three ``None``.
    - K-FAC: ``left = (cS̄+λ_S I)^{-1/2}``, ``right = (Ā+λ_A I)^{-1/2}``.
    - EK-FAC: ``left = Q_Sᵀ``, ``right = Q_A``, ``scale = 1/sqrt(Λ+λ)``.
    - dense: ``scale`` a (k,) vector (or None for identity).

    Index projection (large sketches): with ``index_left`` ``(m, k_out)`` and ``index_right``
    ``(m, k_in)`` (Gaussian, variance ``1/m``), :meth:`apply` returns the ``m × m`` matrix
    ``index_left · (preconditioned Ŝ) · index_rightᵀ`` instead: a second Kronecker JL
    projection, so inner products of index vectors are unbiased estimates of the exact scores
    and FAISS holds ``m²`` numbers per layer however large k is. :meth:`pullback` ignores it:
    exact scores come from the stored records (:mod:`traceprop_engine.attribution.score.scoring`).

    Attributes:
        name: layer name (as in the store).
        kind: the preconditioner kind this was fitted as.
        shape: per-record sketch shape, ``(k_out, k_in)`` or ``(k,)``.
    """

    name: str
    kind: PreconditionerKind
    shape: tuple[int, ...]
    left: np.ndarray | None = None
    right: np.ndarray | None = None
    scale: np.ndarray | None = None
    info: dict = field(default_factory=dict)  # fitted constants (c, λ) for reports
    index_left: np.ndarray | None = None  # (m, k_out) second projection of the index vectors
    index_right: np.ndarray | None = None  # (m, k_in)

    @property
    def dim(self) -> int:
        """Length of this layer's index vector (``m²`` with an index projection)."""
        if self.index_left is not None:
            return int(self.index_left.shape[0] * self.index_right.shape[0])
        return int(np.prod(self.shape))

    def with_index_projection(self, m: int, seed: int) -> LayerPreconditioner:
        """This preconditioner with an ``m × m`` index projection (only when it shrinks the vector)."""
        if len(self.shape) != 2 or m * m >= self.shape[0] * self.shape[1]:
            return self
        gen = np.random.default_rng(seed)
        left = gen.standard_normal((m, self.shape[0])) / np.sqrt(m)
        right = gen.standard_normal((m, self.shape[1])) / np.sqrt(m)
        return dataclasses.replace(self, index_left=left, index_right=right)

    def apply(self, sketches: np.ndarray, dtype: type = np.float32) -> np.ndarray:
        """Precondition and flatten.

        Args:
            sketches: (n, k_out, k_in) or (n, k) records of this layer.
            dtype: output dtype; the arithmetic runs in it too (float64 for exact checks).

        Returns:
            (n, dim) vectors.
        """
        x = np.asarray(sketches, dtype=dtype)
        if x.shape[1:] != self.shape:
            raise StoreError(
                f"layer {self.name!r}: sketches have per-record shape {x.shape[1:]}, the "
                f"preconditioner was fitted for {self.shape}; refit it from this store"
            )
        if self.left is not None:
            x = stack_matmul(self.left.astype(dtype), x, self.right.astype(dtype))
        if self.scale is not None:
            x = x * self.scale.astype(dtype)
        if self.index_left is not None:  # (n, m, m) second Kronecker projection
            x = stack_matmul(self.index_left.astype(dtype), x, self.index_right.T.astype(dtype))
        return np.ascontiguousarray(x.reshape(x.shape[0], -1))

    def apply_factors(self, a: np.ndarray, b: np.ndarray, dtype: type = np.float32) -> np.ndarray:
        """:meth:`apply` of the one sketch ``A Bᵀ`` given by its factors (``a`` (k_out, t),
        ``b`` (k_in, t)), as a (1, dim) vector: ``left A Bᵀ right = (left A)(rightᵀ B)ᵀ`` and the
        index projection likewise, so no ``k × k × k`` product is made. Only for a matrix-product
        preconditioner (identity, K-FAC: ``scale`` None) of a ``(k_out, k_in)`` layer."""
        if self.scale is not None or len(self.shape) != 2:
            raise ValueError(f"layer {self.name!r}: apply_factors needs a matrix-product fit")
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if (a.shape[0], b.shape[0]) != self.shape or a.shape[1] != b.shape[1]:
            raise StoreError(
                f"layer {self.name!r}: query factors of shapes {a.shape} and {b.shape}, the "
                f"preconditioner was fitted for {self.shape}"
            )
        if self.left is not None:
            a, b = self.left @ a, self.right.T @ b
        if self.index_left is not None:
            a, b = self.index_left @ a, self.index_right @ b
        return (a @ b.T).astype(dtype).reshape(1, -1)

    def pullback(self, test_sketches: np.ndarray) -> np.ndarray:
        """The test sketch pushed to the training side: ``T'`` with ``⟨apply(T), apply(X)⟩ = ⟨T', X⟩``.

        ``T' = leftᵀ ((left T right) ⊙ scale²) rightᵀ`` — for K-FAC (symmetric factors)
        ``L² T R²``, i.e. ``H⁻¹ T``. Scoring unpreconditioned (e.g. low-rank factored) training
        sketches against ``T'`` needs no per-record preconditioning
        (:mod:`traceprop_engine.attribution.score.factor_scores`).

        Args:
            test_sketches: (q, *shape) test-side sketches of this layer.

        Returns:
            (q, *shape) float64.
        """
        t = np.asarray(test_sketches, dtype=np.float64)
        if t.shape[1:] != self.shape:
            raise StoreError(
                f"layer {self.name!r}: test sketches have per-record shape {t.shape[1:]}, the "
                f"preconditioner was fitted for {self.shape}"
            )
        if self.left is not None:
            t = stack_matmul(self.left, t, self.right)
        if self.scale is not None:
            t = t * self.scale.astype(np.float64) ** 2
        if self.left is not None:
            t = stack_matmul(self.left.T, t, self.right.T)
        return t

    def to_arrays(self) -> dict[str, np.ndarray]:
        """npz-friendly dict (no objects): matrices plus a JSON string of the metadata."""
        meta = {
            "name": self.name,
            "kind": self.kind.value,
            "shape": list(self.shape),
            "info": self.info,
        }
        out = {"meta": np.array(json.dumps(meta))}
        for key in ("left", "right", "scale", "index_left", "index_right"):
            val = getattr(self, key)
            if val is not None:
                out[key] = np.asarray(val, dtype=np.float64)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> LayerPreconditioner:
        meta = json.loads(str(arrays["meta"]))
        return cls(
            name=meta["name"],
            kind=PreconditionerKind(meta["kind"]),
            shape=tuple(meta["shape"]),
            left=arrays.get("left"),
            right=arrays.get("right"),
            scale=arrays.get("scale"),
            info=meta.get("info", {}),
            index_left=arrays.get("index_left"),
            index_right=arrays.get("index_right"),
        )


@dataclass(frozen=True)
class LayerStats:
    """What the store provides per layer to fit a preconditioner.

    Attributes:
        name: layer name.
        shape: per-record sketch shape, (k_out, k_in) or (k,).
        A, S: K-FAC token sums, None for dense layers.
        n_tokens: token count of A and S (0 for dense layers).
        mean_sq_norm: ``mean_i ‖Ŝ_i‖²`` over records (None if ``moments`` is given).
        moments: streamed :class:`EkfacMoments` (needed for EK-FAC).
        output_head: the layer producing the logits (an LM head over the vocabulary, or a
            classifier's head): fitted as identity by every kind (:meth:`Preconditioner.fit`).
    """

    name: str
    shape: tuple[int, ...]
    A: np.ndarray | None = None
    S: np.ndarray | None = None
    n_tokens: int = 0
    mean_sq_norm: float | None = None
    moments: EkfacMoments | None = None
    output_head: bool = False
