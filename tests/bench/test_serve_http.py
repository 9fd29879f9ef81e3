"""The load generator's clock: a first token is timed by its event, with or without text."""

from __future__ import annotations

import json

from bench.serve_http import EventClock, Result, token_events


def test_a_token_without_text_is_timed_by_its_logprobs_event():
    """A dummy model's byte tokenizer gives most tokens no text: streams carried no event to
    time a first token by, and the stack runs on the GPU reported TTFT for few requests."""
    assert token_events("dummy:llama-1b") == {"logprobs": 0}
    assert token_events("/models/llama") == {}
    res = Result()
    clock = EventClock(res)
    silent = {"choices": [{"text": "", "logprobs": {"tokens": ["bytes:\\xff"]}}]}
    assert not clock.data(json.dumps(silent))
    assert res.ttft is not None
    clock.data(json.dumps({"choices": [{"text": "a"}]}))
    assert len(res.itl) == 1
    assert clock.data("[DONE]") and res.ok
