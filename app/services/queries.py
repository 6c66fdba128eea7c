"""The Influencers page's data: cached engine handles and queries, each serialised per run.

An opened run is one HDF5 handle shared by every session of the app (``st.cache_resource``);
h5py handles are not safe to read from two threads, so every read of an opened run here holds
that run's lock: queries, the example table, overviews and token reads alike.

Opening a run imports no torch. A query's model half (:func:`test_side`, token text) goes to the
query worker (``model_worker``) when there is one, and runs here otherwise
(:func:`in_process`, which imports torch then).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import polars as pl
import streamlit as st

from traceprop_engine import attribution
from traceprop_engine import constants as C
from traceprop_engine.index_settings import (  # noqa: F401 - the pages' copies
    ADAPTER_CLASS_PRIOR,
    DEFAULT_CLASS_PRIOR,
    DEFAULT_LM_BIAS,
)

from . import model_worker
from .runs import step_times


def manifest_mtime(run_dir: str | os.PathLike) -> float:
    p = Path(run_dir) / C.MANIFEST_FILE
    return p.stat().st_mtime if p.exists() else 0.0


def app_threads() -> int:
    """Intra-op threads for the app's torch work (TRACEPROP_APP_THREADS, default 1).

    A query runs one example through the model: on a CPU, more threads only add hand-offs, and
    on a shared or small machine their spin-waiting made a query many times slower (measured
    on 2 cores under load: model answer 600 ms with 2 threads, 11 ms with 1). Training jobs
    run in their own processes and are not affected.
    """
    try:
        return max(1, int(os.environ.get("TRACEPROP_APP_THREADS", "1")))
    except ValueError:
        return 1


@st.cache_resource(max_entries=8, show_spinner="Opening the run…")
def _open_run(run_dir: str, mtime: float):
    from traceprop_engine.attribution import open_run

    return open_run(run_dir), threading.Lock()  # no torch: the model is loaded on first use


def open_cached(run_dir: str | os.PathLike):
    """``(AttributionRun, lock)`` cached per run path + manifest mtime; the lock serialises queries."""
    out = _open_run(str(Path(run_dir).resolve()), manifest_mtime(run_dir))
    torch = sys.modules.get("torch")  # imported by the open; keep the app's thread count
    if torch is not None and torch.get_num_threads() != (n := app_threads()):
        torch.set_num_threads(n)
    return out


def query_overview(run_dir: str | os.PathLike) -> attribution.RunOverview:
    """Run id, task, records, tracked layers, notes and the usable preconditioners of a run.

    Raises:
        TracepropError: the run cannot be opened for queries.
    """
    run, lock = open_cached(run_dir)
    with lock:
        return attribution.describe(run)


@st.cache_resource(max_entries=8, show_spinner=False)
def cached_tokenizer(run_dir: str):
    try:
        from transformers import AutoTokenizer

        info = Path(run_dir) / C.MODEL_DIR / "traceprop_model.json"
        if info.exists() and json.loads(info.read_text()).get("tokenizer") is False:
            return None  # a run finished without a tokenizer: show token ids
        return AutoTokenizer.from_pretrained(str(Path(run_dir) / C.MODEL_DIR))
    except (OSError, ValueError):
        return None


@st.cache_data(max_entries=16, show_spinner=False)
def cached_examples(run_dir: str, mtime: float, split: str | None = None) -> pl.DataFrame:
    run, lock = open_cached(run_dir)
    with lock:
        ex = run.examples()
    return ex if split is None else ex.filter(pl.col("split") == split)


@st.cache_data(max_entries=16, show_spinner=False)
def cached_step_times(run_dir: str, mtime: float) -> pl.DataFrame:
    return step_times(Path(run_dir))


def in_process(run_dir: str | os.PathLike):
    """``(AttributionRun, lock)`` for model work in this process (no query worker): torch is
    imported here, with the app's thread count."""
    import torch  # noqa: F401 - open_cached then sets the app's thread count

    return open_cached(run_dir)


