"""Datasets named by ``builtin:<name>`` sources: the files shipped with the package, the registry
plugins add theirs to, and the resolution of a source's ``builtin:<name>`` to its path."""

from __future__ import annotations

from pathlib import Path

from prefect_tinker.recipes.registry import Registry

__all__ = [
    "BUILTIN_DATASETS",
    "EXAMPLE_CHAT_PATH",
    "EXAMPLE_PREFS_PATH",
    "FORECASTING_QUESTIONS_PATH",
    "SENTIMENT_SENTENCES_PATH",
    "register_builtin_dataset",
    "resolve_source_path",
]

#: The chat set shipped with the package (about 40 short conversations written for it).
EXAMPLE_CHAT_PATH = str(Path(__file__).resolve().parent / "data" / "example_chat.jsonl")
#: The comparisons shipped with the package (40 prompts with a better and a worse reply, written for it).
EXAMPLE_PREFS_PATH = str(Path(__file__).resolve().parent / "data" / "example_prefs.jsonl")
#: 64 short sentences written for the package, half plainly positive and half plainly negative
#: (``{"text", "label"}``): raw inputs for prompt distillation of a classification instruction.
SENTIMENT_SENTENCES_PATH = str(Path(__file__).resolve().parent / "data" / "sentiment_sentences.jsonl")
#: 40 yes/no questions written for the package, half resolved yes (``{"question", "resolution"}``).
FORECASTING_QUESTIONS_PATH = str(Path(__file__).resolve().parent / "data" / "forecasting_questions.jsonl")

#: Datasets named by ``builtin:<name>`` sources: the path of a local data file or dataset
#: directory by name (read like any local source); plugins add more through the entry-point group
#: ``prefect_tinker.builtin_datasets`` (an entry point naming a path string).
BUILTIN_DATASETS: Registry[str | Path] = Registry("builtin dataset", "prefect_tinker.builtin_datasets")


def register_builtin_dataset(name: str, path: str | Path) -> str | Path:
    """Make ``builtin:<name>`` read the local data file or dataset directory ``path`` (overwrites);
    the same as an entry point of group ``prefect_tinker.builtin_datasets`` naming a path."""
    return BUILTIN_DATASETS.register(name, path)


for _name, _path in {
    "example_chat": EXAMPLE_CHAT_PATH,
    "example_prefs": EXAMPLE_PREFS_PATH,
    "sentiment_sentences": SENTIMENT_SENTENCES_PATH,
    "forecasting_questions": FORECASTING_QUESTIONS_PATH,
}.items():
    register_builtin_dataset(_name, _path)


def resolve_source_path(source: str) -> str:
    """``source`` with a ``builtin:<name>`` replaced by the path registered for it
    (:data:`BUILTIN_DATASETS`), else unchanged.

    Raises:
        UnknownComponentError: an unknown builtin name (the message lists the registered names).
    """
    if source.startswith("builtin:"):
        return str(BUILTIN_DATASETS.get_or_raise(source.removeprefix("builtin:")))
    return source
