"""Dataset preparation as one cached Prefect task for every recipe.

``prepare_dataset(builder, tokenizer_id)`` runs ``builder.build(tokenizer)`` (read, validate, split,
render) once; its result is cached across flow runs under a key made of the builder's
:meth:`~prefect_tinker.recipes.builders.DatasetBuilder.fingerprint` (settings plus the *content*
of local files -- never their names), the tokenizer and the task's source, so editing a file
invalidates the cache and renaming it does not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect import get_run_logger, task

from prefect_tinker.recipes.builders import BuiltData, DatasetBuilder, Example, SupervisedData
from prefect_tinker.tasks.clients import tokenizer as load_tokenizer
from prefect_tinker.tasks.policies import cached_options, run_name_from_parameters

__all__ = ["Example", "SupervisedData", "prepare_dataset"]


def _cache_key(context: Any, params: dict[str, Any]) -> str:
    keyed = {"builder": params["builder"].fingerprint(), "tokenizer_id": params["tokenizer_id"]}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def _run_name(parameters: dict[str, Any]) -> str:
    builder: DatasetBuilder = parameters["builder"]
    return f"prepare-{builder.kind or type(builder).__name__.removesuffix('Builder').lower()}-dataset"


@task(
    name="prepare-dataset",
    task_run_name=run_name_from_parameters(_run_name),
    **cached_options(_cache_key),
)
def prepare_dataset(builder: DatasetBuilder, tokenizer_id: str) -> BuiltData[Any, Any]:
    """``builder.build(tokenizer)`` for the tokenizer ``tokenizer_id`` (a local directory or hub
    id), cached by content (see the module docstring). Logs how many records were skipped.
    Returns the builder's data model (``SupervisedBuilder``: ``SupervisedData``, ...).

    Raises:
        DatasetFormatError / FileNotFoundError / ValueError: from the builder, naming the file,
        line and field.
    """
    data = builder.build(load_tokenizer(tokenizer_id))
    if data.skipped:
        get_run_logger().warning("%s: %s", type(builder).__name__, data.skip_summary)
    return data
