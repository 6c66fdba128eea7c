"""Warm the query path in the background, starting beside the first page.

The first page needs no torch (the engine is imported lazily); the first query does: importing
torch and transformers and loading the run's model take about 5 s of one core on this project's
CPUs (``import torch`` 1.6 s, the engine 1.5 s, the tokenizer 0.6 s, the model's transformers
modules 2 s), and the query page then draws a model answer and a plotly chart for the first
time. :func:`start` (called by ``app/main.py`` before the first page's script) does all of
that in a daemon thread: the same server-side calls as the sample question (query with every
example's score, the model's greedy answer, the by-source chart), so a user's first click finds
them done or under way (it then waits on the same imports and the run's lock instead of
starting from scratch).

It runs without pauses, and stops before its own query once a page has started one
(:func:`page_query_started`: that query would hold the run's lock the user's waits on).
Waiting between steps while another page ran (the former design) only delayed the first query:
the pages shared the interpreter lock with the step under way anyway, and the Runs page was no
faster (benchmarks/app_speed.py, idle 2-core box: first query 3.72 → 2.86 s and 3.37 → 3.08 s
in two interleaved A/Bs, first page and Runs page within their noise).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

_started: set[str] = set()
_guard = threading.Lock()
_page_query = threading.Event()  # a page started a query: the warm-up's own query would delay it
FIRST_PAGE_GRACE_S = float(os.environ.get("TRACEPROP_WARMUP_GRACE_S", "0"))
"""Seconds the warm-up waits before its first step (default none: started beside the first
page, it did not slow that page, whose time is mostly the browser's; benchmarks/README.md)."""
log = logging.getLogger(__name__)


def warm(run_dir: str | os.PathLike) -> None:
    """What the sample question does on the server, once, for ``run_dir``'s first eval example:
    open the cached run, load its model and tokenizer, query it with every example's score
    (builds or loads the index), the model's answer, and the by-source chart's figure."""
    from traceprop_engine.errors import TracepropError

    from . import answers, charts
    from .queries import cached_tokenizer, open_cached, run_query_and_scores

    try:
        time.sleep(FIRST_PAGE_GRACE_S)
        run, lock = open_cached(run_dir)  # imports torch and the engine
        with lock:
            run.model()
        cached_tokenizer(str(Path(run_dir).resolve()))
        if _page_query.is_set():  # the user's query does the rest, and no longer waits on ours
            return
        with lock:
            ex = run.examples()
        evals = ex.filter(ex["split"] == "eval")["example_id"].to_list()
        if evals:
            _, by_source, _ = run_query_and_scores(run_dir, eval_example=int(evals[0]))
            answers.model_answer(run_dir, eval_example=int(evals[0]))
            charts.by_source_figure(by_source)
        import pandas  # noqa: F401 - the first table's conversion (st.dataframe), 0.4 s
        import pyarrow  # noqa: F401

        from traceprop_engine.attribution import export, tokens  # noqa: F401 - the query page's
    except (TracepropError, OSError, ValueError) as e:  # the page shows the error on use
        log.info("warm-up of %s skipped: %s", run_dir, e)


def page_query_started() -> None:
    """Called by the Influencers page before its query: the warm-up skips what is left of its
    own query steps (they hold the run's lock the page's query waits on)."""
    _page_query.set()


def start(run_dir: str | os.PathLike | None) -> bool:
    """Start warming ``run_dir`` once per process (no-op for None or an already warmed run).
    Returns whether a thread was started. TRACEPROP_NO_WARMUP=1 turns it off (benchmarks)."""
    if run_dir is None or os.environ.get("TRACEPROP_NO_WARMUP") == "1":
        return False
    key = str(Path(run_dir).resolve())
    with _guard:
        if key in _started:
            return False
        _started.add(key)
    threading.Thread(target=warm, args=(key,), name="traceprop-warmup", daemon=True).start()
    return True
