"""Locust stress test of the OpenAI API with the field study's mix (``bench/field_mix.py``).

Of the requests the users send, invalid ones make 5 %, and of the valid ones long-document
QA makes 20 %, the turns of multi-turn conversations that resend their whole history every
turn 30 %, short generations 50 % (19 / 28.5 / 47.5 % of all; tasks come in one
interleaved sequence per process that keeps these shares at every moment of the run,
``bench.field_mix.interleaved``, a conversation task, ``--turns`` requests, weighted down
by its turns, ``bench.field_mix.task_weights``): malformed JSON, wrong types, unknown parameters, out-of-range values, empty
messages, over-long prompts. Valid requests stream; invalid ones must get a 4xx — a 5xx, a
2xx or a hang (``--invalid-timeout-s``) is a failure. Besides each request's end-to-end time
(its own row), TTFT and inter-token latency are recorded as custom events, so they show up
in locust's stats and CSV files as request types ``TTFT`` and ``ITL``. TTFT is taken at the
first event carrying a token (text, or logprobs for a token without text; not the chat role
event), or at the finish event when that alone carried the tokens (an answer that is just
an EOS: the usage event, requested, counts them). An answer that ends with no token at all
has no TTFT and is counted as request type ``NO_TOKENS`` instead (its time: end to end):
such answers were left out of every figure (``bench.field_mix.StreamClock``).

Every long-document request asks about a document of its own by default, as the field
study's distinct documents: a seeded generator keyed by a counter (and locust's worker
index), the key in the document's first line, so two documents share no prefix past the
instruction and long-context TTFT gets no prefix-cache help. ``--long-doc-pool N`` (or
``LOCUST_LONG_DOC_POOL``) reuses N documents instead, the same N in every process (a
prefix-cache scenario; the old behaviour was 4). Distinct documents are made per request
and not kept; a pool keeps at most ``KEEP_DOCUMENTS`` (the rest are made again, the same
text). Documents follow ``--seed``: a second run with the same seed against a server that
still caches the first run's documents would reuse them.

Long documents are sized to the long group's limit (the server's ``max_model_len``) by
default; the demo model has a 2k context, so pass ``--long-tokens 1500`` (or
``LOCUST_LONG_TOKENS``) against it. The field study's run::

    locust -f bench/locustfile.py --headless --users 100 --spawn-rate 10 \\
        --host http://127.0.0.1:8000 --csv=report -t 1h

Options (flags or ``LOCUST_*`` variables): ``--long-tokens``, ``--max-tokens``,
``--turns``, ``--mix long_doc=38,conversation=57,short=95,invalid=10`` (weights per 200
requests; kinds not named keep these), ``--long-doc-pool`` (0, the default: a new document
every long-document request; N: N documents reused), ``--tokenizer`` (a tokenizer folder to
size documents exactly; default the demo model's), ``--seed``.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from locust import HttpUser, TaskSet, between, events

from bench.field_mix import (
    INVALID_KINDS,
    MIX,
    QA,
    DocumentCache,
    StreamClock,
    interleaved,
    invalid_request,
    keyed_document,
    load_qa,
    long_doc_key,
    long_doc_messages,
    long_doc_probe,
    long_doc_tokens,
    parse_mix,
    short_prompt,
    task_weights,
)
from bench.field_mix import conversation_questions as conversation

DEMO_TOKENIZER = Path(__file__).resolve().parent / "models" / "pystd-tiny"
# A 429 (the group's pending limit) is retried after its Retry-After, capped, this often.
RETRIES_ON_429 = 2
MAX_RETRY_WAIT_S = 5.0
# A --long-doc-pool's documents kept made (a few MB at 8k tokens each); more are made again.
KEEP_DOCUMENTS = 64


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("qosserve field mix")
    group.add_argument(
        "--long-tokens",
        type=int,
        default=0,
        env_var="LOCUST_LONG_TOKENS",
        help="long-document prompt tokens (0 = the server's max_model_len)",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        env_var="LOCUST_MAX_TOKENS",
        help="max_tokens of every valid request",
    )
    group.add_argument(
        "--turns",
        type=int,
        default=3,
        env_var="LOCUST_TURNS",
        help="turns of a multi-turn conversation",
    )
    group.add_argument(
        "--mix",
        default="",
        env_var="LOCUST_MIX",
        help="weights per 200 requests, e.g. long_doc=38,conversation=57,short=95,invalid=10 "
        "(kinds not named keep these)",
    )
    group.add_argument(
        "--long-doc-pool",
        type=int,
        default=0,
        env_var="LOCUST_LONG_DOC_POOL",
        help="long documents to reuse (0 = a new document every request, the field study's; "
        "N = N documents, a prefix-cache scenario)",
    )
    group.add_argument(
        "--tokenizer",
        default=str(DEMO_TOKENIZER),
        env_var="LOCUST_TOKENIZER",
        help="tokenizer folder to size long documents ('' = ~4 chars/token)",
    )
    group.add_argument(
        "--invalid-timeout-s",
        type=float,
        default=30.0,
        env_var="LOCUST_INVALID_TIMEOUT_S",
        help="an invalid request slower than this hangs",
    )
    group.add_argument("--seed", type=int, default=0, env_var="LOCUST_SEED")  # fmt: skip


@events.init.add_listener
def _apply_mix(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    if options.long_doc_pool < 0:
        raise ValueError("--long-doc-pool must be 0 (a new document each request) or more")
    FieldMixUser.order = interleaved(task_weights(parse_mix(options.mix), options.turns))


def _next_of_the_mix(tasks: TaskSet) -> None:
    """The next kind of this process's one sequence (``bench.field_mix.interleaved``), run
    by the user: the mix's proportions hold at any moment of the run. Locust's own pick, at
    random from a weighted list, drifted from the mix by several points a minute."""
    getattr(tasks.user, next(FieldMixUser.order))()


class InterleavedTasks(TaskSet):
    tasks = [_next_of_the_mix]  # noqa: RUF012 (locust declares it an instance variable)


class FieldMixUser(HttpUser):
    """One client of the field mix; see the module docstring."""

    wait_time = between(0.05, 0.5)
    # Shared by the users of this process: the data, the documents, the server's model card.
    _qa: ClassVar[list[QA]] = []
    _documents: ClassVar[DocumentCache] = DocumentCache(KEEP_DOCUMENTS)
    _long_docs: ClassVar[itertools.count[int]] = itertools.count()  # this process's, in order
    _tokenizers: ClassVar[dict[str, Any]] = {}
    _server: ClassVar[dict[str, Any]] = {}
    _users: ClassVar[int] = 0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        FieldMixUser._users += 1
        self.rng = random.Random((options.seed if options else 0) * 100_003 + FieldMixUser._users)
        self.max_tokens = options.max_tokens if options else 32
        self.turns = options.turns if options else 3
        self.invalid_timeout_s = options.invalid_timeout_s if options else 30.0
        if not FieldMixUser._qa:
            FieldMixUser._qa = load_qa()
        if not FieldMixUser._server:
            card = self.client.get("/v1/models", name="/v1/models").json()["data"][0]
            FieldMixUser._server = {"model": card["id"], "max_model_len": card["max_model_len"]}
        self.model = FieldMixUser._server["model"]
        long_tokens = options.long_tokens if options else 0
        self.long_tokens = long_tokens or self._longest_document()
        self.tokenizer_path = options.tokenizer if options else str(DEMO_TOKENIZER)
        self.seed = options.seed if options else 0
        self.long_doc_pool = options.long_doc_pool if options else 0
        # Worker processes of a distributed run count their documents apart.
        self.worker_index = max(0, getattr(self.environment.runner, "worker_index", 0) or 0)

    def _longest_document(self) -> int:
        """The document size that leaves room for the answer in the long group: its limit
        less max_tokens and what the chat template and the longest question add, as the
        gateway's /tokenize counts them (16 tokens of slack was less than the demo model's
        template and questions take, 26-44: every long document was a 400)."""
        counted = self.client.post(
            "/v1/long/tokenize", json={"messages": long_doc_probe(self._qa)},
            name="/v1/long/tokenize",
        )  # fmt: skip
        around = counted.json()["count"] if counted.status_code == 200 else 64
        return long_doc_tokens(FieldMixUser._server["max_model_len"], self.max_tokens, around)

    # --- the mix (task names are the field_mix.MIX keys) -----------------------------------

    def long_doc(self) -> None:
        """Long-document QA on the long group (its path: never the short group by length)."""
        # A new document each request unless --long-doc-pool: four shared ones made
        # long-context TTFT a prefix-cache hit, which the field's distinct documents are not.
        key = long_doc_key(self.long_doc_pool, self.rng, next(FieldMixUser._long_docs),
                           self.seed, self.worker_index)  # fmt: skip

        def make(key: str) -> str:
            return keyed_document(self._qa, self.long_tokens, self._tokenizer(), key)

        # Distinct documents are used once: kept, they would only grow the process.
        document = FieldMixUser._documents.get(key, make) if self.long_doc_pool else make(key)
        messages = long_doc_messages(document, self._qa, self.rng)
        self._chat("/v1/long/chat/completions", "long_doc", messages)

    def conversation(self) -> None:
        """Several turns; each resends the history, the model's answers included."""
        history: list[dict[str, str]] = []
        for turn, question in enumerate(conversation(self._qa, self.rng, self.turns)):
            history.append({"role": "user", "content": question})
            answer = self._chat("/v1/chat/completions", f"conversation turn {turn + 1}", history)
            if answer is None:
                return
            history.append({"role": "assistant", "content": answer})

    def short(self) -> None:
        self._chat("/v1/chat/completions", "short", short_prompt(self._qa, self.rng))

    def invalid(self) -> None:
        """A request the gateway must refuse with a 4xx."""
        kind = self.rng.choice(INVALID_KINDS)
        raw = invalid_request(kind, self.model, FieldMixUser._server["max_model_len"])
        headers = {"Content-Type": "application/json"}
        with self.client.post(
            raw.path, data=raw.body, headers=headers, name=f"invalid {kind}",
            catch_response=True, timeout=self.invalid_timeout_s,
        ) as resp:  # fmt: skip
            if 400 <= resp.status_code < 500:
                resp.success()
            elif resp.status_code == 0:
                resp.failure(f"no answer within {self.invalid_timeout_s:.0f}s: {resp.error}")
            else:
                resp.failure(f"{kind}: HTTP {resp.status_code} (want 4xx): {resp.text[:200]}")

    # The order of task kinds for the default 3 turns; _apply_mix makes it again from --mix
    # and --turns.
    order: ClassVar[Iterator[str]] = interleaved(task_weights(MIX, 3))
    tasks = [InterleavedTasks]  # noqa: RUF012 (as above)

    # --- streaming ---------------------------------------------------------------------------

    def _tokenizer(self) -> Any | None:
        """Loaded once per process: a document is made per request."""
        if not self.tokenizer_path or not Path(self.tokenizer_path, "tokenizer.json").is_file():
            return None
        if self.tokenizer_path not in FieldMixUser._tokenizers:
            from common.tokenizer import load_tokenizer

            FieldMixUser._tokenizers[self.tokenizer_path] = load_tokenizer(self.tokenizer_path)
        return FieldMixUser._tokenizers[self.tokenizer_path]

    def _chat(self, path: str, name: str, messages: list[dict[str, str]]) -> str | None:
        """Stream one chat completion; fire TTFT/ITL events; the text, or None on failure."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "stream": True,
            # The usage event tells an answer with no token (no TTFT) from one whose only
            # tokens came with its finish event (an EOS): see StreamClock.
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()  # a retried request's wait counts in its TTFT and E2E
        for attempt in range(RETRIES_ON_429 + 1):
            with self.client.post(
                path, json=body, name=name, stream=True, catch_response=True, timeout=(5, 120)
            ) as resp:
                if resp.status_code != 429 or attempt == RETRIES_ON_429:
                    return self._stream(resp, name, started)
                # Shed under overload: retried after Retry-After, as the openai client does;
                # a row of its own, so shedding shows without counting as a failure.
                wait = min(float(resp.headers.get("Retry-After") or 1), MAX_RETRY_WAIT_S)
                resp.request_meta["name"] = f"{name} (429, retried)"
                resp.success()
            time.sleep(wait)
        return None

    def _stream(self, resp: Any, name: str, started: float) -> str | None:
        """Read one streamed answer; fire TTFT/ITL events; its text, or None on failure.
        A failure goes to a row of its own (``<name> (failed)``): locust puts failed
        requests in their row's percentiles and rate, and a long document's final 429s
        (~2 s: two Retry-After waits) pulled its E2E p50 a second below its TTFT p50."""
        if resp.status_code != 200:
            resp.request_meta["name"] = f"{name} (failed)"
            resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return None
        text = None
        try:
            text = self._read_stream(resp, name, StreamClock(started))
            return text
        finally:
            # The row's time is the whole stream, also when it fails part-way (a broken 30 s
            # stream read ~20 ms).
            resp.request_meta["response_time"] = (time.perf_counter() - started) * 1e3
            if text is None:
                resp.request_meta["name"] = f"{name} (failed)"

    def _read_stream(self, resp: Any, name: str, clock: StreamClock) -> str | None:
        """:meth:`_stream`'s reading: events fired as ``clock`` times them, the text or None."""
        done = False
        try:
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    resp.failure(f"error event: {event['error']}")
                    return None
                for kind, ms in clock.feed(event, time.perf_counter()):
                    self._event(kind, name, ms)
        except Exception as exc:  # a broken stream is this request's failure, not a crash
            resp.failure(f"stream broke: {exc!r}")
            return None
        if not done:
            resp.failure("the stream ended without [DONE]")
            return None
        for kind, ms in clock.end(time.perf_counter()):
            self._event(kind, name, ms)
        resp.success()
        return clock.text

    def _event(self, kind: str, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=ms, response_length=0,
            exception=None, context={},
        )  # fmt: skip
