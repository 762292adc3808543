"""Dataset preparation as a cached Prefect task.

``prepare_sft_dataset`` renders chat conversations into token arrays and per-token weights once;
its result is cached across flow runs under a key built from the *content* of the source file (or
the dataset id), the tokenizer, the renderer and the split settings — never from file names or
live objects — so editing the file invalidates the cache and renaming it does not.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy
from pydantic import BaseModel

from prefect_tinker.tasks.policies import RETRY_OPTIONS, file_sha256

__all__ = ["Example", "PreparedDataset", "prepare_sft_dataset", "dataset_fingerprint", "dataset_uri"]


class Example(BaseModel):
    """One rendered conversation: ``tokens`` (T,) and ``weights`` (T,) (1.0 on trained tokens)."""

    tokens: list[int]
    weights: list[float]


class PreparedDataset(BaseModel):
    """Rendered train and held-out examples plus the fingerprint of the source they came from."""

    fingerprint: str
    renderer: str
    train: list[Example]
    test: list[Example]
    skipped: int = 0  # conversations dropped: no trained token within max_length


def dataset_uri(source: str) -> str:
    """A URI for the dataset (asset key): ``file:///abs/path`` for files, ``hf://datasets/<id>`` otherwise."""
    if os.path.exists(source):
        return Path(source).resolve().as_uri()
    return f"hf://datasets/{source}"


def dataset_fingerprint(source: str) -> str:
    """Content hash of a local file, or ``hf:<id>`` for a Hugging Face dataset id."""
    if os.path.exists(source):
        return "sha256:" + file_sha256(source)
    return f"hf:{source}"


def _cache_key(context: Any, params: dict[str, Any]) -> str:
    keyed = {k: v for k, v in params.items() if k != "source"}
    keyed["source"] = dataset_fingerprint(params["source"])
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()


@task(
    name="prepare-sft-dataset",
    cache_policy=TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_cache_key),
    persist_result=True,
    **RETRY_OPTIONS,
)
def prepare_sft_dataset(
    source: str,
    tokenizer_id: str,
    renderer: str = "auto",
    max_length: int = 1024,
    test_size: float | int = 0.1,
    seed: int = 0,
    train_on_what: str = "all_assistant_messages",
    messages_field: str = "messages",
) -> PreparedDataset:
    """Load chat conversations from ``source`` (a JSONL path or a Hugging Face dataset id), split
    them into train/test with ``seed``, and render each with ``renderer`` ("auto" = the tokenizer's
    chat template when it has one, else ``role_colon``), truncating to ``max_length`` tokens.

    Raises:
        FileNotFoundError / ValueError: from the dataset loader, naming file, line and field.
    """
    from transformers import AutoTokenizer

    from prefect_tinker.recipes.datasets import load_conversations, split_conversations
    from prefect_tinker.recipes.renderers import get_renderer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_id)
    if renderer == "auto":
        renderer = "chat_template" if getattr(tokenizer, "chat_template", None) else "role_colon"
    rend = get_renderer(renderer, tokenizer)
    conversations = load_conversations(source, messages_field=messages_field)
    train_c, test_c = split_conversations(conversations, test_size=test_size, seed=seed)

    def render(convs: list) -> tuple[list[Example], int]:
        out, skipped = [], []
        for conv in convs:
            model_input, weights = rend.build_supervised_example(conv.messages, train_on_what=train_on_what)
            tokens = model_input.to_ints()[:max_length]
            w = [float(x) for x in weights[: len(tokens)]]
            if sum(w[1:]) > 0:  # something left to train on after the shift
                out.append(Example(tokens=tokens, weights=w))
            else:
                skipped.append(conv.source)
        if skipped:
            get_run_logger().warning(
                "skipped %d conversation(s) with no trained token within max_length=%d: %s",
                len(skipped), max_length, ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""),
            )
        return out, len(skipped)

    (train, n_train), (test, n_test) = render(train_c), render(test_c)
    return PreparedDataset(fingerprint=dataset_fingerprint(source), renderer=renderer, train=train, test=test,
                           skipped=n_train + n_test)
