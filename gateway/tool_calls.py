"""Tool calls in a model's output: OpenAI's ``tool_calls`` from the text a chat model writes.

Models trained on the Hermes format (Qwen 2.5 and 3, Hermes 2 and 3, and the others whose
chat template renders tools with it) answer a call as JSON between tags, one block per
call, possibly after some text::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`split_calls` reads a whole answer into its content and its calls (vLLM's
``hermes`` parser answers the same); :class:`ToolCallStream` does it as the text streams,
holding back only what may be the start of a tag, and sends each call whole once its
block closes (OpenAI's streamed ``tool_calls`` deltas may carry the arguments in one
piece). A block that is not a call (bad JSON, no name) stays text: nothing the model
wrote is lost. Which models: :func:`tool_format`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)

ToolParser = Literal["auto", "hermes", "none"]


def tool_format(setting: ToolParser, template_source: str) -> str | None:
    """The format tool calls are read in: ``hermes``, or None when the model has none
    (``auto``: hermes when the chat template writes its tags, as the templates of models
    trained on it do)."""
    if setting == "none":
        return None
    if setting == "hermes" or OPEN in template_source:
        return "hermes"
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(block: str) -> dict[str, Any] | None:
    """One block's call as OpenAI returns it, or None when it is not one."""
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):  # OpenAI's arguments are a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def split_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None when only calls) and its calls; ``parallel`` False
    keeps the first call only (OpenAI's ``parallel_tool_calls``)."""
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


@dataclass
class ToolCallStream:
    """:func:`split_calls` as the text streams: :meth:`feed` and, at the end,
    :meth:`finish` return the pieces ready to send, ``("content", text)`` or
    ``("call", call)``."""

    parallel: bool = True
    calls: int = 0  # calls read so far
    calls_sent: int = 0  # of those, sent (each call's ``index`` in the stream)
    _pending: str = ""  # text not sent yet: a possible tag start, or a block still open
    _in_block: bool = False
    _pieces: list[tuple[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        while self._step():
            pass
        out, self._pieces = self._pieces, []
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """What is left: a block the model ended without its closing tag is read as one
        (vLLM's parser does too), else it is text."""
        if self._in_block:
            self._close_block(self._pending)
        elif self._pending:
            self._content(self._pending)
        self._pending, self._in_block = "", False
        out, self._pieces = self._pieces, []
        return out

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
        start = pending.find(OPEN)
        if start >= 0:
            self._content(pending[:start])
            self._pending, self._in_block = pending[start + len(OPEN) :], True
            return True
        keep = _partial_tag(pending)  # hold back what may become "<tool_call>"
        self._content(pending[: len(pending) - keep])
        self._pending = pending[len(pending) - keep :]
        return False

    def _close_block(self, block: str, tail: str = "") -> None:
        call = _call(block)
        if call is None:
            self._content(OPEN + block + tail)  # not a call: the text it was
        elif self.parallel or not self.calls:
            self._pieces.append(("call", call))
            self.calls += 1

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.calls and not text.strip():
            return  # the newlines between calls: no content of their own
        self._pieces.append(("content", text))


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
