"""Multiple-choice options: lettering them for the prompt, resolving the reference, reading the
letter a reply chose.

Options come as a list of strings (``["Paris", "Rome"]``, lettered ``A.``, ``B.`` for the prompt;
or already lettered, ``["A) Paris", "B) Rome"]``, shown as they are), a mapping of letters to
texts (``{"A": "Paris", "B": "Rome"}``) or an ARC-style ``{"label": [...], "text": [...]}``.

A reply's letter (:func:`parse_choice`), in order of precedence:

1. an explicit statement, the last one: ``"The answer is B."``, ``"Answer: (c)"``,
   ``"the correct option is D"``;
2. a reply that starts with the letter: ``"B"``, ``"(B)"``, ``"B) Rome"``, ``"B. Rome"``;
3. the last parenthesised letter: ``"... so (C)"``;
4. exactly one distinct standalone capital letter among the options' letters (``"A"`` and
   ``"I"`` followed by a lower-case word are read as words, not letters): ``"I pick B"``;
5. the reply is (after SQuAD normalisation) exactly one option's text.

Otherwise the reply is unparsable (None). Markdown emphasis (``**B**``) is ignored.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefect_tinker.recipes.grading_text import normalize_answer

__all__ = ["Choices", "parse_options", "resolve_reference_letter", "parse_choice"]

LETTERS = string.ascii_uppercase
_PRELETTERED = re.compile(r"^\s*\(?([A-Z])\s*[).:]\s*(.*)$", re.S)
_EXPLICIT = re.compile(
    r"(?i)\b(?:answer|option|choice)\b(?:\s+(?:is|would\s+be|will\s+be))?\s*[:=]?\s*"
    r"(?:(?:option|choice|letter)\s+)?\(?([A-Za-z])\)?(?![A-Za-z0-9'])"
)
_LEADING = re.compile(r"^\(?([A-Z])(?:\)|[.:,](?=\s|$)|$)")
_PAREN = re.compile(r"\(([A-Z])\)")
_STANDALONE = re.compile(r"(?<![A-Za-z0-9'])([A-Z])(?![A-Za-z0-9'])")


@dataclass(frozen=True)
class Choices:
    """Lettered options: ``letters[i]`` labels ``texts[i]``; ``lines[i]`` is how it is shown;
    ``labels[i]`` is the dataset's own label (ARC's ``"1".."4"``; else the letter)."""

    letters: tuple[str, ...]
    texts: tuple[str, ...]
    lines: tuple[str, ...]
    labels: tuple[str, ...] = ()

    def render(self) -> str:
        """The options block of the prompt, one option per line."""
        return "\n".join(self.lines)


def _fail(field: str, problem: str) -> ValueError:
    return ValueError(f"field {field!r} {problem}")


def parse_options(value: Any, field: str = "options") -> Choices:
    """:class:`Choices` from a record's options value (see the module docstring).

    Raises:
        ValueError: not a list/mapping of strings, fewer than 2 or more than 26 options; the
            message names ``field``.
    """
    if isinstance(value, Mapping) and {"label", "text"} <= set(value):
        own, option_texts = [str(x).strip() for x in value["label"]], list(value["text"])
        if len(own) != len(option_texts):
            raise _fail(field, f"has {len(own)} labels but {len(option_texts)} texts")
        labels = [x.upper() for x in own]
        if not all(len(x) == 1 and x in LETTERS for x in labels):
            labels = list(LETTERS[: len(option_texts)])  # numeric labels ("1".."4"): letter by position
        pairs = list(zip(labels, option_texts, strict=True))
    elif isinstance(value, Mapping):
        pairs = [(str(k).strip().upper(), v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        pairs = list(zip(LETTERS, value, strict=False))
    else:
        raise _fail(field, f"must be a list of option texts or a mapping letter -> text, got {str(value)[:60]!r}")
    if not 2 <= len(pairs) <= len(LETTERS):
        raise _fail(field, f"needs 2 to 26 options, got {len(pairs)}")
    for letter, text in pairs:
        if not isinstance(text, (str, int, float)) or isinstance(text, bool):
            raise _fail(field, f"option {letter} must be a string, got {str(text)[:60]!r}")
        if letter not in LETTERS:
            raise _fail(field, f"option label {letter!r} is not a letter A-Z")
    letters = tuple(p[0] for p in pairs)
    texts = tuple(str(p[1]) for p in pairs)
    own_labels = tuple(own) if isinstance(value, Mapping) and "label" in value else letters
    pre = [_PRELETTERED.match(t) for t in texts]
    matched = [m for m, letter in zip(pre, letters, strict=True) if m and m.group(1) == letter]
    if len(matched) == len(pre):  # every option carries its own letter prefix
        return Choices(letters, tuple(m.group(2).strip() for m in matched), tuple(t.strip() for t in texts), own_labels)
    return Choices(
        letters, texts, tuple(f"{letter}. {t}" for letter, t in zip(letters, texts, strict=True)), own_labels
    )


def resolve_reference_letter(value: Any, choices: Choices, field: str = "answer") -> str:
    """The letter of the correct option from a reference value: the dataset's own label (ARC's
    ``"3"``), a letter (``"C"``, ``"(c)"``, ``"C)"``), a 0-based index (``2`` or ``"2"``) or the
    option's text.

    Raises:
        ValueError: the value names no option (the message names ``field`` and the letters).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value < len(choices.letters):
            return choices.letters[value]
        raise _fail(field, f"index {value} is out of range for {len(choices.letters)} options (0-based)")
    if isinstance(value, str):
        s = value.strip()
        if s in choices.labels:
            return choices.letters[choices.labels.index(s)]
        m = re.fullmatch(r"\(?([A-Za-z])\)?[.):]?", s)
        if m and m.group(1).upper() in choices.letters:
            return m.group(1).upper()
        if s.isdigit() and int(s) < len(choices.letters):
            return choices.letters[int(s)]
        norm = normalize_answer(s)
        hits = [letter for letter, t in zip(choices.letters, choices.texts, strict=True) if normalize_answer(t) == norm]
        if len(hits) == 1:
            return hits[0]
    raise _fail(
        field,
        f"value {str(value)[:60]!r} names none of the options {', '.join(choices.letters)} "
        "(give a letter, a 0-based index or the option's text)",
    )


