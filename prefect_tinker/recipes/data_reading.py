"""Reading dataset sources record by record, converting them to conversations, counting skips.

A source (:class:`SourceSpec`) is one of:

- a local data file, read by its file type (:data:`FILE_TYPES`, entry-point group
  ``prefect_tinker.file_types``; :func:`register_file_type`), chosen by ``file_type`` or else by
  the file name's ending: ``jsonl`` (``.jsonl``, ``.ndjson``, optionally gzipped ``.gz``), read
  line by line so errors name ``file:line`` (relative image/audio paths in it are taken next to the
  file); ``json``, ``parquet``, ``csv``, ``arrow`` (read by ``datasets.load_dataset``); a file of
  an ending no file type claims is an error naming the registered ones, unless the source names its
  ``file_type`` (:mod:`prefect_tinker.recipes.file_types`);
- with ``format="image_folder"``: a directory of class folders ``root/<label>/<image>``
  (:mod:`prefect_tinker.recipes.media_sources`);
- ``"builtin:<name>"``: a dataset shipped with this package or a plugin
  (:mod:`prefect_tinker.recipes.builtin_datasets`: ``BUILTIN_DATASETS``, entry-point group
  ``prefect_tinker.builtin_datasets``; ``register_builtin_dataset``):
  ``example_chat`` (the chat set), ``example_prefs`` (its comparisons, ``{"prompt", "chosen",
  "rejected"}``), ``sentiment_sentences`` (raw sentences for prompt distillation),
  ``forecasting_questions`` (binary questions with their resolution, ``{"question",
  "resolution"}``, for the ``forecasting`` environment);
- anything else goes to ``datasets.load_dataset`` (the real Hugging Face ``datasets`` code): a
  dataset id on the Hub or in the local cache (``config_name``, ``split``) or a local dataset
  directory; with ``streaming=True`` rows are read lazily (``IterableDataset``), for sets that do
  not fit in memory.  Errors then name ``source[split]:row``.

Records go through a converter (:mod:`prefect_tinker.recipes.data_sources`, chosen by ``format``) and message
validation.  ``on_error="raise"`` (default) stops at the first bad record with a
:class:`~prefect_tinker.recipes.data_sources.DatasetFormatError` naming file, line and field; ``"skip"`` drops it,
counts it in a :class:`SkipStats` by reason and logs the first few.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, WithJsonSchema, field_validator, model_serializer

from prefect_tinker.recipes.builtin_datasets import resolve_source_path
from prefect_tinker.recipes.data_sources import (
    Conversation,
    DatasetFormatError,
    RecordError,
    convert_record,
    validate_messages,
)
from prefect_tinker.recipes.file_reads import files_sha256
from prefect_tinker.recipes.format_fields import FormatFields
from prefect_tinker.recipes.format_options import FormatOptions
from prefect_tinker.recipes.media_sources import absolutize_media
from prefect_tinker.recipes.registry import Registry, TaggedBy

__all__ = [
    "FILE_TYPES",
    "FileType",
    "OnError",
    "RawRecord",
    "SkipStats",
    "SourceSpec",
    "iter_conversations",
    "iter_records",
    "check_capture_source",
    "check_file_type",
    "check_local_source",
    "dataset_records",
    "file_type_of",
    "is_capture_source",
    "looks_local",
    "missing_local_source",
    "register_file_type",
    "source_fingerprint",
]

logger = logging.getLogger("prefect_tinker.recipes.data")

OnError = Literal["raise", "skip"]


class SourceSpec(FormatFields):
    """One dataset source and how to read it (usable as a field of a flow's pydantic config);
    ``options`` is the options model of its ``format`` (:class:`~prefect_tinker.recipes.format_fields.FormatFields`)."""

    path: str = Field(
        description="JSONL file, local dataset file/dir, 'builtin:example_chat', or a Hugging Face dataset id."
    )
    format: str = Field(
        default="messages",
        description=(
            "Record format: a registered dataset format (messages, sharegpt, instruction, prompt_completion, dialogue, "
            "preference, ...; plugins add more)."
        ),
    )
    fields: dict[str, str] = Field(default_factory=dict, description="Field mapping: converter field -> record path.")
    options: Annotated[FormatOptions, TaggedBy("format"), WithJsonSchema({"type": "object"})] = Field(
        default_factory=FormatOptions, description="Options of the format (system_prompt, ...; see the format's docs)."
    )
    split: str = Field(default="train", description="Split for datasets.load_dataset sources.")
    config_name: str | None = Field(default=None, description="Dataset configuration name (Hugging Face).")
    streaming: bool = Field(default=False, description="Read rows lazily instead of loading the whole set.")
    weight: float = Field(default=1.0, gt=0, description="Sampling weight when interleaving sources.")
    max_records: int | None = Field(default=None, ge=1, description="Read at most this many records.")
    file_type: str | None = Field(
        default=None,
        description="How a local file is read: a registered file type (jsonl, json, parquet, csv, arrow, ...; plugins "
        "add more); default by the file name's ending.",
    )

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, path: str) -> str:
        resolve_source_path(path)  # an unknown builtin:<name> fails here, listing the registered ones
        return path

    @field_validator("file_type")
    @classmethod
    def _known_file_type(cls, name: str | None) -> str | None:
        if name is not None:
            FILE_TYPES.get_or_raise(name)
        return name

    @model_serializer(mode="wrap")
    def _file_type_when_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # left out when unset: configs and data fingerprints of sources read by their name's ending stay as before
        out = handler(self)
        if self.file_type is None:
            out.pop("file_type", None)
        return out

    @classmethod
    def coerce(cls, source: SourceSpec | str | Mapping[str, Any]) -> SourceSpec:
        """A spec from a spec, a path/id string, or a dict of fields."""
        if isinstance(source, SourceSpec):
            return source
        if isinstance(source, Mapping):
            return cls(**source)
        return cls(path=str(source))


@dataclass
class SkipStats:
    """Counts of skipped records/examples by reason, with the first few locations kept and logged."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    keep: int = 5

    def skip(self, reason: str, message: str) -> None:
        """Count one skip; log it (warning) while fewer than ``keep`` of this reason were seen."""
        self.counts[reason] += 1
        seen = self.examples.setdefault(reason, [])
        if len(seen) < self.keep:
            seen.append(message)
            logger.warning("skipped (%s): %s", reason, message)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line, e.g. ``"3 skipped: 2 bad_record, 1 too_long"`` (``"0 skipped"`` when none)."""
        if not self.total:
            return "0 skipped"
        return f"{self.total} skipped: " + ", ".join(f"{n} {r}" for r, n in self.counts.most_common())


@dataclass
class RawRecord:
    """A record read from a source: its location (``file:line``, ``source[split]:row``), and the
    parsed value or the parse error (one line, e.g. ``malformed JSON (... at column 7)``)."""

    where: str
    record: Any = None
    error: str | None = None


@dataclass(frozen=True)
class FileType:
    """How a local data file is read: ``read(path, spec) -> records`` (an iterable of
    :class:`RawRecord` in file order, lazily where it can; ``spec`` the source, for ``split``,
    ``streaming``, ``format``), and the file-name endings that select it when the source gives no
    ``file_type`` (lowercase, with the dot: ``(".jsonl", ".jsonl.gz")``)."""

    read: Callable[[Path, SourceSpec], Iterable[RawRecord]]
    suffixes: tuple[str, ...] = ()


#: File types by name (``file_type=<name>`` of a source, or its file name's ending): ``jsonl``,
#: ``json``, ``parquet``, ``csv``, ``arrow`` register in :mod:`prefect_tinker.recipes.file_types`,
#: imported when the registry is first read; plugins add more through the entry-point group
#: ``prefect_tinker.file_types`` (an entry point naming a :class:`FileType`).
FILE_TYPES: Registry[FileType] = Registry(
    "file type", "prefect_tinker.file_types", builtins=("prefect_tinker.recipes.file_types",)
)


def register_file_type(
    name: str, read: Callable[[Path, SourceSpec], Iterable[RawRecord]], suffixes: Iterable[str] = ()
) -> FileType:
    """Register ``read(path, spec) -> records`` as the file type ``name`` (overwrites), selected
    by ``file_type=<name>`` or, for a source without one, by a file name ending in one of
    ``suffixes`` (matched lowercase, the longest registered ending wins)."""
    return FILE_TYPES.register(name, FileType(read, tuple(x.lower() for x in suffixes)))


def _file_type_by_suffix(path: Path) -> FileType | None:
    name = path.name.lower()
    matches = [(len(x), ft) for ft in FILE_TYPES.values() for x in ft.suffixes if name.endswith(x)]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def file_type_of(path: Path, name: str | None = None) -> FileType:
    """The file type ``name``, else the one whose ending ``path``'s name has.

    Raises:
        UnknownComponentError: ``name`` is not registered (the message lists the registered names).
        ValueError: no ``name`` and no registered file type reads ``path``'s ending (one line naming
            the path, the registered file types with their endings and how to choose one).
    """
    if name is not None:
        return FILE_TYPES.get_or_raise(name)
    found = _file_type_by_suffix(path)
    if found is None:
        raise ValueError(f"{path}: {_no_file_type(path)}")
    return found


def _no_file_type(path: Path) -> str:
    ending = f"the ending {path.suffix.lower()!r}" if path.suffix else "a file name without an ending"
    known = ", ".join(f"{n} ({' '.join(FILE_TYPES[n].suffixes) or 'no ending'})" for n in FILE_TYPES.names())
    return (
        f"no file type reads {ending} (registered: {known}); choose one with "
        f"sources: [{{path: {path}, file_type: <name>}}]"
    )


def check_file_type(source: str, file_type: str | None = None) -> None:
    """Check that a local file ``source`` (a ``builtin:<name>`` resolved) has a file type:
    ``file_type`` or one registered for its ending; nothing to check for a directory, a Hugging
    Face id or a missing path. Configs call it to reject an unreadable file before a run starts.

    Raises:
        ValueError: no file type reads the file's ending (the message lists the registered file types with
            their endings and how to choose one).
        UnknownComponentError: ``file_type`` or a ``builtin:<name>`` is not registered.
    """
    if is_capture_source(source):
        return
    path = Path(resolve_source_path(source)).expanduser()
    if path.is_file() and file_type is None and _file_type_by_suffix(path) is None:
        raise ValueError(_no_file_type(path))
    if file_type is not None:
        FILE_TYPES.get_or_raise(file_type)


def is_capture_source(source: str) -> bool:
    """Whether ``source`` is a ``capture:<root>[::<filter>]`` string: conversations captured by
    ``prefect-tinker capture serve`` (:mod:`prefect_tinker.recipes.capture_data`)."""
    return source.startswith("capture:")


def looks_local(source: str) -> bool:
    """Whether a dataset ``source`` names a local file rather than a Hugging Face dataset id: it
    ends in ``.jsonl``/``.ndjson`` (optionally ``.gz``), ``.json``, ``.parquet``, ``.csv`` or
    ``.arrow`` (or another registered file type's ending: :data:`FILE_TYPES`), or starts with ``/``,
    ``./``, ``../`` or ``~``. ``builtin:`` names are not paths."""
    if source.startswith("builtin:") or is_capture_source(source):
        return False
    return source.startswith(("/", "./", "../", "~")) or _file_type_by_suffix(Path(source)) is not None


def missing_local_source(source: str) -> Path | None:
    """The absolute path of ``source`` when it looks local (:func:`looks_local`) and does not
    exist, else None. Flow configs call it to reject a missing file before a run starts."""
    if not looks_local(source):
        return None
    path = Path(source).expanduser()
    return None if path.exists() else path.absolute()


def check_local_source(source: str | None) -> str | None:
    """``source`` unchanged, for a pydantic ``dataset`` field validator.

    Raises:
        ValueError: ``source`` looks local and does not exist; the message names the absolute path.
        UnknownComponentError: an unknown ``builtin:<name>`` (the message lists the registered names).
    """
    if source:
        resolve_source_path(source)
    missing = missing_local_source(source) if source else None
    if missing is not None:
        raise ValueError(f"file not found: {missing}")
    return source


def source_fingerprint(spec: SourceSpec | str) -> str:
    """Content identity of a source: ``sha256:<hex>`` of a local file's bytes (of every file's
    relative path and bytes for a local directory), or ``hf:<id>[:config]`` for a dataset id
    (whose content the hub versions; pin a revision in the id to make it exact)."""
    spec = SourceSpec.coerce(spec)
    if is_capture_source(spec.path):  # the captured rows the filter selects, as read now
        rows = [[c.messages, c.metadata.get("tools")] for c in _captured(spec)]
        return "sha256:" + hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
    path = Path(resolve_source_path(spec.path)).expanduser()
    if path.is_file():  # the bytes only: renaming the file keeps its identity
        return "sha256:" + files_sha256([path], None)
    if path.is_dir():
        return "sha256:" + files_sha256(sorted(p for p in path.rglob("*") if p.is_file()), path)
    return f"hf:{spec.path}" + (f":{spec.config_name}" if spec.config_name else "")


def _resolve(spec: SourceSpec) -> tuple[str, Path]:
    src = resolve_source_path(spec.path)
    path = Path(src).expanduser()
    if missing_local_source(src) is not None:
        raise FileNotFoundError(f"dataset file not found: {path}")
    return src, path


def dataset_records(ds: Iterable[Mapping[str, Any]], label: str, spec: SourceSpec) -> Iterator[RawRecord]:
    """The rows of a Hugging Face ``datasets`` set as records located ``label[split]:row``; for
    ``format="image_classification"`` the ids of its ``ClassLabel`` columns become class names."""
    names = _class_names(ds) if spec.format == "image_classification" else {}
    for i, row in enumerate(ds):
        row = dict(row)
        for col, classes in names.items():  # ClassLabel ids -> class names
            if isinstance(row.get(col), int) and 0 <= row[col] < len(classes):
                row[col] = classes[row[col]]
        yield RawRecord(f"{label}[{spec.split}]:{i}", row)


def _read_hf(src: str, path: Path, spec: SourceSpec) -> Iterator[RawRecord]:
    """Records of a dataset directory or a Hugging Face dataset id."""
    import datasets  # imported lazily: slow to import

    ds = datasets.load_dataset(
        str(path) if path.exists() else src, spec.config_name, split=spec.split, streaming=spec.streaming
    )
    yield from dataset_records(ds, src, spec)


def _class_names(ds: Any) -> dict[str, list[str]]:
    """``{column: class names}`` of a dataset's ``ClassLabel`` columns."""
    features = getattr(ds, "features", None) or {}
    return {k: list(f.names) for k, f in features.items() if type(f).__name__ == "ClassLabel"}


