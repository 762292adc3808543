"""The built-in file types of :data:`~prefect_tinker.recipes.data_reading.FILE_TYPES` (imported when
the registry is first read):

- ``jsonl`` (``.jsonl``, ``.ndjson``, ``.jsonl.gz``, ``.ndjson.gz``): one JSON value per line (JSON
  Lines, https://jsonlines.org/), read lazily line by line; a line that is not UTF-8 or not JSON
  becomes a record error naming ``file:line`` and the column; blank lines are skipped;
- ``json`` (``.json``), ``parquet`` (``.parquet``),
  ``csv`` (``.csv``), ``arrow`` (``.arrow``): read by ``datasets.load_dataset(<builder>,
  data_files=path)`` (the Hugging Face ``datasets`` packaged builders; ``split``, ``streaming`` of
  the source), records located ``path[split]:row``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect_tinker.recipes.data_reading import RawRecord, SourceSpec, dataset_records, register_file_type
from prefect_tinker.recipes.file_reads import open_data_file

__all__: list[str] = []


def _read_jsonl(path: Path, spec: SourceSpec) -> Iterator[RawRecord]:
    """Records of a JSONL file (gzipped when its name ends in ``.gz``)."""
    with open_data_file(path) as data:
        lines: Any = gzip.GzipFile(fileobj=data) if path.name.lower().endswith(".gz") else data
        for lineno, raw in enumerate(lines, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRecord(
                    where,
                    error=f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte column {exc.start + 1}: {exc.reason})",
                )
                continue
            if not line.strip():
                continue
            try:  # without its line break: an unfinished record is reported where it ends, not at column 1 of the next
                yield RawRecord(where, json.loads(line.rstrip("\r\n")))
            except json.JSONDecodeError as exc:
                yield RawRecord(where, error=f"malformed JSON ({exc.msg} at column {exc.colno})")


def _builder(name: str):
    """A reader of one packaged ``datasets`` builder (``json``, ``parquet``, ``csv``, ``arrow``)."""

    def read(path: Path, spec: SourceSpec) -> Iterator[RawRecord]:
        import datasets  # imported lazily: slow to import

        ds = datasets.load_dataset(name, data_files=str(path), split=spec.split, streaming=spec.streaming)
        yield from dataset_records(ds, str(path), spec)

    return read


register_file_type("jsonl", _read_jsonl, (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz"))
for _name in ("json", "parquet", "csv", "arrow"):
    register_file_type(_name, _builder(_name), (f".{_name}",))
