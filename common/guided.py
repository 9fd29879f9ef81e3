"""Guided decoding (structured output): what a request's output must match, as it travels.

A :class:`GuidedSpec` names a kind and its text. The engine compiles it with llguidance
(the grammar library vLLM and llama.cpp use as one of their backends) into a matcher that
masks every token that could not continue a match; the gateway builds the same grammar
first, so a bad schema is a 400 before any worker sees it.

Kinds: ``json_schema`` (a JSON Schema, as JSON text; ``{"type": "object"}`` is OpenAI's
``json_object``), ``regex`` (Rust regex syntax, anchored at both ends), ``choice`` (a JSON
list of strings: the output is exactly one of them) and ``grammar`` (Lark, or GBNF as
llama.cpp writes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

GuidedKind = Literal["json_schema", "regex", "choice", "grammar"]
GUIDED_KINDS: tuple[str, ...] = ("json_schema", "regex", "choice", "grammar")
# A schema or grammar's text, as the wire allows: room for the call schema of an agent's
# 128 tools (tool_choice "required"), bounded so one request's compile stays bounded.
MAX_GUIDED_SPEC_CHARS = 256 * 1024
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# json.dumps's spacing and no other: with free whitespace a small model can write
# newlines until max_tokens, and the output parses the same either way.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedSpecError(ValueError):
    """The spec cannot be compiled; the message says where."""


@dataclass(frozen=True)
class GuidedSpec:
    kind: str
    spec: str

    def grammar(self) -> str:
        """The llguidance grammar text, checked (raises :class:`GuidedSpecError`)."""
        return _checked_grammar(self.kind, self.spec)


def shape_problem(kind: str, spec: str) -> str | None:
    """What is wrong with ``kind``/``spec`` short of compiling it, or None."""
    if kind not in GUIDED_KINDS:
        return f"unknown kind {kind!r} (one of {', '.join(GUIDED_KINDS)})"
    if not isinstance(spec, str):
        return "the spec must be text"
    if len(spec) > MAX_GUIDED_SPEC_CHARS:
        return f"longer than {MAX_GUIDED_SPEC_CHARS} characters"
    return None


def problem(kind: str, spec: str) -> str | None:
    """Why ``kind``/``spec`` cannot guide a request, or None when it can (compiled: up to
    tens of milliseconds, once per distinct spec)."""
    shape = shape_problem(kind, spec)
    if shape is not None:
        return shape
    try:
        _checked_grammar(kind, spec)
    except GuidedSpecError as exc:
        return str(exc)
    return None


def _checked_grammar(kind: str, spec: str) -> str:
    grammar, error = _compiled(kind, spec)
    if error is not None:
        raise GuidedSpecError(error)
    assert grammar is not None
    return grammar


@lru_cache(maxsize=64)  # a spec may be 256 KiB and its grammar several times that
def _compiled(kind: str, spec: str) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, why), once per distinct spec: agents send the same tool
    schemas on every request, and a client resending a bad one costs one compile, not
    one each time."""
    import llguidance

    try:
        grammar = _grammar(kind, spec)
    except GuidedSpecError as exc:
        return None, str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return (None, error.strip()) if error else (grammar, None)


def _grammar(kind: str, spec: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except RecursionError:  # "[[[[..." past the parser's depth: a bad spec, not a 500
            raise GuidedSpecError("the schema is nested too deeply") from None
        except ValueError as exc:
            raise GuidedSpecError(f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GuidedSpecError("the schema must be a JSON object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GuidedSpecError(str(exc)) from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(_escaped(c) for c in _choices(spec)))
    if kind == "grammar":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as exc:  # the GBNF reader raises bare Exceptions on bad input
            raise GuidedSpecError(f"cannot read the grammar: {exc}") from None
    raise GuidedSpecError(f"unknown kind {kind!r}")


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except (ValueError, RecursionError):
        choices = None
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise GuidedSpecError("choice: a non-empty JSON list of non-empty strings")
    return choices


def _escaped(text: str) -> str:
    """``text`` as a literal in Rust's regex syntax."""
    return "".join(f"\\{c}" if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)
