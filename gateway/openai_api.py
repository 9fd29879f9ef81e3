"""OpenAI request bodies, strictly validated, and the one place their errors are worded.

The models mirror OpenAI's `/v1/completions` and `/v1/chat/completions` plus the vLLM
extensions users expect (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``priority``, ``chat_template_kwargs``, ``cache_salt``, and guided
decoding as ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` or
``structured_outputs``, beside OpenAI's ``response_format``). Validation is
strict: an unknown parameter, a wrong type or an out-of-range value is a 400 naming the parameter,
never a silent coercion, because a client that misspells ``max_tokens`` deserves to know.
OpenAI parameters of features this gateway does not serve are known, not unknown: sent with
a value that asks for nothing (``tools: []``, ``response_format:
{"type": "text"}`` …, as LangChain and the openai client do) they are accepted
and ignored; a value that asks for the feature is a 400 saying it is not supported.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from functools import cached_property
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.errors import InvalidRequestError
from common.guided import JSON_OBJECT_SCHEMA, GuidedSpec, problem
from common.protocol import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    RequestParams,
)
from common.sampling_defaults import SamplingDefaults

MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
MAX_CHOICES = 16  # OpenAI's n
# Prompts in one /v1/completions call (a batch): each is a request of its own on a worker,
# and prompts x n must also fit the group's max_pending.
MAX_BATCH_PROMPTS = 64
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
MAX_MESSAGES = 4096  # a conversation's turns: beyond any context window, bounded work
# "function": a function call's result in the deprecated functions API's history.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool | None = None
    # OpenAI's padding against the token-length side channel (gateway/obfuscation.py); unset:
    # gateway.stream_obfuscation decides.
    include_obfuscation: bool | None = None


class _Part(BaseModel):
    # Keys a part may carry besides its text (a cache breakpoint...) change nothing here.
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(_Part):
    """A content part; only text is served (no vision model behind this gateway)."""

    type: Literal["text"]
    text: str


class RefusalPart(_Part):
    """An assistant message's refusal, as the openai client's types allow it."""

    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    """One message; extra keys (``tool_calls``, ``reasoning_content``...) reach the template."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    role: Role
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None

    def texts(self) -> list[str]:
        """The content's texts: one, or a part's each."""
        if isinstance(self.content, list):
            return [p.text if isinstance(p, TextPart) else p.refusal for p in self.content]
        return [] if self.content is None else [self.content]

    def text(self) -> str | None:
        if isinstance(self.content, list):  # parts on lines of their own, as vLLM joins them
            return "\n".join(self.texts())
        return self.content

    def for_template(self, parts: bool = False, developer: bool = False) -> dict[str, Any]:
        """The message as a chat template expects it: content parts flattened to text (or,
        with ``parts``, for a template that loops over them, kept as text parts), and a tool
        call's ``arguments`` (a JSON string on the wire) as the object templates render with
        ``tojson`` (a string would come out encoded twice), as vLLM passes them. OpenAI's
        ``developer`` role is its system role: a template that does not name it
        (``developer`` False) gets ``system``, which Qwen's templates silently dropped. A
        ``function`` message (a function's result, the older API's) is a ``tool`` message:
        chat templates know that role, and many refuse any other."""
        out = self.model_dump(exclude_none=True)
        if self.role == "developer" and not developer:
            out["role"] = "system"
        elif self.role == "function":
            out["role"] = "tool"
        if isinstance(self.content, list) and parts:
            out["content"] = [{"type": "text", "text": text} for text in self.texts()]
        elif self.content is not None:
            out["content"] = self.text()
        calls = out.get("tool_calls")
        if isinstance(calls, list) and not calls:
            # No calls (some clients send []): Llama 3.1's template raises on any list not
            # of one call, and vLLM drops it too.
            del out["tool_calls"]
        elif isinstance(calls, list):
            out["tool_calls"] = [_decoded_call(c) for c in calls]
        return out


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        # A call without arguments (null, "" or left out) takes none: {} as vLLM passes it;
        # "" reached a template's tojson as '""', and null left it undefined.
        return {**call, "function": {**function, "arguments": {}}}
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the parser's reach
        return call  # the template gets what the client sent
    return {**call, "function": {**function, "arguments": decoded}}


