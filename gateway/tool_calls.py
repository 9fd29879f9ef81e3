"""Tool calls in a model's output: OpenAI's ``tool_calls`` from the text a chat model writes.

Three formats, the ones the engine's model families are trained on:

- ``hermes`` (Qwen 2.5 and 3, Hermes 2 and 3): JSON between tags, one block per call,
  possibly after some text::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the whole answer is the call, a JSON object with
  ``name`` and ``parameters`` (several joined by ``;``), maybe after ``<|python_tag|>``.
- ``mistral`` (Mistral 7B v0.3, Nemo: tokenizer v3): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}``, maybe after some text; from tokenizer v11 (Mistral Small 3.1
  and later, Devstral, Magistral) ``[TOOL_CALLS]name[ARGS]{...}``, a tag per call. The
  tags are special tokens: the worker's text keeps special tokens for these requests. Call
  ids are 9 letters and digits, the only ids Mistral's templates take back in the next turn.

A whole answer is split into its content and its calls as vLLM's parsers of those names
split it, and streamed, read the same (a whole answer is read as one piece of a stream).
Content flows as it comes, holding back only what may be the start of a tag; calls stream
as OpenAI streams them: a call's id and name once written, then its arguments as the model
writes them (:mod:`gateway.call_objects`). A llama3_json answer that begins with ``{`` is
calls, as is a mistral answer from its tag: the first thing in them that is no call, and
all after it, is content; with no call before it, the whole answer is (bad JSON, no name:
nothing the model wrote is lost). Which format: :func:`tool_format`.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.call_objects import CallObjects, Piece
from gateway.tag_hold import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
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


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCallStream:
    """An answer's tool calls, read as its text streams: :meth:`feed` and, at the end,
    :meth:`finish` return the pieces ready to send, ``("content", text)``, ``("call",
    call)`` (its arguments maybe still empty) or ``("arguments", text)`` (more of the last
    call's); :meth:`split` reads a whole answer."""

    parallel: bool = True
    new_id: Callable[[], str] = call_id
    calls: int = 0  # calls read so far
    calls_sent: int = 0  # of those, sent (each call's ``index`` in the stream)
    _pending: str = ""  # text not sent yet
    _pieces: list[tuple[str, Any]] = field(default_factory=list)
    # Content's trailing blanks, held: sent with the next words, dropped before a call (the
    # lines around calls are no content of their own) and, after one, at the end.
    _blanks: list[str] = field(default_factory=list)
    _worded: bool = False  # some content was sent
    _skipping: bool = False  # the call being read is one parallel_tool_calls=False drops

    def feed(self, text: str) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[str, Any]]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer's content (None when it made calls and said nothing else) and its
        calls, read as if it streamed in one piece: so both readings agree. Uses the reader
        up."""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for kind, value in self.feed(text) + self.finish():
            if kind == "content":
                content.append(value)
            elif kind == "call":
                calls.append(value)
            else:
                calls[-1]["function"]["arguments"] += value
        said = "".join(content)
        return (said or None, calls) if calls else (said, [])

    def finish_reason(self, reason: str | None, calls: int) -> str | None:
        """The answer's finish reason once it made ``calls`` calls."""
        return tool_finish_reason(reason, calls)

    def _content(self, text: str) -> None:
        if not text or text.isspace():  # held as parts: a long run costs its length
            self._blanks.append(text)
            return
        text = "".join(self._blanks) + text
        if self.calls and not self._worded:
            text = text.lstrip()  # the line after a call, before any content
        words = text.rstrip()
        self._blanks = [text[len(words) :]]
        if words:
            self._pieces.append(("content", words))
            self._worded = True

    def _take(self, pieces: list[Piece]) -> None:
        """A call reader's pieces: calls (the first only, without parallel calls), their
        arguments, and text as content."""
        for kind, value in pieces:
            if kind == "call":
                self._blanks.clear()
                self._skipping = not self.parallel and self.calls > 0
                if not self._skipping:
                    self._pieces.append(("call", value))
                    self.calls += 1
            elif kind == "arguments":
                if not self._skipping:
                    self._pieces.append(("arguments", value))
            else:
                self._content(value)

    def _end(self) -> list[tuple[str, Any]]:
        """The last pieces: blanks held at the end are the answer's own when it made no
        call (its text is returned as it came)."""
        blank = "".join(self._blanks)
        if blank and not self.calls:
            self._pieces.append(("content", blank))
        self._blanks.clear()
        return self._taken()

    def _content_until(self, tag: str) -> bool:
        """Send the pending content up to ``tag``, or, without it yet, all but what may be
        its start; True (the pending text then begins with the tag) when it was found."""
        pending = self._pending
        at = pending.find(tag)
        if at < 0:
            at = len(pending) - partial_tag(pending, tag)  # held: what may become the tag
        self._content(pending[:at])
        self._pending = pending[at:]
        return self._pending.startswith(tag)

    def _taken(self) -> list[tuple[str, Any]]:
        out, self._pieces = self._pieces, []
        return out


