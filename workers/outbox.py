"""What one request sends back: engine deltas → coalesced chunks with exact ``seq`` numbers.

A :class:`Flight` is a request this replica holds, from its fetch to its ack. It buffers
the engine's deltas until the service flushes them into a :class:`Chunk` whose ``seq`` is
the index (in the whole output) of its first token. ``seq`` counts from ``base``, the
tokens the caller already had when a redelivered attempt began, so a resumed stream
continues where the caller stands. Pure: no NATS, no asyncio; the service does the I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack

from common.errors import QosError
from common.guided import GuidedSpec
from common.protocol import (
    Chunk,
    ContainerBudget,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    TopLogprobs,
    Usage,
)
from common.subjects import is_subject_token
from workers.engine.outputs import RequestDelta
from workers.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Flight:
    """One request in flight here: its message, its attempt, and tokens not yet sent."""

    request: GenerateRequest
    msg: Any  # nats.aio.msg.Msg: acked after the final chunk
    attempt: int  # JetStream delivery count, stamped on every chunk
    start: float  # time.time() the latency clock starts (created_ms when known)
    delivered: int = 0  # the latest delivery count seen here (a late in_progress redelivers)
    base: int = 0  # tokens the caller already had when this attempt began (resume)
    resume_ids: list[int] = field(default_factory=list)  # those tokens (len == base)
    resume_text_len: int = 0  # characters of their text the caller has
    sent: int = 0  # absolute index of the next token to publish = the next chunk's seq
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    # params.prompt_logprobs' values (prompt tokens 1..), sent once, on the next chunk.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_tops: list[TopLogprobs] | None = None
    flush_at: float | None = None  # loop time the buffered tokens are due
    first_sent: bool = False
    error: QosError | None = None  # why it was aborted here (deadline), if it was
    orphaned: bool = False  # aborted here because its gateway went silent
    # A chunk of it was too big to send (workers.service._too_big): the rest of its output is
    # dropped, and the error that task sends is its only ending.
    output_lost: bool = False
    watch: Any = None  # metrics/tracing state (workers.observe.Watch), while observed
    sent_chunks: list[Chunk] = field(default_factory=list)  # for a resync (workers.resync)
    # Its name in the engine: the request id and a number of this flight's own, so output
    # still on its way from an earlier flight of the id (aborted, handed back) is never its.
    engine_id: str = ""
    abort_at: float | None = None  # time.monotonic() its engine request was last aborted

    def resumed_at(self, token_ids: list[int], text_len: int) -> None:
        """The caller already has ``token_ids`` and ``text_len`` characters of their text:
        number from there."""
        self.resume_ids, self.resume_text_len = token_ids, text_len
        self.base = self.sent = len(token_ids)

    @property
    def has_pending(self) -> bool:
        return bool(self.ids or self.text)

    def absorb(self, delta: RequestDelta) -> None:
        """Buffer what one engine step added."""
        self.ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            self.tops.extend(
                TopLogprobs([t for t, _ in top], [lp for _, lp in top])
                for top in delta.top_logprobs
            )
        if delta.prompt_logprobs is not None:
            # Entry 0 is None (no token precedes the first): the wire starts at token 1.
            self.prompt_logprobs = [
                lp if lp is not None else float("-inf") for lp in delta.prompt_logprobs[1:]
            ]
            tops = (delta.prompt_top_logprobs or [])[1:]
            if any(tops):  # prompt_logprobs 0 asks for no alternatives
                self.prompt_tops = [
                    TopLogprobs([t for t, _ in top or ()], [lp for _, lp in top or ()])
                    for top in tops
                ]

    def take_chunk(self, worker: str) -> Chunk:
        """A chunk of everything buffered (possibly nothing); advances ``sent``."""
        n = len(self.ids)
        chunk = Chunk(
            id=self.request.id, seq=self.sent, attempt=self.attempt, token_ids=self.ids,
            text=self.text, logprobs=self.logprobs if len(self.logprobs) == n else [],
            top_logprobs=self.tops if len(self.tops) == n else [], worker=worker,
        )  # fmt: skip
        if self.prompt_logprobs:
            chunk.prompt_logprobs, chunk.prompt_top_logprobs = (
                self.prompt_logprobs,
                self.prompt_tops,
            )
            self.prompt_logprobs, self.prompt_tops = [], None
        self.first_sent = self.first_sent or n > 0
        self.sent += n
        self.ids, self.text, self.logprobs, self.tops, self.flush_at = [], "", [], [], None
        return chunk

    def final_chunk(
        self,
        worker: str,
        reason: str,
        delta: RequestDelta | None = None,
        prompt_tokens: int | None = None,
    ) -> Chunk:
        """The last chunk: what is buffered, ``finish_reason`` and ``usage``.

        Usage counts the original prompt (a resumed attempt's engine prompt also holds the
        ``base`` tokens) and every output token, resumed ones included. Without the
        engine's word (a resumed request that had nothing left to generate), the prompt is
        ``prompt_tokens`` (a text prompt's, as encoded), else the request's own token ids.
        """
        output = delta.output if delta is not None else None
        if output is not None:
            prompt = len(output.prompt_token_ids) - self.base
        elif prompt_tokens is not None:
            prompt = prompt_tokens
        else:
            prompt = len(self.request.prompt_token_ids)
        cached = min(output.num_cached_tokens, prompt) if output is not None else 0
        chunk = self.take_chunk(worker)
        chunk.finish_reason = cast(FinishReason, reason)
        if output is not None and reason == "stop" and self.request.params.want_stop_reason:
            chunk.stop_reason = output.stop_reason
        chunk.usage = Usage(prompt_tokens=prompt, completion_tokens=self.sent, cached_tokens=cached)
        return chunk

    def error_chunk(self, worker: str, error: QosError) -> Chunk:
        """The last chunk of a failed request: ``finish_reason="error"`` and the error."""
        return Chunk(
            id=self.request.id, seq=self.sent, attempt=self.attempt, finish_reason="error",
            error=ErrorInfo(error.code, error.message), worker=worker,
        )  # fmt: skip


def sampling_params(request: GenerateRequest, max_tokens: int) -> SamplingParams:
    """The engine's parameters for ``request`` (``max_tokens`` less any resumed tokens;
    ``min_tokens`` less them too).

    Raises :class:`~workers.engine.sampling_params.SamplingParamsError` for a bad value.
    """
    p = request.params
    resumed = p.max_tokens - max_tokens
    min_tokens = p.min_tokens
    if isinstance(min_tokens, int) and min_tokens > 0:  # a bad value is validate()'s to name
        min_tokens = max(0, min(min_tokens - resumed, max_tokens))
    return SamplingParams(
        max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, logprobs=p.logprobs, min_tokens=min_tokens or 0,
        # A resumed attempt's caller has the first chunk, which carried them.
        prompt_logprobs=p.prompt_logprobs if resumed == 0 else None,
        skip_special_tokens=p.skip_special_tokens is not False,
        include_stop_str_in_output=bool(p.include_stop_str_in_output),
        logit_bias=p.logit_bias(),
        guided=GuidedSpec(p.guided_kind, p.guided_spec or "") if p.guided_kind else None,
        guided_after=p.guided_after_token if p.guided_kind else None,
    )  # fmt: skip


def raw_reply(data: bytes, out_subject: Callable[[str], str]) -> tuple[str | None, str]:
    """(reply, id) read leniently from a payload that failed strict decoding.

    The reply is the request's own ``P.out.<id>`` (``out_subject(id)``) whenever an id can
    be read, whatever the payload names (as :meth:`WorkerService._misdirected` answers): a
    payload naming another subject must not have this worker publish there, and one that
    left ``reply`` out, or was undecodable for a bad string or an integer map key elsewhere,
    still has a caller waiting on its out subject. The id is "" (and the reply None) when
    unreadable.
    """
    count = ContainerBudget("request", len(data))  # a payload of empty maps stops early
    try:
        obj = msgpack.unpackb(
            bytes(data), raw=False, unicode_errors="surrogateescape", strict_map_key=False,
            object_hook=count, list_hook=count,
        )  # fmt: skip
    except Exception:  # msgpack raises several unrelated types
        return None, ""
    if not isinstance(obj, dict):
        return None, ""
    rid = obj.get("id")
    rid = rid if isinstance(rid, str) and is_subject_token(rid) else ""
    if not rid:
        return None, ""
    return out_subject(rid), rid
