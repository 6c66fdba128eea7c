"""A classification LDS set of real prose: docstrings of Python's standard library, by module family.

:func:`generate_docstring_classes` reads the docstrings that ship with the running Python
(``inspect.getdoc`` of each public function, class and method of the modules listed in
``FAMILIES``), keeps the first paragraph of each (whitespace collapsed, 60–400 characters, no
doctest or code lines, each text once), and labels it with its module's family (8 classes:
``text``, ``numbers``, ``files``, ``email``, ``web``, ``concurrency``, ``formats``, ``time``).
Rows per class are drawn with a seeded ``random.Random``, then split into training and eval rows.
This is prose written by CPython's authors, not generated text; the exact rows depend on the
Python version (the data files record it), and the same Python, seed and sizes give the same bytes.

The labels are the module family, which a docstring's words often but not always give away
(``"Return the absolute value ..."`` is ``numbers``; ``"Return a new ...`` could be anything):
the model has to learn from the prose, and a training row's influence on an eval row is not
just "same label".

The same draw without labels (``labelled=False``, :func:`generate_docstring_texts`) is a causal
LM set of real prose (``docslm8``, ``pkgdocslm6``): every token of a docstring is a target, so
each example's per-layer gradient is a sum over many tokens with different targets, where the
generated fact sets put the loss on a few answer tokens. :func:`stdlib_docstrings` is a larger
corpus of the same kind (every public standard-library module) to pretrain a small causal LM on
before a LoRA fine-tune on the package docstrings (``benchmarks/pretrain_tiny.py --corpus
prose``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = [
    "FAMILIES",
    "PACKAGE_FAMILIES",
    "PROSE_EVAL_FILE",
    "PROSE_TRAIN_FILE",
    "generate_docstring_classes",
    "generate_docstring_texts",
    "stdlib_docstrings",
]

PROSE_TRAIN_FILE = "train/docs.jsonl"
PROSE_EVAL_FILE = "eval/docs.jsonl"
PROSE_INFO_FILE = "source.json"

FAMILIES: dict[str, tuple[str, ...]] = {
    "text": ("string", "re", "textwrap", "difflib", "unicodedata", "stringprep", "codecs"),
    "numbers": ("math", "cmath", "decimal", "fractions", "statistics", "random", "numbers"),
    "files": ("os", "os.path", "shutil", "pathlib", "glob", "tempfile", "filecmp", "fnmatch"),
    "email": (
        "email.message",
        "email.utils",
        "email.header",
        "email.parser",
        "email.generator",
        "email.policy",
        "email.headerregistry",
        "email.quoprimime",
        "email.feedparser",
        "email.charset",
        "email.iterators",
        "smtplib",
        "imaplib",
        "poplib",
        "mailbox",
        "mimetypes",
    ),
    "web": (
        "http.client",
        "http.server",
        "http.cookies",
        "http.cookiejar",
        "urllib.request",
        "urllib.parse",
        "urllib.robotparser",
        "wsgiref.handlers",
    ),
    "concurrency": (
        "threading",
        "multiprocessing.pool",
        "multiprocessing.managers",
        "queue",
        "asyncio.tasks",
        "asyncio.queues",
        "asyncio.locks",
        "concurrent.futures",
        "subprocess",
        "sched",
    ),
    "formats": (
        "json",
        "csv",
        "pickle",
        "configparser",
        "plistlib",
        "xml.etree.ElementTree",
        "xml.dom.minidom",
        "tomllib",
        "zipfile",
        "tarfile",
    ),
    "time": ("datetime", "time", "calendar", "zoneinfo", "timeit"),
}
# A second set of the same kind from other authors and another vocabulary: the docstrings of six
# libraries Traceprop installs, labelled by library (``pkgdocs6``). Each module listed is where
# the documented objects are defined (``polars.DataFrame`` lives in ``polars.dataframe.frame``).
PACKAGE_FAMILIES: dict[str, tuple[str, ...]] = {
    "arrays": ("numpy", "numpy.linalg", "numpy.fft", "numpy.ma"),
    "frames": (
        "polars.dataframe.frame",
        "polars.series.series",
        "polars.expr.expr",
        "polars.lazyframe.frame",
    ),
    "nn": (
        "torch.nn.functional",
        "torch.nn.modules.module",
        "torch.nn.modules.loss",
        "torch.nn.modules.linear",
        "torch.nn.modules.conv",
        "torch.nn.modules.activation",
        "torch.optim.optimizer",
        "torch.optim.lr_scheduler",
    ),
    "hdf5": (
        "h5py._hl.dataset",
        "h5py._hl.group",
        "h5py._hl.files",
        "h5py._hl.attrs",
        "h5py._hl.base",
        "h5py._hl.filters",
        "h5py._hl.selections",
        "h5py._hl.vds",
    ),
    "models": (
        "transformers.modeling_utils",
        "transformers.tokenization_utils_base",
        "transformers.trainer",
        "transformers.configuration_utils",
        "transformers.generation.utils",
        "transformers.training_args",
    ),
    "plots": ("plotly.basedatatypes", "plotly.io._kaleido", "plotly.subplots"),
}
_MIN_CHARS, _MAX_CHARS = 60, 400


def _first_paragraph(doc: str | None) -> str | None:
    if not doc:
        return None
    para = doc.strip().split("\n\n")[0]
    if ">>>" in para or "::" in para or re.search(r"^\s*[\w.]+\(.*\)\s*(->.*)?$", para, re.M):
        return None  # a signature line or code, not prose
    text = " ".join(para.split())
    if re.fullmatch(r"[\w.]+\(.*\)\s*(->.*)?", text):
        return None  # a signature wrapped over lines (numpy's C functions)
    if not _MIN_CHARS <= len(text) <= _MAX_CHARS or len(text.split()) < 8:
        return None
    return text


def _module_docs(name: str) -> list[str]:
    """First paragraphs of the public functions, classes and methods defined in module ``name``."""
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 (missing here, or a module that fails on import)
        return []
    out = []
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) not in (name, mod.__name__):
            continue  # imported from elsewhere: it belongs to its own module's family
        members = [obj]
        if inspect.isclass(obj):
            members += [v for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
        for m in members:
            text = _first_paragraph(
                inspect.getdoc(m) if callable(m) or inspect.isclass(m) else None
            )
            if text:
                out.append(text)
    return out


def _versions(families: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The installed version of each distribution whose modules ``families`` reads (the rows of
    a library's set depend on it, as the standard library's depend on the Python version)."""
    from importlib import metadata

    out = {}
    for top in sorted({m.split(".")[0] for mods in families.values() for m in mods}):
        try:
            out[top] = metadata.version(top)
        except metadata.PackageNotFoundError:
            continue  # a standard-library module: the "python" entry says which
    return out


