"""Streamed text read for tags (a tool call's, a thinking block's): the end of a piece that
may be the start of a tag is held back until the next piece says whether it is."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
