"""Tool calls forced by ``tool_choice``: guided decoding made the whole answer JSON.

With a named function the answer is that function's arguments; with ``"required"`` it is a
list of calls, ``[{"name": ..., "parameters": {...}}]`` (the schema
:meth:`~gateway.openai_api.ChatCompletionRequest._call_schema` builds). Either way the model's
own tool-call format plays no part.

Streamed, calls flow as OpenAI and vLLM stream them: a call's first delta names it (id,
function and, for a named call, the first piece of its arguments), the next ones carry
``("arguments", text)`` to append. Cut short by ``max_tokens``, a call's arguments are
incomplete and the reason is ``length`` (whole, the same); a list cut before its first
call's arguments began is text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.call_objects import call_piece
from gateway.tool_calls import HeldCalls


@dataclass
class ForcedCalls(HeldCalls):
    function: str | None = None  # named: the function called; None: "required"'s list
    _started: bool = False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.function is None:
            if not self._started:
                self._started = True
                self._begin("", between=",", listed=True)
            if self._reader is not None:
                self._read(text)
            else:
                self._content(text)
        elif text and not self.calls:
            self._take([("call", call_piece(self.function, text, self.new_id()))])
        elif text:
            self._pieces.append(("arguments", text))
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        self._read_end()
        return self._end()

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        # OpenAI answers a call to a named function with "stop"; "required"'s calls end
        # with "tool_calls", as an answer's own calls do.
        return reason if self.function is not None else super().finish_reason(reason, calls)