@dataclass
class HeldCalls(ToolCallStream):
    """A format whose calls follow a marker: after it, a run of call objects is read;
    until its first call is read, the text after the marker is held, for when it turns out
    no call (then all of it, the marker too, is content)."""

    _reader: CallObjects | None = None  # reading calls since the marker
    _held: list[str] = field(default_factory=list)  # the text since the marker, no call read

    def _begin(
        self,
        marker: str,
        between: str = "",
        listed: bool = False,
        named: bool = False,
        needs_arguments: bool = False,
    ) -> None:
        self._reader = CallObjects(self.new_id, between, listed, named, needs_arguments)
        self._held = [marker]

    def _read(self, text: str, raw: str | None = None) -> None:
        """Read ``text`` (``raw``: as the model wrote it, when that differs)."""
        reader = self._reader
        assert reader is not None
        if not reader.read:
            self._held.append(text if raw is None else raw)
        self._settle(reader.feed(text))

    def _settle(self, pieces: list[Piece]) -> None:
        """Send the reader's pieces once a call was read; with none read and the run over,
        the held text was no call: it is content, and so is all that follows."""
        reader = self._reader
        assert reader is not None
        if reader.read:
            self._take(pieces)
        elif reader.run_over:
            self._no_calls("".join(text for kind, text in pieces if kind == "text"))
            self._reader, self._held = None, []

    def _no_calls(self, rest: str) -> None:
        """The run held no call: what was held is content. ``rest``: the end of it where
        the reader met text."""
        self._content("".join(self._held))

    def _read_end(self) -> None:
        """The run ends (its reader's end is always ``run_over``)."""
        if self._reader is not None:
            self._settle(self._reader.finish())
            self._reader, self._held = None, []


@dataclass
class Llama3JsonCalls(HeldCalls):
    """llama3_json: an answer that begins (after blanks) with ``{`` or the python tag is
    read as calls joined by ``;``; any other streams as content from its first word."""

    _decided: bool = False
    _lead: list[str] = field(default_factory=list)  # the blanks before its first word

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._decided:
            if self._reader is not None:
                self._read(text)
            else:
                self._content(text)
            return self._taken()
        if not self._pending:  # blanks so far: kept apart, so a long run costs its length
            words = text.lstrip()
            self._lead.append(text[: len(text) - len(words)])
            text = words
        self._pending += text
        head = self._pending
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            self._decided = True
            body = head.removeprefix(PYTHON_TAG)
            marker = "".join(self._lead) + head[: len(head) - len(body)]
            self._begin(marker, between=";", needs_arguments=True)
            self._read(body)
        elif head and not PYTHON_TAG.startswith(head):  # not the tag's first characters
            self._decided = True
            self._content("".join(self._lead) + head)
        if self._decided:
            self._pending, self._lead = "", []
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        self._read_end()
        self._content("".join(self._lead) + self._pending)
        self._pending, self._lead = "", []
        return self._end()


@dataclass
class HermesCalls(HeldCalls):
    """hermes: content streams, a tag's possible start is held; in a block, calls stream as
    they are written (a block that holds none is the text it was); a block the model ends
    without its closing tag is read as one, as vLLM reads it."""

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        while self._step():
            pass
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        while self._reader is not None or self._pending:
            if self._reader is not None:  # a block the model left open ends here
                pending, self._pending = self._pending, ""
                self._read(pending)
                self._read_end()
            while self._step():  # text a block gave back may open another
                pass
            if self._reader is None:  # what may begin a tag, and never did
                self._content(self._pending)
                self._pending = ""
        return self._end()

    def _step(self) -> bool:
        """Consume what can be decided now; True when it should be called again."""
        if self._reader is not None:
            # A block ends at its closing tag, or where the next block opens (the model
            # left out the closing tag between two calls).
            pending = self._pending
            ends = [at for at in (pending.find(CLOSE), pending.find(OPEN)) if at >= 0]
            end = min(ends, default=-1)
            held = max(partial_tag(pending, CLOSE), partial_tag(pending, OPEN))
            upto = end if end >= 0 else len(pending) - held
            self._pending = pending[upto:]
            self._read(pending[:upto])
            if self._reader is None:
                return True  # no call in the block: its text is read again
            if end < 0:
                return False
            calls = self._reader.read
            self._read_end()
            if calls and self._pending.startswith(CLOSE):  # else: text, or the next block
                self._pending = self._pending[len(CLOSE) :]
            return True
        if not self._content_until(OPEN):
            return False
        self._pending = self._pending[len(OPEN) :]
        self._begin(OPEN)
        return True

    def _no_calls(self, rest: str) -> None:
        """A block's reader met text before any call: the block is text up to there, and
        what follows is read again, as content or the next block (as it would be had the
        block ended there)."""
        held = "".join(self._held)
        self._content(held[: len(held) - len(rest)])
        self._pending = rest + self._pending


@dataclass
class MistralCalls(HeldCalls):
    """mistral: content streams until the tag (a possible start of it held), then the calls
    after it stream as they are written: a JSON list of them (tokenizers v3 to v7), or
    ``name[ARGS]{...}`` after a tag each (v11 and later, maybe with ``[CALL_ID]id`` before
    ``[ARGS]``); more tags are dropped. No call after the tag: all of it is the text it
    was."""

    new_id: Callable[[], str] = mistral_call_id
    _tagged: bool = False  # the tag was met

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        if not self._tagged and self._content_until(MISTRAL_TAG):
            self._pending = self._pending[len(MISTRAL_TAG) :]
            self._tagged = True
            self._begin(MISTRAL_TAG, between=",", listed=True, named=True)
        if self._tagged:
            self._read_untagged(len(self._pending) - partial_tag(self._pending, MISTRAL_TAG))
        return self._taken()

    def finish(self) -> list[tuple[str, Any]]:
        if self._tagged:
            self._read_untagged(len(self._pending))
            self._read_end()
        self._content(self._pending)
        self._pending = ""
        return self._end()

    def _read_untagged(self, upto: int) -> None:
        """Read the pending text up to ``upto``, less the tags in it (content as it was,
        once the calls are over)."""
        raw, self._pending = self._pending[:upto], self._pending[upto:]
        if self._reader is None:
            self._content(raw)
        else:
            self._read(raw.replace(MISTRAL_TAG, ""), raw)
