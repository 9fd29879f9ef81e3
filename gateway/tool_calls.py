"""Tool calls in a model's output: OpenAI's ``tool_calls`` from the text a chat model writes.

Two formats, the ones the engine's model families are trained on:

- ``hermes`` (Qwen 2.5 and 3, Hermes 2 and 3): JSON between tags, one block per call,
  possibly after some text::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the whole answer is the call, a JSON object with
  ``name`` and ``parameters`` (several joined by ``;``), maybe after ``<|python_tag|>``.
- ``mistral`` (Mistral 7B v0.3, Nemo; tokenizer v3): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}``, maybe after some text. The tag is a special token: the
  worker's text keeps special tokens for these requests. Call ids are 9 letters and digits,
  the only ids Mistral's templates take back in the next turn.

A whole answer is split into its content and its calls as vLLM's parsers of those names
split it. Streamed, hermes content flows as it comes, holding back only what may be the
start of a tag, and each call is sent whole once its block closes (OpenAI's streamed
``tool_calls`` deltas may carry the arguments in one piece); a llama3_json answer that
begins with ``{`` is held to its end, then read, as is a mistral answer from its tag. Whatever is not a call (bad JSON, no name)
stays text: nothing the model wrote is lost. Which format: :func:`tool_format`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's: what follows is a call
MISTRAL_TAG = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits

ToolParser = Literal["auto", "hermes", "llama3_json", "mistral", "none"]
Format = Literal["hermes", "llama3_json", "mistral"]
# The token each format's calls begin with: a special token in some tokenizers, which the
# worker's text must keep for the calls to be read.
CALL_TAGS: dict[str, str] = {"hermes": OPEN, "mistral": MISTRAL_TAG}


def tool_format(setting: ToolParser, template_source: str) -> Format | None:
    """The format tool calls are read in, or None when the model has none. ``auto``: the
    one its chat template writes (hermes tags, or Llama 3.1's python tag)."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    if OPEN in template_source:
        return "hermes"
    if PYTHON_TAG in template_source:
        return "llama3_json"
    if MISTRAL_TAG in template_source:
        return "mistral"
    return None


def tool_call_stream(fmt: Format, parallel: bool = True) -> ToolCallStream:
    """A reader of one answer's tool calls in ``fmt``."""
    if fmt == "hermes":
        return HermesCalls(parallel)
    return Llama3JsonCalls(parallel) if fmt == "llama3_json" else MistralCalls(parallel)


def tool_finish_reason(reason: str | None, calls: int) -> str | None:
    """``tool_calls`` once a call was made, as vLLM answers; but an answer cut by
    ``max_tokens`` stays ``length`` (OpenAI's: its last call may be missing, and clients
    raise on it rather than run half the calls)."""
    return "tool_calls" if calls and reason != "length" else reason


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(block: str) -> dict[str, Any] | None:
    """One block's call as OpenAI returns it, or None when it is not one."""
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        return None
    return _as_call(obj)


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _as_call(obj: object, new_id: Callable[[], str] = call_id) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):  # OpenAI's arguments are a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def split_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole hermes answer's content (None when only calls) and its calls; ``parallel``
    False keeps the first call only (OpenAI's ``parallel_tool_calls``)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue  # not a call: stays in the content
        kept.append(text[at : match.start()])
        at = match.end()
        if parallel or not calls:
            calls.append(call)
    if not calls:
        return text, []
    kept.append(text[at:])
    content = "".join(kept).strip()
    return content or None, calls


def split_llama3_json(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole llama3_json answer: calls when all of it is calls (JSON objects joined by
    ``;``, maybe after the python tag), else all of it content, as vLLM reads it."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return text, []
        call = _as_call(obj)
        if call is None:
            return text, []
        if parallel or not calls:
            calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


@dataclass
class ToolCallStream:
    """An answer's tool calls, read as its text streams: :meth:`feed` and, at the end,
    :meth:`finish` return the pieces ready to send, ``("content", text)`` or
    ``("call", call)``; :meth:`split` reads a whole answer."""

    parallel: bool = True
    calls: int = 0  # calls read so far
    calls_sent: int = 0  # of those, sent (each call's ``index`` in the stream)
    _pending: str = ""  # text not sent yet
    _pieces: list[tuple[str, Any]] = field(default_factory=list)
    # Content's trailing blanks, held: sent with the next words, dropped before a call (the
    # lines around calls are no content of their own) and, after one, at the end.
    _blank: str = ""
    _worded: bool = False  # some content was sent

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        raise NotImplementedError

    def feed(self, text: str) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        """The answer's finish reason once it made ``calls`` calls."""
        return tool_finish_reason(reason, calls)

    def _content(self, text: str) -> None:
        text = self._blank + text
        if self.calls and not self._worded:
            text = text.lstrip()  # the line after a call, before any content
        words = text.rstrip()
        self._blank = text[len(words) :]
        if words:
            self._pieces.append(("content", words))
            self._worded = True

    def _call_found(self, call: dict[str, Any]) -> None:
        self._blank = ""
        if self.parallel or not self.calls:
            self._pieces.append(("call", call))
            self.calls += 1

    def _end(self) -> list[tuple[str, Any]]:
        """The last pieces: blanks held at the end are the answer's own when it made no
        call (its text is returned as it came)."""
        if self._blank and not self.calls:
            self._pieces.append(("content", self._blank))
        self._blank = ""
        return self._taken()

    def _content_until(self, tag: str) -> bool:
        """Send the pending content up to ``tag``, or, without it yet, all but what may be
        its start; True (the pending text then begins with the tag) when it was found."""
        pending = self._pending
        at = pending.find(tag)
        if at < 0:
            at = len(pending) - _partial_tag(pending, tag)  # held: what may become the tag
        self._content(pending[:at])
        self._pending = pending[at:]
        return self._pending.startswith(tag)

    def _taken(self) -> list[tuple[str, Any]]:
        out, self._pieces = self._pieces, []
        return out


@dataclass
class Llama3JsonCalls(ToolCallStream):
    """llama3_json: an answer that begins (after blanks) with ``{`` or the python tag is
    held to its end and read whole; any other streams as content from its first word."""

    _decided: bool = False
    _held: bool = False

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return split_llama3_json(text, self.parallel)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._decided and not self._held:
            self._content(text)
            return self._taken()
        self._pending += text
        head = self._pending.lstrip()
        if not self._decided and head:
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._decided = self._held = True
            elif not PYTHON_TAG.startswith(head):  # not the tag's first characters either
                self._decided = True
                self._content(self._pending)
                self._pending = ""
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        content, calls = self.split(self._pending) if self._pending else (None, [])
        self._pending = ""
        for call in calls:
            self._call_found(call)
        if content:
            self._content(content)
        return self._end()


@dataclass
class HermesCalls(ToolCallStream):
    """hermes: content streams, a tag's possible start is held, each block is read once it
    closes (or at the end, unclosed, as vLLM reads it)."""

    _in_block: bool = False

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return split_calls(text, self.parallel)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        while self._step():
            pass
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        """What is left: a block the model ended without its closing tag is read as one
        (vLLM's parser does too), else it is text."""
        if self._in_block:
            self._close_block(self._pending)
        elif self._pending:
            self._content(self._pending)
        self._pending, self._in_block = "", False
        return self._end()

    def _step(self) -> bool:
        """Consume what can be decided now; True when it should be called again."""
        pending = self._pending
        if self._in_block:
            end = pending.find(CLOSE)
            if end < 0:
                return False
            self._close_block(pending[:end], tail=CLOSE)
            self._pending, self._in_block = pending[end + len(CLOSE) :], False
            return True
        if not self._content_until(OPEN):
            return False
        self._pending, self._in_block = self._pending[len(OPEN) :], True
        return True

    def _close_block(self, block: str, tail: str = "") -> None:
        call = _call(block)
        if call is None:
            self._content(OPEN + block + tail)  # not a call: the text it was
        else:
            self._call_found(call)


def _partial_tag(text: str, tag: str = OPEN) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_mistral(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole mistral answer: the text before the tag, and the calls of the JSON list
    after it (as vLLM's mistral parser reads it); all text when that is not calls."""
    head, tag, rest = text.partition(MISTRAL_TAG)
    if not tag:
        return text, []
    try:
        listed = json.loads(rest.replace(MISTRAL_TAG, "").strip())
    except (ValueError, RecursionError):
        return text, []
    objs = listed if isinstance(listed, list) else [listed]
    calls = [_as_call(obj, mistral_call_id) for obj in objs]
    if not calls or any(call is None for call in calls):
        return text, []
    kept = [call for call in calls if call is not None]
    return head.strip() or None, kept if parallel else kept[:1]


@dataclass
class MistralCalls(ToolCallStream):
    """mistral: content streams until the tag (a possible start of it held), then all is
    held to the end and read."""

    _held: bool = False

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return split_mistral(text, self.parallel)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        if not self._held:
            self._held = self._content_until(MISTRAL_TAG)
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        if self._held:
            _, calls = self.split(self._pending)  # the content before went out already
            if calls:
                for call in calls:
                    self._call_found(call)
            else:
                self._content(self._pending)  # not calls: the text it was
        elif self._pending:
            self._content(self._pending)
        self._pending = ""
        return self._end()
