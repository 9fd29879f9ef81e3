"""One generation request's life: read, validate, tokenize, classify, admit, publish, answer.

Everything that can be refused is refused before anything reaches NATS. Then the
request is registered with the dispatcher (so no chunk can arrive unheard), published on
``<prefix>.req.<group>`` through JetStream (``Nats-Msg-Id`` = request id, so a retried
publish is deduplicated), and answered from its :class:`~gateway.streams.ResponseStream`.
The HTTP response starts only when the first tokens (or an error) arrive, so an error a
worker reports before any output still reaches the client as an HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import Any

from nats.js import JetStreamContext
from opentelemetry.trace import Tracer
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from common.config import Config
from common.detokenizer import IncrementalDetokenizer
from common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    QosError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from common.logging import bind_request
from common.protocol import GenerateRequest
from common.request_publish import CancelledAfterAck, publish_error, publish_request
from common.sampling_defaults import SamplingDefaults
from common.subjects import Subjects
from common.tokenizer import BaseTokenizer, ByteTokenizer, ChatTemplateError
from gateway import tracing as traced
from gateway.admission import Admission, Route
from gateway.auth import OPEN_GRANT, KeyGrant
from gateway.classifier import (
    GROUP_HEADER,
    Classification,
    classify,
    permitted_group,
    settle_max_tokens,
)
from gateway.forced_calls import ForcedCalls
from gateway.metrics import GatewayMetrics
from gateway.obfuscation import Padder
from gateway.openai_api import ChatCompletionRequest, CompletionRequest, parse_body
from gateway.reasoning import THINK_CLOSE, ReasoningSplit, reads_reasoning, starts_thinking
from gateway.responses import Echo, Kind, Shaper, merge, usage_dict
from gateway.streams import (
    SSE_DONE,
    WRITE_STALL_S,
    ClientClosedRequest,
    Delivery,
    Dispatcher,
    ResponseStream,
    SseResponse,
)
from gateway.tool_calls import (
    CALL_TAGS,
    Format,
    ToolCallStream,
    call_id,
    mistral_call_id,
    tool_call_stream,
    tool_format,
)

DEADLINE_HEADER = "X-QoS-Deadline-Ms"
MAX_DEADLINE_MS = 24 * 3600 * 1000
# Prompts longer than this are tokenized in a thread, so the event loop keeps streaming.
INLINE_TOKENIZE_CHARS = 16_384
# Conversations of more messages are rendered in a thread, however small their body: a
# template's work grows with the messages, for some (Gemma 4's) with their square.
INLINE_RENDER_MESSAGES = 32
# Logprob entries (tokens x alternatives) a whole body builds on the event loop; more, on a
# thread (an echoed 8k-token prompt with 20 alternatives took ~0.2 s of the loop).
INLINE_LOGPROB_ENTRIES = 20_000
# An event this big (an echoed prompt's logprobs) goes out as a write of its own, not copied
# into one with the events after it.
BIG_EVENT_BYTES = 64 * 1024
# Room in a chunk carrying prompt logprobs for everything else it holds.
PROMPT_LOGPROBS_SLACK = 16_384
# Prompt tokens of more than this, echoed, are decoded on a thread.
INLINE_ECHO_TOKENS = 4096
# How often a request in flight checks whether its client left.
DISCONNECT_POLL_S = 1.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
log = logging.getLogger(__name__)


# Ends that came from waiting for a first token (the deadline, or the client giving up),
# not from a refusal or an error a worker answered at once.
WAITED_OUT = frozenset({499, 504})


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass(slots=True)
class Flight:
    """An admitted request in flight: what its release must undo."""

    route: Route
    stream: ResponseStream
    shaper: Shaper
    prompt_tokens: int
    started: float  # time.monotonic() at arrival
    deadline: float  # time.monotonic() by which it must finish
    first_token_at: float | None = None
    # time.monotonic() of the next check that the client is still there
    disconnect_check_at: float = field(default_factory=lambda: time.monotonic() + DISCONNECT_POLL_S)
    completion_tokens: int = 0
    worker_usage: Any = None
    finish_reason: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    trace: traced.Decided = None  # the server span, or Unsampled, while tracing is on
    # One choice of several (OpenAI's n): the HTTP request's own accounting (its status,
    # E2E, TTFT, the server span's usage) is done once, by gateway.choices.
    quiet: bool = False
    # The prompt's scores only (echo, max_tokens 0): the token generated is dropped.
    scores_only: bool = False
    key: str = ""  # the API key's name its usage is counted under ("": an open gateway)


class Generator:
    """The request path shared by both endpoints (and their ``/v1/<group>/`` forms)."""

    def __init__(
        self,
        *,
        config: Config,
        tokenizer: BaseTokenizer,
        served_model: str,
        model_aliases: Sequence[str],
        js: JetStreamContext,
        dispatcher: Dispatcher,
        admission: Admission,
        metrics: GatewayMetrics,
        tracer: Tracer | None = None,
        log_prompts: bool = False,
        origin: str = "",
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        self._config = config
        self._sampling_defaults = sampling_defaults
        self._origin = origin  # this gateway's heartbeat id, stamped on every request
        self._tok = tokenizer
        self._model = served_model
        self._model_names = {served_model, *model_aliases}
        self.tokenizer = tokenizer
        self._js = js
        self._dispatcher = dispatcher
        self._admission = admission
        self._metrics = metrics
        self._tracer = tracer
        self._log_prompts = log_prompts
        self._subjects = Subjects(config.nats.subject_prefix)
        self._check_vocab = not isinstance(tokenizer, ByteTokenizer)
        # Logprobs show each token's own bytes: decoding one piece of a character gives U+FFFD.
        self.token_bytes: Callable[[int], bytes] = lru_cache(maxsize=65536)(tokenizer.token_bytes)
        self._special_ids = frozenset(tokenizer.all_special_ids)
        # How tool calls are read from this model's answers (None: it has no format).
        self.tool_format = tool_format(
            config.gateway.tool_call_parser, "\n".join(tokenizer.chat_templates.values())
        )
        # A model whose call tags are special tokens (some Hermes checkpoints): the worker's
        # text must keep them for the calls to be read, as vLLM's hermes parser asks.
        tag_text = CALL_TAGS.get(self.tool_format or "")
        tag = tokenizer.token_to_id(tag_text) if tag_text is not None else None
        self._tool_tags_special = tag is not None and tag in self._special_ids
        # Whether chat answers' thinking is returned apart (gateway/reasoning.py), and
        # whether its tags are special tokens the worker's text must keep to be read.
        self.reads_reasoning = reads_reasoning(
            config.gateway.reasoning_parser, "\n".join(tokenizer.chat_templates.values())
        )
        think = tokenizer.token_to_id(THINK_CLOSE) if self.reads_reasoning else None
        self._think_tags_special = think is not None and think in self._special_ids
        # One token (as in DeepSeek-R1's and Qwen3's vocabularies): a guided request that
        # thinks first has its grammar hold from the token after it.
        self._think_close_id = think

    def check_model(self, model: str | None) -> None:
        """404 for a model name this gateway does not serve (None: the served one)."""
        if model is not None and model not in self._model_names:
            raise ModelNotFoundError(
                f"The model '{model}' does not exist; this gateway serves '{self._model}'",
                param="model",
            )

    def max_model_len(
        self, allowed: Collection[str] | None = None, group: str | None = None
    ) -> int:
        """The longest sequence a key ``allowed`` these groups may send now (to ``group``
        alone, when named: 404 for an unknown one, 403 for one the key may not use)."""
        if group is None:
            return self._admission.max_model_len(allowed=allowed)
        permitted_group(self._config, group, None, allowed)
        return self._admission.max_model_len(groups=[group])

    # -- the whole request -----------------------------------------------------------------

    async def handle(
        self,
        kind: Kind,
        request: Request,
        path_group: str | None,
        grant: KeyGrant = OPEN_GRANT,
    ) -> Response:
        """Answer one generation request; a :class:`QosError` becomes the app's error reply."""
        started = time.monotonic()
        group_label = "-"
        try:
            deadline_ms = _deadline_ms(request, self._config.gateway.default_deadline_ms)
            raw = await self.read_body(request, deadline_ms / 1000)
            body: CompletionRequest | ChatCompletionRequest = (
                parse_body(CompletionRequest, raw)
                if kind == "completion"
                else parse_body(ChatCompletionRequest, raw)
            )
            body.check_fields()
            self.check_model(body.model)
            priority = grant.priority(body.priority)
            # Refusals sure to come, before the costly part (template, tokens, grammar).
            if grant.slots is not None:  # each choice of each prompt is a slot
                prompts_sent = (
                    len(body.prompt_inputs()) if isinstance(body, CompletionRequest) else 1
                )
                grant.slots.shed_if_full(body.choices() * prompts_sent)
            self._admission.shed_if_all_full(grant.groups)
            if body.guided() is not None:  # compiled off the loop: tens of ms for a grammar
                await asyncio.to_thread(body.check_guided)
            logprobs = body.top_logprobs_count()
            prompts, prompt_param = await self.prompts(body, big=len(raw) > INLINE_TOKENIZE_CHARS)
            max_tokens = (
                1  # generated and dropped: see CompletionRequest.scores_only
                if body.scores_only()
                else body.requested_max_tokens()
                if isinstance(body, ChatCompletionRequest)
                else body.max_tokens
            )
            # A batch goes to one group, the one its longest prompt needs.
            prompt_ids = max(prompts, key=len)
            if isinstance(body, CompletionRequest):
                self._check_prompt_logprobs(body, len(prompt_ids))
            echoes = await self.echoes(body, prompts)
            classified = classify(
                self._config,
                prompt_tokens=len(prompt_ids),
                max_tokens=max_tokens,
                path_group=path_group,
                header_group=request.headers.get(GROUP_HEADER),
                prompt_param=prompt_param,
                seq_limit=self._admission.seq_limit,
                allowed=grant.groups,
                min_tokens=body.min_tokens or 0,
                max_tokens_param=(
                    "max_completion_tokens"
                    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens
                    else "max_tokens"
                ),
            )
            group_label = classified.group
            # The deadline runs from arrival: reading and tokenizing the body spent some.
            ends_at = started + deadline_ms / 1000
            # One request on NATS per prompt and choice: more than one is a response of
            # several choices, which gateway.choices serves.
            choices = body.choices() * len(prompts)
            if choices == 1:
                route, classified = await self.admit(
                    classified, len(prompt_ids), body, max_tokens, grant, ends_at
                )
                group_label = route.group
        except QosError as exc:
            self._metrics.finished(group_label, exc.http_status)
            if self._tracer is not None:
                traced.rejected(
                    self._tracer, request.scope, kind=kind, model=self._model,
                    group=None if group_label == "-" else group_label, error=exc.code,
                )  # fmt: skip
            raise
        except ClientGone:
            self._metrics.finished(group_label, 499)
            return Response(status_code=499)
        except Exception:  # a bug: the app's handler answers 500, counted here
            self._metrics.finished(group_label, 500)
            raise
        salt = prefix_cache_salt(grant.cache_namespace, body.cache_salt)
        if choices > 1:  # it admits, answers and accounts for itself
            from gateway.choices import serve_choices  # it builds on this module

            if self._log_prompts:
                log.debug("request body: %s", raw[:4096].decode("utf-8", "replace"))
            return await serve_choices(
                self, kind, request, body, classified, prompts, echoes, logprobs, priority,
                grant, started, deadline_ms, max_tokens, salt,
            )  # fmt: skip
        try:
            flight = self._take_off(
                kind, body, route, prompt_ids, logprobs, started, deadline_ms, echo=echoes[0]
            )
            flight.key = grant.name
        except BaseException as exc:
            self._admission.release(route)  # nothing else holds the slot yet
            self._metrics.finished(
                route.group, exc.http_status if isinstance(exc, QosError) else 500
            )
            raise
        streaming = False
        try:
            if self._tracer is not None:
                flight.trace = traced.admitted(
                    self._tracer, request.scope, kind=kind, model=self._model, group=route.group,
                    request_id=flight.stream.request_id, body=body,
                    max_tokens=0 if flight.scores_only else classified.max_tokens,
                    prompt_tokens=len(prompt_ids),
                )  # fmt: skip
            if self._log_prompts:
                log.debug("request body: %s", raw[:4096].decode("utf-8", "replace"))
            await self._publish(
                flight, body, prompt_ids, classified.max_tokens, request, salt, priority
            )
            first = await self._next(flight, request)
            if first.error is not None:
                raise first.error
            if not body.stream:
                return await self._collect(flight, first, request)
            response = SseResponse(
                self._sse(flight, first),
                headers={**flight.headers, **SSE_HEADERS},
                on_disconnect=flight.stream.hang_up,
                on_close=lambda status: self._land(flight, status=status),
                # The events end the stream at its deadline themselves (an error event), after
                # sending what came in time: a slow reader gets it within the stall bound
                # (a reader that takes nothing is cut by the write-stall check).
                deadline=flight.deadline + WRITE_STALL_S,
            )
            streaming = True  # the response lands the flight from here on
            return response
        except ClientGone:
            self._land(flight, status=499)
            # Nobody reads it, but the access log does: the request's id and group.
            return Response(status_code=499, headers=flight.headers)
        except QosError as exc:
            self._land(flight, status=exc.http_status)
            if self._tracer is not None:
                traced.rejected(
                    self._tracer, request.scope, kind=kind, model=self._model,
                    group=route.group, error=exc.code,
                )  # fmt: skip
            # A copy: one error may end many requests (a shutdown fails every open stream
            # with one), and each answer names its own request.
            answer = copy.copy(exc)
            answer.request_headers = flight.headers
            raise answer from None
        finally:
            if not streaming:
                self._land(flight, status=500)  # a no-op unless something unexpected broke

    async def admit(
        self,
        classified: Classification,
        prompt_tokens: int,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        grant: KeyGrant,
        ends_at: float,
        count: int = 1,
    ) -> tuple[Route, Classification]:
        """A slot for one request (``count`` slots, in one group, for a response of several
        choices or prompts) in the group serving it, by ``ends_at`` (``time.monotonic()``);
        ``classified`` with ``max_tokens`` widened where the group serving it leaves more
        than the one asked for. Raises 429/503/504."""
        left_s = ends_at - time.monotonic()
        if left_s <= 0:
            raise DeadlineExceededError("the request's deadline passed before it was admitted")
        need = prompt_tokens + classified.max_tokens
        try:
            route = await self._admission.admit(
                classified.group, need, left_s, grant.groups, count=count, key=grant.slots
            )
        except ServiceUnavailableError:
            if time.monotonic() >= ends_at:
                # The wait ended at the client's own deadline: a 503 invited the openai
                # client to retry into the same deadline; a 504 says not to.
                raise DeadlineExceededError(
                    "the request's deadline passed while it waited for a worker"
                ) from None
            raise
        if time.monotonic() >= ends_at:
            # Admitted on the wait's last look, past the deadline: publishing it cost a
            # JetStream write, an abort and a delete for a 504 all the same.
            self._admission.release(route, count)
            raise DeadlineExceededError("the request's deadline passed before it was admitted")
        if route.group != classified.group and max_tokens is None:
            # Settled for the group it asked for (realtime's 1,024 left a long prompt 24
            # tokens); the group serving it may leave more.
            wider = settle_max_tokens(
                prompt_tokens,
                max(self._config.gateway.default_max_tokens, body.min_tokens or 0),
                self._admission.seq_limit(route.group),
            )
            if wider is not None and wider > classified.max_tokens:
                classified = replace(classified, max_tokens=wider)
        return route, classified

    # -- before NATS -----------------------------------------------------------------------

    async def read_body(self, request: Request, deadline_s: float | None = None) -> bytes:
        """The request's body, within ``max_body_bytes`` and ``body_timeout_s`` (or the
        request's deadline, ``deadline_s``, if sooner): a client trickling its body, or
        sending none, held a handler and up to the body limit for as long as it liked
        (uvicorn bounds no body read; a deadline alone let it be 24 h)."""
        gateway = self._config.gateway
        limit = gateway.max_body_bytes
        too_large = f"request body over the {limit}-byte limit (gateway.max_body_bytes)"
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(too_large)
        within_s, bound = gateway.body_timeout_s, "gateway.body_timeout_s"
        if deadline_s is not None and deadline_s < within_s:
            within_s, bound = deadline_s, "the request's deadline"
        parts, size = [], 0
        try:
            async with asyncio.timeout(within_s):
                async for part in request.stream():
                    size += len(part)
                    if size > limit:
                        raise PayloadTooLargeError(too_large)
                    parts.append(part)
        except ClientDisconnect:
            raise ClientGone from None
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request body did not arrive within {within_s:g} s ({bound})"
            ) from None
        return b"".join(parts)

    async def prompts(
        self, body: CompletionRequest | ChatCompletionRequest, *, big: bool = False
    ) -> tuple[list[list[int]], str]:
        """Each prompt's token ids (a conversation is one; a completions batch several) and
        the parameter to blame if they are too many. ``big``: see :meth:`prompt_ids`."""
        if isinstance(body, ChatCompletionRequest):
            ids, param = await self.prompt_ids(body, big=big)
            return [ids], param
        batch = body.prompt_inputs()
        texts = [prompt for prompt in batch if isinstance(prompt, str)]
        encoded = iter(await self.encode_all(texts))
        out = []
        for j, prompt in enumerate(batch):
            where = "the prompt" if len(batch) == 1 else f"prompt {j}"
            if isinstance(prompt, str):
                ids = next(encoded)
            else:
                ids = prompt
                if self._check_vocab and max(ids) >= self._tok.vocab_size:
                    raise InvalidRequestError(
                        f"{where}: token id {max(ids)} is outside the vocabulary "
                        f"(size {self._tok.vocab_size})",
                        param="prompt",
                    )
            if not ids:
                raise InvalidRequestError(f"{where} is empty", param="prompt")
            out.append(ids)
        return out, "prompt"

    async def prompt_ids(
        self, body: ChatCompletionRequest, *, big: bool = False, chat_special_tokens: bool = False
    ) -> tuple[list[int], str]:
        """A conversation's token ids and the parameter to blame if they are too many.
        ``big``: the request body is large, so the conversation is prepared and rendered on
        a thread (as is one of more than ``INLINE_RENDER_MESSAGES`` messages).
        ``chat_special_tokens``: it is encoded with the tokenizer's own BOS/EOS too
        (``/tokenize``'s ``add_special_tokens``; the template has its own)."""
        if self._config.gateway.reject_control_tokens:
            self._refuse_control_tokens(body)
        # chat_template_kwargs may set add_generation_prompt (as vLLM lets them) and
        # continue_final_message (transformers' own, handled by the tokenizer).
        kwargs = {
            "add_generation_prompt": body.add_generation_prompt,
            **({"continue_final_message": True} if body.continue_final_message else {}),
            **(body.chat_template_kwargs or {}),
        }
        if body.reasoning_effort is not None:  # as vLLM passes it: for templates that read it
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        tools = body.tool_dicts()
        if tools is not None:
            if self.tool_format is None and not body.forces_call():
                raise InvalidRequestError(
                    "this model has no tool-call format the gateway reads (its chat template "
                    "writes no <tool_call> tags, Llama 3.1's <|python_tag|> or Mistral's "
                    "[TOOL_CALLS]; gateway.tool_call_parser names one)",
                    param="tools",
                )
            if "tools" in kwargs:
                raise InvalidRequestError(
                    "give tools once: in tools, or in chat_template_kwargs",
                    param="chat_template_kwargs",
                )
            kwargs["tools"] = tools

        def render() -> str:
            parts = self._tok.content_parts  # the template loops over content parts
            developer = self._tok.knows_developer_role
            messages = [m.for_template(parts, developer) for m in body.messages]
            return self._tok.apply_chat_template(messages, **kwargs)

        try:
            # A big conversation (by its body: tool arguments and template kwargs count
            # too, not only contents; or by its messages, which a template's loops go
            # over) renders on a thread, as big prompts are tokenized: the event loop
            # serves every other stream meanwhile.
            off_loop = big or len(body.messages) > INLINE_RENDER_MESSAGES
            text = await asyncio.to_thread(render) if off_loop else render()
        except ChatTemplateError as exc:
            top_level = exc.param == "continue_final_message" and "continue_final_message" not in (
                body.chat_template_kwargs or {}
            )
            if top_level:  # given as vLLM's top-level field
                raise InvalidRequestError(str(exc), param=exc.param) from None
            if exc.param in ("tools", "documents", "continue_final_message"):
                # given in chat_template_kwargs
                raise InvalidRequestError(
                    f"chat_template_kwargs: {exc}", param="chat_template_kwargs"
                ) from None
            raise InvalidRequestError(str(exc), param=exc.param) from None
        except TypeError as exc:  # a chat_template_kwargs key that shadows an argument
            raise InvalidRequestError(
                f"chat_template_kwargs: {exc}", param="chat_template_kwargs"
            ) from None
        special = chat_special_tokens or body.add_special_tokens
        ids = await self.encode(text, add_special_tokens=special)
        return ids, "messages"

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids; a long text on a thread, so the event loop keeps streaming."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self._tok.encode, text, add_special_tokens)

    async def encode_all(self, texts: list[str]) -> list[list[int]]:
        """A batch's prompts' token ids; on a thread when, together, they are long (many
        short prompts hold the event loop as long as one long one)."""

        def encode() -> list[list[int]]:
            return [self._tok.encode(text, add_special_tokens=True) for text in texts]

        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return encode()
        return await asyncio.to_thread(encode)

    def _check_prompt_logprobs(self, body: CompletionRequest, longest: int) -> None:
        """400 for what could never be answered: ``n`` identical scorings, or a prompt's
        logprobs over the bus's message size (they ride in one chunk: the worker would
        compute the whole prompt, then fail it, and its group's breaker would count it)."""
        if body.scores_only() and body.choices() > 1:
            raise InvalidRequestError(
                "n > 1 with max_tokens 0 would return the same scores n times; send n=1",
                param="n",
            )
        k = body.prompt_logprobs_count()
        if k is None:
            return
        # Per prompt token: its logprob (f32) and k alternatives (i32 + f32, map keys).
        size = longest * (4 + (24 + 8 * k if k else 0)) + PROMPT_LOGPROBS_SLACK
        limit = self._config.nats.max_payload_bytes
        if size > limit:
            raise InvalidRequestError(
                f"echo with logprobs={k} over a prompt of {longest} tokens is larger (about "
                f"{size} bytes) than one message carries ({limit}, nats.max_payload_bytes): "
                "ask for fewer logprobs or send a shorter prompt",
                param="logprobs",
            )

    async def echoes(
        self, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]]
    ) -> list[Echo | None]:
        """Each prompt as a completion's ``echo`` returns it (None: not asked); big ones
        on a thread, as big prompts are tokenized."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return [None] * len(prompts)
        work = partial(self._echoes, body, prompts)
        if sum(len(ids) for ids in prompts) <= INLINE_ECHO_TOKENS:
            return list(work())
        return list(await asyncio.to_thread(work))

    def _echoes(self, body: CompletionRequest, prompts: list[list[int]]) -> list[Echo]:
        """A text prompt echoes as sent; token ids as decoded (special tokens as the output
        shows them). Offsets (for logprobs) are where each token's text begins, decoded
        in order: a SentencePiece prompt's first word has no leading space there, as in
        the text (its token's own bytes had one, and every offset after it was off)."""
        out = []
        for prompt, ids in zip(body.prompt_inputs(), prompts, strict=True):
            # The text as sent holds no special token the tokenizer added (its BOS).
            skip = isinstance(prompt, str) or body.skip_special_tokens is not False
            offsets: list[int] = []
            if body.logprobs is not None or not isinstance(prompt, str):
                detokenizer = IncrementalDetokenizer(self._tok, [], skip)
                pieces: list[str] = []
                at = 0
                for token_id in ids:
                    offsets.append(at)
                    piece = detokenizer.add(token_id)
                    pieces.append(piece)
                    at += len(piece)
                pieces.append(detokenizer.flush())
                decoded = "".join(pieces)
            text = prompt if isinstance(prompt, str) else decoded
            out.append(Echo(text, ids, offsets if body.logprobs is not None else ()))
        return out

    # -- over NATS -------------------------------------------------------------------------

    def _reasoning(
        self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]
    ) -> ReasoningSplit | None:
        """How a chat answer's thinking is read (None: all of it is content). A guided
        request is read so only when the answer starts inside its thinking and ``</think>``
        is one token: the grammar then holds after it (see :meth:`_publish`); otherwise
        the grammar shapes the whole output, and none of it is thinking."""
        if not self.reads_reasoning or not isinstance(body, ChatCompletionRequest):
            return None
        # Whether the template opened the thinking for the model: the prompt's last tokens.
        tail = self._tok.decode(prompt_ids[-8:], skip_special_tokens=False)
        thinking = starts_thinking(self._config.gateway.reasoning_parser, tail)
        if body.guided() is not None and not (thinking and self._think_close_id is not None):
            return None
        return ReasoningSplit(thinking=thinking, keep=body.include_reasoning)

    def _keeps_special(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        reasoning: ReasoningSplit | None,
    ) -> bool:
        """Whether the answer's text keeps special tokens: asked, or the tags read out of it
        (its tool calls', its thinking's) are special tokens (read, they are no content)."""
        if body.skip_special_tokens is False:
            return True
        if not isinstance(body, ChatCompletionRequest):
            return False
        if self._tool_tags_special and body.calls_tools():
            return True
        return self._think_tags_special and reasoning is not None

    def _take_off(
        self,
        kind: Kind,
        body: CompletionRequest | ChatCompletionRequest,
        route: Route,
        prompt_ids: list[int],
        logprobs: int | None,
        started: float,
        deadline_ms: int,
        choice: tuple[int, str, int] | None = None,
        echo: Echo | None = None,
    ) -> Flight:
        """``choice``: (index, the response's id, its created time) for one of ``n``
        choices, a request of its own on NATS; else the request is the response. ``echo``:
        its prompt, for a completion's ``echo``."""
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        index, response_id, created = choice or (0, request_id, int(time.time()))
        if choice is None:
            bind_request(request_id)
        reasoning = self._reasoning(body, prompt_ids)
        keeps_special = self._keeps_special(body, reasoning)
        shaper = Shaper(
            kind,
            response_id,
            self._model,
            created,
            self.token_bytes,
            logprobs=logprobs,
            include_usage=body.include_usage(),
            continuous_usage=body.continuous_usage(),
            prompt_tokens=len(prompt_ids),
            silent_ids=frozenset() if keeps_special else self._special_ids,
            index=index,
            echo=echo,
            tool_calls=_tool_calls(body, self.tool_format),
            reasoning=reasoning,
            obfuscate=body.obfuscation(self._config.gateway.stream_obfuscation),
        )
        headers = {"X-Request-Id": response_id, GROUP_HEADER: route.group}
        if route.is_fallback:
            headers["X-QoS-Fallback-From"] = route.requested
            if index == 0:  # one HTTP request, one fallback, however many choices it has
                labels = (route.requested, route.group, route.reason or "")
                self._metrics.fallbacks.labels(*labels).inc()
        decode_tail = self._decode_tail
        if keeps_special:  # the worker's text keeps them: so must ours
            decode_tail = partial(self._decode_tail, skip_special_tokens=False)
        # Registered last: the caller's failure path frees the admission slot, not a stream
        # (one opened before a failing step stayed registered for good).
        stream = self._dispatcher.open(request_id, route.group, decode_tail)
        self._metrics.series(route.group, self._model).in_flight.inc()
        return Flight(
            route, stream, shaper, len(prompt_ids), started, started + deadline_ms / 1000,
            headers=headers, quiet=choice is not None,
            scores_only=body.scores_only(),
        )  # fmt: skip

    async def _publish(
        self,
        flight: Flight,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int,
        request: Request,
        cache_salt: str,
        priority: int,
    ) -> None:
        now_ms = int(time.time() * 1000)
        # The worker's deadline is the gateway's, not a fresh one from now.
        deadline_at_ms = now_ms + max(1, int((flight.deadline - time.monotonic()) * 1000))
        # Choice ``index`` of a batch is choice ``index % n`` of its prompt (its seed's offset).
        params = body.wire_params(
            max_tokens, flight.shaper.logprobs, self._sampling_defaults,
            flight.shaper.index % body.choices(), body.prompt_logprobs_count(),
        )  # fmt: skip
        reasoning = flight.shaper.reasoning
        if self._keeps_special(body, reasoning):
            params.skip_special_tokens = False
        if reasoning is not None and reasoning.thinking and params.guided_kind is not None:
            params.guided_after_token = self._think_close_id  # the grammar holds after it
        request_id = flight.stream.request_id
        message = GenerateRequest(
            id=request_id,
            group=flight.route.group,
            reply=self._subjects.out(request_id),
            model=self._model,
            prompt_token_ids=prompt_ids,
            params=params,
            priority=priority,
            deadline_ms=deadline_at_ms,
            created_ms=now_ms,
            origin=self._origin,
            cache_salt=cache_salt,
        )
        headers = {"Nats-Msg-Id": request_id, "Qos-Deadline-Ms": str(deadline_at_ms)}
        subject = self._subjects.request(flight.route.group)
        publish_span: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self._tracer is not None:
            publish_span = traced.publishing(
                self._tracer, flight.trace, subject, request_id, headers, request.headers
            )
        else:
            traced.forward_traceparent(request.headers, headers)
        payload = message.to_bytes()
        try:
            with publish_span:
                ack, _ = await publish_request(
                    self._js, subject, payload, headers, flight.deadline,
                    stream=self._config.nats.stream,
                )  # fmt: skip
            flight.stream.stream_seq = ack.seq
        except CancelledAfterAck as cancelled:  # queued: the abort deletes it by this
            flight.stream.stream_seq = cancelled.ack.seq
            raise
        except Exception as exc:
            error = publish_error(exc, len(payload), "the gateway")
            if error is None:
                raise
            raise error from None

    def _refuse_control_tokens(self, body: ChatCompletionRequest) -> None:
        """400 for a message whose text holds a special token's text (gateway config
        ``reject_control_tokens``): encoded, it would be that token, a turn's end or a role."""
        every = self._tok.control_token_pattern()
        if every is None:
            return
        # The added tokens a template writes (<think>, <tool_call>) are the model's own
        # output, sent back in its assistant turns by every multi-turn client (its reasoning
        # and calls, read apart, come back as fields the template renders with their tags):
        # only the special tokens are refused there.
        special = self._tok.control_token_pattern(template_tokens=False)
        # Every string the template may print: contents, names, tool arguments, reasoning,
        # and the tools and documents passed through chat_template_kwargs; as sent and as
        # the template gets them: tool arguments decoded from their JSON (a "\u003c" is a
        # "<" there), and a message's content parts run together, as a template that loops
        # over them prints them.
        fields: list[tuple[str, Any, re.Pattern[str] | None]] = []
        for i, m in enumerate(body.messages):
            pattern = special if m.role == "assistant" else every
            fields.append((f"messages[{i}]", [m.model_dump(), m.for_template()], pattern))
            if isinstance(m.content, list):
                fields.append((f"messages[{i}].content", _joined_parts(m.texts()), pattern))
        fields.append(("chat_template_kwargs", body.chat_template_kwargs or {}, every))
        fields.append(("tools", body.tool_dicts() or [], every))
        for param, value, pattern in fields:
            if pattern is None:
                continue
            for text in _strings(value):
                found = pattern.search(text)
                if found is not None:
                    raise InvalidRequestError(
                        f"{param} contains {found.group()!r}, a special token of this model; "
                        "this gateway refuses control tokens in client text",
                        param=param,
                        code="control_token",
                    )

    # -- back to the client ----------------------------------------------------------------

    async def _next(self, flight: Flight, request: Request | None) -> Delivery:
        """The next delivery; 504 at the deadline; :class:`ClientGone` if the client left."""
        while True:
            now = time.monotonic()
            left = flight.deadline - now
            if left <= 0 and not flight.stream.has_ready:
                # What came in time goes out first: a reader slower than its worker lost the
                # end of an answer made before the deadline.
                raise DeadlineExceededError("the request's deadline passed before it finished")
            left = max(left, 0.0)
            # Also while deliveries keep coming (a worker flushes every few ms, so a wait
            # for silence would never end): a client that hung up frees its worker's slot.
            if request is not None and now >= flight.disconnect_check_at:
                flight.disconnect_check_at = now + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ClientGone
            delivery = await flight.stream.next(min(left, DISCONNECT_POLL_S) if request else left)
            if delivery is not None:
                if delivery.token_ids and flight.first_token_at is None:
                    flight.first_token_at = time.monotonic()
                    # Observed now, not at the end: a long answer would report it late, one
                    # that fails afterwards never.
                    if not flight.quiet:
                        series = self._metrics.series(flight.route.group, self._model)
                        series.ttft.observe(flight.first_token_at - flight.started)
                if flight.scores_only and delivery.error is None:
                    delivery = _scores_of(delivery)
                flight.completion_tokens += len(delivery.token_ids)
                delivery.completion_tokens = flight.completion_tokens
                if delivery.usage is not None:
                    flight.worker_usage = delivery.usage
                if delivery.finish_reason is not None:
                    flight.finish_reason = delivery.finish_reason
                return delivery

    async def _collect(self, flight: Flight, first: Delivery, request: Request) -> Response:
        deliveries = [first]
        while deliveries[-1].finish_reason is None:
            delivery = await self._next(flight, request)
            if delivery.error is not None:
                raise delivery.error
            deliveries.append(delivery)
        whole = merge(deliveries)
        usage = usage_dict(flight.prompt_tokens, flight.completion_tokens, flight.worker_usage)
        heavy = logprob_entries(flight.shaper, len(whole.token_ids)) > INLINE_LOGPROB_ENTRIES
        body = await shaped(flight.shaper, whole, usage, heavy)
        self._land(flight, status=200)
        content = await json_bytes(body, heavy)
        return Response(content, media_type="application/json", headers=flight.headers)

    def _sse(self, flight: Flight, first: Delivery) -> AsyncIterator[bytes]:
        async def next_event() -> Event:
            return 0, await self._next(flight, None)

        def usage() -> dict[str, Any]:
            return usage_dict(flight.prompt_tokens, flight.completion_tokens, flight.worker_usage)

        return sse_events(
            (0, first), next_event, lambda _: flight.shaper, 1, usage,
            lambda status, _: self._land(flight, status=status),
        )  # fmt: skip

    # -- bookkeeping -----------------------------------------------------------------------

    def _land(self, flight: Flight, *, status: int) -> None:
        """Release everything a flight holds, once; abort the worker if it is not done."""
        stream = flight.stream
        if not self._dispatcher.is_open(stream):
            return
        reason = "client disconnected" if status == 499 else f"gateway answered {status}"
        # Not when the worker ended it; when the gateway did (a bad chunk, a gap), it must.
        self._dispatcher.close(stream, abort=not stream.worker_done, reason=reason)
        group = flight.route.group
        self._admission.release(flight.route)
        series = self._metrics.series(group, self._model)
        series.in_flight.dec()
        if flight.completion_tokens:
            series.tokens.inc(flight.completion_tokens)
        if flight.quiet:
            return  # one choice of several: the request is accounted for once, as a whole
        if flight.trace is not None:
            traced.landed(
                flight.trace, status=status, prompt_tokens=flight.prompt_tokens,
                completion_tokens=flight.completion_tokens, finish_reason=flight.finish_reason,
            )  # fmt: skip
        self.account(
            group, status, flight.started, flight.first_token_at,
            key=flight.key, tokens=(flight.prompt_tokens, flight.completion_tokens),
        )  # fmt: skip

    def account(
        self,
        group: str,
        status: int,
        started: float,
        first_token_at: float | None,
        key: str = "",
        tokens: tuple[int, int] = (0, 0),
    ) -> None:
        """One HTTP generation request answered ``status``: counted, and its E2E (or the
        TTFT it waited out) observed; with its API key's name, its (prompt, completion)
        ``tokens`` counted for that key."""
        series = self._metrics.series(group, self._model)
        self._metrics.finished(group, status)
        if key:
            prompt, completion = tokens
            # Its prompt is billed once it ran (an answer, or tokens made): not for one
            # that timed out queued, nor a 503 or 499 before a worker took it.
            ran = status == 200 or completion > 0
            self._metrics.key_usage(key, status, prompt if ran else 0, completion)
        if status == 200:
            series.e2e.observe(time.monotonic() - started)
        elif first_token_at is None and status in WAITED_OUT:
            # It waited this long and got no token: its TTFT is at least that. Left out, the
            # requests an overload hurt most vanished from the histogram, and its p99 read
            # best exactly when a queue ran past the deadlines.
            series.ttft.observe(time.monotonic() - started)

    def _decode_tail(
        self, delivered: Sequence[int], new: Sequence[int], skip_special_tokens: bool = True
    ) -> str:
        """The text of ``new`` after the ``delivered`` tokens (a redelivered attempt's chunk
        that overlaps them), as the worker's detokenizer streams it: with the delivered
        tokens as context, cut on character boundaries (decoding them with a few tokens of
        context started U+FFFD when that context began inside a character)."""
        detokenizer = IncrementalDetokenizer(
            self._tok, delivered, skip_special_tokens, resumed_tokens=len(delivered)
        )
        return "".join(detokenizer.add(t) for t in new) + detokenizer.flush()


