"""A data set of training examples: load a file or a directory, split off eval, hash the files.

A directory is read file by file (:func:`~.readers.read_file`, where the formats, their row
numbers and hashes, and the field layouts are described); all files of one data set must use
one layout. Each :class:`~.examples.Example` remembers its file, row and the sha256 of its
record, and :func:`hash_files` hashes whole files for the run's manifest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError, DataError
from .examples import ACCEPTED_LAYOUTS, TASK_CAUSAL_LM, TASKS, Example
from .readers import SUPPORTED_SUFFIXES, read_file

logger = logging.getLogger(__name__)

__all__ = [
    "hash_files",
    "load_examples",
    "sha256_file",
    "split_eval",
]

_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# public functions


def load_examples(
    path: str | os.PathLike[str], *, task: str = TASK_CAUSAL_LM
) -> tuple[list[Example], Path]:
    """Read the examples of a data file or a directory of data files.

    A directory is searched recursively; its files are read in order of their relative path,
    hidden files and folders (name starting with ``.``) are skipped, and files whose extension
    is not one of ``.jsonl``, ``.csv``, ``.parquet``, ``.txt`` are ignored. A ``.txt`` file
    holds one example per non-empty line (field ``text``, row = line number).

    Args:
        path: A data file or a directory.
        task: ``"causal-lm"`` (``prompt`` + ``completion``, or ``text``) or
            ``"classification"`` (``text`` + ``label``); a ``settings.Task`` member works too.

    Returns:
        ``(examples, data_root)``: the examples in file order, then row order, and the root
        their ``source`` paths are relative to (the directory, or the file's parent).

    Raises:
        ConfigError: ``task`` is not one of the known tasks.
        DataError: The path does not exist, holds no supported file or no example, a file is
            not UTF-8 or cannot be parsed, a record has a missing, empty or mistyped field, the
            fields match no accepted layout, or files use different layouts.
    """
    task = getattr(task, "value", task)  # accept the settings.Task str-Enum as well
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; use one of {', '.join(map(repr, TASKS))}.")
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"data path does not exist: {path}. Pass a data file "
            f"({', '.join(SUPPORTED_SUFFIXES)}) or a directory that contains such files."
        )
    root, sources = _discover(path)

    examples: list[Example] = []
    first_layout: tuple[str, str] | None = None  # (layout, key of the first example with it)
    for source in sources:
        for example in read_file(root / source, source, task):
            if first_layout is None:
                first_layout = (example.layout, example.key)
            elif example.layout != first_layout[0]:
                raise DataError(
                    f"{example.key}: layout {example.layout!r} differs from layout "
                    f"{first_layout[0]!r} of {first_layout[1]}; all files of a data set must "
                    "use one layout. Split them into separate data sets or convert them."
                )
            examples.append(example)

    if not examples:
        raise DataError(
            f"no examples found in {path}: looked for non-empty records in "
            f"{', '.join(SUPPORTED_SUFFIXES)} files with fields {ACCEPTED_LAYOUTS[task]} "
            f"(files read: {', '.join(sources)})."
        )
    logger.info("loaded %d examples from %d file(s) under %s", len(examples), len(sources), root)
    return examples, root


def split_eval(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Split off a deterministic held-out evaluation set.

    The indices are shuffled with ``random.Random(seed)``; the first
    ``max(1, round(fraction * n))`` of them (none when ``fraction`` is 0) form the evaluation
    set. Both parts keep the original order of ``examples``.

    Args:
        examples: The examples to split.
        fraction: Share of examples held out, in ``[0, 1)``.
        seed: Seed of the shuffle; the same seed and input give the same split.

    Returns:
        ``(train, eval)``.

    Raises:
        ConfigError: ``fraction`` is outside ``[0, 1)``.
        DataError: No training example would remain.
    """
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(
            f"eval fraction must be in [0, 1) (0 = no evaluation set), got {fraction!r}."
        )
    n = len(examples)
    n_eval = 0 if fraction == 0 else max(1, round(fraction * n))
    if n - n_eval < 1:
        raise DataError(
            f"holding out {n_eval} of {n} example(s) for evaluation leaves none for training; "
            "add examples or lower the eval fraction (0 disables the evaluation set)."
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_idx]
    held_out = [ex for i, ex in enumerate(examples) if i in eval_idx]
    return train, held_out


def hash_files(root: Path, sources: Iterable[str]) -> dict[str, str]:
    """Hash whole data files.

    Args:
        root: The data root the sources are relative to.
        sources: Relative POSIX paths (repeats are hashed once).

    Returns:
        ``{source: sha256 hex}`` in first-seen order.

    Raises:
        DataError: A file is missing or unreadable.
    """
    hashes: dict[str, str] = {}
    for source in sources:
        if source not in hashes:
            hashes[source] = sha256_file(Path(root) / source)
    return hashes


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks.

    Raises:
        DataError: The file is missing or unreadable.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError as e:
        raise DataError(f"cannot read data file {path} to hash it: {e.strerror or e}.") from e
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# discovery


def _discover(path: Path) -> tuple[Path, list[str]]:
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataError(
                f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; "
                f"use one of {', '.join(SUPPORTED_SUFFIXES)}."
            )
        _check_name(path.name, path.parent)
        return path.parent, [path.name]

    sources = []
    skipped = []
    for file in path.rglob("*"):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        supported = file.suffix.lower() in SUPPORTED_SUFFIXES
        if supported and file.is_symlink() and not file.exists():
            raise DataError(
                f"{path}: {rel.as_posix()} is a symbolic link to {os.readlink(file)}, which "
                "does not exist; restore its target or remove the link."
            )
        if not file.is_file():
            continue
        if supported:
            _check_name(rel.as_posix(), path)
            sources.append(rel.as_posix())
        else:
            skipped.append(rel.as_posix())
    if not sources:
        found = f"; found only: {', '.join(sorted(skipped)[:10])}" if skipped else " (it is empty)"
        raise DataError(
            f"directory {path} contains no supported data files "
            f"({', '.join(SUPPORTED_SUFFIXES)}){found}."
        )
    if skipped:
        logger.info("ignoring %d unsupported file(s) under %s", len(skipped), path)
    return path, sorted(sources)


def _check_name(source: str, root: Path) -> None:
    # the store and run.json keep each source as UTF-8 text (its lineage): a name in another
    # encoding arrives from the file system as lone surrogates and could not be written
    try:
        source.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(
            f"{root}: the data file name {os.fsencode(source)!r} is not valid UTF-8; rename "
            "it to a UTF-8 name, so that its lineage can be recorded."
        ) from None
