"""The records of one data file as the data readers number and hash them, and the file rebuilt
without some of them.

Rows and hashes are those of :mod:`traceprop_engine.training.readers` (the same code reads the
records), so a row named by a run's lineage is found here by its number and checked by its
hash. The text formats are rebuilt from the original file's own bytes: every kept line is
written as it was (byte for byte, its line terminator and a UTF-8 byte-order mark included),
and only the lines of removed records are left out. A Parquet file is rewritten from its kept
rows, with the same schema (Parquet has no lines to keep).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from ..training.readers import SUPPORTED_SUFFIXES, read_file

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class FileRecords:
    """One data file cut into units: ``units`` concatenate to the file's text (after its
    byte-order mark); ``spans[row] = (first, end)`` are the units of data row ``row``."""

    suffix: str
    bom: bool
    units: list[bytes]
    spans: dict[int, tuple[int, int]]
    sha256: dict[int, str]


def _line_units(data: bytes) -> list[bytes]:
    """The lines of ``data`` with their terminators (the readers' ``\\n`` split)."""
    parts = data.split(b"\n")
    units = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        units.append(parts[-1])  # a last line without a final newline
    return units


def _text_records(data: bytes) -> tuple[list[bytes], dict]:
    """jsonl/txt: one record per non-blank line, numbered as an editor numbers lines."""
    units = _line_units(data)
    spans = {}
    for number, unit in enumerate(units, start=1):
        raw = unit.removesuffix(b"\n").removesuffix(b"\r")
        if raw.decode("utf-8").strip():
            spans[number] = (number - 1, number)
    return units, spans


def _csv_records(data: bytes, source: str) -> tuple[list[bytes], dict]:
    """CSV records may span lines (quoted newlines): each row's units are the lines the csv
    module read for it, split the way the readers' ``StringIO(newline="")`` splits them."""
    lines = list(io.StringIO(data.decode("utf-8"), newline=""))
    reader = csv.reader(iter(lines), strict=True)
    spans: dict[int, tuple[int, int]] = {}
    row, start = 0, 0
    try:
        for i, values in enumerate(reader):
            end = reader.line_num
            if i > 0 and values:  # the header, and blank lines, are no data rows
                row += 1
                spans[row] = (start, end)
            start = end
    except csv.Error as e:
        raise DataError(f"{source}:{reader.line_num}: malformed CSV ({e}).") from e
    return [ln.encode("utf-8") for ln in lines], spans


def read_records(path: Path, source: str, task: str) -> FileRecords:
    """The records of ``path`` (``source`` is its name relative to the data root).

    Raises:
        DataError: an unsupported file type, or a file the data readers refuse.
    """
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{source}: unsupported file type {suffix!r}")
    # the readers' own rows and hashes: what the run's lineage recorded
    hashes = {ex.row: ex.sha256 for ex in read_file(path, source, task)}
    if suffix == ".parquet":
        return FileRecords(suffix, False, [], {r: (r - 1, r) for r in hashes}, hashes)
    data = path.read_bytes()
    bom = data.startswith(_BOM)
    body = data[len(_BOM) :] if bom else data
    if suffix == ".csv":
        units, spans = _csv_records(body, source)
    else:
        units, spans = _text_records(body)
    if set(spans) != set(hashes):
        raise DataError(f"{source}: the records found here differ from the data readers' rows")
    return FileRecords(suffix, bom, units, spans, hashes)


def rebuilt_bytes(rec: FileRecords, drop: set[int]) -> bytes:
    """The text file without the records ``drop`` (data rows); every other byte as it was."""
    dropped = set()
    for row in drop:
        first, end = rec.spans[row]
        dropped.update(range(first, end))
    body = b"".join(u for i, u in enumerate(rec.units) if i not in dropped)
    return (_BOM if rec.bom else b"") + body


def only_bytes(rec: FileRecords, keep: set[int]) -> bytes:
    """The text file with only the records ``keep`` (and, for CSV, its header line)."""
    head = set(range(0, min((s for s, _ in rec.spans.values()), default=0)))
    if rec.suffix != ".csv":
        head = set()
    wanted = set(head)
    for row in keep:
        first, end = rec.spans[row]
        wanted.update(range(first, end))
    body = b"".join(u for i, u in enumerate(rec.units) if i in wanted)
    return (_BOM if rec.bom else b"") + body


def write_parquet_rows(src: Path, dst: Path, rows: set[int], *, keep: bool) -> None:
    """``src``'s rows (1-based) kept (``keep``) or dropped, written to ``dst`` (same schema)."""
    import polars as pl

    frame = pl.read_parquet(src)
    mask = pl.Series([(i + 1 in rows) == keep for i in range(frame.height)])
    frame.filter(mask).write_parquet(dst)


def write_without(src: Path, dst: Path, rec: FileRecords, drop: set[int]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if rec.suffix == ".parquet":
        write_parquet_rows(src, dst, drop, keep=False)
    else:
        dst.write_bytes(rebuilt_bytes(rec, drop))


def write_only(src: Path, dst: Path, rec: FileRecords, keep: set[int]) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if rec.suffix == ".parquet":
        write_parquet_rows(src, dst, keep, keep=True)
    else:
        dst.write_bytes(only_bytes(rec, keep))
