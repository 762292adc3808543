"""Chat datasets: loading and validating conversations, splitting them, making datums.

A conversation is a list of messages ``{"role": "system"|"user"|"assistant"|"tool",
"content": str, ...}`` with at least one assistant message.  :func:`load_conversations` reads any
source :mod:`prefect_tinker.recipes.data_reading` knows (JSONL files, gzipped JSONL, ``builtin:example_chat``, local
dataset files and directories, Hugging Face dataset ids, streamed or not) in any record format
:mod:`prefect_tinker.recipes.data_sources` converts (``messages``, ``sharegpt``, ``instruction``/Alpaca/Dolly,
``prompt_completion``, ``dialogue``/HH, ``self_instruct``).  Errors name ``file:line`` (or
``source[split]:row``) and the field.

:func:`datum_from_example` turns a rendered example (tokens + per-token weights) into a
``tinker.Datum`` with inputs shifted against targets: position i of the model input predicts
``target_tokens[i]``.  :mod:`prefect_tinker.recipes.data_pipeline` builds whole training sets (interleaving,
splits, epochs, truncation, batches) on top of these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import tinker

from prefect_tinker.recipes.builtin_datasets import EXAMPLE_CHAT_PATH
from prefect_tinker.recipes.data_reading import OnError, SkipStats, SourceSpec, iter_conversations
from prefect_tinker.recipes.data_sources import Conversation, DatasetFormatError, validate_messages
from prefect_tinker.recipes.media import MediaToken, model_input_from_tokens, safe_cut, tokens_from_model_input

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


ItemT = TypeVar("ItemT")  # an item of a split (a Conversation, a decision example, ...)


def load_conversations(
    source: str | os.PathLike[str] | SourceSpec,
    *,
    messages_field: str = "messages",
    split: str = "train",
    format: str = "messages",
    fields: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
    on_error: OnError = "raise",
    stats: SkipStats | None = None,
) -> list[Conversation]:
    """Load and validate every conversation of a dataset.

    Args:
        source: a ``.jsonl``/``.jsonl.gz`` path, ``"builtin:example_chat"``, a local
            ``.json``/``.parquet``/``.csv`` file or dataset directory, a Hugging Face dataset id,
            or a :class:`~prefect_tinker.recipes.data_reading.SourceSpec` (then the other arguments are ignored).
        messages_field: the field holding the list of messages (``messages`` format).
        split: split for ``datasets.load_dataset`` sources (ignored for JSONL files).
        format: record format (see :mod:`prefect_tinker.recipes.data_sources`).
        fields: field mapping, converter field -> record path (``{"output": "response"}``).
        options: converter options (``system_prompt``, ``strip_completion_suffix``, ...).
        on_error: ``"raise"`` at the first bad record, or ``"skip"`` it (counted in ``stats``
            and logged).
        stats: skip counter to fill (see :class:`~prefect_tinker.recipes.data_reading.SkipStats`).

    Returns:
        Conversations in file order (a record may give several, e.g. self-instruct instances).

    Raises:
        FileNotFoundError: a path-like source (``.jsonl``, ``/``, ``./``, ``~``) that does not exist.
        DatasetFormatError: malformed JSON, missing field, unknown role, non-string content,
            a conversation without an assistant message, or an empty dataset; the message
            names ``file:line`` (or ``source[split]:row``) and the field.
    """
    if isinstance(source, SourceSpec):
        spec = source
    else:
        mapping = dict(fields or {})
        if format in ("messages",) and messages_field != "messages":
            mapping.setdefault("messages", messages_field)
        spec = SourceSpec(
            path=os.fspath(source), format=format, fields=mapping, options=dict(options or {}), split=split
        )
    stats = stats if stats is not None else SkipStats()
    convs = list(iter_conversations(spec, on_error=on_error, stats=stats))
    if not convs:
        detail = f" ({stats.summary()})" if stats.total else ""
        raise DatasetFormatError(f"{spec.path}: dataset has no conversations{detail}")
    return convs


def split_conversations(
    conversations: Sequence[ItemT],
    test_size: int | float,
    seed: int = 0,
    order: Literal["seeded", "cookbook"] = "seeded",
) -> tuple[list[ItemT], list[ItemT]]:
    """Deterministic train/test split.

    The items are permuted with ``numpy.random.default_rng(seed).permutation``; the first
    ``test_size`` of that permutation are the test items.  ``order="seeded"``: both parts keep
    the original relative order.  ``order="cookbook"``: both parts are in the permuted order, as
    tinker-cookbook 0.6.1's ``FromConversationFileBuilder`` splits (Hugging Face
    ``Dataset.shuffle(seed)``, then ``take(test_size)`` / ``skip(test_size)``; with
    ``test_size`` 0 the training items are permuted too).

    Args:
        conversations: the items to split (any sequence works).
        test_size: number of test items (int >= 0) or a fraction in [0, 1) (rounded, at least
            one item when the fraction is > 0).
        seed: seed of the permutation choosing the test items (same seed, same split).
        order: ``"seeded"`` or ``"cookbook"`` (above).

    Returns:
        ``(train, test)``.

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
    if n_test and n_test >= n:
        raise ValueError(f"test_size={test_size!r} leaves no training conversation out of {n}")
    perm = np.random.default_rng(seed).permutation(n)
    if order == "cookbook":
        return [conversations[i] for i in perm[n_test:]], [conversations[i] for i in perm[:n_test]]
    if not n_test:
        return list(conversations), []
    test_idx = set(perm[:n_test].tolist())
    train = [c for i, c in enumerate(conversations) if i not in test_idx]
    test = [c for i, c in enumerate(conversations) if i in test_idx]
    return train, test


