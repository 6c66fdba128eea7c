"""The layout rules of docs/architecture.md, checked on every run: modules stay small enough to
read, functions short unless a comment says why, the app's pages reach the engine only through
``app/services`` (errors excepted), code outside ``attribution/`` imports only its front door,
and nothing below the CLI imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("traceprop_engine/**/*.py"), *REPO.glob("app/**/*.py")])
# the benchmarks' code, not the peers' virtual environments (benchmarks/peers/.venvs/, ignored
# by git) that benchmarks/peers/setup_peer.sh installs there
BENCHMARKS = sorted(
    p
    for p in REPO.glob("benchmarks/**/*.py")
    if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
)
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80  # statements after the docstring
LONG_REASON = "# long:"  # on the line above a longer function: why it stays whole
ATTRIBUTION = "traceprop_engine.attribution"
# the code that imports attribution/ from outside: the other engine packages, the CLI, the app,
# the benchmarks (tests may import deeper)
OUTSIDE = sorted(
    p
    for p in [*SOURCES, *BENCHMARKS]
    if not p.is_relative_to(REPO / "traceprop_engine" / "attribution")
)
# benchmarks that time or patch attribution's internals, so reach past the front door: what for
PROBES = {
    "benchmarks/bench_compact.py": "the Woodbury preconditioner and scores from stored factors",
    "benchmarks/candidates.py": "patches the ranking's candidate counts and the lists' scan",
    "benchmarks/int8_rerank.py": "times the low-rank test's int8 route against the former one",
    "benchmarks/nprobe_calibration.py": "recall at each nprobe of the index build's query kinds",
    "benchmarks/query_real_run.py": "patches the factor lists' and the ranking's candidate counts",
    "benchmarks/query_rerank.py": "times the exact scorer's and the low-rank test's routes",
    "benchmarks/query_search.py": "times the FAISS search alone",
    "benchmarks/query_stages.py": "times the query's stages (FAISS, lists, re-rank) inside rank",
    "benchmarks/query_threads.py": "patches the query's BLAS thread limit",
    "benchmarks/query_hands.py": "reads how many threads a query's stages use",
    "benchmarks/precondition_probe.py": "patches the head's whitening and the layer scale of a fit",
    "benchmarks/summary_probe.py": "the index projection's moments and the record cache",
    "traceprop_engine/bench/query.py": "times FAISS index builds on synthetic vectors",
    "traceprop_engine/bench/query_e2e.py": "gives an index built before them its layer norms",
}


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


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """``(line, module, names)`` of every import in ``path``, relative ones resolved."""
    pkg = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            yield node.lineno, base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def _past_the_front_door(path: Path) -> list[str]:
    from traceprop_engine import attribution

    front = set(attribution.__all__)
    out = []
    for line, module, names in _imports(path):
        if module == "traceprop_engine" and "attribution" in names:
            continue  # `from traceprop_engine import attribution`
        if module == ATTRIBUTION and (not names or set(names) <= front):
            continue
        if module == ATTRIBUTION or module.startswith(ATTRIBUTION + "."):
            out.append(f"{path.relative_to(REPO)}:{line} {module} {names}")
    return out


def test_outside_code_imports_only_the_attribution_front_door():
    assert any(p.name == "queries.py" for p in OUTSIDE)
    assert any(p.parts[-2] == "benchmarks" for p in OUTSIDE)
    bad = [
        hit
        for p in OUTSIDE
        if str(p.relative_to(REPO)) not in PROBES
        for hit in _past_the_front_door(p)
    ]
    assert bad == [], (
        "import these from traceprop_engine.attribution (add a name to its front door, "
        f"attribution/__init__.py, if it belongs there) or move the code inside: {bad}"
    )


def test_every_listed_probe_reaches_inside():
    """PROBES names benchmarks only, and each still needs its exception."""
    for name in PROBES:
        path = REPO / name
        assert name.startswith(("benchmarks/", "traceprop_engine/bench/")), name
        assert _past_the_front_door(path), (
            f"{name} imports only the front door: drop it from PROBES"
        )


def test_the_front_door_names_what_it_loads():
    from traceprop_engine import attribution

    assert attribution.__all__ == sorted(attribution._LAZY)
    for name in attribution.__all__:
        assert getattr(attribution, name) is not None, name


def test_nothing_below_the_cli_imports_it():
    cli = REPO / "traceprop_engine" / "cli"
    bad = [
        f"{p.relative_to(REPO)}:{line} {module}"
        for p in [*SOURCES, *BENCHMARKS]
        if not p.is_relative_to(cli) and p != REPO / "traceprop_engine" / "__main__.py"
        for line, module, names in _imports(p)
        if module == "traceprop_engine.cli"
        or module.startswith("traceprop_engine.cli.")
        or (module == "traceprop_engine" and "cli" in names)
    ]
    assert bad == [], f"the engine and the app must not import the CLI (move it down): {bad}"


ARCHITECTURE = REPO / "docs" / "architecture.md"
_PATH = re.compile(r"^[\w./-]+(\.py|\.md|/)$")


def _tree_paths(text: str) -> list[str]:
    """The paths of the tree block of docs/architecture.md (two spaces of indent per level)."""
    block = next(
        b for b in re.findall(r"```\n(.*?)```", text, flags=re.S) if "traceprop_engine/\n" in b
    )
    parents: list[str] = []
    out = []
    for line in block.splitlines():
        level = (len(line) - len(line.lstrip())) // 2
        parents = parents[:level]
        for token in line.split():
            if not _PATH.match(token):
                break
            path = "".join(parents) + token
            out.append(path)
            if token.endswith("/"):
                parents = [*parents, token]
    return out


def _named_paths(text: str) -> list[tuple[list[str], str]]:
    """``(section directories, path)`` of every inline-code path outside code blocks; a bare
    file name is looked up under its section's directories (``### `dir/` ``)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    dirs: list[str] = [""]
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            dirs = re.findall(r"`([\w./]+/)`", line) or [""]
            continue
        for token in re.findall(r"`([^`\s]+)`", line):
            if _PATH.match(token) and not token.startswith("RUN/"):
                out.append((dirs, token))
    return out


