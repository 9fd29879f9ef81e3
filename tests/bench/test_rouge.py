"""bench/rouge.py against ROUGE-L values computed by hand."""

from __future__ import annotations

import pytest

from bench.rouge import exact_match, lcs_length, rouge_l, tokens


def test_lcs_of_textbook_sequences() -> None:
    # ABCBDAB / BDCABA: the classic CLRS example, LCS length 4 (e.g. BCBA).
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    assert lcs_length([], list("abc")) == 0
    assert lcs_length(list("abc"), list("abc")) == 3


def test_rouge_l_of_lins_example_by_hand() -> None:
    # Lin (2004): reference "police killed the gunman"; "police kill the gunman" shares
    # police, the, gunman: LCS 3 of 4 and 4 tokens, P = R = F = 0.75.
    score = rouge_l("police kill the gunman", "police killed the gunman")
    assert score.precision == pytest.approx(0.75)
    assert score.recall == pytest.approx(0.75)
    assert score.f1 == pytest.approx(0.75)
    # "the gunman kill police": LCS "the gunman" = 2: P = R = F = 0.5.
    assert rouge_l("the gunman kill police", "police killed the gunman").f1 == pytest.approx(0.5)


def test_rouge_l_with_unequal_lengths_by_hand() -> None:
    # candidate 6 tokens, reference 4, LCS "json dumps a string" = 4:
    # P = 4/6, R = 4/4, F = 2·(2/3)·1 / (2/3 + 1) = 0.8.
    score = rouge_l("json.dumps returns a JSON string!", "json dumps a string")
    assert tokens("json.dumps returns a JSON string!") == [
        "json",
        "dumps",
        "returns",
        "a",
        "json",
        "string",
    ]
    assert score.precision == pytest.approx(4 / 6)
    assert score.recall == pytest.approx(1.0)
    assert score.f1 == pytest.approx(0.8)


def test_empty_texts() -> None:
    assert rouge_l("", "").f1 == 1.0
    assert rouge_l("something", "").f1 == 0.0
    assert rouge_l("", "something").f1 == 0.0
    assert rouge_l("...", "...").f1 == 1.0  # no words on either side, and equal
    assert rouge_l("}", ")").f1 == 0.0  # no words either, but different: not a match
    assert rouge_l("日本語", "中文").f1 == 0.0


def test_exact_match_ignores_only_surrounding_whitespace() -> None:
    assert exact_match(" Serialize obj.\n", "Serialize obj.")
    assert not exact_match("Serialize obj", "Serialize obj.")
    assert not exact_match("serialize obj.", "Serialize obj.")
