"""Exact match and token F1 with SQuAD-style answer normalisation.

Normalisation (as in the official SQuAD v1.1 evaluation script, Rajpurkar et al. 2016,
"SQuAD: 100,000+ Questions for Machine Comprehension of Text"): lower-case, drop ASCII
punctuation, drop the articles ``a``, ``an``, ``the`` as words, collapse whitespace.
Token F1 is the harmonic mean of precision and recall of the normalised tokens (a bag-of-words
overlap, duplicates counted). Several references: the best score over them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

__all__ = ["normalize_answer", "exact_match", "token_f1", "best_exact_match", "best_token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation of ``text`` (see the module docstring)."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> bool:
    """Whether the normalised strings are equal."""
    return normalize_answer(prediction) == normalize_answer(reference)


def token_f1(prediction: str, reference: str) -> float:
    """Token F1 in [0, 1] of the normalised strings; 1.0 when both are empty, 0.0 when one is."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_exact_match(prediction: str, references: Sequence[str]) -> bool:
    """:func:`exact_match` against any of ``references`` (False for none)."""
    return any(exact_match(prediction, r) for r in references)


def best_token_f1(prediction: str, references: Sequence[str]) -> float:
    """Highest :func:`token_f1` over ``references`` (0.0 for none)."""
    return max((token_f1(prediction, r) for r in references), default=0.0)