def _reads_as_word(text: str, m: re.Match) -> bool:
    """Whether the one-letter match is a word of a sentence ("a number", "I think"), not a letter:
    a lower-case letter, or ``A``/``I``, followed by a lower-case word."""
    char = m.group(1)
    after = text[m.end() :].lstrip(" ")
    return (char.islower() or char in "AI") and after[:1].islower()


def parse_choice(reply: str, choices: Choices) -> str | None:
    """The option letter ``reply`` chose, or None (see the module docstring for the rules)."""
    text = reply.replace("**", "").replace("__", "").strip()
    valid = set(choices.letters)
    explicit = [
        m.group(1).upper()
        for m in _EXPLICIT.finditer(text)
        if m.group(1).upper() in valid and not _reads_as_word(text, m)
    ]
    if explicit:
        return explicit[-1]
    m = _LEADING.match(text)
    if m and m.group(1) in valid:
        return m.group(1)
    parens = [m.group(1) for m in _PAREN.finditer(text) if m.group(1) in valid]
    if parens:
        return parens[-1]
    standalone = set()
    for m in _STANDALONE.finditer(text):
        letter = m.group(1)
        if letter not in valid:
            continue
        if not _reads_as_word(text, m):
            standalone.add(letter)
    if len(standalone) == 1:
        return standalone.pop()
    norm = normalize_answer(text)
    hits = [
        letter for letter, t in zip(choices.letters, choices.texts, strict=True) if norm and normalize_answer(t) == norm
    ]
    return hits[0] if len(hits) == 1 else None
