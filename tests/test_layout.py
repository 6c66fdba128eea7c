"""The layout rules of docs/architecture.md, checked on every run: modules stay small enough to
read, functions short unless a comment says why, and the app's pages reach the engine only
through ``app/services`` (errors excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("traceprop_engine/**/*.py"), *REPO.glob("app/**/*.py")])
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # statements after the docstring
LONG_REASON = "# long:"  # on the line above a longer function: why it stays whole


def _long_functions(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if ast.get_docstring(node) is not None:
            body = body[1:]
        if not body:
            continue
        n = node.end_lineno - body[0].lineno + 1
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        if n > MAX_FUNCTION_LINES and not above.startswith(LONG_REASON):
            out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_the_rules_see_the_sources():
    assert len(SOURCES) > 60
    assert any(p.name == "hooks.py" for p in SOURCES)


def test_no_module_over_the_limit():
    big = {
        str(p.relative_to(REPO)): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert big == {}, f"split these modules (limit {MAX_MODULE_LINES} lines): {big}"


def test_no_long_function_without_a_reason():
    long = [f for p in SOURCES for f in _long_functions(p)]
    assert long == [], (
        f"functions over {MAX_FUNCTION_LINES} lines need a split or a '{LONG_REASON} …' comment "
        f"on the line above: {long}"
    )


def test_app_pages_reach_the_engine_through_services():
    for page in sorted((REPO / "app" / "views").glob("*.py")):
        for node in ast.walk(ast.parse(page.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "traceprop_engine"
            ):
                assert node.module == "traceprop_engine.errors", (
                    f"{page.relative_to(REPO)} imports {node.module}: go through app/services"
                )
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("traceprop_engine") for a in node.names), page
