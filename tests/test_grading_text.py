"""SQuAD v1.1 answer normalisation, exact match and token F1, against hand-computed values."""

from __future__ import annotations

import pytest

from prefect_tinker.recipes.grading_text import best_over_references, exact_match, normalize_answer, token_f1


def test_normalize_answer():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear & THE plum.") == "apple pear plum"
    assert normalize_answer("theory of another") == "theory of another"  # articles only as whole words
    assert normalize_answer("rock'n'roll\tin\n1950s") == "rocknroll in 1950s"
    assert normalize_answer("") == "" and normalize_answer(" a the an ") == ""


def test_exact_match():
    assert exact_match("the Beatles", "Beatles.") == 1.0
    assert exact_match("Beatles", "The Rolling Stones") == 0.0
    assert exact_match("", "") == 1.0


def test_token_f1_values():
    # pred {new, york, city} vs ref {new, york}: common 2, precision 2/3, recall 1 -> 0.8
    assert token_f1("New York City", "new york") == pytest.approx(0.8)
    # tokens count with multiplicity: common = min(2,1) cat + min(1,2) dog = 2; p = r = 2/3
    assert token_f1("cat cat dog", "cat dog dog") == pytest.approx(2 / 3)
    assert token_f1("the answer is 42", "42") == pytest.approx(0.5)  # p = 1/3, r = 1
    assert token_f1("Paris", "Paris") == 1.0
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0  # v2.0: both empty is a match


def test_best_over_references():
    refs = ["Denver Broncos", "The Broncos", "Broncos"]
    assert best_over_references(exact_match, "broncos", refs) == 1.0
    assert best_over_references(token_f1, "the Denver team", refs) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no reference"):
        best_over_references(token_f1, "x", [])
