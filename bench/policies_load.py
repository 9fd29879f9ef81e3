"""What ``bench/policies.py`` sends and what it reads back: the field mix as token ids, a
session driver on ``bench/serve_load.py``'s streamed client, and worker telemetry.

Requests go through ``bench/serve_http.py``'s sender (the streamed client of
``bench/serve.py``), paced by ``bench/serve_load.py``'s ``paced``.

A *session* is one arrival: a short generation, a long-document question (on the ``long``
group), or a conversation whose turns go one after another, each resending the whole history
(the previous prompt, the previous answer, the new user message). Prompts are token ids
(exact lengths, no tokenizer in the load generator); outputs run to ``max_tokens``
(``ignore_eos``), so every policy produces the same tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import nats

from bench.field_mix import MIX, task_weights
from bench.serve_http import Result, open_sender, token_events
from bench.serve_load import Req, paced
from common.protocol import Telemetry
from common.subjects import Subjects

GROUP_OF = {"long_doc": "long", "conversation": "short", "short": "short"}


# The error of a conversation turn never sent because an earlier one failed: that failure is
# what counts (a shed or an error), not the turns it left.
UNSENT = "not sent: an earlier turn failed"


@dataclass(frozen=True)
class Session:
    kind: str  # long_doc | conversation | short
    group: str
    turns: tuple[Req, ...]


@dataclass
class Sent:
    """One request of a session, as the client saw it."""

    kind: str
    group: str
    result: Result = field(default_factory=Result)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 250) for _ in range(n)]


def make_sessions(
    n: int, seed: int, long_tokens: int, turns: int = 3, doc_pool: int = 0
) -> list[Session]:
    """``n`` sessions giving the field's proportions by request, as locust's tasks do (a
    conversation sends ``turns`` requests; invalid requests are locust's business). By
    session, as before 2026-12-01, the mix came out 13 % long / 56 % turns / 31 % short.

    ``doc_pool``: 0 (the default since 2026-12-02), a new document for each long-document
    question; N, questions about N shared documents (a prefix-cache scenario: until then
    four were shared, and most of each long prompt was a cache hit)."""
    rng = random.Random(seed)
    weights = task_weights({k: MIX[k] for k in ("long_doc", "conversation", "short")}, turns)
    docs = [_ids(random.Random(seed * 31 + d), long_tokens) for d in range(doc_pool)]
    sessions = []
    for kind in _quota(weights, n, rng):
        if kind == "long_doc":
            document = rng.choice(docs) if docs else _ids(rng, long_tokens)
            prompt = document + _ids(rng, 16)
            reqs: tuple[Req, ...] = (Req(prompt, 32),)
        elif kind == "conversation":
            prompt, built = _ids(rng, 48), []
            for _ in range(turns):
                built.append(Req(list(prompt), 32))
                # Random tokens where the answer goes (not the model's own answer: those are
                # prefilled again, 16-32 tokens more a turn than a real client causes),
                # then the next question.
                prompt = prompt + _ids(rng, 32) + _ids(rng, 24)
            reqs = tuple(built)
        else:
            reqs = (Req(_ids(rng, rng.randint(16, 64)), rng.randint(16, 32)),)
        sessions.append(Session(kind, GROUP_OF[kind], reqs))
    return sessions


def _quota(weights: dict[str, int], n: int, rng: random.Random) -> list[str]:
    """``n`` session kinds in the weights' proportions exactly (largest remainders), in a
    seeded order: drawn one by one, a step of 70 requests carried 11 % long documents, not
    the mix's 20 %, and judged a stack on a lighter load than stated."""
    total = sum(weights.values())
    shares = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(s) for k, s in shares.items()}
    for k in sorted(shares, key=lambda k: shares[k] - counts[k], reverse=True)[
        : n - sum(counts.values())
    ]:
        counts[k] += 1
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


async def run_sessions(
    url: str,
    model: str,
    sessions: list[Session],
    offsets: list[float],
    client: str = "raw",
    pool: str | None = None,
) -> tuple[list[Sent], float]:
    """Start each session at its offset (turns in order); every request and the duration.

    ``client`` is a ``bench/serve_http.py`` sender; ``raw`` costs a tenth of ``httpx``'s CPU,
    which matters where the load generator shares the cores with the stack it measures.
    ``pool``: send every request to that group (``Sent.group`` still names the session's).
    """
    sent: list[list[Sent]] = [[] for _ in sessions]
    async with open_sender(client, url, None) as sender:

        async def one(i: int, start: float) -> None:
            session = sessions[i]
            for n, req in enumerate(session.turns):
                item = Sent(session.kind, session.group)
                sent[i].append(item)
                item.result.start = time.perf_counter() - start
                # A first turn is due at its arrival; a later one when the last answered.
                item.result.scheduled = offsets[i] if n == 0 else item.result.start
                body = {
                    "model": model,
                    "prompt": req.prompt,
                    "max_tokens": req.output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **token_events(model),
                }
                route = pool or session.group
                await sender.send(i, f"/v1/{route}/completions", body, item.result)
                if not item.result.ok:
                    # A conversation stops at its first failed turn; the turns it never
                    # sent count as not completed (the 99 % check is over requests due).
                    for _ in session.turns[n + 1 :]:
                        unsent = Sent(session.kind, session.group)
                        unsent.result.error = UNSENT
                        sent[i].append(unsent)
                    return

        duration = await paced(offsets, one)
    return [s for per in sent for s in per], duration


class TelemetryLog:
    """Every worker telemetry message while connected: (monotonic time, message)."""

    def __init__(self, nats_url: str, prefix: str = "qos") -> None:
        self.nats_url, self.subjects = nats_url, Subjects(prefix)
        self.samples: list[tuple[float, Telemetry]] = []
        self._nc: Any = None

    async def __aenter__(self) -> TelemetryLog:
        self._nc = await nats.connect(self.nats_url)

        async def on(msg: Any) -> None:
            try:
                self.samples.append((time.monotonic(), Telemetry.from_bytes(msg.data)))
            except Exception:
                return  # not a telemetry message of this version: not ours to judge

        await self._nc.subscribe(self.subjects.telemetry_wildcard, cb=on)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.drain()

    def window(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        """Per group, over messages sent in [t0, t1]: mean engine busy fraction and batch."""
        out: dict[str, dict[str, float]] = {}
        for group in sorted({m.group for _, m in self.samples}):
            ms = [m for t, m in self.samples if t0 <= t <= t1 and m.group == group]
            if ms:
                out[group] = {
                    "busy_fraction": round(sum(m.busy_ratio for m in ms) / len(ms), 3),
                    "mean_running": round(sum(m.running for m in ms) / len(ms), 2),
                    "samples": len(ms),
                }
        return out