MAX_CLIENT_CACHE_SALT = 256  # characters; vLLM suggests 43 (256 random bits, base64)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" is a BaseModel attribute: the field is named otherwise, read as "schema".
    # Left out (OpenAI's type allows it): any JSON value.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always kept here: the output matches the schema


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``. Other
    keys beside them are ignored, as they were when only ``text`` was served (LangChain
    sends ``strict`` with it)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its guided_* parameters, gathered): one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's switches that change nothing here: JSON never takes free whitespace, and there
    # is no other backend to fall back to.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None


class _SamplingBody(_Strict):
    """Parameters both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: only the likeliest token, greedy
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # any 64-bit seed, as OpenAI
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    # vLLM's: requests share cached prompt prefixes only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CLIENT_CACHE_SALT)
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    # vLLM's extensions (``extra_body`` in the openai client).
    min_tokens: int | None = Field(None, ge=0, lt=2**31)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # OpenAI parameters served as no-ops: storage, metadata, tiers and cache hints.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # OpenAI's: token id (a JSON key, so a string) -> a bias in [-100, 100] added to its
    # logit. Ids outside the model's vocabulary are the worker's 400 (it knows the model).
    logit_bias: dict[str, float] | None = None
    # Guided decoding (structured output), one source at most: OpenAI's response_format,
    # vLLM's guided_* parameters, or its structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(len(s) > MAX_STOP_CHARS for s in strings if isinstance(s, str)):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            if any(not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        elif value == "":
            raise ValueError("a stop sequence must be a non-empty string")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(not 0 <= t < 2**31 for t in value):
            raise ValueError("token ids must be non-negative int32 values")
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids may be biased")
        for key, bias in value.items():
            if not _TOKEN_ID.fullmatch(key) or int(key) >= 2**31:
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"token {key}: the bias must be in [-100, 100], got {bias}")
        if len({int(key) for key in value}) != len(value):  # "7" and "007"
            raise ValueError("a token id is named twice")
        return value

    def logit_bias_lists(self) -> tuple[list[int], list[float]]:
        """``logit_bias`` as the wire carries it: ids ascending, and their biases."""
        pairs = sorted((int(key), bias) for key, bias in (self.logit_bias or {}).items())
        return [t for t, _ in pairs], [b for _, b in pairs]

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            # Each choice is a request of its own on a worker: a bound keeps one client's
            # call from taking a group's every slot.
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return value

    def choices(self) -> int:
        return self.n or 1

    def guided(self) -> GuidedSpec | None:
        """What the output must match (checked by :meth:`check_guided`), or None."""
        given = self.guided_sources
        return given[0][1] if given else None

    @cached_property
    def guided_sources(self) -> list[tuple[str, GuidedSpec]]:
        """:meth:`_guided_sources`, built once per body: every choice of every prompt asks,
        and the check asks again (a forced call's schema of 128 tools is a json.dumps of up
        to 256 KiB)."""
        return self._guided_sources()

    def _guided_sources(self) -> list[tuple[str, GuidedSpec]]:
        """(the parameter, its spec) for each source of guided decoding the body names."""
        out: list[tuple[str, GuidedSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out.append(("response_format", GuidedSpec("json_schema", JSON_OBJECT_SCHEMA)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs a json_schema "
                    '({"name": ..., "schema": {...}})',
                    param="response_format",
                )
            schema = json.dumps(rf.json_schema.schema_)
            out.append(("response_format", GuidedSpec("json_schema", schema)))
        so = self.structured_outputs
        sources: list[tuple[str, str, Any]] = [
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        if so is not None:
            sources += [
                ("structured_outputs.json", "json_schema", so.json_),
                ("structured_outputs.regex", "regex", so.regex),
                ("structured_outputs.choice", "choice", so.choice),
                ("structured_outputs.grammar", "grammar", so.grammar),
                ("structured_outputs.json_object", "json_schema",
                 JSON_OBJECT_SCHEMA if so.json_object else None),
            ]  # fmt: skip
        for param, kind, value in sources:
            if value is None:
                continue
            text = value if isinstance(value, str) and kind != "choice" else json.dumps(value)
            out.append((param, GuidedSpec(kind, text)))
        return out

    def check_guided(self) -> None:
        """The guided-decoding source, compiled: a 400 naming it when it cannot guide.
        Apart from :meth:`check_fields`: a grammar can take tens of milliseconds to compile,
        which the caller spends off its event loop."""
        given = self.guided_sources
        if len(given) > 1:
            names = ", ".join(param for param, _ in given)
            raise InvalidRequestError(
                f"give one kind of guided decoding, not several ({names})", param=given[1][0]
            )
        for param, spec in given:
            why = problem(spec.kind, spec.spec)
            if why is not None:
                raise InvalidRequestError(f"{param}: {why}", param=param.split(".")[0])

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wire_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: SamplingDefaults | None = None,
        choice: int = 0,
        prompt_logprobs: int | None = None,
    ) -> RequestParams:
        """The sampling parameters as they travel to the worker: fields left out take the
        model's ``defaults`` (its generation_config.json), else OpenAI's. ``choice``: which
        of ``n`` choices; a seeded request's choice ``i`` draws with ``seed + i``, as vLLM's."""
        d = defaults or SamplingDefaults()

        def given(value: Any, default: Any, neutral: Any) -> Any:
            if value is not None:
                return value
            return default if default is not None else neutral

        temperature = given(self.temperature, d.temperature, 1.0)
        top_p = given(self.top_p, d.top_p, 1.0)
        if top_p == 0:
            # Only the likeliest token (OpenAI allows top_p 0; clients send "temperature 0,
            # top_p 0" for determinism): greedy, as temperature 0 is.
            temperature, top_p = 0.0, 1.0
        top_k = given(self.top_k, d.top_k, 0)
        bias_ids, bias_values = self.logit_bias_lists()
        guided = self.guided()
        return RequestParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k == -1 else top_k,
            min_p=given(self.min_p, d.min_p, 0.0),
            repetition_penalty=given(self.repetition_penalty, d.repetition_penalty, 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            # A seed for every request: its sampling is reproducible and traceable.
            seed=(self.seed + choice) % 2**63 if self.seed is not None else secrets.randbits(63),
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            # Sent only when they change something (an older worker refuses unknown fields).
            min_tokens=min(self.min_tokens, max_tokens) if self.min_tokens else None,
            skip_special_tokens=False if self.skip_special_tokens is False else None,
            include_stop_str_in_output=True if self.include_stop_str_in_output else None,
            # Only where the request named something that can end it (the tokenizer's EOS
            # gives None; a generation config's extra EOS id would give its id, as in vLLM,
            # but asking in every request would stop any worker of an earlier release, so
            # the rollout order, workers first, matters only for these requests).
            want_stop_reason=True if self.stop or self.stop_token_ids else None,
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            prompt_logprobs=prompt_logprobs,
            guided_kind=guided.kind if guided is not None else None,
            guided_spec=guided.spec if guided is not None else None,
        )

    def prompt_logprobs_count(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with, when asked."""
        return None

    def scores_only(self) -> bool:
        """Whether only the prompt's scores are asked (a completion's; see there)."""
        return False

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def obfuscation(self, default: bool) -> bool:
        """Whether a stream's chunks are padded (``include_obfuscation``, else ``default``)."""
        asked = self.stream_options.include_obfuscation if self.stream_options else None
        return default if asked is None else asked

    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (with include_usage)."""
        return self.include_usage() and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def check_fields(self) -> None:
        """Rules across fields, checked before the request is routed."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        asked_max = getattr(self, "max_completion_tokens", None)
        if asked_max is None:
            asked_max = self.max_tokens
        # max_tokens 0 (scores only) counts: no min_tokens fits in it.
        if self.min_tokens and asked_max is not None and self.min_tokens > asked_max:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({asked_max})",
                param="min_tokens",
            )


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: a string, one-string list, or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt's scores only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if len(value) == 0:
                raise ValueError("prompt must not be empty")
            batch = value if isinstance(value[0], str | list) else [value]
            if len(batch) > MAX_BATCH_PROMPTS:
                raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts may be sent in one request")
            for ids in batch:
                if isinstance(ids, list) and not ids:
                    raise ValueError("a prompt must not be empty")
                if isinstance(ids, list) and any(not 0 <= t < 2**31 for t in ids):
                    raise ValueError("token ids must be non-negative int32 values")
        return value

    def check_fields(self) -> None:
        super().check_fields()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                param="max_tokens",
            )

    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0 (lm-evaluation-harness's loglikelihood): the
        prompt and its logprobs, nothing generated. One token is generated all the same
        (the prompt's logprobs come with it) and dropped."""
        return bool(self.echo) and self.max_tokens == 0

    def prompt_logprobs_count(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompt_inputs(self) -> list[str | list[int]]:
        """Each prompt (a batch has several, one choice each, or ``n``): its text, or its
        token ids."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            return list(value)
        return [value]  # type: ignore[list-item]

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


MAX_TOOLS = 128  # OpenAI's limit on one request's tools
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FunctionDef(_Strict):
    """A tool's function, as OpenAI declares one (``parameters``: a JSON Schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # A schema guarantee only guided decoding gives: accepted and not enforced, as vLLM
    # without structured outputs (the OpenAI Agents SDK sends true on every tool).
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _FUNCTION_NAME.fullmatch(value):
            raise ValueError("a function name is 1-64 letters, digits, '_', '.' or '-'")
        return value


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``: rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's top-level template controls: continue the last (assistant) message rather
    # than open a new turn (a prefill), and encode with the tokenizer's own BOS/EOS too.
    continue_final_message: bool = False
    add_special_tokens: bool = False
    parallel_tool_calls: bool | None = None  # no effect without tools
    # vLLM's: False leaves a reasoning model's thinking out of the answer.
    include_reasoning: bool = True
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    # Accepted and passed to the chat template (gpt-oss's reads it; others ignore it):
    # the engine sets no thinking budget of its own.
    # The openai SDK's ReasoningEffort, as vLLM takes it ("none" turns thinking off there).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None  # OpenAI's hint on answer length: accepted and ignored, as vLLM
    moderation: Any = None
    prompt_cache_options: dict[str, Any] | None = None  # a cache hint: a no-op, as the others

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def calls_tools(self) -> bool:
        """Tools the model may call: rendered into the prompt, calls read from its answer.
        ``tool_choice: "none"`` declines them (agent frameworks bind their tools to every
        call and switch them off this way): not rendered, as vLLM's
        ``--exclude-tools-when-tool-choice-none``."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them, when :meth:`calls_tools`."""
        if not self.calls_tools():
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def forced_function(self) -> str | None:
        """The function ``tool_choice`` names (a call to it is the whole answer), if any."""
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def forces_call(self) -> bool:
        """``tool_choice`` "required" or a named function: guided decoding writes the
        call(s) as JSON, whatever the model's own tool-call format."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def _guided_sources(self) -> list[tuple[str, GuidedSpec]]:
        out = super()._guided_sources()
        if self.forces_call():
            out.insert(0, ("tool_choice", GuidedSpec("json_schema", self._call_schema())))
        return out

    def _call_schema(self) -> str:
        """The JSON a forced answer must be: the named function's arguments, or (required)
        a list of calls, ``[{"name": ..., "parameters": {...}}]``, as vLLM asks for them."""
        tools = [t.function for t in self.tools or ()]
        named = self.forced_function()
        if named is not None:
            function = next(f for f in tools if f.name == named)  # checked: it is there
            return json.dumps(function.parameters or {"type": "object"})
        defs: dict[str, Any] = {}
        options = []
        for f in tools:
            parameters = dict(f.parameters or {"type": "object"})
            # A tool's "#/$defs/X" pointers name its own root; nested in the list schema
            # they must find its definitions at the new root (pydantic writes them so).
            for key in ("$defs", "definitions"):
                found = parameters.pop(key, None) or {}
                if not isinstance(found, dict):  # {"$defs": 5}: a 500 from .items() before
                    raise InvalidRequestError(
                        f"tools: {f.name!r}'s parameters.{key} must be an object of schemas",
                        param="tools",
                    )
                for name, definition in found.items():
                    if defs.setdefault(f"{key}/{name}", definition) != definition:
                        raise InvalidRequestError(
                            f"tools define {key} {name!r} twice, differently: tool_choice "
                            '"required" needs one definition per name',
                            param="tool_choice",
                        )
            options.append({
                "type": "object",
                "properties": {"name": {"enum": [f.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            })  # fmt: skip
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        for path, definition in defs.items():
            key, name = path.split("/", 1)
            calls.setdefault(key, {})[name] = definition
        return json.dumps(calls)

    def check_fields(self) -> None:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequestError(
                "tool_choice names a tool to call, but no tools were given", param="tool_choice"
            )
        named = self.forced_function()
        if named is not None and named not in {t.function.name for t in self.tools or ()}:
            raise InvalidRequestError(
                f"tool_choice names the function {named!r}, which is not among the tools",
                param="tool_choice",
            )
        super().check_fields()
        if self.include_reasoning is False and self.logprobs:
            raise InvalidRequestError(
                "logprobs with include_reasoning false would spell out the thinking left "
                "out: ask for one or the other",
                param="logprobs",
            )

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        return (self.top_logprobs or 0) if self.logprobs else None


Body = TypeVar("Body", bound=BaseModel)

# OpenAI features this gateway does not serve: the values that ask for nothing, and what the
# 400 for any other value says: refused rather than half served.
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v in (None, 1), "best_of is not supported (only 1)"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    "functions": (lambda v: v in (None, []), "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calling is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is served"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
}


# Tools a request declines to have called ("none"): agent frameworks bind their tools to
# every call and switch them off this way. OpenAI answers in plain text; so does this
# gateway, without rendering them (vLLM's --exclude-tools-when-tool-choice-none).
_DECLINED_BY = {"functions": "function_call"}


def _check_neutral(body: BaseModel) -> None:
    """A 400 for a known-but-unserved parameter sent with a value that asks for it."""
    for name, (asks_nothing, why) in _NEUTRAL.items():
        if name in _DECLINED_BY and getattr(body, _DECLINED_BY[name], None) == "none":
            continue
        if name in type(body).model_fields and not asks_nothing(getattr(body, name)):
            raise InvalidRequestError(
                f"Unsupported value for '{name}': {why}", param=name, code="unsupported_value"
            )


# Parameters that accept several shapes: one sentence beats one error per alternative.
_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of either (a batch)",
    "stop": "must be a string or a list of strings",
    "messages[].content": 'must be a string or a list of {"type": "text", "text": ...} parts',
}


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as the parameter a client wrote: ``messages[0].content``."""
    if not loc:
        return None
    param = str(loc[0])
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param += f"[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ChatMessage.model_fields:
            param += f".{loc[2]}"
    elif param == "stream_options" and len(loc) > 1 and isinstance(loc[1], str):
        param += f".{loc[1]}"
    return param


def parse_body(model: type[Body], body: bytes) -> Body:
    """Validate a raw JSON body; raise :class:`InvalidRequestError` naming the parameter."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise _to_invalid_request(exc, body) from None
    _check_neutral(parsed)
    return parsed


def _to_invalid_request(exc: ValidationError, body: bytes) -> InvalidRequestError:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return InvalidRequestError("the request body is not valid UTF-8", code="invalid_utf8")
        return InvalidRequestError(
            f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}",
            code="invalid_json",
        )
    if kind == "model_type" and not first["loc"]:  # the body itself (a nested one names its field)
        return InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    param = _param_of(first["loc"])
    if kind == "extra_forbidden":
        return InvalidRequestError(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unsupported_parameter",
        )
    if kind == "missing":
        return InvalidRequestError(
            f"Missing required parameter: '{param}'", param=param, code="missing_parameter"
        )
    # Unions report one error per alternative: the last is usually the closest match, but
    # a validator's own wording (ValueError) says what is wrong best: the named field's own
    # (another field's read "Invalid value for 'temperature': n must be in [1, 16]").
    head = first["loc"][:1]
    chosen = next((e for e in errors if e["type"] == "value_error" and e["loc"][:1] == head), None)
    if chosen is not None:
        message = chosen["msg"].removeprefix("Value error, ")
    else:
        message = _UNION_HINTS.get(re.sub(r"\[\d+\]", "[]", param or ""), first["msg"])
    if param is None:  # a rule across fields (a model validator): no one field to name
        return InvalidRequestError(message, code="invalid_value")
    return InvalidRequestError(
        f"Invalid value for '{param}': {message}", param=param, code="invalid_value"
    )
