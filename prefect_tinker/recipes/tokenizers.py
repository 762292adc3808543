"""Loading a tokenizer by name, for the tools that render or decode outside a run (no Prefect)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["resolve_tokenizer"]


def resolve_tokenizer(name: str, cache_dir: str | None = None) -> Any:
    """A tokenizer from a local directory, a local-server preset (``tiny``, ``smollm2``) or a cached HF id.

    Raises:
        ValueError: it cannot be loaded (the message says what was tried).
    """
    from transformers import AutoTokenizer

    if Path(name).expanduser().is_dir():
        return AutoTokenizer.from_pretrained(str(Path(name).expanduser()))
    if name in ("tiny", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        from tinker_local.models import resolve_model  # optional: only for the presets

        root = Path(cache_dir or os.environ.get("PREFECT_TINKER_HOME") or Path.home() / ".prefect-tinker") / "models"
        return AutoTokenizer.from_pretrained(resolve_model(name, root).tokenizer_dir)
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise ValueError(
            f"cannot load tokenizer {name!r}: not a local directory, not a preset (tiny, smollm2), "
            f"and not loadable from the Hugging Face cache ({type(exc).__name__}: {exc})"
        ) from None
