"""OpenAI response objects: completions and chat, whole or as stream chunks.

A :class:`Shaper` belongs to one request and turns its deliveries into exactly what
OpenAI's API returns: ``text_completion`` / ``chat.completion`` bodies, SSE chunks
(``text_completion`` / ``chat.completion.chunk``; the first chat chunk carries
``delta.role``), the usage-only chunk for ``stream_options.include_usage``, and both APIs'
logprobs shapes. The common stream chunk (text, no logprobs, not final) is built from a
precomputed prefix and suffix: at a thousand streams a second, one ``json.dumps`` of a
string beats one of a nested dict.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from common.errors import QosError
from common.protocol import TopLogprobs, Usage
from gateway.reasoning import ReasoningSplit
from gateway.streams import Delivery, sse_event
from gateway.tool_calls import ToolCallStream

Kind = Literal["completion", "chat"]
# OpenAI's stand-in for -inf: JSON has no infinity.
MIN_LOGPROB = -9999.0
TokenBytes = Callable[[int], bytes]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _clamp(logprob: float) -> float:
    # JSON has no NaN either: a NaN (a broken distribution) reads as "very unlikely".
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def _completion_token(data: bytes) -> str:
    """A legacy ``logprobs.tokens`` entry: the token's text, or OpenAI's ``bytes:\\xNN``
    spelling for a piece of a character (bytes that are not UTF-8 on their own)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt as ``echo`` returns it: its text (as sent, or its token ids
    decoded), its token ids, and, for logprobs, where each token's text starts in it."""

    text: str
    ids: Sequence[int]
    offsets: Sequence[int] = ()


def usage_dict(prompt_tokens: int, completion_tokens: int, worker: Usage | None) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when the worker reported it."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if worker is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": worker.cached_tokens}
    return usage


