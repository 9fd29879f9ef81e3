"""One request's chunks → new tokens exactly once, in order, across redeliveries.

Shared by the NATS-native client (``common/client.py``) and the gateway's streams: both
keep ``delivered`` tokens and the highest resumed ``attempt``, drop chunks of older
attempts, hold chunks past a gap until it fills, and trim overlaps (DESIGN §2). Pure and
transport-free: :meth:`ChunkSequencer.feed` takes a decoded chunk and returns what is
deliverable now; :meth:`ChunkSequencer.resume` answers a worker's resume query.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from common.errors import InternalError, ServiceUnavailableError, error_from_code
from common.protocol import Chunk, Control, ResumeQuery, ResumeReply

# Out-of-order chunks held while a gap fills; those past it are dropped, not held: the
# resync that fills the gap resends every chunk from it (workers/resync.py), final one
# included, and a gap no resync fills ends the answer at GAP_GIVE_UP_S, retryable.
MAX_EARLY_CHUNKS = 256
# A gap still open this long reads as chunks lost (not only late): the caller asks the
# workers to resync (its heartbeat's count). One no resync filled in GAP_GIVE_UP_S (the
# worker had forgotten the request, or stopped) ends the answer, retryable, rather than
# at its deadline.
GAP_RESYNC_S = 0.5
GAP_GIVE_UP_S = 5.0


def gap_given_up() -> ServiceUnavailableError:
    """How a stream ends whose gap no resync filled in GAP_GIVE_UP_S: retryable."""
    return ServiceUnavailableError(
        "part of the answer was lost on the way and could not be recovered; retry",
        retry_after_s=1,
    )


def second_run_stop(
    group: str, request_id: str, run: tuple[int, str], followed_seq: int | None
) -> Control:
    """The ``supersede`` a caller publishes on ``P.abort.<group>`` to stop a second run
    (:meth:`ChunkSequencer.take_second_run`): ``run`` is its (attempt, worker),
    ``followed_seq`` the stream sequence of the message the caller follows, when known."""
    return Control(
        action="supersede", issued_ms=int(time.time() * 1000), group=group,
        request_id=request_id, attempt=run[0], worker=run[1], stream_seq=followed_seq,
        reason="a second run of this delivery",
    )  # fmt: skip


# (ids already delivered, new ids) -> text of the new ids; for chunks trimmed after an overlap.
DecodeTail = Callable[[Sequence[int], Sequence[int]], str]


class ChunkSequencer:
    """Dedupe, reorder and resume state of one request.

    A chunk trimmed after an overlap keeps its text only when ``decode_tail`` is given
    (text cannot be split by tokens without a tokenizer); overlaps are rare, since a
    resumed worker starts exactly where the caller stands. A chunk with text but no
    tokens is delivered (a detokenizer releasing held-back text).

    One run per attempt: the stream follows the worker whose chunk of the newest attempt
    came first. Another worker's chunks of that same attempt come
    from a second run of one delivery (a group consumer deleted and made again delivers
    its messages afresh, as attempt 1; a request published twice under one id): they are
    dropped, and :meth:`take_second_run` names that worker once, for the caller to stop
    it. Without worker names (workers before them) two runs that disagree fail the answer.
    """

    __slots__ = (
        "_early",
        "_stopped",
        "decode_tail",
        "finished",
        "min_attempt",
        "request_id",
        "run",
        "second_run",
        "text_len",
        "token_ids",
    )

    def __init__(self, request_id: str, decode_tail: DecodeTail | None = None) -> None:
        self.request_id = request_id
        self.decode_tail = decode_tail
        self.token_ids: list[int] = []  # delivered so far: what a resume reply carries
        self.text_len = 0
        self.min_attempt = 1
        self.finished = False
        self._early: dict[int, Chunk] = {}
        self.run: tuple[int, str] | None = None  # (attempt, worker) the stream follows
        self.second_run: tuple[int, str] | None = None  # a run to stop, not yet taken
        self._stopped: set[tuple[int, str]] = set()  # runs named to stop already

    def take_second_run(self) -> tuple[int, str] | None:
        """(attempt, worker) of a second run seen since the last call, to stop; once each."""
        found, self.second_run = self.second_run, None
        return found

    def _follows(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` is of the run this stream follows: the first worker's of the
        newest attempt. Another run's worker is named once (:meth:`take_second_run`),
        whatever its attempt: a delivery made afresh by a consumer made again may come
        with a lower one than a resume raised the stream to."""
        if not chunk.worker:
            return True  # a worker that names none: the tokens' agreement decides
        if chunk.attempt >= self.min_attempt and (self.run is None or chunk.attempt > self.run[0]):
            self.run = (chunk.attempt, chunk.worker)
            return True
        if (chunk.attempt, chunk.worker) == self.run:
            return True
        run = (chunk.attempt, chunk.worker)
        if run not in self._stopped:
            self._stopped.add(run)
            self.second_run = run
        return False

    @property
    def holding_gap(self) -> bool:
        """Chunks arrived past one that has not (yet): lost, or only late."""
        return bool(self._early)

    def feed(self, chunk: Chunk) -> list[Chunk]:
        """Chunks to deliver now (possibly none), trimmed to what is new.

        Raises the chunk's error as a :class:`~common.errors.QosError` (the stream is then
        finished); ``finish_reason="error"`` without details is an internal error.
        """
        if self.finished or chunk.id != self.request_id:
            return []  # a chunk of another request (published here by mistake) is not ours
        if not self._follows(chunk) or chunk.attempt < self.min_attempt:
            return []
        if chunk.error is not None:
            self.finished = True
            raise error_from_code(chunk.error.code, chunk.error.message)
        if chunk.finish_reason == "error":
            self.finished = True
            raise InternalError("the worker failed the request")
        if chunk.seq > len(self.token_ids):
            # Past the bound, dropped: a 500 here cut streams their resync was about to mend.
            if len(self._early) < MAX_EARLY_CHUNKS:
                self._early[chunk.seq] = chunk
            return []
        out = self._accept(chunk)
        while self._early and not self.finished:
            ready = sorted(seq for seq in self._early if seq <= len(self.token_ids))
            if not ready:
                break
            for seq in ready:
                out += self._accept(self._early.pop(seq))
        return out

    def _accept(self, chunk: Chunk) -> list[Chunk]:
        if self.finished:
            return []
        skip = len(self.token_ids) - chunk.seq
        if skip > 0:
            delivered = self.token_ids[chunk.seq : chunk.seq + len(chunk.token_ids)]
            if chunk.token_ids[: len(delivered)] != delivered:
                # Two runs of one attempt answer at once (a consumer deleted and made again
                # delivers its messages afresh, as attempt 1): splicing them would be an
                # answer neither run gave. Fail it; the caller may retry.
                self.finished = True
                self._early.clear()
                raise InternalError(
                    "two runs of the request answered with different tokens; retry it"
                )
            ids = chunk.token_ids[skip:]
            text = self.decode_tail(self.token_ids, ids) if self.decode_tail and ids else ""
            chunk = replace(
                chunk,
                seq=len(self.token_ids),
                token_ids=ids,
                text=text,
                logprobs=chunk.logprobs[skip:],
                top_logprobs=chunk.top_logprobs[skip:],
                # Those came with the first chunk, which was delivered.
                prompt_logprobs=[],
                prompt_top_logprobs=None,
            )
        if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
            return []  # nothing new: delivered already
        self.token_ids.extend(chunk.token_ids)
        self.text_len += len(chunk.text)
        if chunk.finish_reason is not None:
            self.finished = True
            self._early.clear()
        return [chunk]

    def resume(self, query: ResumeQuery) -> ResumeReply:
        """What the caller has; chunks of older attempts are ignored from now on. A stream
        that has its final chunk is closed: a redelivered copy (its ack lost) would else
        generate the rest again for nobody, unaborted since its worker was done."""
        if self.finished:
            return ResumeReply(id=self.request_id, closed=True)
        if query.attempt > self.min_attempt:
            self.min_attempt = query.attempt
            self._early.clear()  # held chunks came from an older attempt; the new one resends
        return ResumeReply(
            id=self.request_id, token_ids=list(self.token_ids), text_len=self.text_len
        )
