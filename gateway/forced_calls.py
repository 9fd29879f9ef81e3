"""Tool calls forced by ``tool_choice``: guided decoding made the whole answer JSON.

With a named function the answer is that function's arguments; with ``"required"`` it is a
list of calls, ``[{"name": ..., "parameters": {...}}]`` (the schema
:meth:`~gateway.openai_api.ChatCompletionRequest._call_schema` builds). Either way the model's
own tool-call format plays no part.

Streamed, a named call's arguments flow as they are written, as OpenAI and vLLM stream
them: the first delta names the call (id, function, the first piece of its arguments), the
next ones carry ``("arguments", text)`` to append; cut short by ``max_tokens``, the
arguments are incomplete and the reason is ``length`` (whole, the same). The calls of
``"required"`` go out whole at the end, as the other formats' calls go out once their block
closes; a list cut short is no JSON, and stays text.
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
        if self.function is not None:
            call = self._named(text)
            return (None, [call]) if call is not None else (text, [])
        calls = self._read(text)
        return (None, calls) if calls else (text, [])

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.function is None:
            self._text.append(text)
        elif text and not self.calls:
            call = self._named(text)
            if call is not None:
                self._call_found(call)
        elif text:
            self._pieces.append(("arguments", text))
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        if self.function is not None:
            return self._end()
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

    def _named(self, arguments: str) -> dict[str, Any] | None:
        """The named function's call with ``arguments`` as written (guided decoding made
        them valid JSON for its parameters, unless max_tokens cut them)."""
        if not arguments:
            return None
        return _as_call({"name": self.function, "arguments": arguments}, self.new_id)

    def _read(self, text: str) -> list[dict[str, Any]]:
        """The calls of "required"'s list, or none when it is no complete list."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return []
        if not isinstance(value, list):
            return []
        calls = [_as_call(item, self.new_id) for item in value]
        return [c for c in calls if c is not None]
