"""Traceprop app: ``streamlit run app/main.py`` (opens on the bundled sample run).

This module is the server: a Streamlit ``st.App`` whose start also starts the query worker
(the runs' models in a process of their own, ``services/model_worker.py``), so that torch and
the active run's model load from the moment the server starts, on another core, not from the
moment a browser first connects. Every browser session runs ``navigation.py`` (the pages).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import streamlit as st

APP_DIR = Path(__file__).resolve().parent
for p in (APP_DIR, APP_DIR.parent):  # `import services` and the engine, from any working directory
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@contextlib.asynccontextmanager
async def _lifespan(_app):
    from services import warmup

    warmup.start_worker()  # returns at once: the worker imports torch in its own process
    yield None
    warmup.shutdown()  # the warm-up stopped and joined, the worker stopped (Ctrl-C included)


if __name__ != "__main__" and hasattr(st, "App"):
    # `streamlit run` found the st.App below and imported this module to serve it (uvicorn)
    app = st.App(APP_DIR / "navigation.py", lifespan=_lifespan)
else:
    # run as the pages' script (AppTest, or a Streamlit without st.App): draw the pages; the
    # first session then starts the worker
    exec(compile((APP_DIR / "navigation.py").read_text(), str(APP_DIR / "navigation.py"), "exec"))