def collect_docstrings(
    families: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, list[str]]:
    """``{family: [first paragraphs]}`` of ``families`` (default :data:`FAMILIES`), each text
    once over all families (first family wins)."""
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for fam, modules in (families or FAMILIES).items():
        texts = []
        for name in modules:
            for t in _module_docs(name):
                if t not in seen:
                    seen.add(t)
                    texts.append(t)
        out[fam] = texts
    return out


def generate_docstring_classes(
    out_dir: Path,
    *,
    seed: int = 0,
    n_train_per_class: int = 30,
    n_eval_per_class: int = 8,
    families: dict[str, tuple[str, ...]] | None = None,
    labelled: bool = True,
) -> dict[str, Any]:
    """Write the docstring classification set: ``train/docs.jsonl``, ``eval/docs.jsonl``.

    Rows are ``{"text": first paragraph of a docstring, "label": family}``, ``n_train_per_class``
    and ``n_eval_per_class`` per family (8 families: 240 / 64 rows by default), shuffled;
    ``source.json`` records the Python version, the modules of each family and the counts.

    Args:
        out_dir: output directory (created; the files are overwritten).
        seed: seed of the draw and of the row order.
        n_train_per_class: training rows per family.
        n_eval_per_class: eval rows per family.
        families: ``{label: modules}`` (default :data:`FAMILIES`, the standard library's;
            :data:`PACKAGE_FAMILIES` reads the installed libraries' docstrings and records their
            versions).
        labelled: False writes ``{"text"}`` rows only (the same docstrings in the same order):
            a causal LM set (:func:`generate_docstring_texts`).

    Returns:
        The ``source.json`` dictionary.

    Raises:
        ConfigError: a count is not positive, or a family has fewer docstrings than asked for.
    """
    if n_train_per_class < 1 or n_eval_per_class < 1:
        raise ConfigError("n_train_per_class and n_eval_per_class must be positive integers")
    families = families or FAMILIES
    docs = collect_docstrings(families)
    rng = random.Random(seed)
    train, evals = [], []
    need = n_train_per_class + n_eval_per_class
    for fam, texts in docs.items():
        if len(texts) < need:
            raise ConfigError(
                f"family {fam!r} has {len(texts)} usable docstrings here, fewer than "
                f"the {need} asked for; lower n_train_per_class / n_eval_per_class"
            )
        pick = rng.sample(texts, need)
        train += [{"text": t, "label": fam} for t in pick[:n_train_per_class]]
        evals += [{"text": t, "label": fam} for t in pick[n_train_per_class:]]
    rng.shuffle(train)
    rng.shuffle(evals)
    if not labelled:
        train = [{"text": r["text"]} for r in train]
        evals = [{"text": r["text"]} for r in evals]
    out_dir = Path(out_dir)
    for rel, rows in ((PROSE_TRAIN_FILE, train), (PROSE_EVAL_FILE, evals)):
        p = out_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    info = {
        "generator": "traceprop_engine.evaluate.prose_data."
        + ("generate_docstring_classes" if labelled else "generate_docstring_texts"),
        "task": "classification" if labelled else "causal-lm",
        "python": sys.version.split()[0],
        "seed": seed,
        "families": {f: list(m) for f, m in families.items()},
        "available": {f: len(t) for f, t in docs.items()},
        "n_train": len(train),
        "n_eval": len(evals),
        "versions": _versions(families),
    }
    (out_dir / PROSE_INFO_FILE).write_text(json.dumps(info, indent=1))
    return info