def datum_from_example(
    model_input: tinker.ModelInput | Sequence[int | MediaToken],
    weights: Any,
    max_length: int | None = None,
    reduction: Literal["none", "mean"] = "none",
    keep_untrained: bool = False,
) -> tinker.Datum:
    """Make a next-token-prediction datum from a rendered example.

    With the example's N positions ``t`` and weights ``w`` (after truncation to ``max_length``
    positions, never inside a media item: :func:`~prefect_tinker.recipes.media.safe_cut`), the
    datum has model input ``t[:-1]`` (text chunks, and image / DMel chunks for media runs) and
    ``loss_fn_inputs`` ``target_tokens = t[1:]`` (int64, shape (N-1,); a media position's target
    is its placeholder id) and ``weights = w[1:]`` (float32, shape (N-1,), 0 at media positions),
    so position i of the input predicts ``target_tokens[i]``.

    Args:
        model_input: the example's positions: a ``tinker.ModelInput`` or a token list (media as
            :class:`~prefect_tinker.recipes.media.MediaToken` runs; a stored
            :class:`~prefect_tinker.recipes.builders.Example` makes its own with ``Example.datum``).
        weights: per-position weights, shape (N,).
        max_length: keep at most this many positions of the example (the model input then has
            at most ``max_length - 1``); None keeps everything.
        reduction: ``"none"``: the weights as given (the loss sums over trained tokens);
            ``"mean"``: the target weights divided by their sum (float32), so each example
            weighs 1 whatever its length (tinker-cookbook 0.6.1's SFT default,
            ``conversation_to_datum(..., reduction="mean")``; an example without trained
            token keeps its zero weights).
        keep_untrained: make a datum even when no target has weight (it then contributes
            nothing to the loss; the cookbook keeps such truncated examples) instead of raising.

    Raises:
        ValueError: weights not of shape (N,), fewer than 2 positions, ``max_length < 2``, an
            example ending in a media item, or no positive weight left among the targets after
            truncation; MediaError (a ValueError) for a missing or changed media file.
    """
    if isinstance(model_input, tinker.ModelInput):
        tokens = tokens_from_model_input(model_input)
    else:
        tokens = [t if isinstance(t, MediaToken) else int(t) for t in model_input]
    w = np.array(weights, dtype=np.float32)
    if w.shape != (len(tokens),):
        raise ValueError(f"weights have shape {w.shape}, expected ({len(tokens)},) to match the tokens")
    if max_length is not None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        cut = safe_cut(tokens, max_length)
        tokens, w = tokens[:cut], w[:cut]
    if len(tokens) < 2:
        raise ValueError(f"an example needs at least 2 tokens to make a datum, got {len(tokens)}")
    if isinstance(tokens[-1], MediaToken):
        raise ValueError("the example ends with a media item: nothing follows it to predict")
    w[[i for i, t in enumerate(tokens) if isinstance(t, MediaToken)]] = 0.0
    target_w = w[1:]
    if not keep_untrained and not (target_w > 0).any():
        raise ValueError(
            f"no trained token left in the example (length {len(tokens)}"
            + (f", max_length={max_length}" if max_length is not None else "")
            + "): all target weights are 0"
        )
    if reduction == "mean" and target_w.sum() > 0:
        target_w = target_w / np.float32(target_w.sum())
    elif reduction not in ("none", "mean"):
        raise ValueError(f"reduction must be 'none' or 'mean', got {reduction!r}")
    return tinker.Datum(
        model_input=model_input_from_tokens(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray([int(t) for t in tokens[1:]], dtype=np.int64)),
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
        renderer: a :class:`prefect_tinker.recipes.renderers.Renderer`.
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
        where = (conv.source if isinstance(conv, Conversation) else "") or f"conversation {i}"
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
