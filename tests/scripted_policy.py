"""Scripted policies for environment tests: a stand-in for ``tinker.SamplingClient`` whose replies
are fixed texts, and tokenizer directories the renderer cache can load (tiny, SmolLM2, and the
Qwen3 / Llama 3 stand-ins of tests/renderer_tokenizers.py saved to disk)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.data_files import smollm2_tokenizer_dir
from tests.renderer_tokenizers import llama3_like, qwen3_like


class ScriptedSampler:
    """Has the SDK's ``sample``: each sampled sequence is the next reply of ``replies`` (texts,
    or ``reply(prompt_text) -> text``), encoded as markup so that ``<|im_end|>`` is the control
    token a model would sample. Logprobs are distinct per token (``-0.001 * (n + 1)`` for the
    n-th token sampled overall), so tests can find each one in the datums.

    Attributes:
        calls: ``(prompt tokens, num_samples, seed)`` per request.
        sampled: ``(prompt tokens, tokens, logprobs)`` per sequence, in sampling order.
    """

    def __init__(self, tokenizer, replies: list[str] | Callable[[str], str], *, stop_reason: str = "stop"):
        self.tok, self.replies, self.stop_reason = tokenizer, replies, stop_reason
        self.calls: list[tuple[list[int], int, int]] = []
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []
        self.n = 0

    def _next(self, prompt_text: str) -> str:
        if callable(self.replies):
            return self.replies(prompt_text)
        if not self.replies:
            raise AssertionError("the scripted policy ran out of replies")
        return self.replies.pop(0)

    def sample(self, prompt, num_samples, sampling_params):
        ints = prompt.to_ints()
        self.calls.append((ints, num_samples, sampling_params.seed))
        text = self.tok.decode(ints, skip_special_tokens=False)
        seqs = []
        for _ in range(num_samples):
            tokens = list(self.tok.encode(self._next(text), add_special_tokens=False))
            lps = [-0.001 * (self.n + j + 1) for j in range(len(tokens))]
            self.n += len(tokens)
            self.sampled.append((ints, tokens, lps))
            seqs.append(SimpleNamespace(tokens=tokens, logprobs=lps, stop_reason=self.stop_reason, sequence_id=""))
        return completed(SimpleNamespace(sequences=seqs, prompt_cache_hit_tokens=0))


def completed(value):
    """A finished ``Future`` holding ``value``: what an SDK call returns, already resolved."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory) -> dict[str, str]:
    """``{"tiny", "smollm2", "qwen3", "llama3"}`` -> a local tokenizer directory."""
    smollm2 = smollm2_tokenizer_dir()  # skips the test where there is none
    from tinker_local.tokenizer import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    save_tiny_tokenizer(str(root / "tiny"), vocab_size=2048, seed=0)
    qwen3_like().save_pretrained(str(root / "qwen3"))
    llama3_like().save_pretrained(str(root / "llama3"))
    return {"tiny": str(root / "tiny"), "smollm2": str(smollm2), "qwen3": str(root / "qwen3"),
            "llama3": str(root / "llama3")}
