"""Reading one data file into :class:`~.examples.Example` s, with its lineage.

Supported files:

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

Size: a record holds at most :data:`MAX_RECORD_BYTES` (1 MiB) of UTF-8: a longer ``.jsonl`` or
``.txt`` line, or a longer text field of any format, is refused with its file and line. Lines
are read one at a time and never past that bound, so memory does not grow with a file's
longest line (a 30 MB single-line file used to take 6 GB in the tokenizer). A ``.csv`` field
is also bounded by Python's ``csv.field_size_limit()`` (131 072 characters by default).

Text is Unicode: a JSON string with a lone surrogate escape (``"\\ud800"``), which is not a
character and cannot be written as UTF-8, is refused with its row like a NUL character.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DataError
from .examples import ACCEPTED_LAYOUTS, TASK_CAUSAL_LM, TASK_CLASSIFICATION, Example

SUPPORTED_SUFFIXES = (".jsonl", ".csv", ".parquet", ".txt")
MAX_RECORD_BYTES = 1 << 20
"""The most UTF-8 bytes one record (a line of ``.jsonl``/``.txt``, a text field) may hold."""
_BOM = b"\xef\xbb\xbf"


# formats: each yields Examples; rows with problems raise DataError("file:line: ...")


def read_file(file: Path, source: str, task: str) -> Iterator[Example]:
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(file, source, task)
        return
    if suffix == ".csv":
        yield from _read_csv(_read_bytes(file, source), source, task)
    elif suffix == ".jsonl":
        yield from _read_jsonl(_lines(file, source), source, task)
    else:
        yield from _read_txt(_lines(file, source), source, task)


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


def _lines(file: Path, source: str) -> Iterator[tuple[int, bytes, str]]:
    """(1-based line number, line bytes without ``\\n`` / ``\\r\\n``, the line as text),
    read one line at a time and at most :data:`MAX_RECORD_BYTES` (+ terminator) at once."""
    try:
        f = file.open("rb")
    except OSError as e:
        raise DataError(f"{source}: cannot read file: {e.strerror or e}.") from e
    with f:
        number, offset = 0, 0  # offset: of the line's first byte in the file
        while True:
            try:
                line = f.readline(MAX_RECORD_BYTES + 3)
            except OSError as e:
                raise DataError(f"{source}: cannot read file: {e.strerror or e}.") from e
            if not line:
                return
            number += 1
            start, offset = offset, offset + len(line)
            if number == 1 and line.startswith(_BOM):
                line, start = line[len(_BOM) :], start + len(_BOM)
            raw = line[:-1] if line.endswith(b"\n") else line
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            if len(raw) > MAX_RECORD_BYTES:
                raise DataError(
                    f"{source}:{number}: the line is longer than {MAX_RECORD_BYTES} bytes "
                    "(1 MiB), the most one record may hold; split it into several records."
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{source}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                    f"offset {start + e.start}); re-save the file with UTF-8 encoding."
                ) from e
            yield number, raw, text


def _read_jsonl(lines, source: str, task: str) -> Iterator[Example]:
    for number, raw, line in lines:
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


def _read_txt(lines, source: str, task: str) -> Iterator[Example]:
    if task != TASK_CAUSAL_LM:
        raise DataError(
            f"{source}: a .txt file holds text only, but task {task!r} needs "
            f"{ACCEPTED_LAYOUTS[task]}; use a .jsonl, .csv or .parquet file."
        )
    for number, raw, line in lines:
        if line.strip():
            _check_text(line, f"{source}:{number}")
            yield Example(source, number, hashlib.sha256(raw).hexdigest(), text=line)


def _read_csv(data: bytes, source: str, task: str) -> Iterator[Example]:
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None or not any(h.strip() for h in header):
            raise DataError(
                f"{source}:1: a CSV file needs a header row naming its columns "
                f"({ACCEPTED_LAYOUTS[task]}); found an empty first line."
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
        f"{ACCEPTED_LAYOUTS[task]}. Rename the columns or pick another task."
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
    _check_text(value, f"{where}: field {name!r}")
    return value


def _check_text(value: str, what: str) -> None:
    # the store keeps text as HDF5 strings, which end at a NUL: refuse it here, with the row
    if "\x00" in value:
        raise DataError(
            f"{what} contains a NUL character (\\x00) at offset {value.index(chr(0))}; "
            "remove it from the data file."
        )
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in JSON): not a character
        raise DataError(
            f"{what} contains a lone surrogate (\\u{ord(value[e.start]):04x}) at offset "
            f"{e.start}, which is not a character and cannot be stored as UTF-8; fix the "
            "escape in the data file."
        ) from None
    if size > MAX_RECORD_BYTES:
        raise DataError(
            f"{what} holds {size} bytes, more than the {MAX_RECORD_BYTES} (1 MiB) one record "
            "may hold; split it into several records."
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
    _check_text(label, f"{where}: field 'label'")
    return label