def test_side(run_dir: str | os.PathLike, **query):
    """The query's sketches and loss on the run's model (``TestSide``): from the query worker,
    or computed here when there is none.

    Raises:
        TracepropError: the query is malformed, or the run cannot be queried.
    """
    try:
        return model_worker.call("test_side", run_dir, **query)
    except model_worker.WorkerUnavailable:
        run, lock = in_process(run_dir)
        with lock:
            return run.test_side(**query)


def token_pieces(run_dir: str | os.PathLike, ids) -> list[str] | None:
    """Each token id as text, by the run's tokenizer (None when the run has none)."""
    ids = [int(t) for t in ids]
    try:
        return model_worker.call("decode", run_dir, ids=ids)
    except model_worker.WorkerUnavailable:
        tok = cached_tokenizer(str(Path(run_dir).resolve()))
        return None if tok is None else [tok.decode([t]) for t in ids]


def run_query(run_dir: str | os.PathLike, **query):
    """``(QueryResult, influence by source)`` of one query on a cached run (serialised per run);
    ``query``: the keywords of :func:`run_query_and_scores`."""
    res, by_source, _, _ = run_query_and_scores(run_dir, **query)
    return res, by_source


def run_query_and_scores(
    run_dir: str | os.PathLike,
    *,
    prompt=None,
    completion=None,
    eval_example=None,
    label=None,
    top_k: int = 10,
    preconditioner: str = C.DEFAULT_PRECONDITIONER,
    class_prior: float | None = None,
    lm_bias: float | None = None,
):
    """``(QueryResult, influence by source, every example's score, TestSide)`` of one query: the
    by-source totals and the score histogram come from one pass over the store, made here once;
    the ``TestSide`` (the query's model half) ranks the same query under another estimator.
    ``class_prior``: a classification run's class prior, ``lm_bias``: a free-text run's LM-bias
    term (each None: the run's default; 0: off)."""
    from traceprop_engine.attribution import source_influence
    from traceprop_engine.settings import IndexSettings

    ts = test_side(
        run_dir, prompt=prompt, completion=completion, eval_example=eval_example, label=label
    )
    run, lock = open_cached(run_dir)
    s = IndexSettings(preconditioner=preconditioner, class_prior=class_prior, lm_bias=lm_bias)
    with lock:
        res = run.query(top_k=top_k, settings=s, test_side=ts)
        table = run.example_scores(res, s)
    by_source = source_influence(table["score"].to_numpy(), table["source"].to_numpy())
    return res, by_source, table, ts


def layer_scores_table(layer_scores: str) -> pl.DataFrame:
    d = json.loads(layer_scores or "{}")
    return pl.DataFrame({"layer": list(d), "score": [float(v) for v in d.values()]})


def decode_tokens(run_dir: Path, ids, loss_mask) -> str:
    """Tokens as text, the trained-on (loss) tokens in ⟦brackets⟧; ids when no tokenizer loads."""
    ids = ids.tolist()
    pieces = token_pieces(run_dir, ids)
    out = []
    for i, (t, m) in enumerate(zip(ids, loss_mask.tolist(), strict=True)):
        piece = pieces[i] if pieces is not None else str(t)
        out.append(f"⟦{piece}⟧" if m else piece)
    return ("" if pieces is not None else "ids: ") + (
        "".join(out) if pieces is not None else " ".join(out)
    )


def example_tokens_text(run_dir: str | os.PathLike, example_id: int) -> str:
    """The tokens training example ``example_id`` was trained on, as :func:`decode_tokens` shows
    them (read from the store under the run's lock; kept per run, manifest mtime and example:
    every rerun of the Influencers page shows the same examples' tokens again)."""
    return _example_tokens_text(str(Path(run_dir).resolve()), manifest_mtime(run_dir), example_id)


@st.cache_data(max_entries=4096, show_spinner=False)
def _example_tokens_text(run_dir: str, mtime: float, example_id: int) -> str:
    run, lock = open_cached(run_dir)
    with lock:
        ids, mask = attribution.example_tokens(run, example_id)
    return decode_tokens(Path(run_dir), ids, mask)
