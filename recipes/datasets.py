"""Chat datasets: loading and validating conversations, splitting them, making datums.

A conversation is a list of messages ``{"role": "system"|"user"|"assistant"|"tool",
"content": str}`` with at least one assistant message.  Sources:

- a local JSONL file, one JSON object per line holding the messages under
  ``messages_field`` (default ``"messages"``); read line by line so errors name
  ``file:line``;
- ``"builtin:example_chat"``: the small chat set shipped with this package
  (``recipes/data/example_chat.jsonl``, see :data:`EXAMPLE_CHAT_PATH`);
- anything else goes to ``datasets.load_dataset``: a Hugging Face dataset id (needs the
  hub or its local cache), a local dataset directory, or a ``.json``/``.parquet``/``.csv``
  file (loaded with the matching builder).  Errors then name ``source[split]:row``.

:func:`datum_from_example` turns a rendered example (tokens + per-token weights) into a
``tinker.Datum`` with inputs shifted against targets: position i of the model input
predicts ``target_tokens[i]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tinker

__all__ = [
    "EXAMPLE_CHAT_PATH",
    "Conversation",
    "DatasetFormatError",
    "build_datums",
    "datum_from_example",
    "load_conversations",
    "split_conversations",
    "validate_messages",
]

#: The chat set shipped with the package (about 40 short conversations written for it).
EXAMPLE_CHAT_PATH = str(Path(__file__).resolve().parent / "data" / "example_chat.jsonl")

_BUILTIN = {"builtin:example_chat": EXAMPLE_CHAT_PATH}
_ROLES = ("system", "user", "assistant", "tool")
_LOAD_DATASET_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetFormatError(ValueError):
    """A dataset record is malformed; the message names ``file:line`` (or row) and the field."""


@dataclass(frozen=True)
class Conversation:
    """One validated conversation.

    Attributes:
        messages: the messages, each a plain ``{"role", "content"}`` dict.
        source: where it came from, ``"path:line"`` or ``"dataset[split]:row"``.
        metadata: the record's other top-level fields (small values only; kept as read).
    """

    messages: list[dict[str, str]]
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.messages)


def validate_messages(messages: Any, where: str, field_name: str = "messages") -> list[dict[str, str]]:
    """Check one record's messages and return them as plain dicts.

    Args:
        messages: the value of the messages field.
        where: location for error messages, e.g. ``"data.jsonl:12"``.
        field_name: the field's name for error messages.

    Raises:
        DatasetFormatError: not a non-empty list, a message without string ``role`` or
            ``content``, an unknown role, or no assistant message.
    """
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(
            f"{where}: field {field_name!r} must be a non-empty list of messages, got {_short(messages)}"
        )
    out = []
    for i, msg in enumerate(messages):
        loc = f"{where}: field '{field_name}[{i}]"
        if not isinstance(msg, Mapping):
            raise DatasetFormatError(f"{loc}' must be an object with role and content, got {_short(msg)}")
        if "role" not in msg:
            raise DatasetFormatError(f"{loc}.role' is missing")
        if "content" not in msg:
            raise DatasetFormatError(f"{loc}.content' is missing")
        role, content = msg["role"], msg["content"]
        if role not in _ROLES:
            raise DatasetFormatError(f"{loc}.role': unknown role {_short(role)} (expected one of {', '.join(_ROLES)})")
        if not isinstance(content, str):
            raise DatasetFormatError(f"{loc}.content' must be a string, got {_short(content)}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DatasetFormatError(f"{where}: field {field_name!r} has no assistant message to train on")
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _conversation_from_record(record: Any, where: str, messages_field: str) -> Conversation:
    if not isinstance(record, Mapping):
        raise DatasetFormatError(f"{where}: expected a JSON object, got {_short(record)}")
    if messages_field not in record:
        raise DatasetFormatError(
            f"{where}: field {messages_field!r} is missing (record has: {', '.join(map(str, record)) or 'no fields'})"
        )
    messages = validate_messages(record[messages_field], where, messages_field)
    meta = {k: v for k, v in record.items() if k != messages_field}
    return Conversation(messages=messages, source=where, metadata=meta)


def _load_jsonl(path: Path, messages_field: str) -> list[Conversation]:
    convs = []
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            convs.append(_conversation_from_record(record, where, messages_field))
    return convs


def _load_with_datasets(source: str, split: str, messages_field: str) -> list[Conversation]:
    import datasets  # imported lazily: it is slow to import

    suffix = Path(source).suffix.lower()
    if suffix in _LOAD_DATASET_BUILDERS and Path(source).is_file():
        ds = datasets.load_dataset(_LOAD_DATASET_BUILDERS[suffix], data_files=source, split=split)
    else:
        ds = datasets.load_dataset(source, split=split)
    if messages_field not in ds.column_names:
        raise DatasetFormatError(
            f"{source}[{split}]: field {messages_field!r} is missing (columns: {', '.join(ds.column_names)})"
        )
    return [_conversation_from_record(row, f"{source}[{split}]:{i}", messages_field) for i, row in enumerate(ds)]


def load_conversations(
    source: str | os.PathLike[str], *, messages_field: str = "messages", split: str = "train"
) -> list[Conversation]:
    """Load and validate every conversation of a dataset.

    Args:
        source: a ``.jsonl`` path, ``"builtin:example_chat"``, a local ``.json``/``.parquet``/
            ``.csv`` file or dataset directory, or a Hugging Face dataset id.
        messages_field: the field holding the list of messages.
        split: split for ``datasets.load_dataset`` sources (ignored for JSONL files).

    Returns:
        Conversations in file order.

    Raises:
        FileNotFoundError: a path-like source (``.jsonl``, ``/``, ``./``, ``~``) that does not exist.
        DatasetFormatError: malformed JSON, missing field, unknown role, non-string content,
            a conversation without an assistant message, or an empty dataset; the message
            names ``file:line`` (or ``source[split]:row``) and the field.
    """
    src = _BUILTIN.get(str(source), str(source))
    path = Path(src).expanduser()
    if path.suffix.lower() == ".jsonl" or src.startswith(("/", "./", "../", "~")):
        if not path.exists():
            raise FileNotFoundError(f"dataset file not found: {path}")
    if path.is_file() and path.suffix.lower() in (".jsonl", ".ndjson"):
        convs = _load_jsonl(path, messages_field)
    else:
        convs = _load_with_datasets(str(path) if path.exists() else src, split, messages_field)
    if not convs:
        raise DatasetFormatError(f"{src}: dataset has no conversations")
    return convs


def split_conversations(
    conversations: Sequence[Conversation], test_size: int | float, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic train/test split.

    Args:
        conversations: the items to split (any sequence works).
        test_size: number of test items (int >= 0) or a fraction in [0, 1) (rounded, at least
            one item when the fraction is > 0).
        seed: seed of the permutation choosing the test items (same seed, same split).

    Returns:
        ``(train, test)``, each in the original relative order.

    Raises:
        ValueError: a negative size, a fraction outside [0, 1), or a split leaving no
            training item.
    """
    n = len(conversations)
    if isinstance(test_size, bool) or not isinstance(test_size, (int, float)):
        raise ValueError(f"test_size must be an int count or a float fraction, got {test_size!r}")
    if isinstance(test_size, float):
        if not 0.0 <= test_size < 1.0:
            raise ValueError(f"test_size fraction must be in [0, 1), got {test_size}")
        n_test = max(1, round(n * test_size)) if test_size > 0 else 0
    else:
        if test_size < 0:
            raise ValueError(f"test_size must be >= 0, got {test_size}")
        n_test = test_size
    if n_test >= n:
        raise ValueError(f"test_size={test_size!r} leaves no training conversation out of {n}")
    order = np.random.default_rng(seed).permutation(n)
    test_idx = set(order[:n_test].tolist())
    train = [c for i, c in enumerate(conversations) if i not in test_idx]
    test = [c for i, c in enumerate(conversations) if i in test_idx]
    return train, test