def _dotted_names(text: str) -> list[str]:
    """Inline ``module.name`` references whose first part is an engine module or package."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    engine = REPO / "traceprop_engine"
    out = []
    for token in re.findall(r"`([A-Za-z_][\w.]*\.[A-Za-z_]\w*)`", text):
        head = token.split(".")[0]
        if token.rsplit(".", 1)[1] in ("py", "md", "json", "jsonl", "h5", "csv", "npy", "npz"):
            continue  # a file name, not an object
        if (engine / head).is_dir() or (engine / f"{head}.py").is_file():
            out.append(token)
    return out


def test_architecture_names_only_paths_that_exist():
    text = ARCHITECTURE.read_text()
    tree = _tree_paths(text)
    assert "traceprop_engine/attribution/score/" in tree and len(tree) > 30
    missing = [p for p in tree if not (REPO / p).exists()]
    for dirs, token in _named_paths(text):
        if "/" in token.rstrip("/"):
            found = any((REPO / base / token).exists() for base in ("", "traceprop_engine"))
        else:  # a bare name: under its section's directories, or at the top of the engine
            found = (
                any((REPO / d / token).exists() or any((REPO / d).rglob(token)) for d in dirs)
                or (REPO / "traceprop_engine" / token).exists()
                or (REPO / token).exists()
            )
        if not found:
            missing.append(f"{token} (under {dirs})")
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_architecture_names_only_engine_objects_that_exist():
    import importlib

    missing = []
    for token in _dotted_names(ARCHITECTURE.read_text()):
        parts = ["traceprop_engine", *token.split(".")]
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(token)
            break
    assert missing == [], f"docs/architecture.md names objects that do not exist: {missing}"


def test_the_tree_lists_every_engine_package():
    tree = set(_tree_paths(ARCHITECTURE.read_text()))
    packages = {
        str(p.parent.relative_to(REPO)) + "/" for p in REPO.glob("traceprop_engine/**/__init__.py")
    }
    assert packages - tree == set(), f"add these packages to the tree: {packages - tree}"


def test_app_services_lists_its_modules():
    init = REPO / "app" / "services" / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    listed = set(re.findall(r":mod:`services\.(\w+)`", doc))
    modules = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    assert listed == modules, (
        f"app/services/__init__.py: list {modules - listed}, drop {listed - modules}"
    )


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


def _imported_modules(path: Path) -> list[tuple[int, str]]:
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
        for line, mod in _imported_modules(p)
        if mod == "traceprop_engine.training" or mod.startswith("traceprop_engine.training.")
    ]
    assert up == [], f"capture/ imports training: {up}"
    assert any(
        mod == "traceprop_engine.store.writer.StoreWriter"
        for _, mod in _imported_modules(REPO / "traceprop_engine" / "capture" / "tracker.py")
    ), "the import rule resolves relative imports"


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (the tests folders are not packages): two files
    of one name stop the whole run at collection."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
