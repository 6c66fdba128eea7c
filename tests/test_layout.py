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


# -- run.json has one owner (run_record.RunRecord) ------------------------------------------------
MANIFEST_OWNER = REPO / "traceprop_engine" / "run_record.py"
DICT_MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "append", "extend", "insert"}


def _mentions_manifest(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and "manifest" in n.id.lower())
        or (isinstance(n, ast.Attribute) and "manifest" in n.attr.lower())
        for n in ast.walk(node)
    )


def _manifest_mutations(text: str, name: str) -> list[str]:
    """``manifest[...] = / += / del``, and ``manifest....setdefault/update/pop/append(...)``,
    on anything whose expression names a manifest."""
    out = []
    for node in ast.walk(ast.parse(text)):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and _mentions_manifest(t.value):
                out.append(f"{name}:{node.lineno}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in DICT_MUTATORS
            and _mentions_manifest(node.func.value)
        ):
            out.append(f"{name}:{node.lineno} .{node.func.attr}()")
    return out


def test_nothing_but_the_run_record_mutates_a_manifest():
    found = [
        m
        for p in SOURCES
        if p != MANIFEST_OWNER
        for m in _manifest_mutations(p.read_text(), str(p.relative_to(REPO)))
    ]
    assert found == [], f"change run.json through run_record.RunRecord's methods: {found}"


def test_the_mutation_rule_sees_a_mutation():
    probe = (
        "job.manifest['error'] = 'x'\nmanifest['model']['saved'] = 1\n"
        "job.manifest.setdefault('notes', []).append('n')\ndel run.manifest['pid']\n"
        "m = RunManifest.load(d)\nprint(manifest['status'])\n"
    )
    assert len(_manifest_mutations(probe, "probe")) == 5


def test_only_the_run_record_writes_run_json():
    """``write_manifest`` is called from ``RunRecord.save`` only."""
    callers = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name == "write_manifest" and p != MANIFEST_OWNER:
                    callers.append(f"{p.relative_to(REPO)}:{node.lineno}")
    assert callers == [], f"write run.json through RunRecord.save: {callers}"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at the top or inside a function), relative ones resolved."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out += [(node.lineno, mod)]
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def test_the_capture_imports_nothing_from_training():
    """The capture is below the training loop: making a run (saving the model, run.json) lives
    with the run (``run_record.make_run``), not in ``capture/``."""
    up = [
        f"{p.relative_to(REPO)}:{line} {mod}"
        for p in sorted((REPO / "traceprop_engine" / "capture").glob("*.py"))
        for line, mod in _imports(p)
        if mod == "traceprop_engine.training" or mod.startswith("traceprop_engine.training.")
    ]
    assert up == [], f"capture/ imports training: {up}"
    assert any(
        mod == "traceprop_engine.store.writer.StoreWriter"
        for _, mod in _imports(REPO / "traceprop_engine" / "capture" / "tracker.py")
    ), "the import rule resolves relative imports"