def iter_records(source: SourceSpec | str) -> Iterator[RawRecord]:
    """Records of a source in order, at most ``max_records`` (lazily for JSONL and streaming sets).

    Raises:
        FileNotFoundError: a path-like source that does not exist.
        UnknownComponentError: an unknown ``builtin:<name>``.
    """
    spec = SourceSpec.coerce(source)
    src, path = _resolve(spec)
    it: Iterator[RawRecord]
    if spec.format == "image_folder":
        from prefect_tinker.recipes.media_sources import iter_image_folder

        it = (RawRecord(where, record) for where, record in iter_image_folder(path))
    elif path.is_file():
        it = iter(file_type_of(path, spec.file_type).read(path, spec))
    else:
        it = _read_hf(src, path, spec)
    for n, raw in enumerate(it):
        if spec.max_records is not None and n >= spec.max_records:
            return
        yield raw


def iter_conversations(
    source: SourceSpec | str,
    *,
    on_error: OnError = "raise",
    stats: SkipStats | None = None,
    require_assistant: bool = True,
) -> Iterator[Conversation]:
    """Validated conversations of a source, in record order.

    Args:
        source: a :class:`SourceSpec` or a path / dataset id (``messages`` format).
        on_error: ``"raise"`` or ``"skip"`` (counted in ``stats``, reasons ``malformed_json`` and
            ``bad_record``).
        stats: where skips are counted (a new one when None).
        require_assistant: reject conversations without an assistant message.

    Raises:
        DatasetFormatError: (``on_error="raise"``) e.g. ``"data.jsonl:7: field 'output' is missing
            (record has: instruction, input)"``.
        FileNotFoundError: a missing local file.
    """
    spec = SourceSpec.coerce(source)
    stats = stats if stats is not None else SkipStats()
    if is_capture_source(spec.path):
        yield from _captured(spec, stats)
        return
    local = Path(resolve_source_path(spec.path)).expanduser()
    base = local.parent.resolve() if local.is_file() else None  # relative media paths: next to the file
    for raw in iter_records(spec):
        if raw.error is not None:
            _fail_or_skip(on_error, stats, "malformed_json", f"{raw.where}: {raw.error}")
            continue
        if not isinstance(raw.record, Mapping):
            _fail_or_skip(on_error, stats, "bad_record", f"{raw.where}: expected a JSON object, got {raw.record!r:.60}")
            continue
        try:
            converted = convert_record(raw.record, spec.format, spec.fields, spec.options)
            convs = [
                Conversation(
                    messages=validate_messages(
                        absolutize_media(c.messages, base), raw.where, c.field, require_assistant=require_assistant
                    ),
                    source=raw.where,
                    metadata={**{k: v for k, v in raw.record.items() if k not in c.used}, **(c.metadata or {})},
                    field=c.field,
                )
                for c in converted
            ]
        except RecordError as exc:
            _fail_or_skip(on_error, stats, "bad_record", f"{raw.where}: {exc}")
            continue
        except DatasetFormatError as exc:
            _fail_or_skip(on_error, stats, "bad_record", str(exc))
            continue
        yield from convs