def datum_from_example(
    model_input: tinker.ModelInput | Sequence[int], weights: Any, max_length: int | None = None
) -> tinker.Datum:
    """Make a next-token-prediction datum from a rendered example.

    With the example's N tokens ``t`` and weights ``w`` (after truncation to
    ``max_length`` tokens), the datum has model input ``t[:-1]`` and ``loss_fn_inputs``
    ``target_tokens = t[1:]`` (int64, shape (N-1,)) and ``weights = w[1:]`` (float32,
    shape (N-1,)), so position i of the input predicts ``target_tokens[i]``.

    Args:
        model_input: the example's tokens (``tinker.ModelInput`` of token chunks, or ints).
        weights: per-token weights, shape (N,).
        max_length: keep at most this many tokens of the example (the model input then has
            at most ``max_length - 1``); None keeps everything.

    Raises:
        ValueError: weights not of shape (N,), fewer than 2 tokens, ``max_length < 2``, or
            no positive weight left among the targets after truncation.
    """
    tokens = model_input.to_ints() if isinstance(model_input, tinker.ModelInput) else [int(t) for t in model_input]
    w = np.asarray(weights, dtype=np.float32)
    if w.shape != (len(tokens),):
        raise ValueError(f"weights have shape {w.shape}, expected ({len(tokens)},) to match the tokens")
    if max_length is not None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        tokens, w = tokens[:max_length], w[:max_length]
    if len(tokens) < 2:
        raise ValueError(f"an example needs at least 2 tokens to make a datum, got {len(tokens)}")
    target_w = w[1:]
    if not (target_w > 0).any():
        raise ValueError(
            f"no trained token left in the example (length {len(tokens)}"
            + (f", max_length={max_length}" if max_length is not None else "")
            + "): all target weights are 0"
        )
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ascontiguousarray(target_w)),
        },
    )


def build_datums(
    conversations: Sequence[Conversation | Sequence[Mapping[str, str]]],
    renderer: Any,
    max_length: int | None = None,
    train_on_what: str = "all_assistant_messages",
    *,
    skip_empty: bool = True,
) -> list[tinker.Datum]:
    """Render conversations with ``renderer`` and make one datum each.

    Args:
        conversations: conversations (or plain message lists).
        renderer: a :class:`recipes.renderers.Renderer`.
        max_length: passed to :func:`datum_from_example`.
        train_on_what: passed to ``renderer.build_supervised_example``.
        skip_empty: drop conversations with no trained token left after truncation instead
            of raising.

    Raises:
        ValueError: a conversation cannot be rendered or (``skip_empty=False``) has no
            trained token; the message names the conversation's source.
    """
    datums = []
    for i, conv in enumerate(conversations):
        where = getattr(conv, "source", "") or f"conversation {i}"
        try:
            model_input, weights = renderer.build_supervised_example(conv, train_on_what)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        try:
            datums.append(datum_from_example(model_input, weights, max_length))
        except ValueError as exc:
            if skip_empty and "no trained token" in str(exc):
                continue
            raise ValueError(f"{where}: {exc}") from exc
    return datums
