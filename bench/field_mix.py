"""The field study's traffic mix, as requests: what ``bench/locustfile.py`` sends.

Shares (field study, "Validation"): 20 % long-document QA, 30 % multi-turn dialogue that
resends its history every turn, 50 % short generation, plus 5 % invalid requests that must
get a 4xx. The text comes from ``bench/data/stdlib_qa.jsonl`` (questions and answers about
Python's standard library, what the demo model was trained on), chosen by a seeded RNG.
Also how the locust file reads a streamed answer's timings (:class:`StreamClock`): kept
here, apart from locust, whose import monkey-patches the process.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


def interleaved(weights: dict[str, int]) -> Iterator[str]:
    """Kinds in the weights' proportions at every length of the sequence, each count within
    one of its exact share (smooth weighted round robin, as nginx spreads requests over its
    upstreams). Drawn at random one by one (locust's own pick), a 60 s run of ~730 tasks
    carried 16.8 % long documents and 24.3 % turns where the mix says 19 and 28.5."""
    if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights {weights}: none negative, some positive")
    current, total = dict.fromkeys(weights, 0), sum(weights.values())
    while True:
        for kind, weight in weights.items():
            current[kind] += weight
        chosen = max(current, key=current.__getitem__)
        current[chosen] -= total
        yield chosen


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
    qa: list[QA], n_tokens: int, tokenizer: Encoder | None, rng: random.Random, title: str = ""
) -> str:
    """A reference document of about ``n_tokens`` tokens (exact with a tokenizer): ``title``,
    then Q/A entries in a seeded order, as a manual would list them."""
    order = rng.sample(range(len(qa)), len(qa))
    parts: list[str] = [title]
    size = len(title)
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
    # Trim by halving the overshoot until the token count fits (tokenizers merge across cuts);
    # one encoding a step: a document is made per request now, not four per run.
    hi = len(text)
    count = len(tokenizer.encode(text, add_special_tokens=False))
    while count > n_tokens:
        hi -= max(1, (count - n_tokens) * 2)
        count = len(tokenizer.encode(text[:hi], add_special_tokens=False))
    return text[:hi]


def long_doc_key(pool: int, rng: random.Random, serial: int, seed: int = 0, worker: int = 0) -> str:
    """Which document a long-document request asks about. ``pool`` 0: a new one every
    request (``serial`` counts this process's long-document requests, ``worker`` tells
    locust's worker processes apart), as the field study's distinct documents. ``pool`` N:
    one of N, the same N for every user and process (a prefix-cache scenario)."""
    if pool > 0:
        return f"pool-{rng.randrange(pool)}"
    return f"s{seed}-w{worker}-{serial}"


def keyed_document(qa: list[QA], n_tokens: int, tokenizer: Encoder | None, key: str) -> str:
    """The document of ``key``: the same text for the same key, in any process (a ``str``
    seed goes through SHA-512, not the salted ``hash``). Its title names the key, so two
    keys' documents part at their first line: no prefix in common past the instruction
    (two shuffles of the Q/A entries start alike one time in ``len(qa)``)."""
    return long_document(qa, n_tokens, tokenizer, random.Random(key), title=f"Manual {key}\n\n")


class DocumentCache:
    """Documents by key, at most ``keep`` of them (least recently used out; an evicted key
    is made again, the same text): a pool's documents without keeping every one made."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._docs: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str, make: Callable[[str], str]) -> str:
        if key in self._docs:
            self._docs.move_to_end(key)
            return self._docs[key]
        doc = make(key)
        if self.keep > 0:
            self._docs[key] = doc
            while len(self._docs) > self.keep:
                self._docs.popitem(last=False)
        return doc

    def __len__(self) -> int:
        return len(self._docs)


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


# --------------------------------------------------------------------------- reading answers


def carries_token(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice shows a generated token: text (a chat delta's content, a
    completion's text), or logprobs for a token that has no text of its own. The chat role
    event (empty content) and a bare finish event show none."""
    delta = choice.get("delta") or {}
    if delta.get("content") or choice.get("text"):
        return True
    logprobs = choice.get("logprobs") or {}
    return bool(logprobs.get("content") or logprobs.get("tokens"))


@dataclass
class StreamClock:
    """A streamed answer's timings from its SSE events, fed in order with the time each was
    read: TTFT at the first event carrying a token, ITL between such events.

    An answer no event of which showed a token: when the usage event counts tokens, its
    finish event carried them (an answer that is just an EOS), so TTFT is taken there (an
    upper bound if the gateway held back earlier textless tokens: it sends those only with
    logprobs). With no token counted (or no usage to tell), it had no first token: no TTFT,
    but a ``NO_TOKENS`` sample, so such answers are counted instead of silently missing
    from the TTFT figures."""

    started: float
    parts: list[str] = field(default_factory=list)
    last: float | None = None  # when the last event that carried a token was read
    finished_at: float | None = None
    completion_tokens: int | None = None

    def feed(self, event: dict[str, Any], now: float) -> list[tuple[str, float]]:
        """One (non-error) event; the ``(kind, ms)`` samples it gives."""
        usage = event.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens")
        choices = event.get("choices") or []
        if not choices:
            return []
        choice = choices[0]
        if choice.get("finish_reason") is not None and self.finished_at is None:
            self.finished_at = now
        if not carries_token(choice):
            return []
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if text:
            self.parts.append(text)
        kind, since = ("TTFT", self.started) if self.last is None else ("ITL", self.last)
        self.last = now
        return [(kind, (now - since) * 1e3)]

    def end(self, now: float) -> list[tuple[str, float]]:
        """At ``[DONE]``: nothing more for an answer that showed a token; else its TTFT at
        the finish event (tokens counted) or its ``NO_TOKENS`` sample (end-to-end ms)."""
        if self.last is not None:
            return []
        if self.completion_tokens and self.finished_at is not None:
            self.last = self.finished_at
            return [("TTFT", (self.finished_at - self.started) * 1e3)]
        return [("NO_TOKENS", (now - self.started) * 1e3)]

    @property
    def text(self) -> str:
        return "".join(self.parts)