def generate_docstring_texts(out_dir: Path, **kwargs) -> dict[str, Any]:
    """The docstring set as a causal LM set: :func:`generate_docstring_classes` with
    ``labelled=False`` (``{"text"}`` rows; the same keyword arguments otherwise)."""
    return generate_docstring_classes(out_dir, labelled=False, **kwargs)


# standard-library modules never imported for the corpus: they open windows or browsers, print
# on import, need a terminal or another platform, or hold tests rather than documented API
_STDLIB_SKIP = frozenset(
    [
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "pydoc",
        "pydoc_data",
        "lib2to3",
        "ensurepip",
        "venv",
        "test",
        "unittest",
        "msvcrt",
        "winreg",
        "winsound",
        "nt",
        "msilib",
        "curses",
        "readline",
        "crypt",
        "nis",
        "ossaudiodev",
        "spwd",
        "sqlite3",
        "webbrowser",
        "distutils",
    ]
)


def stdlib_docstrings(exclude: Iterable[str] = ()) -> list[str]:
    """First paragraphs (as :func:`generate_docstring_classes` keeps them) of every public
    module of the running Python's standard library and of its packages' public submodules,
    each text once, in module order, less the texts in ``exclude``: a pretraining corpus of
    technical prose (about 1450 texts on Python 3.11). Modules that fail to import are skipped;
    importing prints nothing. A library's class can inherit a standard-library docstring
    (``inspect.getdoc``), so a corpus for a fine-tune on :data:`PACKAGE_FAMILIES` passes their
    texts as ``exclude``."""
    import contextlib
    import io
    import pkgutil
    import warnings

    names = []
    quiet = io.StringIO()
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
    ):
        warnings.simplefilter("ignore")
        for top in sorted(sys.stdlib_module_names):
            if top.startswith("_") or top in _STDLIB_SKIP:
                continue
            names.append(top)
            try:
                mod = importlib.import_module(top)
            except Exception:  # noqa: BLE001 (a platform's module missing here)
                continue
            subs = pkgutil.walk_packages(
                getattr(mod, "__path__", []), top + ".", onerror=lambda _name: None
            )  # a subpackage that raises on import (any error) is skipped, not fatal
            for info in subs:
                parts = info.name.split(".")[1:]
                if not any(p.startswith(("_", "test")) or p in _STDLIB_SKIP for p in parts):
                    names.append(info.name)
        texts = collect_docstrings({"stdlib": tuple(names)})["stdlib"]
    skip = set(exclude)
    return [t for t in texts if t not in skip]
