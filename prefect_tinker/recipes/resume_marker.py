"""Which fields of a recipe's config a resumed run must keep: the :data:`RESUME` marker on a field's
annotation (``seed: Annotated[int, RESUME] = Field(...)``), read by :func:`resume_fields`.

A marked field changes the data position or the objective (batch size, seed, loss, record format):
:func:`~prefect_tinker.flows.resume_checks.check_resumed_config` refuses a resumed run whose config
differs from the stored one in it, unless the field is listed in the config's
``allow_config_change``. The marker travels with the field through mixins (a config that uses
:class:`~prefect_tinker.recipes.builders.SourceFields` or
:class:`~prefect_tinker.recipes.rl.envs.EnvSpec` gets their marked fields), and a field stays
marked in a subclass that declares it again (a new default or description).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

__all__ = ["RESUME", "ResumeField", "resume_fields"]


@dataclass(frozen=True)
class ResumeField:
    """The marker class: ``Annotated[T, ResumeField()]`` (spelled :data:`RESUME`) on a pydantic
    field of a recipe's config makes it one that a resumed run must keep."""


RESUME = ResumeField()


def resume_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` marked :data:`RESUME` by ``model`` or by a base class declaring the
    same field, in the model's field order."""
    bases = [b for b in model.__mro__ if isinstance(b, type) and issubclass(b, BaseModel)]
    return tuple(
        name
        for name in model.model_fields
        if any(
            isinstance(m, ResumeField) for b in bases if name in b.model_fields for m in b.model_fields[name].metadata
        )
    )
