"""One benchmark example (:class:`Example`): what :mod:`~prefect_tinker.recipes.evals.examples`
reads and the graders (:mod:`~prefect_tinker.recipes.evals.graders`) compare a reply with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefect_tinker.recipes.evals.choice import Choices

__all__ = ["Example"]


@dataclass(frozen=True)
class Example:
    """One benchmark example.

    Attributes:
        id: the ``id`` field's value, else the 0-based position in the source.
        question: the question text.
        reference: the expected answer(s), as graders compare them (a tuple when several).
        choices: lettered options (multiple choice), else None.
        fields: every mapped field's value as read (template placeholders, code runner inputs).
        where: ``file:line`` (or ``dataset[split]:row``) of the record.
    """

    id: str
    question: str
    reference: str | tuple[str, ...]
    choices: Choices | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    where: str = ""

    def reference_text(self) -> str:
        """The reference as one string (JSON list when several), for ``eval_samples.reference``."""
        return self.reference if isinstance(self.reference, str) else json.dumps(list(self.reference))
