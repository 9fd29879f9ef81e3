"""Tool calls written as JSON objects, read as their text comes.

Every tool-call format the gateway reads writes a call as a JSON object, ``{"name": ...,
"arguments": {...}}`` (Llama 3.1 and forced calls say ``"parameters"``), several of them
one after another (Llama 3.1: joined by ``;``) or in a JSON list (Mistral, forced calls).
:class:`CallObjects` reads such a run as it streams, the way OpenAI streams calls: once a
call's name and the opening brace of its arguments are written, its id and name go out
(``("call", {... "arguments": ""})``), then its arguments as the model writes them
(``("arguments", text)``, the model's own JSON text, unchanged); a cut answer leaves a call
with the arguments written so far, as OpenAI's do under ``max_tokens``. An object written
another way (arguments first, or as a JSON string) is read whole when it closes. The first
thing that is no call ends the run: from there on all is ``("text", ...)``.

A whole answer reads the same, fed at once: whatever the cuts, the calls, their arguments
and the text come out equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A call's head up to its arguments' opening brace; only then can its arguments stream.
_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
# Mistral's tokenizers from v11 (Mistral Small 3.1+, Devstral, Magistral) write a call as
# ``[TOOL_CALLS]name[ARGS]{...}``, maybe with ``[CALL_ID]id`` before ``[ARGS]`` (the tags
# come out of the tag-dropping reader as the name's neighbours): the head up to the brace.
_NAMED = re.compile(r"([\w.\-]+)(?:\[CALL_ID\][\w\-]*)?\[ARGS\]\s*\{")
_NAMED_SO_FAR = re.compile(r"[\w.\-]+(?:\[CALL_ID\][\w\-]*)?")
MAX_NAMED_HEAD = 256
BLANKS = " \t\r\n"

Piece = tuple[str, Any]


def call_piece(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """A call as OpenAI returns (or, streamed, opens) it: ``arguments`` a JSON string."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def read_call(
    obj: object, new_id: Callable[[], str], needs_arguments: bool = False
) -> dict[str, Any] | None:
    """A decoded object's call, or None when it is none (no name; no arguments when
    ``needs_arguments``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if needs_arguments and "arguments" not in obj and "parameters" not in obj:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):  # OpenAI's arguments are a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call_piece(obj["name"], arguments, new_id())


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:  # a bad escape: the object is read whole, or is text
        return None
    return value if isinstance(value, str) else None


def _may_be_named(text: str) -> bool:
    """Whether ``text`` may still become the head of a ``name[ARGS]{`` call (a name as
    OpenAI's, at most 64 characters, and a call id, within a bound: no head grows without
    end, each piece matched again)."""
    if len(text) > MAX_NAMED_HEAD:
        return False
    so_far = _NAMED_SO_FAR.match(text)
    if so_far is None:
        return False
    rest = text[so_far.end() :]
    if rest.startswith("[ARGS]"):
        return not rest[len("[ARGS]") :].strip(BLANKS)  # blanks, then its brace
    return "[ARGS]".startswith(rest) or "[CALL_ID]".startswith(rest)


@dataclass
class CallObjects:
    """A run of call objects (``between`` may separate two; ``listed``: maybe in a JSON
    list), read as it comes: :meth:`feed` and, at the end, :meth:`finish` return the
    pieces ready, ``("call", call)``, ``("arguments", text)`` (more of the last call's) and
    ``("text", text)``."""

    new_id: Callable[[], str]
    between: str = ""
    listed: bool = False
    named: bool = False  # calls may be Mistral v11's name[ARGS]{...}
    # An object is a call only with its arguments (llama3_json: no tag says it is one, and
    # a JSON answer with a "name" key was a call to a tool of that name; vLLM's rule).
    needs_arguments: bool = False
    read: int = 0  # calls read so far
    _text: str = ""  # not read yet: the object being read begins it (less arguments sent)
    _state: str = "between"  # "between" objects, in an "object", or all "text" now
    _in_list: bool = False
    _out: list[Piece] = field(default_factory=list)
    # The object being read: scanned up to _at, its depth then, inside a string or not.
    _at: int = 0
    _depth: int = 0
    _string: bool = False
    _escape: bool = False
    _streaming: bool = False  # its arguments stream: the text sent is cut from _text
    _bare: bool = False  # its arguments are all of it (name[ARGS]{...})
    _args_end: int = -1  # where they end in _text, once written

    @property
    def run_over(self) -> bool:
        """Something that is no call was met: all that follows is text."""
        return self._state == "text"

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        while self._step():
            pass
        return self._taken()

    def finish(self) -> list[Piece]:
        """The end: an object cut short is a call when its arguments began to stream
        (they stay as written, up to their closing brace if it came), else text; the rest
        is text."""
        if self._state == "object" and self._streaming:
            self._send_arguments(self._args_end if self._args_end >= 0 else len(self._text))
            self._text = ""
        if self._text:
            self._out.append(("text", self._text))
        self._text, self._state = "", "text"
        return self._taken()

    def _step(self) -> bool:
        if self._state == "text":
            if self._text:
                self._out.append(("text", self._text))
                self._text = ""
            return False
        if self._state == "object":
            return self._read_object()
        # Blanks and separators between objects are no text: dropped as they come (a long
        # run of them, fed a token at a time, costs no more than its length).
        rest = self._text = self._text.lstrip(BLANKS + self.between)
        if not rest:
            return False
        if rest[0] == "{" or (self.named and (rest[0].isalnum() or rest[0] in "_.-")):
            named = _NAMED.match(rest) if rest[0] != "{" else None
            if rest[0] != "{" and named is None:
                if _may_be_named(rest):
                    return False  # not known yet
                self._state = "text"
                return True
            self._state = "object"
            self._at = self._depth = 0
            self._string = self._escape = self._streaming = False
            self._args_end = -1
            self._bare = named is not None
            if named is not None:
                self._open_call(named.group(1), named.end() - 1)
        elif self.listed and rest[0] == "[" and not self._in_list:
            # A list, or (after calls) another one, as a tag per call writes them; after
            # calls, a "[" that opens no object is text.
            inside = rest[1:].lstrip(BLANKS)
            if self.read and not inside:
                return False  # not known yet
            if self.read and inside[0] != "{":
                self._state = "text"
            else:
                self._text, self._in_list = rest[1:], True
        elif self._in_list and rest[0] == "]":
            self._text, self._in_list = rest[1:], False
        else:
            self._state = "text"  # no call: all that follows is text
        return True

    def _read_object(self) -> bool:
        """Scan the object's new text; True when it closed (the run goes on after it)."""
        if not self._streaming:
            head = _HEAD.match(self._text)
            name = _string(head.group(1)) if head is not None else None
            if head is not None and name:
                self._open_call(name, head.end() - 1)
        end = self._scan()
        if self._streaming:
            sent = self._send_arguments(self._args_end if self._args_end >= 0 else self._at)
            end -= sent if end >= 0 else 0
        if end < 0:
            return False
        obj_text, self._text = self._text[:end], self._text[end:]
        self._state = "between"
        if self._streaming:
            return True  # streamed: what follows its arguments is no part of the call
        try:
            call = read_call(json.loads(obj_text), self.new_id, self.needs_arguments)
        except (ValueError, RecursionError):
            call = None
        if call is None:
            self._text, self._state = obj_text + self._text, "text"
            return True
        self.read += 1
        self._out.append(("call", call))
        return True

    def _open_call(self, name: str, args_from: int) -> None:
        """The head is read: the call goes out, and the text before its arguments is cut."""
        self.read += 1
        self._streaming = True
        self._out.append(("call", call_piece(name, "", self.new_id())))
        # The scan had not reached the arguments' brace (else the head had matched then):
        # it goes on from there, inside the object, outside any string.
        self._text = self._text[args_from:]
        self._at, self._depth, self._string, self._escape = 0, 1, False, False

    def _send_arguments(self, upto: int) -> int:
        """Send the arguments' text up to ``upto`` and cut it from the text held; how
        much was cut."""
        if upto <= 0:
            return 0
        self._out.append(("arguments", self._text[:upto]))
        self._text = self._text[upto:]
        self._at -= upto
        if self._args_end >= 0:
            self._args_end -= upto
        return upto

    def _scan(self) -> int:
        """JSON-scan the object's text from where the last scan stopped: the end of the
        object (just past its closing brace) once written, else -1. Marks where streamed
        arguments end."""
        text, depth, string, escape = self._text, self._depth, self._string, self._escape
        at, end, args_end = self._at, -1, self._args_end
        while at < len(text):
            char = text[at]
            at += 1
            if string:
                if escape:
                    escape = False
                elif char == "\\":
                    escape = True
                elif char == '"':
                    string = False
            elif char == '"':
                string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 1 and self._streaming and args_end < 0:
                    args_end = at
                    if self._bare:  # the arguments were the whole call
                        end = at
                        break
                if depth == 0:
                    end = at
                    break
        self._at, self._depth, self._string, self._escape = at, depth, string, escape
        self._args_end = args_end
        return end

    def _taken(self) -> list[Piece]:
        out, self._out = self._out, []
        return out