def logprob_entries(shaper: Shaper, generated: int) -> int:
    """How many logprob entries a body with ``generated`` tokens (and the echoed prompt's)
    holds: 0 when none are asked."""
    if shaper.logprobs is None:
        return 0
    tokens = generated + (len(shaper.echo.ids) if shaper.echo is not None else 0)
    return tokens * (shaper.logprobs + 1)


async def shaped(
    shaper: Shaper, whole: Delivery, usage: dict[str, Any], heavy: bool
) -> dict[str, Any]:
    """A whole answer's body; a ``heavy`` one (tens of thousands of logprob entries: an
    echoed prompt's) built on a thread, so the event loop keeps every other stream going."""
    work = partial(
        shaper.body, whole.text, whole.finish_reason, usage, whole, stop_reason=whole.stop_reason
    )
    return await asyncio.to_thread(work) if heavy else work()


Event = tuple[int, Delivery]  # a choice's index and its next delivery


async def sse_events(
    first: Event,
    next_event: Callable[[], Awaitable[Event]],
    shaper_of: Callable[[int], Shaper],
    choices: int,
    usage: Callable[[], dict[str, Any]],
    land: Callable[[int, str | None], None],
) -> AsyncIterator[bytes]:
    """The SSE body of a response of ``choices`` choices, from its ``first`` delivery on
    (``next_event`` the next, of any choice): each choice's chunks as they come, its first
    with its opening (a chat's role, an echo); the usage chunk and ``[DONE]`` once every
    choice finished; an error event ends it. ``land(status, finish_reason)`` runs however
    it ends."""
    status = 500
    reason: str | None = None
    done = 0
    opened: set[int] = set()
    obfuscate = shaper_of(first[0]).obfuscate
    pad = Padder(shaper_of(first[0]).logprobs) if obfuscate else _as_is
    try:
        i, delivery = first
        while True:
            if isinstance(delivery.error, ClientClosedRequest):
                status = 499
                return  # nobody to tell; landing aborts the workers
            if delivery.error is not None:
                status = delivery.error.http_status
                yield pad(Shaper.error_event(delivery.error) + SSE_DONE)
                return
            shaper = shaper_of(i)
            parts: list[bytes] = []
            head = b""  # the choice's opening, padded apart (its size is no chunk's)
            if i not in opened:
                # A chat's roles go out for every choice at once, in index order: the
                # openai client's stream helper files choices by order of appearance
                # (IndexError, or one choice's text in another's, when choice 1 spoke
                # first), and vLLM sends them so.
                ahead = range(choices) if shaper.kind == "chat" else (i,)
                opening = b"".join(
                    [await opening_events(shaper_of(j), delivery) for j in ahead if j not in opened]
                )
                opened.update(ahead)
                if obfuscate:
                    opening = Padder()(opening)
                if len(opening) > BIG_EVENT_BYTES:
                    yield opening  # an echoed prompt's logprobs: not copied into the rest
                else:
                    head = opening
            if delivery.finish_reason is not None:
                done += 1
                reason = reason or delivery.finish_reason
                parts.append(shaper.delta_event(delivery))
                if done == choices:
                    if shaper.include_usage:
                        parts.append(shaper.usage_event(usage()))
                    status = 200
                    # The last events leave in one write: SseResponse ends the body with it.
                    yield head + pad(b"".join((*parts, SSE_DONE)))
                    return
            elif delivery.text or (shaper.logprobs is not None and delivery.token_ids):
                parts.append(shaper.delta_event(delivery))  # maybe b"": a tool call's tag held
            out = pad(b"".join(parts))  # one part: that part, not a copy
            if head:
                out = head + out
            if out:
                yield out
            try:
                i, delivery = await next_event()
            except DeadlineExceededError as exc:
                status = exc.http_status
                yield pad(Shaper.error_event(exc) + SSE_DONE)
                return
    except (GeneratorExit, asyncio.CancelledError):
        # The response stopped reading (client gone, its deadline) or the server is
        # shutting down: nothing may await here.
        status = 499
        raise
    finally:
        land(status, reason)


