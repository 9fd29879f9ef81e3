"""Reasoning in a chat model's answer: what it thinks, ``<think>...</think>``, apart from
what it says, as vLLM's ``deepseek_r1`` and ``qwen3`` reasoning parsers split it.

A message gets the thinking as ``reasoning`` and ``reasoning_content`` (the names vLLM's
clients read since 2026 and before, DeepSeek's) and the rest as ``content`` (where tool
calls are read); streamed, deltas carry both while the model thinks, then ``content``. Whether an answer starts inside its thinking is the prompt's to say: a
template that ends the generation prompt with ``<think>`` (DeepSeek-R1 and its distills,
Qwen3's thinking models) has the model write only the closing tag, and one that does not
(Qwen3's hybrid models: ``enable_thinking`` decides) has it open the block itself, or not
think at all. So one reader serves both kinds of template (``auto``, ``qwen3``);
``deepseek_r1`` holds every answer to begin inside its thinking, as vLLM's parser of that
name does (DeepSeek-R1 sometimes skips the opening tag its template leaves to it). A
leading ``<think>`` the model writes anyway is dropped. An answer cut before its thinking
ended is all reasoning (vLLM's deepseek_r1 reading; its qwen3 one calls it content).

Reasoning is stripped of the blank lines around it, content of those before it (the
templates strip both when they render the message back); a whole answer reads the same
as the streamed one, whatever the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.tag_hold import partial_tag

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ReasoningParser = Literal["auto", "deepseek_r1", "qwen3", "none"]

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def reads_reasoning(setting: ReasoningParser, template_source: str) -> bool:
    """Whether answers are split into reasoning and content: ``auto`` when the chat
    template knows the closing tag (it strips thinking from the history it renders)."""
    if setting == "none":
        return False
    return setting != "auto" or THINK_CLOSE in template_source


def starts_thinking(setting: ReasoningParser, prompt_tail: str) -> bool:
    """Whether an answer to a prompt ending in ``prompt_tail`` begins inside its thinking:
    the template opened the block for the model (always, for ``deepseek_r1``)."""
    return setting == "deepseek_r1" or prompt_tail.rstrip().endswith(THINK_OPEN)


@dataclass
class ReasoningSplit:
    """One answer's reasoning and content, read as its text streams: :meth:`feed` and, at
    the end, :meth:`finish` return the pieces ready; :meth:`split` reads a whole answer."""

    thinking: bool = False  # the answer begins inside its thinking
    keep: bool = True  # False (include_reasoning false): the thinking is read and dropped
    # "start" (before any word), "reasoning", "after" (its closing tag) or "content"
    _state: str = "start"
    _pending: str = ""  # what may still be the start of a tag
    _lead: list[str] = field(default_factory=list)  # blanks before the first word, held
    _blanks: list[str] = field(default_factory=list)  # reasoning's trailing blanks, held
    _said: bool = False  # a word of reasoning went out
    _lead_done: bool = False  # the blanks and tag before the first word are read
    _out: list[Piece] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.thinking:
            self._state = "reasoning"

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        while self._step(final=False):
            pass
        return self._taken()

    def finish(self) -> list[Piece]:
        while self._step(final=True):
            pass
        return self._taken()

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's reasoning (None when it did not think) and its content, read
        as if it streamed in one piece. Uses the reader up."""
        reasoning: list[str] = []
        content: list[str] = []
        for kind, piece in self.feed(text) + self.finish():
            (reasoning if kind == "reasoning" else content).append(piece)
        return ("".join(reasoning) or None), "".join(content)

    def _step(self, final: bool) -> bool:
        """Consume what can be decided now; True when it should be called again."""
        pending = self._pending
        if not pending and not (final and self._state == "start" and any(self._lead)):
            return False
        if self._state in ("start", "reasoning") and not self._said and not self._lead_done:
            # Before any word: blanks kept apart (a long run costs its length), then the
            # opening tag, which starts the thinking (or, inside it already, is dropped).
            words = pending.lstrip()
            self._lead.append(pending[: len(pending) - len(words)])
            self._pending = pending = words
            if not words:
                if final and self._state == "start":
                    self._state, self._pending = "content", "".join(self._lead)
                    return True
                return False
            if words.startswith(THINK_OPEN):
                self._state, self._pending = "reasoning", words[len(THINK_OPEN) :]
                self._lead_done = True
                return True
            if not final and THINK_OPEN.startswith(words):
                return False  # what may become the tag
            self._lead_done = True
            if self._state == "start":  # no thinking: all of it is content, as it came
                self._state, self._pending = "content", "".join(self._lead) + words
            return True
        if self._state == "after":  # the blank lines after the thinking are no content
            rest = pending.lstrip("\r\n")
            self._pending = rest
            if rest:
                self._state = "content"
            return bool(rest)
        if self._state == "content":
            self._out.append(("content", pending))
            self._pending = ""
            return False
        at = pending.find(THINK_CLOSE)
        if at >= 0:
            self._reason(pending[:at])
            self._blanks.clear()  # the blanks before the closing tag are no reasoning
            self._state, self._pending = "after", pending[at + len(THINK_CLOSE) :]
            return True
        held = 0 if final else partial_tag(pending, THINK_CLOSE)
        self._reason(pending[: len(pending) - held])
        self._pending = pending[len(pending) - held :]
        return False

    def _reason(self, text: str) -> None:
        """Reasoning text out, less its leading blanks and with its trailing ones held
        (sent with the next words; dropped at the closing tag or the end)."""
        if not text:
            return
        if not self._said:
            text = text.lstrip()
            if not text:
                return
        if text.isspace():
            self._blanks.append(text)
            return
        words = text.rstrip()
        self._out.append(("reasoning", "".join(self._blanks) + words))
        self._blanks = [text[len(words) :]] if len(words) < len(text) else []
        self._said = True

    def _taken(self) -> list[Piece]:
        out, self._out = self._out, []
        return out if self.keep else [p for p in out if p[0] != "reasoning"]
