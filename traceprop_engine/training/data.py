"""Training examples with lineage: read data files, remember where every example came from.

Every :class:`Example` carries its source file (relative to the data root, POSIX separators),
its 1-based row and a sha256 of its raw record, so an attribution can be traced back to the
exact line a person can open in an editor, and an audit can re-verify it later.

Supported files (a single file, or a directory searched recursively):

- ``.jsonl``: one JSON object per line. Blank lines are skipped, but rows keep the line number
  an editor shows. ``sha256`` is the hash of the raw line bytes, without the line terminator
  (``\\n`` or ``\\r\\n``); a UTF-8 byte-order mark at the start of the file is not part of the
  first line.
- ``.txt``: one example per non-empty line (whitespace-only lines are skipped); the line, as
  written, is the example's ``text``; ``row`` is its line number; ``sha256`` as for ``.jsonl``.
  A ``.txt`` file has no labels, so it cannot be used for ``task="classification"``.
- ``.csv``: UTF-8, comma-separated, a header row is required; ``row`` is the 1-based data row
  after the header, and errors name the file line (data row + 1 for single-line records).
- ``.parquet``: read with polars; ``row`` is the 1-based data row and errors name it as
  ``file:row``.

For ``.csv`` and ``.parquet`` the ``sha256`` is taken over the canonical JSON of the row dict
(``sort_keys=True, ensure_ascii=False, separators=(",", ":")``, values that JSON cannot hold
written with ``str``), encoded as UTF-8.

Field layouts (extra fields are ignored):

- ``prompt`` + ``completion`` (both strings; the prompt may be empty, the completion may not);
  the loss is taken on the completion.
- ``text`` (a non-empty string); for ``task="causal-lm"`` a ``label`` field is ignored.
- ``text`` + ``label`` for ``task="classification"``; labels may be strings or integers in the
  file and are always stored as strings.

All files of one data set must use the same layout.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceprop_engine.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

__all__ = [
    "LAYOUTS",
    "LAYOUT_PROMPT_COMPLETION",
    "LAYOUT_TEXT",
    "LAYOUT_TEXT_LABEL",
    "SUPPORTED_SUFFIXES",
    "TASKS",
    "Example",
    "hash_files",
    "load_examples",
    "sha256_file",
    "split_eval",
]

LAYOUT_PROMPT_COMPLETION = "prompt_completion"
LAYOUT_TEXT = "text"
LAYOUT_TEXT_LABEL = "text_label"
LAYOUTS = (LAYOUT_PROMPT_COMPLETION, LAYOUT_TEXT, LAYOUT_TEXT_LABEL)

TASK_CAUSAL_LM = "causal-lm"
TASK_CLASSIFICATION = "classification"
TASKS = (TASK_CAUSAL_LM, TASK_CLASSIFICATION)

SUPPORTED_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt")

_ACCEPTED_LAYOUTS = {
    TASK_CAUSAL_LM: "'prompt' + 'completion', or 'text'",
    TASK_CLASSIFICATION: "'text' + 'label'",
}
_BOM = b"\xef\xbb\xbf"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Example:
    """One training (or evaluation) example and where it came from.

    Attributes:
        source: Path of the data file relative to the data root, with POSIX separators.
        row: 1-based row: the editor line number for ``.jsonl``/``.txt``, the data row after
            the header for ``.csv``/``.parquet``.
        sha256: Hex sha256 of the raw record (see the module docstring for what is hashed).
        text: The text, for the ``text`` and ``text_label`` layouts.
        prompt: The prompt, for the ``prompt_completion`` layout (may be empty).
        completion: The completion, for the ``prompt_completion`` layout.
        label: The classification label, always a string.
    """

    source: str
    row: int
    sha256: str
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.completion is None):
            raise DataError(
                f"{self.key}: an example needs both 'prompt' and 'completion', or neither "
                "(then 'text'); got only one of them."
            )
        if (self.prompt is None) == (self.text is None):
            raise DataError(
                f"{self.key}: an example needs either 'prompt' + 'completion' or 'text', "
                "not both and not neither."
            )

    @property
    def key(self) -> str:
        """``"source:row"``, unique within a data set."""
        return f"{self.source}:{self.row}"

    @property
    def layout(self) -> str:
        """``"prompt_completion"``, ``"text"`` or ``"text_label"``."""
        if self.prompt is not None:
            return LAYOUT_PROMPT_COMPLETION
        if self.label is not None:
            return LAYOUT_TEXT_LABEL
        return LAYOUT_TEXT

    def full_text(self) -> str:
        """The whole text the model sees: ``prompt + completion``, or ``text``."""
        if self.prompt is not None:
            return self.prompt + (self.completion or "")
        return self.text or ""


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
        for example in _read_file(root / source, source, task):
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
            f"{', '.join(SUPPORTED_SUFFIXES)} files with fields {_ACCEPTED_LAYOUTS[task]} "
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
        return path.parent, [path.name]

    sources = []
    skipped = []
    for file in path.rglob("*"):
        rel = file.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not file.is_file():
            continue
        if file.suffix.lower() in SUPPORTED_SUFFIXES:
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


# --------------------------------------------------------------------------------------------
# readers: each yields Examples; rows with problems raise DataError("file:line: ...")


def _read_file(file: Path, source: str, task: str) -> Iterator[Example]:
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(file, source, task)
        return
    data = _read_bytes(file, source)
    if suffix == ".csv":
        yield from _read_csv(data, source, task)
    elif suffix == ".jsonl":
        yield from _read_jsonl(data, source, task)
    else:
        yield from _read_txt(data, source, task)


def _read_bytes(file: Path, source: str) -> bytes:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise DataError(f"{source}: cannot read file: {e.strerror or e}.") from e
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{source}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at byte offset "
            f"{e.start}); re-save the file with UTF-8 encoding."
        ) from e
    return data[len(_BOM) :] if data.startswith(_BOM) else data


def _raw_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without ``\\n`` / ``\\r\\n``)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file's final newline ends the last line; it does not start a new one
    for number, line in enumerate(lines, start=1):
        yield number, line[:-1] if line.endswith(b"\r") else line


def _read_jsonl(data: bytes, source: str, task: str) -> Iterator[Example]:
    for number, raw in _raw_lines(data):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno}).") from e
        if not isinstance(record, dict):
            raise DataError(
                f'{where}: expected a JSON object like {{"text": ...}}, '
                f"got {type(record).__name__}."
            )
        yield _make_example(record, source, number, hashlib.sha256(raw).hexdigest(), where, task)


def _read_txt(data: bytes, source: str, task: str) -> Iterator[Example]:
    if task != TASK_CAUSAL_LM:
        raise DataError(
            f"{source}: a .txt file holds text only, but task {task!r} needs "
            f"{_ACCEPTED_LAYOUTS[task]}; use a .jsonl, .csv or .parquet file."
        )
    for number, raw in _raw_lines(data):
        line = raw.decode("utf-8")
        if line.strip():
            _no_nul(line, f"{source}:{number}")
            yield Example(source, number, hashlib.sha256(raw).hexdigest(), text=line)


def _read_csv(data: bytes, source: str, task: str) -> Iterator[Example]:
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None or not any(h.strip() for h in header):
            raise DataError(
                f"{source}:1: a CSV file needs a header row naming its columns "
                f"({_ACCEPTED_LAYOUTS[task]}); found an empty first line."
            )
        duplicates = sorted({h for h in header if header.count(h) > 1})
        if duplicates:
            raise DataError(
                f"{source}:1: duplicate column name(s) in the header: {', '.join(duplicates)}."
            )
        row = 0
        for values in reader:
            if not values:  # the csv module gives [] for a blank line
                continue
            row += 1
            where = f"{source}:{reader.line_num}"
            if len(values) != len(header):
                raise DataError(
                    f"{where}: the row has {len(values)} field(s) but the header has "
                    f"{len(header)}; check quoting and commas."
                )
            record = dict(zip(header, values, strict=True))
            yield _make_example(record, source, row, _canonical_sha256(record), where, task)
    except csv.Error as e:
        raise DataError(f"{source}:{reader.line_num}: malformed CSV ({e}).") from e


def _read_parquet(file: Path, source: str, task: str) -> Iterator[Example]:
    import polars as pl  # imported here so that the other formats do not pay for polars

    try:
        frame = pl.read_parquet(file)
    except Exception as e:  # polars raises several unrelated types for a bad file
        raise DataError(f"{source}: cannot read the Parquet file ({e}).") from e
    for row, record in enumerate(frame.iter_rows(named=True), start=1):
        yield _make_example(record, source, row, _canonical_sha256(record), f"{source}:{row}", task)


def _canonical_sha256(record: dict[str, Any]) -> str:
    canonical = json.dumps(
        record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# field layouts


def _make_example(
    record: dict[str, Any], source: str, row: int, sha256: str, where: str, task: str
) -> Example:
    if task == TASK_CLASSIFICATION:
        if "text" not in record and "label" not in record:
            raise _unknown_layout(record, where, task)
        text = _string_field(record, "text", where, allow_empty=False)
        label = _label_field(record, where)
        return Example(source, row, sha256, text=text, label=label)

    if "prompt" in record or "completion" in record:
        prompt = _string_field(record, "prompt", where, allow_empty=True)
        completion = _string_field(record, "completion", where, allow_empty=False)
        return Example(source, row, sha256, prompt=prompt, completion=completion)
    if "text" in record:
        text = _string_field(record, "text", where, allow_empty=False)
        return Example(source, row, sha256, text=text)
    raise _unknown_layout(record, where, task)


def _unknown_layout(record: dict[str, Any], where: str, task: str) -> DataError:
    fields = ", ".join(repr(k) for k in record) or "none"
    return DataError(
        f"{where}: unknown field layout (fields found: {fields}); task {task!r} accepts "
        f"{_ACCEPTED_LAYOUTS[task]}. Rename the columns or pick another task."
    )


def _string_field(record: dict[str, Any], name: str, where: str, *, allow_empty: bool) -> str:
    if name not in record:
        raise DataError(f"{where}: required field {name!r} is missing.")
    value = record[name]
    if value is None:
        raise DataError(f"{where}: field {name!r} is null; give it a string value.")
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {name!r} must be a string, got {type(value).__name__} ({value!r})."
        )
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: field {name!r} is empty.")
    _no_nul(value, f"{where}: field {name!r}")
    return value


def _no_nul(value: str, what: str) -> None:
    # the store keeps text as HDF5 strings, which end at a NUL: refuse it here, with the row
    if "\x00" in value:
        raise DataError(
            f"{what} contains a NUL character (\\x00) at offset {value.index(chr(0))}; "
            "remove it from the data file."
        )


def _label_field(record: dict[str, Any], where: str) -> str:
    if "label" not in record:
        raise DataError(f"{where}: required field 'label' is missing.")
    value = record["label"]
    # bool is an int subclass, but True/False as a class label is almost always a mistake
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(
            f"{where}: field 'label' must be a string or an integer, "
            f"got {type(value).__name__} ({value!r})."
        )
    label = str(value)
    if not label.strip():
        raise DataError(f"{where}: field 'label' is empty.")
    _no_nul(label, f"{where}: field 'label'")
    return label