def _as_is(data: bytes) -> bytes:
    return data


async def opening_events(shaper: Shaper, first: Delivery) -> bytes:
    """:meth:`Shaper.opening_events`; an echoed prompt's many logprobs built on a thread."""
    if logprob_entries(shaper, 0) > INLINE_LOGPROB_ENTRIES:
        return await asyncio.to_thread(shaper.opening_events, first)
    return shaper.opening_events(first)


async def json_bytes(body: Any, heavy: bool) -> bytes:
    """``body`` as compact JSON; a ``heavy`` one encoded on a thread."""
    work = partial(json.dumps, body, ensure_ascii=False, separators=(",", ":"))
    return (await asyncio.to_thread(work) if heavy else work()).encode()


def _tool_calls(
    body: CompletionRequest | ChatCompletionRequest, fmt: Format | None
) -> ToolCallStream | None:
    """How a chat answer's tool calls are read (None: it is text only)."""
    if not isinstance(body, ChatCompletionRequest) or not body.calls_tools():
        return None
    parallel = body.parallel_tool_calls is not False
    if body.forces_call():
        new_id = mistral_call_id if fmt == "mistral" else call_id  # its templates' ids
        return ForcedCalls(parallel, function=body.forced_function(), new_id=new_id)
    if body.guided() is not None:
        # The answer's shape is the client's schema, not the model's call format: guided
        # JSON with a "name" key was read as a llama3_json call to a tool of that name.
        return None
    return tool_call_stream(fmt, parallel=parallel) if fmt is not None else None


