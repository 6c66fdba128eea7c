"""The persisted indexes of one run: build, load, staleness, and what each query reuses.

An index lives in ``<run>/index/<settings name>/``: the fitted preconditioner, the vectors
(:mod:`traceprop_engine.attribution.precondition.vectors`), their example ids, the exact row norms,
a memory-mapped copy of the records for the re-rank
(:mod:`~traceprop_engine.attribution.score.record_cache`), on large runs the factor lists of the
layers holding most of the energy (:mod:`~traceprop_engine.attribution.index.lists`), the FAISS
index and ``index.json``, which records the digest of every file. Its fingerprint (the store's
fingerprint + the settings) makes an index built from other records stale; a stale, half-written or
damaged index is rebuilt, never used (:mod:`traceprop_engine.attribution.index.files`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ... import constants as C
from ...errors import IndexBuildError, IndexStaleError, RunError, StoreError, TracepropError
from ...permissions import make_temp_dir
from ...run import is_bundled
from ...settings import IndexSettings
from ...store.column_view import column_view
from ..precondition.preconditioner import Preconditioner
from ..precondition.vectors import fit_preconditioner, write_vectors
from ..score import record_cache
from ..score.record_cache import RecordCache, write_record_cache
from ..score.rerank import as_bounds
from ..score.scoring import ExactScorer
from .build import RECALL_MARGIN, build_index
from .files import index_lock, publish_dir
from .lists import (
    LISTS_RECALL_MARGIN,
    FactorLists,
    build_lists,
    list_layers,
    open_lists,
    wants_lists,
)
from .vector_index import INDEX_META_FILE, VectorIndex

log = logging.getLogger(__name__)

VECTORS_FILE = "vectors.npy"
IDS_FILE = "ids.npy"
PRECOND_FILE = "preconditioner.npz"
NORMS_FILE = "norms.npy"  # exact ‖H^{-1/2} x_i‖² per row (cosine, self-influence)
LAYER_NORMS_FILE = "layer_norms.npy"  # the same per row and layer, float32 rounded up (rerank)
BUILD_FILE = "build.json"
BUILD_FORMAT = 3
"""What a build writes, recorded in ``build.json`` (absent: 1). 2: the rows' per-layer norms
(the layer-by-layer re-rank, :mod:`~traceprop_engine.attribution.score.rerank`) and the index
projection split by energy. 3: the factor lists of large runs
(:mod:`~traceprop_engine.attribution.index.lists`). An older index still answers exactly (its vectors
only pick candidates) and is reused; its queries get :data:`OLD_BUILD_NOTE` (format 2: only where
this release would build lists)."""
OLD_BUILD_NOTE = (
    "this index was built by an earlier version of Traceprop: every score is still exact, but "
    "rebuilding it (`traceprop index RUN --rebuild` with the same settings) makes queries "
    "faster and lets the candidate search find more of the true top examples"
)
_READ_ROWS = 65536  # vectors read from the memory map at a time

# progress(stage, done, total): "statistics" (the final model's, where the settings use them),
# "preconditioner", "vectors", "records", "lists", "index"
Progress = Callable[[str, int, int], None]


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def user_index_root(run_dir: Path) -> Path:
    """Where the indexes of a run that cannot be written go: ``$TRACEPROP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/traceprop`` (``~/.cache/traceprop``), then ``indexes/<hash of the run's
    absolute path>``. An index there is checked against the store like one in ``RUN/index``."""
    base = os.environ.get("TRACEPROP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "traceprop"
    )
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return Path(base) / "indexes" / key


class RunIndexes:
    """The indexes of one run's store, one per :class:`IndexSettings`, kept once loaded.

    Every lookup is by ``settings.name``; an entry holds the index, its row -> example ids, the
    preconditioner, the memory-mapped vectors and the exact scorer the queries reuse.
    """

    def __init__(self, run_dir: Path, store) -> None:
        self.run_dir = run_dir
        self.store = store
        self._indexes: dict[str, tuple[VectorIndex, np.ndarray, Preconditioner]] = {}
        self._scorers: dict[str, ExactScorer] = {}
        self._vector_maps: dict[str, np.ndarray] = {}  # the memory-mapped vectors.npy of each
        self._build_formats: dict[str, int] = {}  # build.json's build_format of each
        self._where: dict[str, Path] = {}  # index root of each name not under RUN/index
        self._views: dict = {}  # columns -> the store read through them
        # IndexSettings.statistics final / both: (settings, index root, progress) -> the
        # statistics to fit with (None: the store's); set by AttributionRun, which has the model
        self.statistics: Callable[..., list | None] | None = None

    def store_for(self, s: IndexSettings):
        """The store as the index ``s`` reads it (its first ``s.columns`` factor columns)."""
        c = s.columns or 0
        if c not in self._views:
            self._views[c] = column_view(self.store, c)
        return self._views[c]

    def dir(self, s: IndexSettings) -> Path:
        """The folder of the index ``s`` (it may not exist yet): ``RUN/index/<name>``, or the
        user's cache (:func:`user_index_root`) for a run whose folder cannot be written."""
        return self._where.get(s.name, self.run_dir / C.INDEX_DIR) / s.name

    def _lock_path(self, s: IndexSettings) -> Path:
        return self.dir(s).parent / f".{s.name}.lock"

    def _refuse_links(self, s: IndexSettings) -> None:
        """The index folders are the run's own: a symbolic link among them (``index/``, its
        ``<name>/`` or lock file) would make a build write outside the run, as ``train`` refuses."""
        for p in (self.run_dir / C.INDEX_DIR, self.dir(s), self._lock_path(s)):
            if p.is_symlink():
                raise RunError(
                    f"{p} is a symbolic link (to {p.readlink()}): Traceprop never writes through "
                    "a link, so it builds no index there; replace the link with a folder of the "
                    "run (or remove it) and run `traceprop index RUN` again"
                )

    def _fingerprint(self, s: IndexSettings) -> str:
        blob = json.dumps({"store": self.store_for(s).fingerprint, **s.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def get(
        self, s: IndexSettings, *, rebuild: bool = False, progress: Progress | None = None
    ) -> tuple[VectorIndex, np.ndarray, Preconditioner]:
        """The persisted index for ``s``; built when missing, rebuilt when stale or damaged (never
        used stale, half-written or changed after its build)."""
        if not rebuild and s.name in self._indexes:
            return self._indexes[s.name]
        self._refuse_links(s)
        if not rebuild:
            cache = user_index_root(self.run_dir)
            roots = [self.run_dir / C.INDEX_DIR] + ([cache] if cache.is_dir() else [])
            for root in roots:  # the run's own index first, then one built in the cache
                self._where[s.name] = root
                with index_lock(self._lock_path(s), exclusive=False):
                    hit = self._load(s)
                if hit is not None:
                    return hit
            self._where.pop(s.name, None)
        if not rebuild and is_bundled(self.run_dir):  # a query never writes into a bundled run
            self._build_in_cache(s, progress, "it is a bundled sample run", reuse=True)
        else:
            self.build(s, progress, reuse=not rebuild)
        return self._indexes[s.name]

    def _build_in_cache(
        self, s: IndexSettings, progress: Progress | None, why: str, *, reuse: bool
    ) -> VectorIndex:
        """:meth:`build_here` in :func:`user_index_root`, with a warning saying why and where."""
        cache = user_index_root(self.run_dir)
        log.warning(
            "not writing the index %s into %s (%s): building it in %s instead",
            s.name,
            self.run_dir / C.INDEX_DIR,
            why,
            cache,
        )
        self._where[s.name] = cache
        return self.build_here(s, progress, reuse=reuse)

    def build(
        self, s: IndexSettings, progress: Progress | None = None, *, reuse: bool = False
    ) -> VectorIndex:
        """:meth:`build_here` in ``RUN/index``; where the run's folder cannot be written (a
        read-only or shared run), in the user's cache instead (:func:`user_index_root`),
        with a warning that says where."""
        self._where.pop(s.name, None)
        try:
            return self.build_here(s, progress, reuse=reuse)
        except IndexBuildError as e:
            cause = e.__cause__
            if not (isinstance(cause, OSError) and cause.errno in _NOT_WRITABLE):
                raise
            why = f"cannot write there: {cause.strerror or cause}"
            return self._build_in_cache(s, progress, why, reuse=reuse)

    def build_here(
        self, s: IndexSettings, progress: Progress | None = None, *, reuse: bool = False
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
        if self.store.n_records == 0:
            raise StoreError(f"{self.store.path} holds no records yet: nothing to index")
        self._refuse_links(s)
        final = self.dir(s)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with index_lock(self._lock_path(s), exclusive=True):
                if reuse and self._load(s) is not None:
                    return self._indexes[s.name][0]
                return self._build_locked(s, final, progress)
        except TracepropError:
            raise
        except OSError as e:
            raise IndexBuildError(
                f"cannot write the index {s.name} of {self.run_dir}: {e.strerror or e}"
                f"{f' ({e.filename})' if e.filename else ''}; free disk space (or fix the "
                "folder's permissions) and run `traceprop index RUN` again. The previous index, "
                "if there was one, was left as it was"
            ) from e

    def _fit(self, s: IndexSettings, root: Path, progress) -> Preconditioner:
        """The preconditioner of ``s``, from the statistics it names (:attr:`statistics`)."""
        covariances = None
        if self.statistics is not None:
            covariances = self.statistics(
                s, root, progress and (lambda d, n: progress("statistics", d, n))
            )
        return fit_preconditioner(
            self.store_for(s),
            s,
            progress and (lambda d, n: progress("preconditioner", d, n)),
            covariances,
        )

    def _build_locked(self, s: IndexSettings, final: Path, progress) -> VectorIndex:
        root = final.parent
        for leftover in (*root.glob(f".{s.name}.tmp-*"), *root.glob(f".{s.name}.old-*")):
            # a build killed before it could clean up (we hold the lock: nobody else is building)
            shutil.rmtree(leftover, ignore_errors=True)
        out = make_temp_dir(root, f".{s.name}.tmp-")  # the umask's mode, not 0700
        store = self.store_for(s)
        try:
            t0 = time.perf_counter()
            pre = self._fit(s, root, progress)
            pre.save(out / PRECOND_FILE)
            ids = write_vectors(
                store,
                s,
                pre,
                out / VECTORS_FILE,
                progress and (lambda d, n: progress("vectors", d, n)),
            )
            np.save(out / IDS_FILE, ids)
            vectors = np.load(out / VECTORS_FILE, mmap_mode="r")
            # the records again, memory-mapped: the re-rank reads scattered candidates from it
            cache_names: list[str] = []
            scorer = ExactScorer(store, pre, ids, s.per_record, s.records)
            if record_cache.wanted(store):
                cache_names = write_record_cache(
                    store, out, progress and (lambda d, n: progress("records", d, n))
                )
                scorer.cache = RecordCache(out, store)
            layer_norms = scorer.example_sq_norms()  # (n, L); None: too large
            files = (PRECOND_FILE, VECTORS_FILE, IDS_FILE, BUILD_FILE, *cache_names)
            if layer_norms is not None:  # exact self-influence and cosine denominators
                scorer.row_sq_norms = layer_norms.sum(1)
                np.save(out / NORMS_FILE, scorer.row_sq_norms)
                scorer.layer_sq_norms = as_bounds(layer_norms)
                np.save(out / LAYER_NORMS_FILE, scorer.layer_sq_norms)
                files += (NORMS_FILE, LAYER_NORMS_FILE)
                files += self._build_lists(s, scorer, layer_norms, out, progress)

            def chunks():
                for i in range(0, len(ids), _READ_ROWS):
                    yield np.ascontiguousarray(vectors[i : i + _READ_ROWS])

            index = build_index(
                chunks,
                pre.dim,
                len(ids),
                kind=s.kind,
                normalize=s.cosine,
                # the lists propose the dominant layers' top rows beside FAISS's (lists.py)
                recall_margin=LISTS_RECALL_MARGIN if scorer.lists else RECALL_MARGIN,
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
                "build_format": BUILD_FORMAT,
                "store_fingerprint": store.fingerprint,
            }
            (out / BUILD_FILE).write_text(json.dumps(meta, indent=2))
            # index.json last: it records the digests of everything written before it
            index.save(out, fp, files=files)
            publish_dir(out, final)  # the memory maps stay valid: same files, new folder name
        finally:
            if out.exists():
                shutil.rmtree(out, ignore_errors=True)
        self._indexes[s.name] = (index, ids, pre)
        self._vector_maps[s.name] = vectors
        self._scorers[s.name] = scorer  # the queries reuse its record map and norms
        self._build_formats[s.name] = BUILD_FORMAT
        return index

    def _build_lists(self, s: IndexSettings, scorer, layer_norms, out: Path, progress) -> tuple:
        """The factor lists of a build (:mod:`~traceprop_engine.attribution.index.lists`), when
        ``s`` and the run want them: written into ``out`` and given to ``scorer``; returns their
        file names."""
        layers = list_layers(layer_norms, [i.rank == 1 for i in self.store_for(s).layers])
        if not layers or not wants_lists(s.lists, scorer.n_rows):
            return ()
        xn = np.sqrt(np.maximum(scorer.row_sq_norms, 1e-60))
        files: tuple = ()
        for li in layers:
            files += tuple(
                build_lists(
                    scorer,
                    li,
                    xn if s.cosine else np.ones_like(xn),
                    out,
                    progress and (lambda d, n: progress("lists", d, n)),
                )
            )
        scorer.lists = [FactorLists(out, li) for li in layers]
        return files

    def _load(self, s: IndexSettings):
        """The persisted index for ``s`` if it is fresh and complete, else None (logged why)."""
        out = self.dir(s)
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
        self._build_formats.pop(s.name, None)  # read again from this build's build.json
        self._vector_maps[s.name] = vectors
        return hit

    def vectors(self, s: IndexSettings) -> np.ndarray:
        """The memory-mapped vectors of the index ``s`` (the same build as :meth:`get`'s)."""
        if s.name not in self._vector_maps or s.name not in self._indexes:
            self.get(s)
        return self._vector_maps[s.name]

    def scorer(self, s: IndexSettings) -> ExactScorer:
        """The exact scorer of the index ``s`` (kept per build: its record map and norms)."""
        _, ids, pre = self.get(s)
        hit = self._scorers.get(s.name)
        if hit is None or hit.pre is not pre:
            store = self.store_for(s)
            hit = self._scorers[s.name] = ExactScorer(store, pre, ids, s.per_record, s.records)
            try:  # an index built before the record cache existed reads the store instead
                hit.cache = RecordCache.open(self.dir(s), store)
            except (OSError, ValueError) as e:
                log.warning("record cache of %s unusable (%s); reading the store", s.name, e)
            try:  # none: FAISS alone proposes the candidates
                hit.lists = open_lists(self.dir(s), hit.n_rows)
            except (OSError, ValueError, KeyError) as e:
                log.warning("factor lists of %s unusable (%s); not used", s.name, e)
        return hit

    def row_sq_norms(self, s: IndexSettings) -> np.ndarray:
        """Exact ``‖H^{-1/2} x_i‖²`` per index row (index vectors' norms when too large to keep);
        read once per index build and kept with its scorer (every cosine query needs them)."""
        scorer = self.scorer(s)
        if scorer.row_sq_norms is None:
            scorer.row_sq_norms = self._read_row_sq_norms(s)
        return scorer.row_sq_norms

    def row_norms(self, s: IndexSettings, rows: np.ndarray | None = None) -> np.ndarray:
        """``‖H^{-1/2} x_i‖`` of ``rows`` (all when None), floored: the cosine denominators."""
        sq = self.row_sq_norms(s)
        sq = sq if rows is None else sq[np.asarray(rows, dtype=np.int64)]  # rows first
        return np.sqrt(np.maximum(sq, 1e-60))

    def row_layer_sq_norms(self, s: IndexSettings) -> np.ndarray | None:
        """Exact ``‖H_l^{-1/2} x_{i,l}‖²`` per index row and layer, float32 rounded up
        (memory-mapped), or None for an index built without them (too large to compute exactly,
        or built before they were kept): the bounds of
        :mod:`~traceprop_engine.attribution.score.rerank`."""
        scorer = self.scorer(s)
        if scorer.layer_sq_norms is None:
            path = self.dir(s) / LAYER_NORMS_FILE
            scorer.layer_sq_norms = np.load(path, mmap_mode="r") if path.exists() else False
        return None if scorer.layer_sq_norms is False else scorer.layer_sq_norms

    def notes(self, s: IndexSettings) -> list[str]:
        """What a query on the index ``s`` should tell its reader about the index itself."""
        if s.name not in self._build_formats:
            try:
                meta = json.loads((self.dir(s) / BUILD_FILE).read_text())
            except (OSError, ValueError):
                meta = {}
            self._build_formats[s.name] = int(meta.get("build_format", 1))
        fmt = self._build_formats[s.name]
        n = self._indexes[s.name][0].n if s.name in self._indexes else 0
        old = fmt < BUILD_FORMAT and (fmt < 2 or wants_lists(s.lists, n))
        return [OLD_BUILD_NOTE] if old else []

    def _read_row_sq_norms(self, s: IndexSettings) -> np.ndarray:
        path = self.dir(s) / NORMS_FILE
        if path.exists():
            return np.load(path)
        v = self.vectors(s)
        parts = (np.asarray(v[i : i + _READ_ROWS]) for i in range(0, len(v), _READ_ROWS))
        return np.concatenate([np.einsum("ij,ij->i", x, x) for x in parts])
