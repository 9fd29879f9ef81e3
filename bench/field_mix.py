"""The field study's traffic mix, as requests: what ``bench/locustfile.py`` sends.

Shares (field study, "Validation"): 20 % long-document QA, 30 % multi-turn dialogue that
resends its history every turn, 50 % short generation, plus 5 % invalid requests that must
get a 4xx. The text comes from ``bench/data/stdlib_qa.jsonl`` (questions and answers about
Python's standard library, what the demo model was trained on), chosen by a seeded RNG.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DATA = Path(__file__).resolve().parent / "data" / "stdlib_qa.jsonl"
# Per 200 requests: the field's 20 / 30 / 50 of the valid ones exactly, and 5 % invalid
# within the whole (19 / 28 / 48 of 100 gave 20.0 / 29.5 / 50.5).
MIX = {"long_doc": 38, "conversation": 57, "short": 95, "invalid": 10}
INVALID_KINDS = (
    "malformed_json",
    "wrong_type",
    "unknown_parameter",
    "out_of_range",
    "empty_messages",
    "over_long_prompt",
)


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class QA:
    question: str
    answer: str
    domain: str


@dataclass(frozen=True)
class RawRequest:
    """An HTTP request as bytes: invalid ones cannot always be expressed as JSON."""

    kind: str
    path: str
    body: bytes


def load_qa(path: Path = DATA) -> list[QA]:
    """Every Q/A pair of the data file, in file order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [QA(r["question"], r["answer"], r.get("domain", "")) for r in rows]


def task_weights(mix: dict[str, int], turns: int) -> dict[str, int]:
    """Weights per task (what locust picks) that give ``mix`` per request: a conversation
    task sends ``turns`` requests, every other task one."""
    return {kind: w if kind == "conversation" else w * turns for kind, w in mix.items()}


def parse_mix(text: str) -> dict[str, int]:
    """``"long_doc=38,short=95"`` → weights (per 200 requests, as ``MIX``); kinds not named
    keep their default weight."""
    mix = dict(MIX)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in MIX or not value.isdigit():
            raise ValueError(f"mix entry {part!r}: use kind=weight with kind in {sorted(MIX)}")
        mix[name] = int(value)
    return mix


def long_document(
    qa: list[QA], n_tokens: int, tokenizer: Encoder | None, rng: random.Random
) -> str:
    """A reference document of about ``n_tokens`` tokens (exact with a tokenizer): Q/A
    entries in a seeded order, as a manual would list them."""
    order = rng.sample(range(len(qa)), len(qa))
    parts: list[str] = []
    size = 0
    i = 0
    # ~4 characters a token is what byte-level BPE gives on English and code.
    while size < n_tokens * 4 + 200:
        item = qa[order[i % len(order)]]
        parts.append(f"Q: {item.question}\nA: {item.answer}\n")
        size += len(parts[-1])
        i += 1
    text = "".join(parts)
    if tokenizer is None:
        return text[: n_tokens * 4]
    # Trim by halving the overshoot until the token count fits (tokenizers merge across cuts).
    hi = len(text)
    while len(tokenizer.encode(text[:hi], add_special_tokens=False)) > n_tokens:
        over = len(tokenizer.encode(text[:hi], add_special_tokens=False)) - n_tokens
        hi -= max(1, over * 2)
    return text[:hi]


def long_doc_messages(document: str, qa: list[QA], rng: random.Random) -> list[dict[str, str]]:
    """A question about the document, after it."""
    return long_doc_chat(document, rng.choice(qa).question)


def long_doc_chat(document: str, question: str) -> list[dict[str, str]]:
    prompt = f"Read this reference and answer the question.\n\n{document}\n\n{question}"
    return [{"role": "user", "content": prompt}]


def long_doc_probe(qa: list[QA]) -> list[dict[str, str]]:
    """What goes around a long document at most (the longest question, no document): what
    the gateway's /tokenize counts of it is the room a document must leave."""
    return long_doc_chat("", max(qa, key=lambda item: len(item.question)).question)


def long_doc_tokens(max_model_len: int, max_tokens: int, around: int) -> int:
    """The document size that leaves room for the answer in a group of ``max_model_len``:
    less ``max_tokens`` and what goes ``around`` it (chat template, instruction, question),
    and a few tokens more, since the document's edges may merge with their neighbours."""
    return max_model_len - max_tokens - around - 8


def short_prompt(qa: list[QA], rng: random.Random) -> list[dict[str, str]]:
    """One short question (the demo model's trained format)."""
    return [{"role": "user", "content": rng.choice(qa).question}]


def conversation_questions(qa: list[QA], rng: random.Random, turns: int) -> list[str]:
    """The user's messages of one conversation, one domain (a user stays on a topic)."""
    domain = rng.choice(qa).domain
    pool = [item for item in qa if item.domain == domain] or qa
    return [rng.choice(pool).question for _ in range(turns)]


def invalid_request(kind: str, model: str, max_model_len: int) -> RawRequest:
    """A request the gateway must refuse with a 4xx (never 5xx, never a hang)."""
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "What does json.dumps do?"}]
    body: Any
    if kind == "malformed_json":
        return RawRequest(kind, chat, b'{"model": "' + model.encode() + b'", "messages": [{"role"')
    if kind == "wrong_type":
        body = {"model": model, "messages": "What does json.dumps do?", "max_tokens": "ten"}
    elif kind == "unknown_parameter":
        body = {"model": model, "messages": user, "max_tokens": 8, "frobnicate": True}
    elif kind == "out_of_range":
        body = {"model": model, "messages": user, "max_tokens": 8, "temperature": -1}
    elif kind == "empty_messages":
        body = {"model": model, "messages": [], "max_tokens": 8}
    elif kind == "over_long_prompt":
        # Token ids: longer than every group's limit without tokenizing megabytes of text.
        body = {"model": model, "prompt": [17] * (max_model_len + 1), "max_tokens": 8}
        return RawRequest(kind, "/v1/completions", json.dumps(body).encode())
    else:
        raise ValueError(f"unknown invalid kind {kind!r}")
    return RawRequest(kind, chat, json.dumps(body).encode())