def _scores_of(delivery: Delivery) -> Delivery:
    """``delivery`` without the tokens generated (the prompt's scores only): its prompt
    logprobs, and the end ("length": the max_tokens of 0 asked for)."""
    return Delivery(
        finish_reason=None if delivery.finish_reason is None else "length",
        usage=delivery.usage,
        prompt_logprobs=delivery.prompt_logprobs,
        prompt_top_logprobs=delivery.prompt_top_logprobs,
    )


def _joined_parts(texts: list[str]) -> list[str]:
    """Content parts as templates run them together: joined as they are, and each trimmed
    first (Gemma 3's and Llama 4's ``item['text'] | trim``): "<end_of_ " and " turn>" pass
    a check of each part and of their plain join, and trimmed they are a turn's end. (A
    token without spaces found after lstrip, rstrip or a separator between the parts is
    found in one of these too; the newline join is the message's own, checked as vLLM's.)"""
    return ["".join(texts), "".join(t.strip() for t in texts)]


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (dict keys and values, list items), depth first."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def prefix_cache_salt(namespace: str, requested: str | None) -> str:
    """The worker's prefix-cache salt: the key's namespace (fixed length, so a client's own
    salt can never reach another key's), then the client's ``cache_salt``."""
    if not namespace:
        return requested or ""
    return f"{namespace}:{requested or ''}"


def _deadline_ms(request: Request, default_ms: int) -> int:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return default_ms
    raw = raw.strip()
    # ASCII digits only, and few: isdigit() takes '²' and 5,000 nines, which int() refuses.
    if (
        not (raw.isascii() and raw.isdigit() and len(raw) <= 12)
        or not 0 < int(raw) <= MAX_DEADLINE_MS
    ):
        raise InvalidRequestError(
            f"header {DEADLINE_HEADER} must be a whole number of milliseconds in 1..{MAX_DEADLINE_MS}",
            param=DEADLINE_HEADER,
        )
    return int(raw)
