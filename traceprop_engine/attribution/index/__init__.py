"""The FAISS index of a run: candidates for the exact re-rank, built atomically under a lock and
rebuilt when stale.

``vector_index.py`` (:class:`VectorIndex`: one FAISS index and its metadata), ``build.py``
(streaming vectors into an index, ``nprobe`` tuning), ``files.py`` (locks, atomic publication,
file digests), ``projection.py`` (the index-side projection and reduction of wide layers),
``lists.py`` (large runs: more candidates from the dominant layers' own records, in lists by
output factor), ``run_indexes.py`` (:class:`RunIndexes`: a run's indexes by settings, fitting,
building, loading and checking them).
"""
