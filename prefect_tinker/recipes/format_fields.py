"""The ``format`` / ``fields`` / ``options`` of a dataset source, validated as a union tagged by
``format`` (shared by :class:`~prefect_tinker.recipes.data_reading.SourceSpec` and a recipe's data
fields, :class:`~prefect_tinker.recipes.builders.SourceFields`)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from prefect_tinker.recipes.data_sources import CONVERTERS, converter_names, data_format
from prefect_tinker.recipes.format_options import FormatOptions
from prefect_tinker.recipes.registry import tagged_options, tagged_union_schema

__all__ = ["FormatFields"]


class FormatFields(BaseModel):
    """Validation shared by the models that name a dataset ``format`` with its ``fields`` and
    ``options`` (a data source, a recipe's data fields): ``options`` becomes an instance of the
    options model of the format ``format`` names (a union tagged by ``format``: an unknown or bad
    option fails as ``format '<name>': options.<field>: <problem>``); a dump holds the options as
    given, defaults left out, so stored configs and data fingerprints read as before options were
    typed; the JSON schema spells the union out (one ``if format == <name>`` branch per format).
    The subclass declares the three fields (``options: FormatOptions``)."""

    model_config = ConfigDict(json_schema_extra=lambda schema, cls: _format_union_schema(schema))

    @model_validator(mode="before")
    @classmethod
    def _typed_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("format", cls.model_fields["format"].default)
        if not isinstance(name, str) or name not in CONVERTERS:
            return data  # the field's own validation names the problem
        options = tagged_options("format", name, data_format(name).Options, data.get("options"))
        return {**data, "options": options}

    @field_validator("format", check_fields=False)
    @classmethod
    def _known_format(cls, name: str) -> str:
        data_format(name)
        return name

    @field_serializer("options", check_fields=False)
    def _given_options(self, options: FormatOptions, info: SerializationInfo) -> dict[str, Any]:
        return options.model_dump(mode=info.mode, exclude_unset=True)


def _format_union_schema(schema: dict[str, Any]) -> None:
    """``options`` of a :class:`FormatFields` model in its JSON schema: the registered formats'
    option models (flat models, inlined), tagged by ``format``."""
    branches = {name: data_format(name).Options.model_json_schema() for name in converter_names()}
    tagged_union_schema(schema, tag="format", field="options", branches=branches, default="messages")
