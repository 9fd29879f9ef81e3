"""Driving an engine by hand in tests."""

from __future__ import annotations

from workers.engine import LLMEngine


def drain_all(eng: LLMEngine) -> dict[str, list[int]]:
    """Step ``eng`` until it has nothing left; the tokens each request got, by id."""
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for delta in eng.step():
            outs.setdefault(delta.request_id, []).extend(delta.token_ids)
    return outs
