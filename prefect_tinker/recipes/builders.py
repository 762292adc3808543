"""Dataset builders: pydantic models that say what a recipe trains on, with a fingerprint (the
cache key of the prepared data) and ``build(tokenizer)`` giving the train and test splits.

- :class:`SourceFields`: the data fields every data-driven recipe config shares (``dataset``,
  ``format``, ``fields``, ``options``, several weighted ``sources``, ``test_size``,
  ``max_length``, ``on_error``), turned into :class:`~prefect_tinker.recipes.data_reading.SourceSpec`
  s by :meth:`SourceFields.source_specs`.
- :class:`DatasetBuilder`: the interface (``fingerprint()``, ``build(tokenizer)``,
  ``uris()`` for asset lineage, ``check()`` reading the records before anything runs).
- :class:`SupervisedBuilder`: chat conversations -> rendered ``(tokens, weights)`` examples
  through the one supervised pipeline, :class:`~prefect_tinker.recipes.data_pipeline.SupervisedDataset`.

Other builders live with their recipe (preference pairs: :mod:`prefect_tinker.recipes.preference`).
The renderer a builder gets is a concrete name (the run session resolves ``auto`` once per run).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import tinker
from pydantic import BaseModel, Field, WithJsonSchema, field_validator, model_validator

from prefect_tinker.recipes.builtin_datasets import EXAMPLE_CHAT_PATH, resolve_source_path
from prefect_tinker.recipes.data_pipeline import DataOrder
from prefect_tinker.recipes.data_reading import (
    OnError,
    SourceSpec,
    check_capture_source,
    check_file_type,
    check_local_source,
    is_capture_source,
    source_fingerprint,
)
from prefect_tinker.recipes.datasets import datum_from_example
from prefect_tinker.recipes.format_fields import FormatFields
from prefect_tinker.recipes.format_options import FormatOptions
from prefect_tinker.recipes.media import MediaSpan, media_spans, restore_media
from prefect_tinker.recipes.registry import TaggedBy
from prefect_tinker.recipes.resume_marker import RESUME

__all__ = [
    "BuiltData",
    "DatasetBuilder",
    "Example",
    "PreferenceSourceFields",
    "SourceFields",
    "SupervisedBuilder",
    "SupervisedData",
]


class Example(BaseModel):
    """One rendered sequence: ``tokens`` (T,) and ``weights`` (T,) (1.0 on trained tokens), and
    its ``media`` by reference (image / audio files with their SHA-256 and the positions they
    fill; ``tokens`` holds the placeholder ids there): small and picklable, no pixels.  Make its
    datum with :func:`~prefect_tinker.recipes.datasets.datum_from_example` (``(example)``)."""

    tokens: list[int]
    weights: list[float]
    media: list[MediaSpan] = Field(default_factory=list)

    @classmethod
    def from_sequence(cls, tokens: Any, weights: Any) -> Example:
        """An example from a rendered token list (media as MediaToken runs) and its weights."""
        return cls(tokens=[int(t) for t in tokens], weights=[float(x) for x in weights], media=media_spans(tokens))

    def sequence(self) -> list[int]:
        """``tokens`` with the media positions as MediaToken runs again."""
        return restore_media(self.tokens, self.media) if self.media else list(self.tokens)

    def datum(
        self, max_length: int | None = None, reduction: Literal["none", "mean"] = "none", keep_untrained: bool = False
    ) -> tinker.Datum:
        """The example's next-token-prediction datum (media read from their files and checked
        against their SHA-256): :func:`~prefect_tinker.recipes.datasets.datum_from_example` of
        :meth:`sequence` and ``weights`` (``reduction``, ``keep_untrained`` as there).

        Raises:
            MediaError: a media file is missing or changed since it was rendered; ValueError as
                ``datum_from_example``.
        """
        return datum_from_example(self.sequence(), self.weights, max_length, reduction, keep_untrained)

    def prompt(self) -> list[int]:
        """The positions before the first trained token (media kept): what a sampler continues."""
        first = next((i for i, w in enumerate(self.weights) if w > 0), len(self.tokens))
        return self.sequence()[:first]


class SourceFields(FormatFields):
    """Where a recipe's records come from (fields of the recipe's config).

    One source: ``dataset`` (a JSONL file, local dataset file/dir, ``builtin:example_chat`` or a
    Hugging Face dataset id) read in ``format`` with the field mapping ``fields``; several
    weighted sources: ``sources`` (each a full :class:`SourceSpec`; then ``dataset`` is unset: a config's
    default ``dataset`` is dropped, one given too is an error).
    The one mixin of the data-driven recipes' configs (sft, dpo, reward_model, decisions): ``format``,
    ``fields``, ``sources``, ``test_size`` and ``max_length`` are marked
    :data:`~prefect_tinker.recipes.resume_marker.RESUME` for all of them.
    """

    dataset: str | None = Field(
        default=None,
        description="JSONL file, local dataset file/dir, 'builtin:example_chat' or a Hugging Face dataset id.",
    )
    format: Annotated[str, RESUME] = Field(
        default="messages",
        description="Record format of `dataset` (messages, sharegpt, instruction, prompt_completion, dialogue, "
        "self_instruct, preference, ...).",
    )
    fields: Annotated[dict[str, str], RESUME] = Field(
        default_factory=dict,
        description="Field mapping of `dataset`: format field -> record path (dotted, e.g. meta.answer).",
    )
    options: Annotated[FormatOptions, TaggedBy("format"), WithJsonSchema({"type": "object"})] = Field(
        default_factory=FormatOptions,
        description="Options of `format` for `dataset` (system_prompt, ...; unknown keys are errors).",
    )
    split: str = Field(default="train", description="Split of a Hugging Face `dataset`.")
    max_records: int | None = Field(
        default=None,
        ge=1,
        description="Read at most this many records of `dataset` (the first ones, before the split).",
    )
    sources: Annotated[list[SourceSpec], RESUME] = Field(
        default_factory=list,
        description="Several weighted sources instead of `dataset` (each: path, format, fields, options, weight, ...).",
    )
    test_size: Annotated[float, RESUME] = Field(
        default=0.1, ge=0, description="Held-out fraction (<1) or count (>=1), split with `seed`."
    )
    max_length: Annotated[int, RESUME] = Field(default=512, ge=8, description="Most tokens of one example.")
    on_error: OnError = Field(
        default="raise", description="A bad record: 'raise' (error naming file, line and field) or 'skip' (counted)."
    )

    @field_validator("dataset")
    @classmethod
    def _dataset_readable(cls, dataset: str | None) -> str | None:
        # a missing file, or one whose ending no file type reads, fails here (before a run starts)
        if dataset := check_local_source(dataset):
            check_file_type(dataset)
        return dataset

    @model_validator(mode="before")
    @classmethod
    def _sources_alone(cls, data: Any) -> Any:
        # sources given without dataset: the config's default dataset is not "given" (left unset, not both)
        if isinstance(data, dict) and data.get("sources") and "dataset" not in data:
            return {**data, "dataset": None}
        return data

    @model_validator(mode="after")
    def _one_way(self) -> SourceFields:
        if self.sources and self.dataset is not None:
            raise ValueError("give either dataset=... or sources=[...], not both")
        if self.sources and self.max_records is not None:
            raise ValueError("max_records applies to dataset=...: give each of sources=[...] its own max_records")
        for i, spec in enumerate(self.sources):
            try:
                check_local_source(spec.path)
                check_file_type(spec.path, spec.file_type)
            except ValueError as exc:
                raise ValueError(f"sources[{i}].path: {exc}") from None
        return self

    def source_specs(self, default: str | None = None) -> list[SourceSpec]:
        """The sources as specs (``dataset`` -> one spec; ``default`` when neither is given).

        Raises:
            ValueError: no source at all.
        """
        if self.sources:
            return list(self.sources)
        path = self.dataset or default
        if path is None:
            raise ValueError("dataset: required (a JSONL file, dataset directory or Hugging Face id)")
        return [
            SourceSpec(
                path=path,
                format=self.format,
                fields=self.fields,
                options=self.options,
                split=self.split,
                max_records=self.max_records,
            )
        ]

    def test_count(self) -> float | int:
        """``test_size`` as the split functions take it: an int count when >= 1, else a fraction."""
        return int(self.test_size) if self.test_size >= 1 else float(self.test_size)


class PreferenceSourceFields(SourceFields):
    """:class:`SourceFields` of a recipe that reads comparisons (DPO, the reward model): the same
    fields, records in the ``preference`` format by default."""

    format: str = Field(
        default="preference",
        description="Record format: preference ({prompt?, chosen, rejected}) or dialogue (HH-RLHF transcripts).",
    )


class DatasetBuilder(BaseModel, ABC):
    """What a recipe trains on: a pure description (hashable into :meth:`fingerprint`) that
    :meth:`build` turns into data for one tokenizer."""

    sources: list[SourceSpec]
    renderer: str = Field(description="A concrete renderer name (resolved from 'auto' by the run session).")
    seed: int = 0
    # bumped when build() makes other data from the same settings (a cached dataset is then rebuilt)
    build_version: ClassVar[int] = 1
    # the data's short name in task-run names (``prepare-<kind>-dataset``); empty: the class name
    # without ``Builder``, lower-case
    kind: ClassVar[str] = ""

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the builder's settings with each local source replaced by the hash
        of its content (editing a file changes it, renaming it does not)."""
        body = self.model_dump(mode="json", exclude={"sources"})
        body["kind"] = type(self).__name__
        if body.get("data_order") == "seeded":  # the default, which earlier builders had implicitly
            del body["data_order"]
        if self.build_version > 1:
            body["build_version"] = self.build_version
        body["sources"] = [
            dict(s.model_dump(mode="json", exclude={"path"}), content=source_fingerprint(s)) for s in self.sources
        ]
        return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def uris(self) -> list[str]:
        """Asset URIs of the sources: ``file:///abs/path`` for local ones, ``hf://datasets/<id>`` else."""
        out = []
        for spec in self.sources:
            path = resolve_source_path(spec.path)
            if is_capture_source(path):  # the capture store the conversations came from
                root = path.removeprefix("capture:").split("::", 1)[0].strip()
                out.append(root if "://" in root else Path(root).resolve().as_uri())
            else:
                out.append(Path(path).resolve().as_uri() if Path(path).exists() else f"hf://datasets/{spec.path}")
        return out

    def check(self) -> None:
        """Read and validate every record of the local sources without rendering (no tokenizer,
        no server): a bad record fails here, naming file, line and field, before a run starts.
        ``capture:`` sources are read too (a filter selecting nothing usable fails here).
        Hugging Face ids are read by :meth:`build` only (they may be large or remote).

        Raises:
            DatasetFormatError / FileNotFoundError: as :meth:`build`.
        """
        for spec in self.sources:
            if is_capture_source(spec.path):  # captured conversations: read now, truncated replies counted
                check_capture_source(spec)
            elif Path(resolve_source_path(spec.path)).expanduser().exists():
                self._check_source(spec)

    def _check_source(self, spec: SourceSpec) -> None:
        """Read one local source's records (subclasses: through their own converter)."""

    @abstractmethod
    def build(self, tokenizer: Any) -> BuiltData[Any, Any]:
        """Read, validate, split and render the data for ``tokenizer``.

        Raises:
            DatasetFormatError: a bad record (the message names file, line and field).
            FileNotFoundError: a missing local source.
        """


