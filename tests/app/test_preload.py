"""The app's preload of the frontend's chart and table code (services/preload.py)."""

from __future__ import annotations

import json

from services import preload


def test_chunk_files_are_the_installed_frontends(tmp_path):
    names = preload.chunk_files()
    assert [n.split(".")[1].lstrip("/") for n in names[:2]] == ["DataFrame", "PlotlyChart"]
    assert all((preload.STATIC_JS / n[2:]).is_file() for n in names)
    assert len(names) == len(preload.CHUNKS)  # every chunk found in this Streamlit


def test_chunk_files_skip_missing_and_ambiguous(tmp_path):
    (tmp_path / "PlotlyChart.abc.js").write_text("")
    (tmp_path / "DataFrame.a.js").write_text("")
    (tmp_path / "DataFrame.b.js").write_text("")  # two versions: which one the frontend uses?
    assert preload.chunk_files(tmp_path) == ["./PlotlyChart.abc.js"]
    html = preload.script(tmp_path)
    assert json.dumps(["./PlotlyChart.abc.js"]) in html and html.startswith("<script>")
