"""bench/policies.py without a stack: the field-mix sessions and the comparison arithmetic."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.policies import group_figures, ratios
from bench.policies_load import Sent, make_sessions
from bench.serve_http import Result


def test_sessions_follow_the_field_mix_and_conversations_resend_their_history() -> None:
    sessions = make_sessions(2000, seed=1, long_tokens=256)
    share = Counter(s.kind for s in sessions)
    assert share["long_doc"] / 2000 == pytest.approx(0.20, abs=0.03)
    assert share["conversation"] / 2000 == pytest.approx(0.30, abs=0.03)
    assert share["short"] / 2000 == pytest.approx(0.50, abs=0.03)
    for s in sessions:
        assert s.group == ("long" if s.kind == "long_doc" else "short")
        if s.kind == "conversation":
            for before, after in zip(s.turns, s.turns[1:], strict=False):
                assert after.prompt[: len(before.prompt)] == before.prompt
                assert len(after.prompt) > len(before.prompt) + before.output_len
        if s.kind == "long_doc":
            assert len(s.turns[0].prompt) == 256 + 16
    assert make_sessions(50, 7, 64) == make_sessions(50, 7, 64)


def _sent(group: str, ttft: float, e2e: float) -> Sent:
    return Sent("short", group, Result(ok=True, status=200, ttft=ttft, e2e=e2e, output_tokens=10))


def test_goodput_counts_requests_within_their_own_groups_slos() -> None:
    # short: TTFT 200 ms / E2E 500 ms; long: 5 s / 60 s (common.config defaults).
    sent = [_sent("short", 0.1, 0.4), _sent("short", 0.3, 0.4), _sent("long", 1.0, 10.0)]
    figures = group_figures(sent, duration=2.0)
    assert figures["short"]["goodput"] == 0.5  # one good short request in 2 s
    assert figures["long"]["goodput"] == 0.5
    assert figures["all"]["goodput"] == 1.0
    assert figures["all"]["request_throughput"] == 1.5


def test_ratios_are_against_dynamic() -> None:
    def result(req_s: float, sat: float) -> dict:
        row = {"req_s": req_s, "out_tok_s": 10 * req_s, "goodput_req_s": req_s / 2,
               "ttft_p99_ms": 100.0, "e2e_p99_ms": 400.0}  # fmt: skip
        return {"fixed_rate": {"groups": {"all": row}}, "saturation_req_s": sat}

    rel = ratios({"dynamic": result(2.0, 4.0), "continuous": result(3.0, 11.6)})
    assert rel["dynamic"]["saturation_req_s"] == 1.0
    assert rel["continuous"]["saturation_req_s"] == 2.9
    assert rel["continuous"]["fixed_req_s"] == 1.5
    assert ratios({"continuous": result(3.0, 1.0)}) == {}
