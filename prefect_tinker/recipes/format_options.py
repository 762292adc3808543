"""Typed options of the dataset formats, and the registered form of a format.

A dataset source names a ``format`` and gives that format's ``options``; like an RL config's
``env_options``, ``options`` is a union of the registered formats' option models tagged by
``format`` (:class:`~prefect_tinker.recipes.format_fields.FormatFields`): validation turns the given
mapping into the model of the format named, so an unknown or misspelt option fails before
anything is read, as ``options.<field>: <problem>``.

Every format takes :class:`FormatOptions` (``system_prompt``, ``include_truncated``); a format
with options of its own registers a subclass with it (:class:`DataFormat`). A plugin's format
registered as a bare function (an entry point of ``prefect_tinker.formats`` naming a function)
takes any option and receives them as a plain dict, as formats did before options were typed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.record_fields import Converted

__all__ = ["AnyOptions", "DataFormat", "FormatOptions"]


class FormatOptions(BaseModel):
    """Options every dataset format takes (any other key is an error)."""

    model_config = ConfigDict(extra="forbid")

    system_prompt: str | None = Field(
        default=None, description="A system message put first in each conversation that has none."
    )
    include_truncated: bool = Field(
        default=False,
        description="Capture sources: keep replies cut at max_tokens (finish_reason 'length'); skipped by default.",
    )


class AnyOptions(FormatOptions):
    """Options of a format registered as a bare function: any key, passed on as a dict."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True)
class DataFormat:
    """A registered dataset format: ``convert(record, fields, options) -> list[Converted]`` and
    the model of its ``options`` (``options`` reaches ``convert`` as an instance of it).

    A bare function registered as a format is wrapped with :class:`AnyOptions`, its options passed
    as a dict (:meth:`of`).
    """

    convert: Callable[[Any, Mapping[str, str], Any], list[Converted]]
    Options: type[FormatOptions] = FormatOptions
    options_as_dict: bool = False

    @classmethod
    def of(cls, component: DataFormat | Callable[..., list[Converted]]) -> DataFormat:
        """``component`` as a :class:`DataFormat` (a bare function: any option, as a dict)."""
        if isinstance(component, DataFormat):
            return component
        return cls(component, AnyOptions, options_as_dict=True)

    def __call__(self, record: Any, fields: Mapping[str, str], options: FormatOptions) -> list[Converted]:
        return self.convert(record, fields, options.model_dump() if self.options_as_dict else options)
