"""Supervised sequences for top-K soft targets: each conversation's last assistant reply rendered
for the student, with the prompt messages kept so the teacher can render its own prompt.

:class:`SoftTargetBuilder` is a :class:`~prefect_tinker.recipes.builders.DatasetBuilder` (its
fingerprint keys ``prepare-dataset``); it reads conversations with the shared readers, splits them
with the shared seeded split and renders each with the run's renderer
(``train_on_what="last_assistant_message"``), keeping tokens up to the reply's last trained token.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from prefect_tinker.recipes.builders import BuiltData, DatasetBuilder
from prefect_tinker.recipes.data_pipeline import render_example
from prefect_tinker.recipes.data_reading import OnError, SkipStats, iter_conversations
from prefect_tinker.recipes.data_sources import DatasetFormatError
from prefect_tinker.recipes.datasets import split_conversations
from prefect_tinker.recipes.distill.prompts import PromptRecord, freeze

__all__ = ["SoftData", "SoftExample", "SoftTargetBuilder"]


class SoftExample(BaseModel):
    """One rendered sequence: ``tokens`` (T,), ``prompt_len`` (tokens of the student's prompt; the
    reply starts there), ``prompt`` (the messages before the reply, for the teacher), ``id``."""

    tokens: list[int]
    prompt_len: int
    prompt: PromptRecord
    id: str = ""


class SoftData(BuiltData[SoftExample, SoftExample]):
    """Rendered train and held-out sequences of a :class:`SoftTargetBuilder`."""


class SoftTargetBuilder(DatasetBuilder):
    """Conversations -> :class:`SoftExample` s (see the module docstring)."""

    kind: ClassVar[str] = "soft-targets"
    max_length: int = 512
    on_error: OnError = "raise"
    test_size: float | int = 0.1
    on_too_long: Literal["truncate", "skip"] = "truncate"

    def build(self, tokenizer: Any) -> SoftData:
        from prefect_tinker.recipes.renderers import get_renderer

        rend = get_renderer(self.renderer, tokenizer)
        stats = SkipStats()
        convs = [c for spec in self.sources for c in iter_conversations(spec, on_error=self.on_error, stats=stats)]
        if not convs:
            raise DatasetFormatError(
                f"no conversations in {', '.join(s.path for s in self.sources)} ({stats.summary()})"
            )
        train, test = split_conversations(convs, self.test_size, seed=self.seed) if self.test_size else (convs, [])

        def examples(items) -> list[SoftExample]:
            out = []
            for conv in items:
                if conv.messages[-1]["role"] != "assistant":
                    stats.skip("bad_record", f"{conv.source}: the last message is not an assistant reply")
                    continue
                rendered = render_example(
                    rend,
                    conv,
                    train_on_what="last_assistant_message",
                    max_length=self.max_length,
                    on_too_long=self.on_too_long,
                )
                if rendered is None:
                    stats.skip("too_long", f"{conv.source}: longer than max_length={self.max_length}")
                    continue
                tokens, weights = rendered
                trained = [i for i, w in enumerate(weights) if w > 0]
                prompt = [{k: m[k] for k in ("role", "content")} for m in conv.messages[:-1]]
                record = PromptRecord(freeze(prompt), str(conv.messages[-1]["content"]), conv.source)
                out.append(
                    SoftExample(
                        tokens=list(tokens[: trained[-1] + 1]), prompt_len=trained[0], prompt=record, id=conv.source
                    )
                )
            return out

        data_train, data_test = examples(train), examples(test)
        if not data_train:
            raise DatasetFormatError(f"no training sequence left ({stats.summary()})")
        return SoftData(
            fingerprint=self.fingerprint(),
            renderer=self.renderer,
            train=data_train,
            test=data_test,
            skipped=stats.total,
            skip_summary=stats.summary(),
        )
