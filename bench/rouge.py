"""Exact match and ROUGE-L (Lin, 2004) between a generated text and its reference.

ROUGE-L F1 is computed on tokens as ``rouge-score`` makes them by default: lowercase, every
run of characters outside ``[a-z0-9]`` is a separator. ``LCS`` is the longest common
subsequence of the two token lists; precision = LCS / candidate tokens, recall = LCS /
reference tokens, F1 their harmonic mean. Two empty texts match (1.0); one empty text
against a non-empty one scores 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SEPARATOR = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class RougeL:
    precision: float
    recall: float
    f1: float


def tokens(text: str) -> list[str]:
    """``rouge-score``'s default tokenization (without stemming)."""
    return [t for t in _SEPARATOR.split(text.lower()) if t]


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence: O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, 1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(candidate: str, reference: str) -> RougeL:
    """ROUGE-L precision, recall and F1 of ``candidate`` against ``reference``. Two texts
    without words score 1 when they are equal (Google's rouge-score gives 0): an empty
    output that matches an empty reference, as two identical runs can, is agreement, not a
    miss; two different ones ("}" and ")", or text in a script with no a-z0-9 words) score
    0, as rouge-score has it (1 made any non-Latin golden set read as perfect)."""
    cand, ref = tokens(candidate), tokens(reference)
    if not cand and not ref:
        same = candidate.strip() == reference.strip()
        return RougeL(1.0, 1.0, 1.0) if same else RougeL(0.0, 0.0, 0.0)
    lcs = lcs_length(cand, ref)
    if lcs == 0:
        return RougeL(0.0, 0.0, 0.0)
    precision, recall = lcs / len(cand), lcs / len(ref)
    return RougeL(precision, recall, 2 * precision * recall / (precision + recall))


def exact_match(candidate: str, reference: str) -> bool:
    """The texts are equal, ignoring leading and trailing whitespace."""
    return candidate.strip() == reference.strip()