def _captured(spec: SourceSpec, stats: SkipStats | None = None) -> list[Conversation]:
    """The conversations of a ``capture:`` source (request messages + the reply given; tool
    schemas in ``metadata["tools"]``), at most ``max_records``. Replies cut by ``max_tokens``
    (``finish_reason = 'length'``) are skipped and counted in ``stats`` (reason ``truncated``)
    unless ``options.include_truncated`` is true."""
    from prefect_tinker.recipes.capture_data import parse_capture_source, read_captured_conversations

    root, where = parse_capture_source(spec.path)
    include = spec.options.include_truncated
    out: list[Conversation] = []
    for conv in read_captured_conversations(root, where, include_truncated=True):
        if not include and "length" in (conv.metadata.get("finish_reason"), conv.metadata.get("stop_reason")):
            if stats is not None:
                stats.skip(
                    "truncated",
                    f"{conv.source}: the reply was cut at max_tokens "
                    "(options.include_truncated=true keeps such replies)",
                )
            continue
        out.append(conv)
        if spec.max_records is not None and len(out) >= spec.max_records:
            break
    return out


def check_capture_source(spec: SourceSpec) -> None:
    """Read a ``capture:`` source as a run would, before it starts.

    Raises:
        DatasetFormatError: the filter selects no usable conversation; the message gives the
            skip counts (e.g. ``3 skipped: 3 truncated``) and how to keep truncated replies.
        CaptureFilterError: the filter is not one SQL expression, or DuckDB refused it.
    """
    stats = SkipStats()
    if not _captured(spec, stats):
        hint = "; options.include_truncated=true keeps replies cut at max_tokens" if stats.counts["truncated"] else ""
        raise DatasetFormatError(f"no conversations in {spec.path} ({stats.summary()}{hint})")


def _fail_or_skip(on_error: OnError, stats: SkipStats, reason: str, message: str) -> None:
    if on_error == "raise":
        raise DatasetFormatError(message)
    if on_error != "skip":
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    stats.skip(reason, message)