TrainT = TypeVar("TrainT")
TestT = TypeVar("TestT")


class BuiltData(BaseModel, Generic[TrainT, TestT]):
    """What a builder's ``build`` returns: rendered train and held-out items, the builder's
    fingerprint and renderer, and the records it dropped (too long, nothing trained within
    ``max_length``, bad record) with a summary by reason."""

    fingerprint: str
    renderer: str
    train: list[TrainT]
    test: list[TestT]
    skipped: int = 0
    skip_summary: str = "0 skipped"


class SupervisedData(BuiltData[Example, Example]):
    """Rendered train and held-out examples of a :class:`SupervisedBuilder`."""


class SupervisedBuilder(DatasetBuilder):
    """Chat conversations for supervised fine-tuning, through
    :class:`~prefect_tinker.recipes.data_pipeline.SupervisedDataset` (weighted interleaving of the
    sources, seeded train/test split, rendering with ``train_on_what``, truncation)."""

    kind: ClassVar[str] = "sft"
    train_on_what: str = "all_assistant_messages"
    max_length: int = 512
    on_too_long: Literal["truncate", "truncate_keep", "skip", "error"] = "truncate"
    on_error: OnError = "raise"
    test_size: float | int = 0.1
    data_order: DataOrder = "seeded"
    stopping: Literal["first_exhausted", "all_exhausted", "each_once"] = "each_once"
    renderer_options: dict[str, Any] = Field(default_factory=dict)

    def _check_source(self, spec: SourceSpec) -> None:
        from prefect_tinker.recipes.data_reading import SkipStats, iter_conversations

        for _ in iter_conversations(spec, on_error=self.on_error, stats=SkipStats(keep=0)):  # build() logs skips
            pass

    def build(self, tokenizer: Any) -> SupervisedData:
        from prefect_tinker.recipes.data_pipeline import SupervisedDataset
        from prefect_tinker.recipes.renderers import get_renderer

        if any(s.streaming for s in self.sources):
            raise ValueError(
                "streamed sources cannot be prepared in memory for SFT; set streaming=false "
                "(and max_records to bound a large set)"
            )
        rend = get_renderer(self.renderer, tokenizer, **self.renderer_options)
        ds = SupervisedDataset(
            self.sources,
            rend,
            batch_size=1,
            max_length=self.max_length,
            train_on_what=self.train_on_what,
            on_too_long=self.on_too_long,
            on_error=self.on_error,
            test_size=self.test_size,
            seed=self.seed,
            data_order=self.data_order,
            stopping=self.stopping,
        )

        def examples(pairs):
            return [Example.from_sequence(t, w) for t, w in pairs]

        return SupervisedData(
            fingerprint=self.fingerprint(),
            renderer=self.renderer,
            train=examples(ds.train_examples()),
            test=examples(ds.test_examples()),
            skipped=ds.stats.total,
            skip_summary=ds.stats.summary(),
        )


#: The bundled example chats (the SFT default dataset).
EXAMPLE_CHATS = EXAMPLE_CHAT_PATH
