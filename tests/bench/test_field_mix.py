"""bench/field_mix.py's pure parts the locust file leans on: which document a long-document
request gets, the bounded document cache, and the TTFT clock of a streamed answer (events
made up here, times given: no server, no locust import, no timing)."""

from __future__ import annotations

import random
from typing import Any

from bench.field_mix import (
    DocumentCache,
    StreamClock,
    carries_token,
    keyed_document,
    load_qa,
    long_doc_key,
)

# --------------------------------------------------------------------------- documents


def test_by_default_every_long_document_request_gets_a_document_of_its_own() -> None:
    rng = random.Random(0)
    keys = [long_doc_key(0, rng, serial) for serial in range(500)]
    assert len(set(keys)) == 500
    # Locust's worker processes count from 0 each: their documents must differ too.
    assert long_doc_key(0, rng, 7, worker=0) != long_doc_key(0, rng, 7, worker=1)


def test_a_pool_reuses_that_many_documents() -> None:
    rng = random.Random(0)
    keys = {long_doc_key(4, rng, serial) for serial in range(500)}
    assert keys == {f"pool-{i}" for i in range(4)}


def test_distinct_keys_give_documents_that_part_at_their_first_line() -> None:
    """Two shuffles can start with the same Q/A entry (1 in 300): a shared prefix the
    prefix cache would serve. The key in the title parts every two documents at once."""
    qa = load_qa()
    a, b = (keyed_document(qa, 200, None, long_doc_key(0, random.Random(0), s)) for s in (1, 2))
    assert a != b and a.split("\n", 1)[0] != b.split("\n", 1)[0]
    # The same key is the same text (a pool's document, made again after eviction).
    assert keyed_document(qa, 200, None, "pool-3") == keyed_document(qa, 200, None, "pool-3")


def test_the_document_cache_keeps_at_most_its_size_and_remakes_the_same_text() -> None:
    made: list[str] = []

    def make(key: str) -> str:
        made.append(key)
        return f"document {key}"

    cache = DocumentCache(keep=3)
    for i in range(100):
        assert cache.get(f"k{i % 10}", make) == f"document k{i % 10}"
        assert len(cache) <= 3
    assert len(made) == 100  # 10 keys in turn through 3 places: each made again, the same
    cache.get("k9", make)  # the most recent: kept
    assert len(made) == 100
    cache.get("k5", make)  # evicted long ago
    assert len(made) == 101
    # keep=0 keeps nothing: a distinct document per request does not grow the process.
    empty = DocumentCache(keep=0)
    for i in range(10):
        empty.get(f"d{i}", make)
    assert len(empty) == 0


# --------------------------------------------------------------------------- TTFT


def chat(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def usage(tokens: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}


def play(events: list[tuple[dict[str, Any], float]], done: float) -> list[tuple[str, float]]:
    """Feed ``events`` (event, seconds after start) and end at ``done``; the samples."""
    clock = StreamClock(started=100.0)
    out: list[tuple[str, float]] = []
    for event, at in events:
        out += clock.feed(event, 100.0 + at)
    out += clock.end(100.0 + done)
    return [(kind, round(ms, 3)) for kind, ms in out]


def test_ttft_is_the_first_event_carrying_text_not_the_role_event() -> None:
    got = play([(ROLE, 0.01), (chat(""), 0.02), (chat("Hi"), 0.25), (chat(" there"), 0.3),
                (chat(None, "stop"), 0.31), (usage(2), 0.31)], done=0.32)  # fmt: skip
    assert got == [("TTFT", 250.0), ("ITL", 50.0)]


def test_a_token_shown_only_by_its_logprobs_is_the_first_token() -> None:
    """A token with no text of its own (half a character) comes with logprobs only."""
    lp = {"content": [{"token": "\\xe2", "logprob": -0.1, "bytes": [226]}]}
    got = play([(ROLE, 0.01), (chat(None, logprobs=lp), 0.1), (chat("é"), 0.15),
                (chat(None, "stop"), 0.2), (usage(2), 0.2)], done=0.2)  # fmt: skip
    assert got == [("TTFT", 100.0), ("ITL", 50.0)]
    # Completions: their logprobs list tokens.
    assert carries_token({"text": "", "logprobs": {"tokens": ["\\xe2"]}})
    assert not carries_token({"text": "", "logprobs": None, "finish_reason": "stop"})


def test_an_answer_whose_tokens_came_only_with_its_finish_gets_its_ttft_there() -> None:
    """Just an EOS: no text, one token counted; the finish event carried it."""
    got = play([(ROLE, 0.01), (chat(None, "stop"), 0.4), (usage(1), 0.4)], done=0.41)
    assert got == [("TTFT", 400.0)]


def test_an_answer_with_no_token_gets_no_ttft_but_is_counted() -> None:
    got = play([(ROLE, 0.01), (chat(None, "stop"), 0.4), (usage(0), 0.4)], done=0.5)
    assert got == [("NO_TOKENS", 500.0)]
    # Without a usage event nothing tells a token was made: counted, no TTFT guessed.
    assert play([(ROLE, 0.01), (chat(None, "stop"), 0.4)], done=0.5) == [("NO_TOKENS", 500.0)]


def test_the_clock_keeps_the_answers_text() -> None:
    clock = StreamClock(started=0.0)
    for i, event in enumerate([ROLE, chat("a"), chat(""), chat("b", "length"), usage(2)]):
        clock.feed(event, float(i))
    assert clock.text == "ab" and clock.end(9.0) == []
