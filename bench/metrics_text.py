"""Text-similarity metrics for comparing generations: exact match and ROUGE-L (LCS based)."""

from __future__ import annotations

from collections.abc import Sequence


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token sequences (O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace tokens, in [0, 1]; two empty texts score 1."""
    c, r = candidate.split(), reference.split()
    if not c and not r:
        return 1.0
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(c), lcs / len(r)
    return 2 * precision * recall / (precision + recall)
