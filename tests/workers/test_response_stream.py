"""ChunkSequencer (client and gateway): every token once, in order, across reordering and redeliveries."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.errors import ContextLengthExceededError, InternalError
from common.protocol import Chunk, ErrorInfo, ResumeQuery, Usage
from common.sequencer import ChunkSequencer as ResponseStream


def chunk(seq: int, ids: list[int], attempt: int = 1, final: bool = False) -> Chunk:
    return Chunk(
        id="r",
        seq=seq,
        attempt=attempt,
        token_ids=ids,
        text="".join(chr(97 + i % 26) for i in ids),
        finish_reason="length" if final else None,
        usage=Usage(1, seq + len(ids)) if final else None,
    )


def delivered(stream: ResponseStream, *chunks: Chunk) -> list[int]:
    return [t for c in chunks for out in stream.feed(c) for t in out.token_ids]


def test_out_of_order_chunks_wait_for_the_gap() -> None:
    stream = ResponseStream("r")
    assert delivered(stream, chunk(2, [3, 4])) == []
    assert delivered(stream, chunk(0, [1, 2])) == [1, 2, 3, 4]
    assert delivered(stream, chunk(4, [5], final=True)) == [5] and stream.finished


def test_overlap_after_a_redelivery_is_trimmed() -> None:
    stream = ResponseStream("r", decode_tail=lambda have, new: "+" * len(new))
    delivered(stream, chunk(0, [1, 2, 3]))
    (out,) = stream.feed(chunk(1, [2, 3, 4], attempt=2))
    assert (out.seq, out.token_ids, out.text) == (3, [4], "+")
    assert stream.feed(chunk(0, [1, 2], attempt=2)) == []  # nothing new


def test_a_redelivered_first_chunk_brings_no_second_copy_of_the_prompt_logprobs() -> None:
    stream = ResponseStream("r", decode_tail=lambda have, new: "+" * len(new))
    (first,) = stream.feed(replace(chunk(0, [1, 2]), prompt_logprobs=[-1.0]))
    assert first.prompt_logprobs == [-1.0]
    (again,) = stream.feed(replace(chunk(0, [1, 2, 3]), attempt=2, prompt_logprobs=[-1.0]))
    assert again.token_ids == [3] and again.prompt_logprobs == []


def test_two_runs_of_one_attempt_that_disagree_fail_the_stream_rather_than_splice() -> None:
    """A group consumer deleted and made again delivers the unacked request afresh, as
    attempt 1, while its first run still streams: chunks of both raced for each position
    and the caller got an answer neither run gave."""
    stream = ResponseStream("r")
    assert delivered(stream, chunk(0, [1, 2, 3])) == [1, 2, 3]
    assert delivered(stream, chunk(0, [1, 2, 3])) == []  # a resent copy: agrees, dropped
    with pytest.raises(InternalError, match="two runs"):
        stream.feed(chunk(2, [9, 4]))  # position 2 was 3
    assert stream.finished and stream.feed(chunk(3, [4], final=True)) == []


def test_a_second_workers_run_of_the_same_attempt_is_dropped_and_named_once() -> None:
    """Two runs of one delivery (a consumer made again; an id published twice) each
    streamed into the answer: identical greedy runs were deduplicated by luck, sampled ones
    failed it. The first run is followed; the other's chunks are dropped, and its worker is
    named once, for the caller to stop."""
    stream = ResponseStream("r")

    def by(worker: str, c: Chunk) -> Chunk:
        c.worker = worker
        return c

    assert delivered(stream, by("a", chunk(0, [1, 2]))) == [1, 2]
    assert delivered(stream, by("b", chunk(0, [7, 8, 9]))) == []
    assert stream.take_second_run() == (1, "b") and stream.take_second_run() is None
    assert delivered(stream, by("b", chunk(3, [9], final=True))) == []
    assert stream.take_second_run() is None and not stream.finished
    assert delivered(stream, by("a", chunk(2, [3], final=True))) == [3] and stream.finished
    # A later delivery takes over, and its first worker's chunks are followed.
    later = ResponseStream("r")
    delivered(later, by("a", chunk(0, [1])))
    later.resume(ResumeQuery(id="r", attempt=2, worker="c"))
    assert delivered(later, by("c", chunk(1, [2], attempt=2))) == [2]
    assert delivered(later, by("d", chunk(2, [3], attempt=2))) == []
    assert later.take_second_run() == (2, "d")
    # A consumer made again delivers it afresh as attempt 1, below the stream's 2: that run
    # is named too (the resume's supersede went out before it began).
    assert delivered(later, by("e", chunk(0, [1, 2, 3], attempt=1))) == []
    assert later.take_second_run() == (1, "e")


def test_resume_answers_what_was_delivered_and_silences_older_attempts() -> None:
    stream = ResponseStream("r")
    delivered(stream, chunk(0, [1, 2]))
    reply = stream.resume(ResumeQuery(id="r", attempt=2))
    assert reply.token_ids == [1, 2] and reply.text_len == 2
    assert delivered(stream, chunk(2, [9, 9], attempt=1)) == []  # the old worker, still talking
    assert delivered(stream, chunk(2, [3], attempt=2, final=True)) == [3]
    assert stream.token_ids == [1, 2, 3]
    # Finished: a copy redelivered after a lost ack is told to drop it, not handed the
    # tokens to generate the rest again for nobody.
    again = stream.resume(ResumeQuery(id="r", attempt=3))
    assert again.closed and again.token_ids == []


def test_an_error_chunk_raises_the_matching_error() -> None:
    stream = ResponseStream("r")
    bad = Chunk(
        id="r", finish_reason="error", error=ErrorInfo("context_length_exceeded", "too long")
    )
    with pytest.raises(ContextLengthExceededError):
        stream.feed(bad)
    assert stream.finished and stream.feed(chunk(0, [1])) == []


def test_a_chunk_of_another_request_is_ignored() -> None:
    """Chunks are routed by subject: one published on this request's subject for another
    id (a caller naming someone else's reply) must neither add tokens nor end the stream."""
    stream = ResponseStream("r")
    foreign = Chunk(id="other", seq=0, token_ids=[9], text="x", finish_reason="stop")
    assert stream.feed(foreign) == [] and not stream.finished
    assert delivered(stream, chunk(0, [1], final=True)) == [1] and stream.finished


def test_chunks_past_a_long_gap_are_dropped_not_fatal_and_the_resend_completes_it() -> None:
    """A fast stream holds 256 chunks past a lost one in about a second, before the resync
    (asked at 0.5 s, at most one a second per caller) resends them: the stream failed with
    a 500, though the worker was alive and resends every chunk from the gap on."""
    stream = ResponseStream("r")
    sent = [chunk(i, [i + 1]) for i in range(400)] + [chunk(400, [401], final=True)]
    assert delivered(stream, *sent[1:]) == [] and not stream.finished  # chunk 0 was lost
    assert stream.holding_gap  # the gap watch still sees it (its resync, its give-up)
    assert delivered(stream, *sent) == list(range(1, 402)) and stream.finished
