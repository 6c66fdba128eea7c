"""Load the browser's code for charts and tables while the user reads the first page.

Streamlit's frontend loads each element's code when the first such element is drawn: the Runs
page's loss curve waited on 4.7 MB of plotly code (fetched, compiled and run: 1.6 s of the
page's 3.9 s on 2 shared cores), its table on 1.3 MB of dataframe code. :func:`script` returns a
script for ``st.html`` that imports those chunks right after a page is drawn, in the page's own
window, so the frontend's later import of the same URL finds them loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import streamlit

# the elements the app's pages draw, in the order a new user meets them (Runs, then a query)
CHUNKS = ("DataFrame", "PlotlyChart", "Selectbox", "Metric", "Table", "Slider", "TextArea", "Radio")
STATIC_JS = Path(streamlit.__file__).parent / "static" / "static" / "js"

_SCRIPT = """<script>
(function () {
  const w = window.parent || window;
  if (w.__tracepropPreload) return;
  w.__tracepropPreload = true;
  const doc = w.document;
  const main = doc.querySelector('script[type="module"][src*="static/js/index."]');
  if (!main) return;
  const files = %s;
  // one import after another, each a module script in the page's own window (same module map
  // as the frontend's lazy imports); a failed one is left to the frontend's own import
  const code = "for (const f of " + JSON.stringify(files) + ") {" +
    " try { await import(new URL(f, " + JSON.stringify(main.src) + ").href); } catch (e) {} }";
  w.setTimeout(function () {
    const s = doc.createElement("script");
    s.type = "module";
    s.textContent = code;
    doc.head.appendChild(s);
  }, 0);
})();
</script>"""


def chunk_files(static_js: Path = STATIC_JS) -> list[str]:
    """The frontend's file names of :data:`CHUNKS` (``"./PlotlyChart.D9Z0_fxz.js"``...): hashed
    names of the installed Streamlit, found on disk; a chunk not found is left out."""
    out = []
    for name in CHUNKS:
        found = sorted(static_js.glob(f"{name}.*.js"))
        if len(found) == 1:
            out.append("./" + found[0].name)
    return out


def script(static_js: Path = STATIC_JS) -> str:
    """The HTML for ``st.html(..., unsafe_allow_javascript=True)`` (a no-op after its first run
    in a browser tab)."""
    return _SCRIPT % json.dumps(chunk_files(static_js))
