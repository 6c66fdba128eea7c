"""The thin service layer between the Streamlit pages and the engine.

Pages hold layout and widgets only; every value they show comes from a function here, and every
function here is plain Python (testable without Streamlit) except the ``cached_*`` / ``open_cached``
wrappers in :mod:`services.queries`, which add ``st.cache_resource`` / ``st.cache_data``. Pages call
engine functions only through this package, never engine internals (``run.store``...).

One module per concern, each importable on its own (``from services import jobs``):

- :mod:`services.config`: where the app reads and writes, path safety, uploads, sample data
- :mod:`services.runs`: run listings and summaries, the active run, bench and LDS results
- :mod:`services.run_story`: the Runs page's story of one run (loss curve, configuration, bytes
  per example, measured quality, the Launch form prefilled)
- :mod:`services.launch`: the Launch form's spec and the measured tracking configurations
- :mod:`services.jobs`: training jobs: start, state from disk, cancel, wait
- :mod:`services.page_rerun`: whether a rerun waits (a timer's page rerun never undoes a click)
- :mod:`services.landing`: the landing page's sample question and how to read a score
- :mod:`services.queries`: cached runs, queries, overviews and tokens under each run's lock
- :mod:`services.answers`: the model's own loss and greedy answer for a query
- :mod:`services.find`: filter, sort and page a query's influencers, name an export
- :mod:`services.distributions`: a query's scores over every example, query-independent rankings
- :mod:`services.charts`: plotly figures of those distributions
- :mod:`services.compare`: one query answered by two (run, preconditioner) sides
- :mod:`services.counterfactual`: the counterfactual check (a background job) and per-token view
- :mod:`services.curate`: the Curate page's selection, its background job and its proof
- :mod:`services.model_worker`: the query worker holding the runs' models (the server
  process imports no torch while it runs)
- :mod:`services.warmup`: the first query's work, started beside the first page
- :mod:`services.preload`: the browser's chart and table code, loaded while the first page is read
- :mod:`services.exports`: influencer and audit-trail downloads, verification of a run
- :mod:`services.text`: markdown escaping and one-line texts

The names below are the package's public API (the tests and ``navigation.py`` use ``services.X``).
"""

from __future__ import annotations

from traceprop_engine.errors import TracepropError

from . import config, exports, jobs, launch, queries, runs, text
from .config import (
    BENCH_DIR,
    DATA_EXTENSIONS,
    MAX_UPLOAD_BYTES,
    UPLOADS_DIR,
    AppConfig,
    PathError,
    is_sample,
    safe_path,
    sample_dataset,
    sanitize_name,
    save_uploads,
)
from .exports import audit_bytes, export_bytes, shown_rows, verify_inputs
from .jobs import (
    LAUNCH_FILE,
    JobError,
    JobState,
    active_job,
    cancel_job,
    job_state,
    log_tail,
    process_alive,
    start_job,
    wait_job,
)
from .launch import LaunchSpec, assess_configuration, measured_configurations
from .queries import (
    cached_examples,
    cached_step_times,
    decode_tokens,
    example_tokens_text,
    layer_scores_table,
    manifest_mtime,
    open_cached,
    query_overview,
    run_query,
)
from .runs import (
    all_runs,
    delete_run,
    ensure_active_run,
    read_bench,
    read_lds,
    run_summary,
    runs_table,
    step_times,
)
from .text import md_escape, one_line

__all__ = [
    "BENCH_DIR",
    "DATA_EXTENSIONS",
    "LAUNCH_FILE",
    "MAX_UPLOAD_BYTES",
    "UPLOADS_DIR",
    "AppConfig",
    "JobError",
    "JobState",
    "LaunchSpec",
    "PathError",
    "TracepropError",
    "active_job",
    "all_runs",
    "assess_configuration",
    "audit_bytes",
    "cached_examples",
    "cached_step_times",
    "cancel_job",
    "config",
    "decode_tokens",
    "delete_run",
    "ensure_active_run",
    "example_tokens_text",
    "export_bytes",
    "exports",
    "is_sample",
    "job_state",
    "jobs",
    "launch",
    "layer_scores_table",
    "log_tail",
    "manifest_mtime",
    "md_escape",
    "measured_configurations",
    "one_line",
    "open_cached",
    "process_alive",
    "queries",
    "query_overview",
    "read_bench",
    "read_lds",
    "run_query",
    "run_summary",
    "runs",
    "runs_table",
    "safe_path",
    "sample_dataset",
    "sanitize_name",
    "save_uploads",
    "shown_rows",
    "start_job",
    "step_times",
    "text",
    "verify_inputs",
    "wait_job",
]