class Shaper:
    """Formats one request's output for one endpoint."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        token_bytes: TokenBytes,
        *,
        logprobs: int | None = None,
        include_usage: bool = False,
        continuous_usage: bool = False,
        prompt_tokens: int = 0,
        silent_ids: frozenset[int] = frozenset(),
        index: int = 0,
        echo: Echo | None = None,
        tool_calls: ToolCallStream | None = None,
        reasoning: ReasoningSplit | None = None,
        obfuscate: bool = False,
    ) -> None:
        self.kind = kind
        # Streamed chunks padded against the token-length side channel (obfuscation.py).
        self.obfuscate = obfuscate
        self.index = index  # the choice's index (OpenAI's n: one Shaper per choice)
        # A completion's ``echo``: its prompt's text before the generated text, and (with
        # logprobs) its tokens' logprobs before theirs.
        self.echo = echo
        # A chat answer's tool calls, read from its text as it streams (None: text only).
        self.tool_calls = tool_calls
        # A chat answer's thinking, read apart from its content (None: all is content).
        self.reasoning = reasoning
        # Tokens whose text the output leaves out (special tokens under skip_special_tokens):
        # they take no room in text_offset, which indexes the returned text.
        self._silent_ids = silent_ids
        self.request_id = request_id
        self.model = model
        self.created = created
        self.token_bytes = token_bytes
        self.logprobs = logprobs
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        self.continuous_usage = include_usage and continuous_usage
        self.prompt_tokens = prompt_tokens
        # Completions' logprobs.text_offset runs across chunks, in the text returned.
        self._text_offset = len(echo.text) if echo is not None else 0
        # The tokens' bytes so far, as text: a character split over tokens counts once,
        # when its last byte comes, so text_offset indexes the text the client got.
        self._offset_text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._object = "text_completion" if kind == "completion" else "chat.completion.chunk"
        head = _dumps(
            {"id": request_id, "object": self._object, "created": created, "model": model}
        )
        tail = ',"logprobs":null,"finish_reason":null}]' + (
            ',"usage":null' if include_usage else ""
        )
        close = "" if kind == "completion" else "}"  # a chat chunk's delta
        if kind == "completion":
            self._fast_prefix = f'data: {head[:-1]},"choices":[{{"index":{index},"text":'.encode()
        else:
            self._fast_prefix = (
                f'data: {head[:-1]},"choices":[{{"index":{index},"delta":{{"content":'.encode()
            )
        # A reasoning model's thinking: the same chunk with the text under both names
        # clients read it by, delta.reasoning (vLLM's since 2026) and
        # delta.reasoning_content (vLLM's before, DeepSeek's, litellm's).
        self._fast_reasoning_prefix = self._fast_prefix.replace(
            b'"delta":{"content":', b'"delta":{"reasoning":'
        )
        self._fast_suffix = (close + tail + "}\n\n").encode()
        self._usage_head = (close + ',"logprobs":null,"finish_reason":null}],"usage":').encode()

    # -- streaming -------------------------------------------------------------------------

    def _text_event(self, text: str, done: int, reasoning: bool = False) -> bytes:
        """The common chunk: text only (chat: as ``delta.content``, or ``reasoning``: as
        ``delta.reasoning`` and ``delta.reasoning_content``), not the last; ``done``: the
        tokens generated so far (for continuous usage)."""
        body = _dumps(text).encode()
        if reasoning:
            head = self._fast_reasoning_prefix + body + b',"reasoning_content":' + body
        else:
            head = self._fast_prefix + body
        if self.continuous_usage:
            usage = _dumps(self.usage_so_far(done)).encode()
            return head + self._usage_head + usage + b"}\n\n"
        return head + self._fast_suffix

    def usage_so_far(self, done: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def role_event(self) -> bytes:
        """The first chat chunk: the assistant's role and empty content, as OpenAI sends."""
        return sse_event(
            self._chunk(
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        )

    def echo_event(self, first: Delivery) -> bytes:
        """A completion's first chunk under ``echo``: its prompt's text (and logprobs, from
        the ``first`` delivery), as vLLM sends it."""
        text = self.echo.text if self.echo is not None else ""
        if self.logprobs is None:
            return self._text_event(text, 0)  # before anything generated
        choice = {
            "index": self.index,
            "text": text,
            "logprobs": self._prompt_logprobs(first),
            "finish_reason": None,
        }
        return sse_event(self._chunk(choice))

    def opening_events(self, first: Delivery) -> bytes:
        """What a stream sends before its ``first`` delivery: a chat's role, an echo."""
        if self.kind == "chat":
            return self.role_event()
        return self.echo_event(first) if self.echo is not None else b""

    def delta_event(self, delivery: Delivery) -> bytes:
        """One SSE chunk with the delivery's text (and logprobs / finish reason); with tool
        calls or reasoning read, the chunks of what can be told apart so far (maybe none)."""
        if self.reasoning is not None:
            return self._reasoning_events(delivery, self.reasoning)
        return self._content_events(delivery)

    def _reasoning_events(self, delivery: Delivery, split: ReasoningSplit) -> bytes:
        """The delivery's thinking as ``delta.reasoning`` chunks, then its content
        (tool calls read there) as any delivery's."""
        pieces = _read_pieces(split, delivery)
        out = b""
        for kind, text in pieces:
            if kind == "reasoning":
                out += self._text_event(text, delivery.completion_tokens, reasoning=True)
        content = "".join(text for kind, text in pieces if kind == "content")
        logprobs_due = self.logprobs is not None and bool(delivery.token_ids)
        if content or delivery.finish_reason is not None or logprobs_due:
            shown = delivery if content == delivery.text else replace(delivery, text=content)
            out += self._content_events(shown)
        return out

    def _content_events(self, delivery: Delivery) -> bytes:
        if self.tool_calls is not None:
            return self._tool_events(delivery, self.tool_calls)
        if delivery.finish_reason is None and self.logprobs is None:
            return self._text_event(delivery.text, delivery.completion_tokens)
        logprobs = self._logprobs(delivery) if self.logprobs is not None else None
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": self.index, "text": delivery.text}
        else:
            choice = {
                "index": self.index,
                "delta": {"content": delivery.text} if delivery.text else {},
            }
        choice["logprobs"] = logprobs
        choice["finish_reason"] = delivery.finish_reason
        if delivery.finish_reason is not None:
            choice["stop_reason"] = delivery.stop_reason
        return sse_event(self._chunk(choice, delivery.completion_tokens))

    def _tool_events(self, delivery: Delivery, stream: ToolCallStream) -> bytes:
        """The content and tool calls in ``delivery``'s text, one chunk each: a call's
        opening delta (its index, id and name), or more of its arguments as they come;
        the end's reason is ``tool_calls`` once a call was made, as vLLM answers. The
        delivery's logprobs, when asked, ride on its first chunk (one of their own, with an
        empty delta, when the reader held all of its text back): every token's, in order,
        across the stream, whatever its text became."""
        pieces = _read_pieces(stream, delivery)
        lp = self._logprobs(delivery) if self.logprobs is not None and delivery.token_ids else None
        out = b""
        for kind, value in pieces:
            if kind == "content":
                if lp is None:
                    out += self._text_event(value, delivery.completion_tokens)
                else:
                    out += self._delta_event({"content": value}, delivery, lp)
                    lp = None
                continue
            if kind == "arguments":  # more of the last call's arguments
                piece = {"index": stream.calls_sent - 1, "function": {"arguments": value}}
            else:
                piece = {"index": stream.calls_sent, **value}
                stream.calls_sent += 1
            out += self._delta_event({"tool_calls": [piece]}, delivery, lp)
            lp = None
        if delivery.finish_reason is not None:
            reason = stream.finish_reason(delivery.finish_reason, stream.calls)
            choice = {"index": self.index, "delta": {}, "logprobs": lp, "finish_reason": reason}
            choice["stop_reason"] = delivery.stop_reason
            out += sse_event(self._chunk(choice, delivery.completion_tokens))
        elif lp is not None:
            out += self._delta_event({}, delivery, lp)
        return out

    def _delta_event(
        self, delta: dict[str, Any], delivery: Delivery, logprobs: Any = None
    ) -> bytes:
        """A chat chunk carrying ``delta`` (a tool call's piece), with ``logprobs``."""
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return sse_event(self._chunk(choice, delivery.completion_tokens))

    def usage_event(self, usage: dict[str, Any]) -> bytes:
        """The ``include_usage`` chunk: empty choices, the whole request's usage."""
        return sse_event(
            {
                "id": self.request_id,
                "object": self._object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            }
        )

    @staticmethod
    def error_event(error: QosError) -> bytes:
        """An error after the stream started: OpenAI's error object as one event."""
        return sse_event(error.to_openai())

    def _chunk(self, choice: dict[str, Any], done: int = 0) -> dict[str, Any]:
        chunk = {
            "id": self.request_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = self.usage_so_far(done) if self.continuous_usage else None
        return chunk

    # -- whole responses -------------------------------------------------------------------

    def body(
        self,
        text: str,
        finish_reason: str | None,
        usage: dict[str, Any],
        logprobs: Delivery | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response; ``logprobs`` is every token merged into one delivery."""
        lp = (
            self._logprobs(logprobs) if logprobs is not None and self.logprobs is not None else None
        )
        if self.echo is not None and logprobs is not None and self.logprobs is not None:
            lp = _joined(self._prompt_logprobs(logprobs), lp)
        if self.kind == "completion":
            choice: dict[str, Any] = {
                "index": self.index,
                "text": (self.echo.text if self.echo is not None else "") + text,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            obj = "text_completion"
        else:
            reasoning = None
            if self.reasoning is not None:
                reasoning, text = self.reasoning.split(text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:  # as vLLM's: an answer that only thought says null
                message["content"] = text or None
            if self.tool_calls is not None:
                content, calls = self.tool_calls.split(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish_reason = self.tool_calls.finish_reason(finish_reason, len(calls))
            if reasoning is not None:  # under both names clients read (see __init__)
                message["reasoning"] = message["reasoning_content"] = reasoning
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            obj = "chat.completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    # -- logprobs --------------------------------------------------------------------------

    def _logprobs(self, delivery: Delivery) -> dict[str, Any] | None:
        if not delivery.logprobs:
            return None  # a chunk with no token (the last, with only the finish reason)
        if self.kind == "chat":
            return {"content": self._chat_logprobs(delivery)}
        return self._completion_logprobs(delivery)

    def _chat_logprobs(self, delivery: Delivery) -> list[dict[str, Any]]:
        out = []
        for i, (token_id, lp) in enumerate(
            zip(delivery.token_ids, delivery.logprobs, strict=False)
        ):
            data = self.token_bytes(token_id)
            entry: dict[str, Any] = {
                # The token's own bytes: a piece of a character shows U+FFFD as its text,
                # and the pieces' bytes join into the character.
                "token": data.decode("utf-8", errors="replace"),
                "logprob": _clamp(lp),
                "bytes": list(data),
                "top_logprobs": [
                    {
                        "token": t.decode("utf-8", errors="replace"),
                        "logprob": _clamp(v),
                        "bytes": list(t),
                    }
                    for t, v in self._top(delivery.top_logprobs, i)
                ],
            }
            out.append(entry)
        return out

    def _completion_logprobs(self, delivery: Delivery) -> dict[str, Any]:
        tokens, offsets = [], []
        for token_id in delivery.token_ids:
            data = self.token_bytes(token_id)
            tokens.append(_completion_token(data))
            offsets.append(self._text_offset)
            if token_id not in self._silent_ids:
                self._text_offset += len(self._offset_text.decode(data))
        token_logprobs = [_clamp(lp) for lp in delivery.logprobs]
        # The chosen token's entry too, whether or not it is among the best (OpenAI: "up to
        # logprobs+1 elements"; with logprobs 0, that entry alone).
        top = [
            self._legacy_top(delivery.top_logprobs, i, token, token_logprobs[i])
            for i, token in enumerate(tokens[: len(token_logprobs)])
        ]
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, delivery: Delivery) -> dict[str, Any]:
        """The legacy logprobs of the echoed prompt's tokens: the first has none (nothing
        precedes it), nor has any the worker did not send (a simulated engine's); offsets
        index the echoed text (see :class:`Echo`)."""
        assert self.echo is not None
        ids, offsets = self.echo.ids, self.echo.offsets
        values: Sequence[float | None] = delivery.prompt_logprobs or []
        tops: Sequence[TopLogprobs] = delivery.prompt_top_logprobs or []
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for j, token_id in enumerate(ids):
            token = _completion_token(self.token_bytes(token_id))
            tokens.append(token)
            value = values[j - 1] if 0 < j <= len(values) else None
            token_logprobs.append(None if value is None else _clamp(value))
            if value is None:
                top.append(None)
                continue
            top.append(self._legacy_top(tops, j - 1, token, _clamp(value)))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": list(offsets),
        }

    def _legacy_top(
        self, tops: Sequence[TopLogprobs], i: int, token: str, logprob: float
    ) -> dict[str, float]:
        """Position ``i``'s legacy ``top_logprobs`` entry: its alternatives, and the chosen
        ``token`` too, whether or not among the best (OpenAI: "up to logprobs+1 elements")."""
        return {_completion_token(t): _clamp(v) for t, v in self._top(tops, i)} | {token: logprob}

    def _top(self, tops: Sequence[TopLogprobs], i: int) -> list[tuple[bytes, float]]:
        """Position ``i``'s alternatives as (token bytes, logprob), best first."""
        if not self.logprobs or i >= len(tops):
            return []
        alternatives = tops[i]
        pairs = zip(alternatives.token_ids, alternatives.logprobs, strict=False)
        return [(self.token_bytes(t), v) for t, v in list(pairs)[: self.logprobs]]


def _read_pieces(reader: ToolCallStream | ReasoningSplit, delivery: Delivery) -> list[Any]:
    """What ``reader`` can tell apart in ``delivery``'s text, its end's too at the last."""
    pieces: list[Any] = list(reader.feed(delivery.text))
    if delivery.finish_reason is not None:
        pieces += reader.finish()
    return pieces


def _joined(prompt: dict[str, Any], output: dict[str, Any] | None) -> dict[str, Any]:
    """The echoed prompt's legacy logprobs followed by the output's, one object."""
    if output is None:
        return prompt
    return {key: prompt[key] + output[key] for key in prompt}


def merge(deliveries: Sequence[Delivery]) -> Delivery:
    """All deliveries of a request as one (for non-streaming responses)."""
    merged = Delivery()
    for d in deliveries:
        merged.token_ids.extend(d.token_ids)
        merged.logprobs.extend(d.logprobs)
        merged.top_logprobs.extend(d.top_logprobs)
        merged.finish_reason = d.finish_reason or merged.finish_reason
        merged.stop_reason = d.stop_reason if d.stop_reason is not None else merged.stop_reason
        merged.usage = d.usage or merged.usage
        if d.prompt_logprobs:
            merged.prompt_logprobs, merged.prompt_top_logprobs = (
                d.prompt_logprobs,
                d.prompt_top_logprobs,
            )
    merged.text = "".join(d.text for d in deliveries)
    return merged
