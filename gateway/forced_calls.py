"""Tool calls forced by ``tool_choice``: guided decoding made the whole answer JSON.

With a named function the answer is that function's arguments; with ``"required"`` it is a
list of calls, ``[{"name": ..., "parameters": {...}}]`` (the schema
:meth:`~gateway.openai_api.ChatCompletionRequest._call_schema` builds). Either way the model's
own tool-call format plays no part. Streamed, the calls go out whole at the end, as the
other formats' calls go out whole once their block closes. An answer cut short by
``max_tokens`` is no complete JSON: it stays text, with ``length``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.tool_calls import ToolCallStream, _as_call, call_id


@dataclass
class ForcedCalls(ToolCallStream):
    function: str | None = None  # named: the function called; None: "required"'s list
    new_id: Callable[[], str] = call_id
    _text: list[str] = field(default_factory=list)

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls = self._read(text)
        return (None, calls) if calls else (text, [])

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._text.append(text)
        return []

    def finish(self) -> list[tuple[str, Any]]:
        text = "".join(self._text)
        calls = self._read(text)
        if not calls:
            self._content(text)
        for call in calls:
            self._call_found(call)
        return self._end()

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        # OpenAI answers a call to a named function with "stop"; "required"'s calls end
        # with "tool_calls", as an answer's own calls do.
        return reason if self.function is not None else super().finish_reason(reason, calls)

    def _read(self, text: str) -> list[dict[str, Any]]:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return []
        if self.function is not None:
            if not isinstance(value, dict):
                return []
            call = _as_call({"name": self.function, "arguments": text.strip()}, self.new_id)
            return [call] if call is not None else []
        if not isinstance(value, list):
            return []
        calls = [_as_call(item, self.new_id) for item in value]
        return [c for c in calls if c is not None]
