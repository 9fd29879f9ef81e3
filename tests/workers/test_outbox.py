"""A flight's final chunk: its usage, with or without the engine's last delta."""

from __future__ import annotations

import msgpack

from common.protocol import GenerateRequest
from workers.outbox import Flight, raw_reply


def test_a_final_chunk_without_an_engine_delta_still_counts_the_prompt():
    """A resumed request that had nothing left to generate ends with no delta: its usage
    read 0 prompt tokens (and 0 cached)."""
    req = GenerateRequest(id="r", group="short", reply="o.r", prompt_token_ids=[1, 2, 3])
    st = Flight(req, msg=None, attempt=2, start=0.0)
    st.resumed_at([5, 6, 7, 8], 4)  # the caller has all 4 tokens
    final = st.final_chunk("w0", "length")
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 4)
    assert final.finish_reason == "length" and final.seq == 4


def test_a_text_prompts_final_chunk_without_an_engine_delta_counts_it_as_encoded():
    """A text prompt (a direct NATS caller's) carries no ids: the service passes the
    length it encoded, else usage read 0 prompt tokens."""
    req = GenerateRequest(id="r", group="short", reply="o.r", prompt="hello there")
    st = Flight(req, msg=None, attempt=2, start=0.0)
    st.resumed_at([5, 6], 2)
    final = st.final_chunk("w0", "length", prompt_tokens=3)
    assert final.usage is not None and final.usage.prompt_tokens == 3


def test_prompt_logprobs_ride_once_on_the_first_chunk_and_not_into_a_resumed_attempt():
    from common.protocol import RequestParams
    from workers.engine.outputs import RequestDelta
    from workers.outbox import sampling_params

    params = RequestParams(max_tokens=4, prompt_logprobs=1)
    req = GenerateRequest(id="r", group="short", reply="o.r", prompt_token_ids=[1, 2, 3],
                          params=params)  # fmt: skip
    st = Flight(req, msg=None, attempt=1, start=0.0)
    st.absorb(RequestDelta("r", [7], "x", prompt_logprobs=[None, -1.0, -2.0],
                           prompt_top_logprobs=[None, [(5, -0.5)], [(6, -0.25)]]))  # fmt: skip
    first = st.take_chunk("w0")
    assert first.prompt_logprobs == [-1.0, -2.0]
    assert first.prompt_top_logprobs is not None
    assert [t.token_ids for t in first.prompt_top_logprobs] == [[5], [6]]
    st.absorb(RequestDelta("r", [8], "y"))
    assert st.take_chunk("w0").prompt_logprobs == []
    assert sampling_params(req, 4).prompt_logprobs == 1
    assert sampling_params(req, 2).prompt_logprobs is None  # the caller has the first chunk


def test_the_reply_of_an_undecodable_request_is_read_without_building_a_flood_of_maps() -> None:
    """A request refused for its shape is read again for its id, to answer its caller: that
    read built every one of 8 MiB of empty maps (~700 MB) the refusal had stopped short of."""

    def out(rid: str) -> str:
        return f"P.out.{rid}"

    bad = msgpack.packb({"v": 1, "id": "r1", "prompt": 5})
    assert raw_reply(bad, out) == ("P.out.r1", "r1")
    flood = msgpack.packb({"v": 1, "id": "r1", "x": [{}] * 200_000})
    assert raw_reply(flood, out) == (None, "")
