"""Answer extraction and grading for math problems (GSM8K ``#### n`` answers, ``\\boxed{}`` answers).

Extraction:
- :func:`extract_boxed`: content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces ok).
- :func:`extract_hash_answer`: text after the last ``####`` (GSM8K's final-answer line).
- :func:`extract_final_answer`: either, by style.

Comparison (:func:`answers_match`), in order:
1. numeric: both sides parse as numbers after normalisation (:func:`parse_number`: thousands
   commas, ``$``/``\\$``, ``%``, units and words after the number, ``\\text{}``, ``\\frac``/``\\dfrac``,
   ``a/b``, mixed numbers ``1 1/2``, degrees) -> exact rational comparison, or a relative
   tolerance of 1e-6 for decimals;
2. symbolic: `math-verify <https://github.com/huggingface/Math-Verify>`_ (Hugging Face's grader,
   LaTeX -> SymPy) when installed: ``\\sqrt{2}/2`` vs ``\\frac{\\sqrt2}{2}``, ``2\\pi`` vs
   ``6.2832``, intervals, sets; run without its signal-based timeout outside the main thread
   (rollouts run in worker threads), with inputs capped at :data:`MAX_ANSWER_CHARS`;
3. string equality after removing spaces, ``\\left``/``\\right``, ``\\!`` and a trailing period.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = [
    "MAX_ANSWER_CHARS",
    "extract_boxed",
    "extract_hash_answer",
    "extract_final_answer",
    "parse_number",
    "answers_match",
    "math_verify_available",
]

#: Longer candidate answers are not compared symbolically (SymPy can take very long on them).
MAX_ANSWER_CHARS = 200

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if absent
    or unclosed. ``\\boxed 5`` (no braces) gives ``"5"``."""
    found = None
    for m in _BOX_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1].strip()
    if found is None:
        bare = re.findall(r"\\boxed\s+([^\s$]+)", text)
        if bare:
            found = bare[-1]
    return found


def extract_hash_answer(text: str) -> str | None:
    """Text after the last ``####`` up to the end of that line, stripped; None if absent or empty."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    ans = text[idx + 4 :].split("\n", 1)[0].strip()
    return ans or None


def extract_final_answer(text: str, style: str = "any") -> str | None:
    """The final answer in ``text``: ``style="hash"`` (``#### n``), ``"boxed"`` (``\\boxed{}``) or
    ``"any"`` (``####`` first, then ``\\boxed{}``).

    Raises:
        ValueError: unknown style.
    """
    if style == "hash":
        return extract_hash_answer(text)
    if style == "boxed":
        return extract_boxed(text)
    if style == "any":
        return extract_hash_answer(text) or extract_boxed(text)
    raise ValueError(f"unknown answer style {style!r}; accepted: hash, boxed, any")


# ----- numeric normalisation ---------------------------------------------------------------------
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d])")
_NUMBER = re.compile(
    r"^(?P<sign>[-+−]?)\s*(?:(?P<whole>\d+)\s+(?P<mn>\d+)\s*/\s*(?P<md>\d+)"  # mixed 1 1/2
    r"|(?P<num>\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*(?P<den>\d+(?:\.\d*)?))?(?:[eE](?P<exp>[-+]?\d+))?)"
)


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    for _ in range(3):  # nested \text{...}
        s = _TEXT_CMD.sub(r" \1 ", s)
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    s = _LATEX_FRAC_SHORT.sub(r"\1/\2", s)
    s = re.sub(r"\\(?:left|right|displaystyle|,|;|!|:|quad|qquad)", " ", s)
    s = s.replace("\\$", " ").replace("$", " ").replace("\\%", "%").replace("−", "-")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", " ", s)
    s = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), s)
    s = re.sub(r"\((\d+(?:\.\d+)?)\)/\((\d+(?:\.\d+)?)\)", r"\1/\2", s)  # (3)/(4) from \frac
    return " ".join(s.split())


def parse_number(text: str) -> Fraction | None:
    """The number ``text`` states, as an exact ``Fraction``; None if it is not (just) a number.

    Accepts ``1,234``, ``$18``, ``\\$18.50``, ``50%`` / ``50\\%`` (-> 50: percent signs are
    dropped, since answers state the percentage), ``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``,
    ``1 1/2``, ``-2.5``, ``1e3``, ``18 dollars``, ``5 \\text{ cm}``, ``90^\\circ``, ``x = 7``,
    a trailing period. Rejects text with more than one number (``3 + 4``) or a letter before the
    number (``x7``).
    """
    s = _clean(text)
    s = re.sub(r"^[A-Za-z]\w*\s*=\s*", "", s)  # "x = 7"
    s = s.rstrip(".").strip()
    m = _NUMBER.match(s)
    if not m:
        return None
    rest = s[m.end() :].strip()
    rest = rest.lstrip("%").strip()
    # anything left must be unit words, not more arithmetic or digits
    if rest and (re.search(r"\d", rest) or not re.fullmatch(r"[A-Za-z][A-Za-z .'/^²³-]*", rest)):
        return None
    sign = -1 if m.group("sign") in ("-", "−") else 1
    try:
        if m.group("whole") is not None:
            den = int(m.group("md"))
            if den == 0:
                return None
            value = int(m.group("whole")) + Fraction(int(m.group("mn")), den)
        else:
            value = Fraction(m.group("num"))
            if m.group("den") is not None:
                divisor = Fraction(m.group("den"))
                if divisor == 0:
                    return None
                value /= divisor
            if m.group("exp") is not None:
                value *= Fraction(10) ** int(m.group("exp"))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return sign * value


def _numbers_equal(a: Fraction, b: Fraction, rel_tol: float = 1e-6) -> bool:
    if a == b:
        return True
    scale = max(abs(a), abs(b), Fraction(1))
    return abs(a - b) <= Fraction(rel_tol) * scale


# ----- math-verify ------------------------------------------------------------------------------
def math_verify_available() -> bool:
    """True when the ``math-verify`` package imports."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _mv_parse(mv, text: str, timeout):
    text = text.strip()
    if not text.startswith("$") and "\\boxed" not in text:
        text = f"${text}$"
    return mv.parse(text, parsing_timeout=timeout)


def _math_verify_equal(given: str, reference: str) -> bool | None:
    """math-verify's verdict, or None when unavailable or either side does not parse."""
    try:
        import math_verify as mv
    except ImportError:
        return None
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _mv_parse(mv, reference, timeout)
        pred = _mv_parse(mv, given, timeout)
        if not gold or not pred:
            return None
        return bool(mv.verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # the grader's own failures count as "no verdict", not as a crash
        return None


def _string_form(s: str) -> str:
    s = _clean(s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").lower()


def answers_match(given: str | None, reference: str | None) -> bool:
    """Whether the extracted answer ``given`` equals ``reference`` (see the module docstring).

    Both are answer strings (not whole responses). None or empty -> False.
    """
    if not given or not reference:
        return False
    given, reference = given.strip(), reference.strip()
    gnum, rnum = parse_number(given), parse_number(reference)
    if gnum is not None and rnum is not None:
        return _numbers_equal(gnum, rnum)
    if len(given) <= MAX_ANSWER_CHARS and len(reference) <= MAX_ANSWER_CHARS:
        verdict = _math_verify_equal(given, reference)
        if verdict is not None:
            return verdict
    return _string_form(given) == _string_form(reference)
