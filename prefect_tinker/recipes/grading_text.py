"""Exact match and token F1 of short text answers, with SQuAD's answer normalisation.

The one text grader of the package (the benchmarks' ``exact_match`` grader, multiple-choice
option matching and RL rewards use it). It follows the official SQuAD evaluation scripts
(Rajpurkar et al., "SQuAD: 100,000+ Questions for Machine Comprehension of Text", EMNLP 2016;
``evaluate-v1.1.py`` and ``evaluate-v2.0.py``): an answer is normalised by lowercasing, removing
punctuation (``string.punctuation``), removing the articles ``a``/``an``/``the`` as words and
collapsing whitespace, in that order; exact match compares the normalised strings; F1 is the
harmonic mean of precision and recall over the bag of normalised tokens (duplicates counted); when
either side normalises to nothing, F1 is 1.0 if both do and 0.0 otherwise (the v2.0 rule, so that
F1 is 1 whenever exact match is); with several references the best score over them counts.
Also the word error rate of speech recognition (:func:`word_error_rate`). Pure functions, no state.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "best_exact_match",
    "best_over_references",
    "best_token_f1",
    "exact_match",
    "normalize_answer",
    "normalize_transcript",
    "token_f1",
    "word_error_rate",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop articles (a, an, the), collapse whitespace (SQuAD)."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0 (SQuAD ``exact_match_score``)."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 in [0, 1] of the normalised answers (SQuAD ``f1_score``); 1.0 when both
    normalise to nothing, 0.0 when only one does (SQuAD v2.0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_over_references(metric: Callable[[str, str], float], prediction: str, references: Iterable[str]) -> float:
    """The best ``metric(prediction, reference)`` over ``references`` (SQuAD
    ``metric_max_over_ground_truths``), as a float.

    Raises:
        ValueError: ``references`` is empty.
    """
    scores = [float(metric(prediction, ref)) for ref in references]
    if not scores:
        raise ValueError("best_over_references: no reference answers")
    return max(scores)


def best_exact_match(prediction: str, references: Sequence[str]) -> bool:
    """Whether ``prediction`` matches any of ``references`` exactly (False for none)."""
    return any(exact_match(prediction, r) for r in references)


def best_token_f1(prediction: str, references: Sequence[str]) -> float:
    """Highest :func:`token_f1` over ``references`` (0.0 for none)."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def normalize_transcript(text: str) -> str:
    """Lowercase, punctuation removed (apostrophes kept), whitespace collapsed: the usual text
    normalisation before scoring speech recognition."""
    text = "".join(ch if ch == "'" or ch not in string.punctuation else " " for ch in text.lower())
    return " ".join(text.split())


def word_error_rate(prediction: str, reference: str) -> float:
    """Word error rate ``(S + D + I) / N``: the word-level Levenshtein distance between the
    normalised prediction and reference (:func:`normalize_transcript`) over the reference's word
    count N (the NIST sclite definition).  An empty reference gives 0.0 for an empty prediction,
    else 1.0 per inserted word.  Not bounded by 1 (insertions)."""
    ref, hyp = normalize_transcript(reference).split(), normalize_transcript(prediction).split()
    if not ref:
        return float(len(hyp))
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / len(ref)
