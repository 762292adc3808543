"""What a compared recipe is (:class:`Recipe`: the cookbook's program, the two config mappings, which
sample requests are compared) and what every recipe's mapping uses: :func:`our_renderer`, and the
sample-request filters :func:`any_sample` and :func:`prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Recipe:
    name: str  # our recipe (prefect-tinker run NAME)
    cookbook_code: str
    cookbook_args: Callable[..., dict[str, Any]]  # (args, work[, teacher]) -> the cookbook program's arguments
    ours: Callable[..., dict[str, Any]]  # (args, work[, teacher]) -> our config's key=value pairs
    samples: Callable[[dict], bool] | None = None  # which sample requests are compared (None: none)
    # the fields of a sampled sequence compared (default all: weights, prompt, parameters, what came back)
    sample_fields: tuple[str, ...] | None = None
    # compare each optimizer step's forward_backward datums as one set (streaming minibatches are filled in the
    # order groups finish sampling, which neither side controls): the step's datums in a canonical order, the
    # step's summed loss
    by_step: bool = False
    # the recipe needs a teacher (a sampler checkpoint on the server, made by Server.teacher)
    teacher: bool = False


def our_renderer(renderer: str) -> str:
    """Our renderer sending the tokens of the cookbook's ``renderer``: ``role_colon_cookbook`` for its
    ``role_colon`` (ours trains the stop after every reply, takes the tokenizer's own leading tokens and
    escapes role markers in content); any other name as is."""
    return "role_colon_cookbook" if renderer == "role_colon" else renderer


def any_sample(e: dict) -> bool:
    return True


def prompt_logprobs(e: dict) -> bool:
    return bool(e["prompt_logprobs"])
