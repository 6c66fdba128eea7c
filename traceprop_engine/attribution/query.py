"""Queries: the test-side sketch on the final model, preconditioned, searched in the index.

``AttributionRun`` is the Python API the CLI and the app share::

    run = AttributionRun("runs/my-run")
    result = run.query(prompt="Q: What colour is the planet Velmora?\\nA:", completion=" teal", top_k=10)
    result.rows          # polars DataFrame: rank, score, kind, example_id, source, row, sha256, text, ...

Scores: ``τ(test, i) = Σ_layers ⟨Ŝ_test, H⁻¹ Ŝ_i⟩`` with ``Ŝ_i`` the learning-rate-weighted sum
of example ``i``'s records (TracIn along the real trajectory). Positive = proponent: the example
pushed the model toward the test output (up-weighting it lowers the test loss); negative =
opponent.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from .. import constants as C
from ..capture.hooks import Capture, TrackedLayer
from ..errors import (
    ConfigError,
    IndexBuildError,
    IndexStaleError,
    QueryError,
    RunError,
    StoreError,
    TracepropError,
)
from ..run import read_manifest
from ..settings import SketchKind, parse_choice
from ..store.hdf5 import open_run_store
from ..training.examples import Example
from ..training.losses import example_losses
from ..training.models import collate, encode_example, load_saved_model, model_inputs, quiet_hf
from .index import INDEX_META_FILE, IndexKind, VectorIndex, build_index, index_lock, publish_dir
from .precondition import EkfacMoments, LayerStats, Preconditioner, PreconditionerKind
from .scoring import ExactScorer

log = logging.getLogger(__name__)

SIGN_NOTE = (
    "score > 0: proponent (the example pushed the model toward this output; up-weighting it "
    "lowers the test loss); score < 0: opponent (it pushed the model away)"
)
CHUNK = 4096
VECTORS_FILE = "vectors.npy"
IDS_FILE = "ids.npy"
PRECOND_FILE = "preconditioner.npz"
NORMS_FILE = "norms.npy"  # exact ‖H^{-1/2} x_i‖² per row (cosine, self-influence)
INDEX_SIDE = 8
"""m of the m × m index projection of layers with larger sketches (IndexSettings.index_side):
64 numbers per layer, the size of a k = 8 sketch, so a k = 64 store indexes at the same size as
before (1088 dims on the default 17-layer model). Its scores only pick candidates: every
returned score is recomputed exactly from the store (:mod:`traceprop_engine.attribution.scoring`)."""
CANDIDATES = 4
"""FAISS returns ``max(CANDIDATES · top_k, MIN_CANDIDATES)`` rows per side for the exact re-rank."""
MIN_CANDIDATES = 200
BUILD_FILE = "build.json"


@dataclass(frozen=True)
class IndexSettings:
    """How the index of a run is built (part of its fingerprint).

    Default: identity preconditioning with cosine scores (TracIn directions along the
    trajectory, normalised). On both LDS data sets it matched or beat identity, K-FAC and
    EK-FAC at k ≥ 32 (benchmarks/EVAL.md), and unlike raw inner products it does not let a few
    large-gradient examples top every query.
    """

    preconditioner: PreconditionerKind = PreconditionerKind(C.DEFAULT_PRECONDITIONER)
    damping: float | None = None
    cosine: bool = True
    per_record: bool = False
    kind: IndexKind = IndexKind.AUTO
    index_side: int = INDEX_SIDE

    def __post_init__(self) -> None:
        if isinstance(self.index_side, bool) or not isinstance(self.index_side, int):
            raise ConfigError(f"index_side must be an integer >= 0, got {self.index_side!r}")
        if self.index_side < 0:
            raise ConfigError(
                f"index_side must be >= 0 (0: no index projection), got {self.index_side}"
            )
        object.__setattr__(
            self,
            "preconditioner",
            parse_choice(PreconditionerKind, self.preconditioner, "preconditioner"),
        )
        object.__setattr__(self, "kind", parse_choice(IndexKind, self.kind, "index kind"))

    @property
    def name(self) -> str:
        parts = [self.preconditioner.value]
        if self.damping is not None:
            parts.append(f"d{self.damping:g}")
        if self.cosine:
            parts.append("cos")
        if self.per_record:
            parts.append("rec")
        if self.kind is not IndexKind.AUTO:
            parts.append(self.kind.value)
        return "-".join(parts)

    def to_dict(self) -> dict:
        return {
            "preconditioner": self.preconditioner.value,
            "damping": self.damping,
            "cosine": self.cosine,
            "per_record": self.per_record,
            "kind": self.kind.value,
            "index_side": self.index_side,
        }


@dataclass
class QueryResult:
    """A ranked answer with everything needed to show, export or audit it."""

    rows: pl.DataFrame
    query: dict
    notes: list[str] = field(default_factory=list)
    layer_names: list[str] = field(default_factory=list)
    elapsed_ms: float = 0.0
    sign_note: str = SIGN_NOTE
    sketches: list[np.ndarray] | None = field(default=None, repr=False)  # the query's raw sketches

    @property
    def proponents(self) -> pl.DataFrame:
        return self.rows.filter(pl.col("kind") == "proponent")

    @property
    def opponents(self) -> pl.DataFrame:
        return self.rows.filter(pl.col("kind") == "opponent")


class AttributionRun:
    """One run opened for attribution: its store, manifest, saved model and indexes.

    Raises:
        RunError: not a run directory.
        StoreError / SchemaVersionError: the store cannot be used.
    """

    def __init__(self, run_dir: str | os.PathLike, device: str = "cpu") -> None:
        self.dir = Path(run_dir)
        self.manifest = read_manifest(self.dir)
        if not (self.dir / C.STORE_FILE).exists() and not self.manifest.get("shards"):
            raise RunError(
                f"{self.dir} has no {C.STORE_FILE}: it was trained with --no-track, or it failed before tracking began"
            )
        self.store = open_run_store(
            self.dir, self.manifest
        )  # a Store, or a ShardedStore for a DDP run
        self.device = device
        self._loaded = None
        self._capture_layers: list[TrackedLayer] | None = None
        self._indexes: dict[str, tuple[VectorIndex, np.ndarray, Preconditioner]] = {}
        self._scorers: dict[str, ExactScorer] = {}
        self._vector_maps: dict[str, np.ndarray] = {}  # the memory-mapped vectors.npy of each
        self._examples: pl.DataFrame | None = None
        self._notes_extra: list[str] = []

    # -- description --------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id", self.dir.name))

    @property
    def task(self) -> str:
        return self.manifest.get("config", {}).get("task", "causal-lm")

    @property
    def notes(self) -> list[str]:
        out = []
        if self.store.is_partial:
            out.append(self.store.describe_partial())
        return out + self._notes_extra

    def examples(self) -> pl.DataFrame:
        """The example table: example_id, source, row, sha256, split, text, prompt, completion, label."""
        if self._examples is None:
            ex = self.store.examples()
            if not ex:  # a store written without an example table (Tracker used without lineage)
                n = (
                    int(self.store.records()[C.REC_EXAMPLE].max()) + 1
                    if self.store.n_records
                    else 0
                )
                empty = np.array([""] * n, dtype=object)
                ex = {
                    C.EX_SOURCE: empty,
                    C.EX_ROW: np.zeros(n, np.int64),
                    C.EX_SHA256: empty,
                    C.EX_SPLIT: np.array([C.SPLIT_TRAIN] * n, dtype=object),
                    C.EX_TEXT: empty,
                    C.EX_PROMPT: empty,
                    C.EX_COMPLETION: empty,
                    C.EX_LABEL: empty,
                }
                self._notes_extra = [
                    "this store has no example table (no lineage): rows show example ids only"
                ]
            n = len(ex[C.EX_SOURCE])
            text = [
                (p + c) if p or c else t
                for p, c, t in zip(ex[C.EX_PROMPT], ex[C.EX_COMPLETION], ex[C.EX_TEXT], strict=True)
            ]
            self._examples = pl.DataFrame(
                {
                    "example_id": np.arange(n, dtype=np.int64),
                    "source": ex[C.EX_SOURCE],
                    "row": ex[C.EX_ROW],
                    "sha256": ex[C.EX_SHA256],
                    "split": ex[C.EX_SPLIT],
                    "text": text,
                    "prompt": ex[C.EX_PROMPT],
                    "completion": ex[C.EX_COMPLETION],
                    "label": ex[C.EX_LABEL],
                }
            )
        return self._examples

    def eval_examples(self) -> pl.DataFrame:
        return self.examples().filter(pl.col("split") == C.SPLIT_EVAL)

    # -- index --------------------------------------------------------------------------------
    def _index_dir(self, s: IndexSettings) -> Path:
        return self.dir / C.INDEX_DIR / s.name

    def _lock_path(self, s: IndexSettings) -> Path:
        return self.dir / C.INDEX_DIR / f".{s.name}.lock"

    def _fingerprint(self, s: IndexSettings) -> str:
        blob = json.dumps({"store": self.store.fingerprint, **s.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def fit_preconditioner(
        self, s: IndexSettings, progress: Callable[[int, int], None] | None = None
    ) -> Preconditioner:
        """Fit from the stored statistics (EK-FAC streams the sketches once for its eigenvalues)."""
        kind = s.preconditioner
        if (
            kind is not PreconditionerKind.IDENTITY
            and not self.store.has_covariance
            and self.store.sketch != "dense"
        ):
            raise StoreError(
                f"{self.store.path} has no covariance (trained with --no-covariance, or the run stopped "
                "before it was written): use --preconditioner identity"
            )
        n = max(self.store.n_records, 1)
        stats = []
        for li, layer in enumerate(self.store.layers):
            # dense layers have no K-FAC factors: a diagonal (EK-FAC) or isotropic (K-FAC) fit
            cov = self.store.covariance(li) if layer.sketch != "dense" else None
            moments = None
            if kind is PreconditionerKind.EKFAC:
                moments = (
                    EkfacMoments.from_factors(
                        cov["A"] / cov["n_tokens"], cov["S"] / cov["n_tokens"]
                    )
                    if cov
                    else EkfacMoments.dense(layer.dim)
                )
                for start in range(0, self.store.n_records, CHUNK):
                    moments.update(self.store.sketches(li, start, start + CHUNK))
                    if progress:
                        progress(
                            li * self.store.n_records + start,
                            len(self.store.layers) * self.store.n_records,
                        )
            stats.append(
                LayerStats(
                    name=layer.name,
                    shape=layer.record_shape,
                    A=cov["A"] if cov else None,
                    S=cov["S"] if cov else None,
                    n_tokens=int(cov["n_tokens"]) if cov else 0,
                    mean_sq_norm=None if moments is not None else self.store.sq_norm_sum(li) / n,
                    moments=moments,
                )
            )
        return Preconditioner.fit(kind, stats, s.damping, index_side=s.index_side)

    def _vector_ids(self, s: IndexSettings) -> np.ndarray:
        """Row -> example index (per-example vectors: the training examples with records)."""
        rec = self.store.records()
        if s.per_record:
            return rec[C.REC_EXAMPLE]
        return np.unique(rec[C.REC_EXAMPLE])

    def _write_vectors(
        self, s: IndexSettings, pre: Preconditioner, out: Path, progress
    ) -> np.ndarray:
        """Preconditioned vectors of every example (or record) into ``vectors.npy`` (memory-mapped)."""
        rec = self.store.records()
        ids = self._vector_ids(s)
        n_rec = self.store.n_records
        mm = np.lib.format.open_memmap(
            out / VECTORS_FILE, mode="w+", dtype=np.float32, shape=(len(ids), pre.dim)
        )
        _reserve(out / VECTORS_FILE)
        mm[:] = 0
        row_of = {int(e): i for i, e in enumerate(ids)} if not s.per_record else None
        for start in range(0, n_rec, CHUNK):
            stop = min(start + CHUNK, n_rec)
            vec = pre.apply(
                [self.store.sketches(li, start, stop) for li in range(len(self.store.layers))]
            )
            if s.per_record:
                mm[start:stop] = vec
            else:
                rows = np.fromiter(
                    (row_of[int(e)] for e in rec[C.REC_EXAMPLE][start:stop]), np.int64, stop - start
                )
                w = rec[C.REC_LR][start:stop].astype(np.float32)[:, None]
                np.add.at(mm, rows, vec * w)  # lr-weighted sum over an example's records
            if progress:
                progress(stop, n_rec)
        mm.flush()
        return ids

    def build_index(
        self,
        s: IndexSettings | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        *,
        reuse: bool = False,
    ) -> VectorIndex:
        """Fit the preconditioner, write the vectors, build and persist the FAISS index.

        Every file is written into a temporary folder beside ``index/<name>/`` and the folder is
        renamed into place once complete, all under an exclusive lock on ``index/.<name>.lock``:
        concurrent builds of one index run one after the other, and an interrupted or failed
        build leaves the previous index as it was.

        Args:
            reuse: once the lock is held, use a fresh index another process finished meanwhile
                instead of building again.

        Raises:
            IndexBuildError: a write failed (disk full, permissions...); the previous index, if
                any, is untouched.
        """
        s = s or IndexSettings()
        if self.store.n_records == 0:
            raise StoreError(f"{self.store.path} holds no records yet: nothing to index")
        final = self._index_dir(s)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with index_lock(self._lock_path(s), exclusive=True):
                if reuse and self._load_index(s) is not None:
                    return self._indexes[s.name][0]
                return self._build_locked(s, final, progress)
        except TracepropError:
            raise
        except OSError as e:
            raise IndexBuildError(
                f"cannot write the index {s.name} of {self.dir}: {e.strerror or e}"
                f"{f' ({e.filename})' if e.filename else ''}; free disk space (or fix the "
                "folder's permissions) and run `traceprop index RUN` again. The previous index, "
                "if there was one, was left as it was"
            ) from e

    def _build_locked(self, s: IndexSettings, final: Path, progress) -> VectorIndex:
        root = final.parent
        for leftover in (*root.glob(f".{s.name}.tmp-*"), *root.glob(f".{s.name}.old-*")):
            # a build killed before it could clean up (we hold the lock: nobody else is building)
            shutil.rmtree(leftover, ignore_errors=True)
        out = Path(tempfile.mkdtemp(prefix=f".{s.name}.tmp-", dir=root))
        try:
            t0 = time.perf_counter()
            pre = self.fit_preconditioner(
                s, progress and (lambda d, n: progress("preconditioner", d, n))
            )
            pre.save(out / PRECOND_FILE)
            ids = self._write_vectors(
                s, pre, out, progress and (lambda d, n: progress("vectors", d, n))
            )
            np.save(out / IDS_FILE, ids)
            vectors = np.load(out / VECTORS_FILE, mmap_mode="r")
            scorer = ExactScorer(self.store, pre, ids, s.per_record)
            norms = scorer.example_sq_norms()
            scorer.row_sq_norms = norms  # None: too large, read from the index vectors
            files = (PRECOND_FILE, VECTORS_FILE, IDS_FILE, BUILD_FILE)
            if norms is not None:  # exact self-influence and cosine denominators
                np.save(out / NORMS_FILE, norms)
                files += (NORMS_FILE,)

            def chunks():
                for i in range(0, len(ids), 65536):
                    yield np.ascontiguousarray(vectors[i : i + 65536])

            index = build_index(
                chunks,
                pre.dim,
                len(ids),
                kind=s.kind,
                normalize=s.cosine,
                fetch=lambda rows: np.asarray(vectors[np.sort(rows)]),
                progress=progress and (lambda d, n: progress("index", d, n)),
            )
            fp = self._fingerprint(s)
            meta = {
                "settings": s.to_dict(),
                "fingerprint": fp,
                "n_vectors": int(len(ids)),
                "dim": pre.dim,
                "build_s": round(time.perf_counter() - t0, 3),
                "store_fingerprint": self.store.fingerprint,
            }
            (out / BUILD_FILE).write_text(json.dumps(meta, indent=2))
            # index.json last: it records the digests of everything written before it
            index.save(out, fp, files=files)
            publish_dir(out, final)  # the memory map stays valid: same file, new folder name
        finally:
            if out.exists():
                shutil.rmtree(out, ignore_errors=True)
        self._indexes[s.name] = (index, ids, pre)
        self._vector_maps[s.name] = vectors
        self._scorers[s.name] = scorer  # the queries reuse its record map and norms
        return index

    def _load_index(self, s: IndexSettings):
        """The persisted index for ``s`` if it is fresh and complete, else None (logged why)."""
        out = self._index_dir(s)
        if not (out / INDEX_META_FILE).exists():
            return None
        try:
            # checks the fingerprint and the size and digest of every file of the index
            index = VectorIndex.load(out, self._fingerprint(s))
            vectors = np.load(out / VECTORS_FILE, mmap_mode="r")
            ids = np.load(out / IDS_FILE)
            pre = Preconditioner.load(out / PRECOND_FILE)
        except IndexStaleError as e:
            log.warning("%s; rebuilding", e)
            return None
        except (StoreError, OSError, ValueError) as e:
            log.warning("index at %s unusable (%s); rebuilding", out, e)
            return None
        if vectors.shape != (index.n, index.dim) or len(ids) != index.n:
            log.warning(
                "index at %s unusable (vectors %s, %d ids, index of %d x %d); rebuilding",
                out,
                vectors.shape,
                len(ids),
                index.n,
                index.dim,
            )
            return None
        index.fetch = lambda rows: np.asarray(vectors[np.sort(rows)])
        hit = (index, ids, pre)
        self._indexes[s.name] = hit
        self._vector_maps[s.name] = vectors
        return hit

    def index(
        self, s: IndexSettings | None = None, *, rebuild: bool = False, progress=None
    ) -> tuple[VectorIndex, np.ndarray, Preconditioner]:
        """The persisted index for ``s``; built when missing, rebuilt when stale or damaged (never
        used stale, half-written or changed after its build)."""
        s = s or IndexSettings()
        if not rebuild and s.name in self._indexes:
            return self._indexes[s.name]
        if not rebuild:
            with index_lock(self._lock_path(s), exclusive=False):
                hit = self._load_index(s)
            if hit is not None:
                return hit
        self.build_index(s, progress, reuse=not rebuild)
        return self._indexes[s.name]

    def _vectors(self, s: IndexSettings) -> np.ndarray:
        """The memory-mapped vectors of the index ``s`` (the same build as :meth:`index`'s)."""
        if s.name not in self._vector_maps or s.name not in self._indexes:
            self.index(s)
        return self._vector_maps[s.name]

    # -- test-side sketch -----------------------------------------------------------------------
    def _model(self):
        if self._loaded is None:
            model_dir = self.dir / C.MODEL_DIR
            if not model_dir.exists():
                raise RunError(
                    f"{self.dir} has no saved model ({C.MODEL_DIR}/): the run stopped before saving it; queries need it"
                )
            with quiet_hf():
                self._loaded = load_saved_model(model_dir, self.device)
            modules = dict(self._loaded.model.named_modules())
            layers = []
            for li, info in enumerate(self.store.layers):
                m = modules.get(info.name)
                if m is None:
                    raise self._mismatch(f"the saved model has no layer {info.name!r}")
                m.weight.requires_grad_(True)
                P_in, P_out = self.store.projection(li, "in"), self.store.projection(li, "out")
                layer = TrackedLayer(
                    name=info.name,
                    module=m,
                    kind=info.kind,
                    d_in=info.d_in,
                    d_out=info.d_out,
                    k_in=info.k_in,
                    k_out=info.k_out,
                    sketch=SketchKind(info.sketch),
                    P_in=None if P_in is None else torch.from_numpy(P_in),
                    P_out=None if P_out is None else torch.from_numpy(P_out),
                    dense_k=info.dense_k,
                )
                if info.sketch == "dense":
                    idx, sign = self.store.dense_projection(li)
                    layer.dense_index, layer.dense_sign = (
                        torch.from_numpy(idx),
                        torch.from_numpy(sign),
                    )
                w = m.weight
                d_in, d_out = (
                    (w.shape[0], w.shape[1]) if info.kind == "conv1d" else (w.shape[1], w.shape[0])
                )
                if (d_in, d_out) != (info.d_in, info.d_out):
                    raise self._mismatch(
                        f"layer {info.name} is {d_in}->{d_out} in the model, {info.d_in}->{info.d_out} in the store"
                    )
                layers.append(layer)
            self._capture_layers = layers
        return self._loaded

    def _mismatch(self, detail: str):
        from ..errors import ModelMismatchError

        return ModelMismatchError(
            f"the model in {self.dir / C.MODEL_DIR} does not match the store ({detail})"
        )

    def encode(
        self,
        prompt: str | None = None,
        completion: str | None = None,
        *,
        eval_example: int | None = None,
        label: str | None = None,
        input_ids=None,
        labels=None,
        loss_mask=None,
    ):
        """Tokens of a query as training saw them; returns ``(Encoded, query description, notes)``.

        A query is text (``prompt``/``completion``, through the run's tokenizer), an example of
        the run (``eval_example``), or token ids (``input_ids``, with ``labels`` -100 where no
        loss is taken, or a 0/1 ``loss_mask``; neither: the loss on every token after the first).
        """
        loaded = self._model()
        cfg = self.manifest.get("config", {})
        max_length = int(cfg.get("max_length", 128))
        notes: list[str] = []
        if input_ids is not None:
            if prompt is not None or completion is not None or eval_example is not None:
                raise QueryError(
                    "give the query either as input_ids (+ labels or loss_mask), or as "
                    "prompt/completion, or as eval_example, not several"
                )
            return self._encode_ids(loaded, input_ids, labels, loss_mask, label), {}, notes
        if labels is not None or loss_mask is not None:
            raise QueryError("labels/loss_mask go with input_ids: pass input_ids=... as well")
        if loaded.tokenizer is None and eval_example is None:
            raise QueryError(
                "this run has no tokenizer (it was finished without one): query it by token ids, "
                "run.query(input_ids=..., labels=...)"
            )
        if eval_example is not None:
            ex = self.examples()
            if not 0 <= eval_example < ex.height:
                raise QueryError(
                    f"example {eval_example} does not exist (the run has examples 0..{ex.height - 1})"
                )
            r = ex.row(eval_example, named=True)
            ids, mask = self.store.tokens(eval_example)
            from ..training.models import Encoded

            lab = -1
            if self.task == "classification":
                lab = (
                    (loaded.labels or []).index(r["label"])
                    if r["label"] in (loaded.labels or [])
                    else -1
                )
            enc = Encoded(ids.astype(np.int32), mask.astype(np.uint8), lab)
            desc = {
                "eval_example": eval_example,
                "source": r["source"],
                "row": r["row"],
                "prompt": r["prompt"] or r["text"],
                "completion": r["completion"],
                "label": r["label"],
                "split": r["split"],
            }
            return enc, desc, notes
        if self.task == "classification":
            if not (prompt or "").strip():
                raise QueryError("the text to classify is empty: type a text")
            labels = loaded.labels or []
            if label is None or label not in labels:
                raise QueryError(f"a classification query needs a label, one of {labels}")
            ex = Example(source="<query>", row=1, sha256="", text=prompt, label=label)
            enc = encode_example(
                ex,
                loaded.tokenizer,
                "classification",
                max_length,
                {lab: i for i, lab in enumerate(labels)},
            )
            return enc, {"prompt": prompt, "label": label}, notes
        if not (prompt or "").strip() and not (completion or "").strip():
            raise QueryError(
                "the prompt is empty: type a prompt (and the completion whose origin you want explained)"
            )
        if completion:
            ex = Example(
                source="<query>", row=1, sha256="", prompt=prompt or "", completion=completion
            )
        else:
            ex = Example(source="<query>", row=1, sha256="", text=prompt)
        enc = encode_example(ex, loaded.tokenizer, "causal-lm", max_length)
        if enc.truncated:
            notes.append(
                f"the query was longer than the model's training length ({max_length} tokens) and was truncated"
            )
        if enc.loss_mask.sum() == 0:
            raise QueryError(
                "the query has no target token to explain: give a completion (or a longer text)"
            )
        return enc, {"prompt": prompt, "completion": completion}, notes

    def _encode_ids(self, loaded, input_ids, labels, loss_mask, label):
        """An :class:`Encoded` from token ids and ``labels`` (-100: no loss) or a 0/1 loss mask."""
        from ..training.models import Encoded

        ids = _as_1d_ints(input_ids, "input_ids")
        if ids.size == 0:
            raise QueryError("input_ids is empty: give the query's token ids")
        vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
        if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
            raise QueryError(
                f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        if labels is not None and loss_mask is not None:
            raise QueryError("give labels or loss_mask, not both")
        if labels is not None:
            lab = _as_1d_ints(labels, "labels")
            if lab.shape != ids.shape:
                raise QueryError(
                    f"labels has {lab.size} entries, input_ids {ids.size}: give one per token"
                )
            mask = lab != -100
            if np.any(lab[mask] != ids[mask]):
                raise QueryError(
                    "labels must equal input_ids where a loss is taken (-100 elsewhere), as for a "
                    "Hugging Face causal LM (the model shifts them)"
                )
        elif loss_mask is not None:
            mask = _as_1d_ints(loss_mask, "loss_mask")
            if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
                raise QueryError("loss_mask must hold one 0/1 value per token of input_ids")
            mask = mask.astype(bool)
        else:
            mask = np.ones(ids.size, bool)
        lab_id = -1
        if self.task == "classification":
            names = loaded.labels or []
            if label not in names:
                raise QueryError(f"a classification query needs a label, one of {names}")
            lab_id = names.index(label)
            mask = np.ones(ids.size, bool)
        elif not mask[1:].any():
            raise QueryError(
                "the query has no target token (labels all -100, or only the first token): mark "
                "the tokens whose loss you want explained"
            )
        return Encoded(ids.astype(np.int32), mask.astype(np.uint8), lab_id)

    def query_sketches(self, enc) -> tuple[list[np.ndarray], float]:
        """Per-layer ``(1, *record_shape)`` sketches of the query's loss on the final model."""
        loaded = self._model()
        layers = self._capture_layers
        pad = _pad_id(loaded)
        batch = collate([enc], pad, self.task, self.device)
        slots = [
            torch.zeros(1, *(info.record_shape), device=self.device) for info in self.store.layers
        ]
        with (
            torch.enable_grad(),
            Capture(loaded.model, layers, covariance=False) as cap,
            cap.batch(slots, token_mask=batch["attention_mask"], loss_scale=1.0),
        ):
            loss = example_losses(loaded.model(**model_inputs(batch)), batch, self.task)
            loss.sum().backward()
        loaded.model.zero_grad(set_to_none=True)
        return [s.cpu().numpy() for s in slots], float(loss.detach()[0])

    # -- query --------------------------------------------------------------------------------
    def query(
        self,
        prompt: str | None = None,
        completion: str | None = None,
        *,
        eval_example: int | None = None,
        label: str | None = None,
        top_k: int = 10,
        opponents: bool = True,
        settings: IndexSettings | None = None,
        input_ids=None,
        labels=None,
        loss_mask=None,
    ) -> QueryResult:
        """Rank training examples by influence on the query's loss.

        The query is text (``prompt``/``completion``), an example of the run
        (``eval_example``), or token ids: ``input_ids`` (1-D) with ``labels`` (-100 where no
        loss is taken, Hugging Face style) or a 0/1 ``loss_mask``.

        Raises:
            QueryError: empty prompt, unknown example, bad top_k, bad token ids, text on a run
                without a tokenizer.
        """
        if top_k < 1:
            raise QueryError(f"top_k must be at least 1, got {top_k}")
        s = settings or IndexSettings()
        t0 = time.perf_counter()
        enc, desc, notes = self.encode(
            prompt,
            completion,
            eval_example=eval_example,
            label=label,
            input_ids=input_ids,
            labels=labels,
            loss_mask=loss_mask,
        )
        if input_ids is not None:
            desc = {
                "prompt": None,
                "completion": None,
                "input_ids": enc.ids.tolist(),
                "loss_mask": enc.loss_mask.tolist(),
            }
        sk, qloss = self.query_sketches(enc)
        index, ids, pre = self.index(s)
        qv = pre.apply(sk)  # (1, D) index vector: picks candidates
        n_cand = min(max(CANDIDATES * top_k, MIN_CANDIDATES), index.n)
        res = index.search_both(qv, n_cand)
        cand = np.unique(
            np.concatenate([res.proponent_ids[0], res.opponent_ids[0] if opponents else []])
        ).astype(np.int64)
        cand = cand[cand >= 0]
        # exact scores of the candidates (the re-rank), split by layer for the rows
        per_layer = self.exact_scores(sk, s, rows=cand, per_layer=True)[0]  # (L, n_cand)
        rows, sign_notes = signed_hits(cand, per_layer, top_k, opponents)
        notes += sign_notes
        rows = self._rows(rows, ids, pre, s)
        q = {
            **desc,
            "run_id": self.run_id,
            "query_loss": qloss,
            "top_k": top_k,
            **s.to_dict(),
            "n_vectors": int(index.n),
        }
        return QueryResult(
            rows,
            q,
            notes=self.notes + notes,
            layer_names=pre.layer_names,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
            sketches=sk,
        )

    def _rows(self, hits, ids, pre: Preconditioner, s: IndexSettings) -> pl.DataFrame:
        ex = self.examples()
        rec = self.store.records() if s.per_record else None
        out = []
        for kind, rank, v, score, layer_scores in hits:
            e = int(ids[v])
            r = ex.row(e, named=True)
            shares = {name: float(x) for name, x in zip(pre.layer_names, layer_scores, strict=True)}
            row = {
                "rank": rank,
                "kind": kind,
                "score": score,
                "example_id": e,
                "source": r["source"],
                "row": r["row"],
                "sha256": r["sha256"],
                "text": r["text"],
                "label": r["label"],
                "layer_scores": json.dumps(shares),
            }
            if rec is not None:
                row["record"] = v
                row["step"] = int(rec[C.REC_STEP][v])
                row["epoch"] = int(rec[C.REC_EPOCH][v])
            out.append(row)
        if not out:
            return pl.DataFrame(
                schema={
                    "rank": pl.Int64,
                    "kind": pl.Utf8,
                    "score": pl.Float64,
                    "example_id": pl.Int64,
                    "source": pl.Utf8,
                    "row": pl.Int64,
                    "sha256": pl.Utf8,
                    "text": pl.Utf8,
                    "label": pl.Utf8,
                    "layer_scores": pl.Utf8,
                }
            )
        return pl.DataFrame(out)

    def _scorer(self, s: IndexSettings) -> ExactScorer:
        _, ids, pre = self.index(s)
        hit = self._scorers.get(s.name)
        if hit is None or hit.pre is not pre:
            hit = self._scorers[s.name] = ExactScorer(self.store, pre, ids, s.per_record)
        return hit

    def _row_sq_norms(self, s: IndexSettings) -> np.ndarray:
        """Exact ``‖H^{-1/2} x_i‖²`` per index row (index vectors' norms when too large to keep);
        read once per index build and kept with its scorer (every cosine query needs them)."""
        scorer = self._scorer(s)
        if scorer.row_sq_norms is None:
            scorer.row_sq_norms = self._read_row_sq_norms(s)
        return scorer.row_sq_norms

    def _read_row_sq_norms(self, s: IndexSettings) -> np.ndarray:
        path = self._index_dir(s) / NORMS_FILE
        if path.exists():
            return np.load(path)
        vectors = self._vectors(s)
        return np.concatenate(
            [
                np.einsum("ij,ij->i", x := np.asarray(vectors[i : i + 65536]), x)
                for i in range(0, len(vectors), 65536)
            ]
        )

    def exact_scores(
        self,
        sketches: list[np.ndarray],
        s: IndexSettings,
        rows: np.ndarray | None = None,
        per_layer: bool = False,
    ) -> np.ndarray:
        """Exact scores of query sketches against index rows, from the stored records.

        Args:
            sketches: per layer the query's (q, *record_shape) sketches (``query_sketches``).
            s: which index (preconditioner, cosine, per-record).
            rows: index rows to score (default: all), in this order.
            per_layer: split every score by layer.

        Returns:
            (q, n) or (q, L, n) float64; cosine divides by both vectors' exact norms.
        """
        scorer = self._scorer(s)
        pb = scorer.pullbacks(sketches)  # once, for the scores and the query's norm
        out = scorer.scores(sketches, rows=rows, per_layer=per_layer, pullbacks=pb)
        if s.cosine:
            qn = np.sqrt(np.maximum(scorer.query_sq_norm(sketches, pb), 1e-60))  # (q,)
            xn = np.sqrt(np.maximum(self._row_sq_norms(s), 1e-60))
            xn = xn if rows is None else xn[np.asarray(rows, dtype=np.int64)]
            out = out / (qn[:, None, None] if per_layer else qn[:, None]) / xn
        return out

    def all_scores(self, sketches, s: IndexSettings) -> np.ndarray:
        """Exact scores of one query against every index row (example-id order of ``ids``).

        Args:
            sketches: the query's per-layer sketches (``query_sketches``). A (1, D) index
                vector (``pre.apply(sketches)``, the older call) is still accepted and scored
                against ``vectors.npy``: exact only when the index has no index projection.
        """
        if isinstance(sketches, (list, tuple)):
            return self.exact_scores(list(sketches), s)[0]
        qv = sketches
        vectors = self._vectors(s)
        q = qv[0].astype(np.float32)
        if s.cosine:
            q = q / max(np.linalg.norm(q), 1e-30)
        out = np.empty(len(vectors), np.float32)
        for i in range(0, len(vectors), 65536):
            x = np.asarray(vectors[i : i + 65536])
            if s.cosine:
                x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)
            out[i : i + len(x)] = x @ q
        return out

    def scores(
        self,
        prompt: str | list[str] | None = None,
        completion: str | list[str] | None = None,
        *,
        input_ids=None,
        labels=None,
        loss_mask=None,
        eval_example: int | list[int] | None = None,
        label: str | list[str] | None = None,
        settings: IndexSettings | None = None,
    ) -> np.ndarray:
        """Scores of every training example, in example-id order (exact: no index search).

        One query (a string, or 1-D ``input_ids``) gives a ``(n_examples,)`` array; a batch (a
        list of strings, a list of id sequences or a 2-D ``input_ids``, with ``labels`` /
        ``loss_mask`` of the same form) gives ``(n_queries, n_examples)``. Entry ``i`` is the
        same score ``query()`` reports for example ``i``; an example with no record scores 0.

        Raises:
            QueryError: as for :meth:`query`; ``per_record`` settings (scores are per example).
        """
        s = settings or IndexSettings()
        if s.per_record:
            raise QueryError(
                "scores() gives one score per example: use settings with per_record=False"
            )
        queries, batched = _query_batch(
            prompt, completion, input_ids, labels, loss_mask, eval_example, label
        )
        _, ids, _ = self.index(s)
        n = max(self.examples().height, int(ids.max()) + 1 if len(ids) else 0)
        out = np.zeros((len(queries), n), np.float64)
        for qi, kw in enumerate(queries):
            enc, _, _ = self.encode(**kw)
            sk, _ = self.query_sketches(enc)
            out[qi, ids] = self.all_scores(sk, s)
        return out if batched else out[0]

    def influence_by_source(
        self, result: QueryResult, settings: IndexSettings | None = None
    ) -> pl.DataFrame:
        """Total, positive and negative influence of every source file on the query (all examples)."""
        s = settings or IndexSettings()
        sk = result.sketches
        if sk is None:  # a result rebuilt from its description (e.g. an audit trail)
            enc, _, _ = self.encode(
                result.query.get("prompt"),
                result.query.get("completion"),
                eval_example=result.query.get("eval_example"),
                label=result.query.get("label"),
                input_ids=result.query.get("input_ids"),
                loss_mask=result.query.get("loss_mask"),
            )
            sk, _ = self.query_sketches(enc)
        _, ids, _ = self.index(s)
        scores = self.all_scores(sk, s)
        src = self.examples()["source"].to_numpy()[ids]
        df = pl.DataFrame({"source": src, "score": scores})
        return (
            df.group_by("source")
            .agg(
                pl.col("score").sum().alias("total"),
                pl.col("score").clip(lower_bound=0).sum().alias("positive"),
                pl.col("score").clip(upper_bound=0).sum().alias("negative"),
                pl.len().alias("examples"),
            )
            .sort("total", descending=True)
        )

    # -- baselines for audits -------------------------------------------------------------------
    def self_influence(self, settings: IndexSettings | None = None) -> pl.DataFrame:
        """``τ(i, i) = ‖v_i‖²`` of every indexed example, and the raw sketch norm (gradient norm)."""
        s = dataclasses.replace(settings or IndexSettings(), cosine=False)  # ‖v‖² = 1 under cosine
        _, ids, _ = self.index(s)
        si = self._row_sq_norms(s)
        return pl.DataFrame({"example_id": ids.astype(np.int64), "self_influence": si}).join(
            self.gradient_norms(), on="example_id", how="left"
        )

    def gradient_norms(self) -> pl.DataFrame:
        """Mean over an example's records of the raw (unpreconditioned) sketch norm."""
        rec = self.store.records()
        sq = np.zeros(self.store.n_records)
        for li, info in enumerate(self.store.layers):
            for start in range(0, self.store.n_records, CHUNK):
                if info.rank:  # ‖U Vᵀ‖² = Σ (UᵀU ⊙ VᵀV): no k_out × k_in rebuild
                    u, v = self.store.factors(li, start, start + CHUNK)
                    n = np.einsum("nor,nos,nir,nis->n", u, u, v, v, optimize=True)
                else:
                    x = self.store.sketches(li, start, start + CHUNK)
                    x = x.reshape(len(x), -1)
                    n = np.einsum("ij,ij->i", x, x)
                sq[start : start + len(n)] += n
        df = pl.DataFrame({"example_id": rec[C.REC_EXAMPLE], "gn": np.sqrt(sq)})
        return df.group_by("example_id").agg(pl.col("gn").mean().alias("gradient_norm"))

    @torch.no_grad()
    def representations(self, encs) -> np.ndarray:
        """Mean-pooled final hidden state of each encoded example (representation-similarity baseline)."""
        loaded = self._model()
        pad = _pad_id(loaded)
        out = []
        for i in range(0, len(encs), 16):
            batch = collate(encs[i : i + 16], pad, self.task, self.device)
            h = loaded.model(**model_inputs(batch), output_hidden_states=True).hidden_states[-1]
            m = batch["attention_mask"].unsqueeze(-1).float()
            out.append(((h * m).sum(1) / m.sum(1)).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def close(self) -> None:
        self.store.close()


def signed_hits(
    cand: np.ndarray, per_layer: np.ndarray, top_k: int, opponents: bool
) -> tuple[list[tuple], list[str]]:
    """``(kind, rank, vector row, score, per-layer scores)`` of the re-ranked candidates, by sign.

    ``cand`` are the index rows FAISS proposed (both ends of the ranking) and ``per_layer`` their
    exact (L, n) scores. A proponent has score > 0 and an opponent score < 0, so an example is
    in at most one list and a zero score in none; a note says when a list is shorter than
    ``top_k``.
    """
    exact = per_layer.sum(0)
    kinds = [("proponent", np.argsort(-exact, kind="stable"), 1.0, "positive")]
    if opponents:
        kinds.append(("opponent", np.argsort(exact, kind="stable"), -1.0, "negative"))
    hits, notes = [], []
    for kind, order, sign, word in kinds:
        keep = [int(j) for j in order if sign * exact[j] > 0][:top_k]
        hits += [
            (kind, rank, int(cand[j]), float(exact[j]), per_layer[:, j])
            for rank, j in enumerate(keep, start=1)
        ]
        if len(keep) < top_k:
            notes.append(
                f"{len(keep)} {kind}{'s' if len(keep) != 1 else ''} of the {top_k} asked: no "
                f"other indexed training example has a {word} score"
            )
    return hits, notes


def _reserve(path: Path) -> None:
    """Allocate a freshly created file's blocks now: on a full disk the write then fails here with
    ENOSPC (an OSError) instead of killing the process with SIGBUS (a Bus error) when a page
    of its memory map is first written."""
    if not hasattr(os, "posix_fallocate"):
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # unsupported: write as before
            raise
    finally:
        os.close(fd)


def _pad_id(loaded) -> int:
    """The pad id: the tokenizer's, else the model config's, else 0 (right padding is masked)."""
    tok = loaded.tokenizer
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    pad = getattr(getattr(loaded.model, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _as_1d_ints(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise QueryError(
            f"{what} must be a 1-D sequence of integers, got {a.dtype} of shape {a.shape}"
        )
    return a.astype(np.int64)


def _is_batch(x) -> bool:
    if x is None or isinstance(x, str):
        return False
    if isinstance(x, torch.Tensor | np.ndarray):
        return x.ndim == 2
    return isinstance(x, list | tuple) and len(x) > 0 and not np.isscalar(x[0])


def _query_batch(prompt, completion, input_ids, labels, loss_mask, eval_example, label):
    """The keyword sets of :meth:`AttributionRun.encode` for each query, and whether it was a batch."""
    if input_ids is not None:
        batched = _is_batch(input_ids)
        if not batched:
            return [
                dict(input_ids=input_ids, labels=labels, loss_mask=loss_mask, label=label)
            ], False
        n = len(input_ids)
        for name, v in (("labels", labels), ("loss_mask", loss_mask)):
            if v is not None and len(v) != n:
                raise QueryError(f"{name} holds {len(v)} rows for {n} queries in input_ids")
        lab = label if isinstance(label, list | tuple) else [label] * n
        return [
            dict(
                input_ids=input_ids[i],
                labels=None if labels is None else labels[i],
                loss_mask=None if loss_mask is None else loss_mask[i],
                label=lab[i],
            )
            for i in range(n)
        ], True
    if isinstance(eval_example, list | tuple):
        return [dict(eval_example=int(e), label=label) for e in eval_example], True
    if isinstance(prompt, list | tuple):
        n = len(prompt)
        comp = completion if isinstance(completion, list | tuple) else [completion] * n
        lab = label if isinstance(label, list | tuple) else [label] * n
        if len(comp) != n or len(lab) != n:
            raise QueryError(f"completion/label must give one entry per prompt ({n})")
        return [
            dict(prompt=p, completion=c, label=la)
            for p, c, la in zip(prompt, comp, lab, strict=True)
        ], True
    return [
        dict(prompt=prompt, completion=completion, eval_example=eval_example, label=label)
    ], False


def open_run(run_dir: str | os.PathLike, device: str = "cpu") -> AttributionRun:
    """Open a run for attribution (see :class:`AttributionRun`)."""
    return AttributionRun(run_dir, device)
