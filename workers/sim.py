"""SimEngine: the engine's step API without a model, for testing and measuring the serving path.

It behaves like :class:`~workers.engine.engine.LLMEngine` as the worker service sees it
(``add_request`` / ``abort`` / ``step`` / ``has_unfinished`` / ``stats``, a batch cap, a
``tokenizer`` and ``max_seq_len``) and spends, in each ``step``, the time a cost model says
a real step would take:

    step_s = base_s + prefill_s_per_token × prefill tokens + decode_s_per_seq × decoding seqs

The defaults are fitted to ``dummy:llama-1b`` bf16 with CUDA graphs on one H200
(``bench/results/gpu``, 2026-11-30, the engine's policy runs with ``--phases``): decode
steps of 36-86 sequences at contexts of ~600-1,000 tokens took 0.87 ms + 34 µs a sequence
(least squares over the policies' mean step times, residuals within 0.5 ms), prefill steps
of ~1,100-1,650 prompt tokens ~9 µs a token. Longer contexts make a decoding sequence
dearer. For other hardware run ``bench/engine.py --phases`` there and pass the fit with
``--sim-base-ms`` / ``--sim-prefill-us-per-token`` / ``--sim-decode-us-per-seq``. Zero
costs make steps free, which measures the message plane.

Continuous batching: each step admits waiting requests (lower ``priority`` first, then
oldest) while the batch cap, the token budget and the simulated KV blocks allow; an admitted
request prefills its whole prompt and samples its first token in that step, and every other
running request decodes one token. KV blocks are reserved for prompt + ``max_tokens`` at
admission, so the simulation never preempts.

Tokens are deterministic: the token at absolute position ``p`` (prompt included) of a request
with seed ``s`` is :func:`sim_token` ``(s, p)``. A request resumed from prompt + the tokens
a client already has therefore continues exactly where the first attempt left off.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequestError
from workers.engine.admission_checks import check_logit_bias, checked_prompt_ids
from workers.engine.outputs import EngineStats, RequestDelta, RequestMetrics, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.stopping import primary_eos, settle_token

_MASK64 = (1 << 64) - 1


def sim_token(seed: int, position: int, vocab_size: int = 32000) -> int:
    """The simulated token at absolute ``position`` for ``seed`` (splitmix64 of both)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % vocab_size


@dataclass
class SimCost:
    """Seconds one step costs; see the module docstring for the formula."""

    base_s: float = 0.00087
    prefill_s_per_token: float = 0.000009
    decode_s_per_seq: float = 0.000034

    def step_s(self, prefill_tokens: int, decoding_seqs: int) -> float:
        return (
            self.base_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decoding_seqs
        )


@dataclass(eq=False)
class _SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    prompt: str | None
    max_total_tokens: int
    seed: int
    blocks: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    detokenizer: Any = None
    stop_matcher: Any = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Token ids its logit_bias bans (-100): the sim draws without logits to add a bias to.
    banned: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=self.output_text,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=None,
            logprobs=None,
            top_logprobs=None,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_scheduled_time=self.first_scheduled_time,
                first_token_time=self.first_token_time,
                finish_time=self.finish_time,
                num_cached_tokens=0,
                num_preemptions=0,
            ),
        )


class SimEngine:
    """A model-free engine with LLMEngine's step API; one thread owns it (not thread-safe).

    ``tokenizer`` (a :class:`common.tokenizer.BaseTokenizer`) is optional: without one a
    text prompt counts as its UTF-8 bytes and outputs carry no text.
    """

    def __init__(
        self,
        *,
        max_batch_size: int = 16,
        max_seq_len: int = 4096,
        cost: SimCost | None = None,
        tokenizer: Any | None = None,
        vocab_size: int = 32000,
        eos_token_ids: frozenset[int] | None = None,
        num_kv_blocks: int = 8192,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        sleep: Any = time.sleep,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 2 or num_kv_blocks < 1 or block_size < 1:
            raise ValueError("SimEngine: sizes must be positive (max_seq_len >= 2)")
        self.max_batch_size = max_batch_size
        self._engine_max_batch = max_batch_size
        self.max_seq_len = max_seq_len
        self.cost = cost if cost is not None else SimCost()
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else vocab_size
        if eos_token_ids is None:
            eos = tokenizer.eos_token_id if tokenizer is not None else None
            eos_token_ids = frozenset() if eos is None else frozenset({eos})
        self.eos_token_ids = eos_token_ids
        self.primary_eos = primary_eos(tokenizer)
        self.num_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority_aging_s = 0.0  # the group's (apply_group_scheduling)
        self.slowdown_s = 0.0
        self._sleep = sleep
        self._free_blocks = num_kv_blocks
        self.waiting: deque[_SimRequest] = deque()
        self.running: list[_SimRequest] = []
        self.requests: dict[str, _SimRequest] = {}
        self._pending: list[RequestDelta] = []
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.prefix_cache_queries = 0

    # --- knobs ---------------------------------------------------------------------------

    def set_max_batch_size(self, cap: int) -> None:
        """Cap the running batch (at most the size the engine was built with)."""
        self.max_batch_size = max(1, min(cap, self._engine_max_batch))

    def set_slowdown(self, seconds: float) -> None:
        """Add ``seconds`` to every step from now on (0 removes it): provokes SLO breaches."""
        self.slowdown_s = max(0.0, float(seconds))

    def running_ids(self) -> list[str]:
        return [r.request_id for r in self.running]

    def encode(self, prompt: str) -> list[int]:
        """A text prompt's token ids: the tokenizer's, else its UTF-8 bytes."""
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(prompt))
        return list(prompt.encode())

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resumed_tokens: int = 0,
        delivered_text_len: int = 0,
        cache_salt: str = "",  # no prefix cache here to salt
    ) -> None:
        """Queue a request; raises and resumes like :meth:`LLMEngine.add_request`."""
        params = params if params is not None else SamplingParams()
        ids = checked_prompt_ids(
            request_id, self.requests, prompt, prompt_token_ids, self.encode, self.max_seq_len,
            self.vocab_size,
        )  # fmt: skip
        check_logit_bias(params.logit_bias, self.vocab_size)
        if params.stop and self.tokenizer is None:  # as the engine: silently ignored, else
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        if params.guided is not None:  # its tokens are a script, not a model's to mask
            raise InvalidRequestError("the simulated engine does no guided decoding",
                                      param="guided")  # fmt: skip
        req = _SimRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt,
            max_total_tokens=min(len(ids) + params.max_tokens, self.max_seq_len),
            seed=params.seed if params.seed is not None else 0,
            banned=frozenset(t for t, b in (params.logit_bias or {}).items() if b <= -100),
        )
        if self.tokenizer is not None:
            from common.detokenizer import attach_text_state

            attach_text_state(
                req, self.tokenizer, ids, params,
                resumed_tokens=resumed_tokens, delivered_text_len=delivered_text_len,
            )  # fmt: skip
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next ``step`` reports ``abort``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort", time.time())
        self._pending.append(
            RequestDelta(
                request_id, [], "", finished=True, finish_reason="abort",
                output=req.output(), num_output_tokens=len(req.output_token_ids),
            )
        )  # fmt: skip
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    # --- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One simulated forward pass: sleeps for the cost model's time, returns deltas."""
        deltas, self._pending = self._pending, []
        decoding = list(self.running)
        admitted = self._admit()
        if not decoding and not admitted:
            return deltas
        prefill_tokens = sum(len(r.prompt_token_ids) for r in admitted)
        seconds = self.cost.step_s(prefill_tokens, len(decoding)) + self.slowdown_s
        if seconds > 0:
            self._sleep(seconds)
        self.num_steps += 1
        self.num_prompt_tokens_computed += prefill_tokens
        now = time.time()
        for req in decoding + admitted:
            deltas.append(self._emit(req, now))
        return deltas

    def _admit(self) -> list[_SimRequest]:
        admitted: list[_SimRequest] = []
        budget = self.max_num_batched_tokens
        aging = self.priority_aging_s  # as the engine's Request.urgency
        ordered = sorted(
            self.waiting,
            key=lambda r: (r.priority + (r.arrival_time / aging if aging > 0 else 0.0),
                           r.arrival_time),
        )  # fmt: skip
        for req in ordered:
            need = -(-req.max_total_tokens // self.block_size)
            n_prompt = len(req.prompt_token_ids)
            if len(self.running) >= self.max_batch_size or need > self._free_blocks:
                break
            if admitted and n_prompt > budget:  # the first one always fits: no starvation
                break
            self.waiting.remove(req)
            self._free_blocks -= need
            req.blocks = need
            req.first_scheduled_time = time.time()
            self.prefix_cache_queries += n_prompt
            self.running.append(req)
            admitted.append(req)
            budget -= n_prompt
        return admitted

    def _emit(self, req: _SimRequest, now: float) -> RequestDelta:
        token = sim_token(req.seed, req.num_tokens, self.vocab_size)
        params = req.params
        # Drawn without logits, the sim honours only the bans of logit_bias (-100), as it
        # honours min_tokens: no EOS or stop id before them (another draw instead).
        banned = req.banned
        if len(req.output_token_ids) < params.min_tokens:
            banned = banned | self.eos_token_ids | set(params.stop_token_ids)
        if banned:
            redraw = 0
            while token in banned and redraw < 16:
                redraw += 1
                token = sim_token(req.seed + redraw, req.num_tokens, self.vocab_size)
            if token in banned:  # a vocabulary of mostly banned ids: the next allowed one
                allowed = (i % self.vocab_size for i in range(token, token + self.vocab_size))
                token = next((i for i in allowed if i not in banned), token)
        req.output_token_ids.append(token)
        self.num_generation_tokens += 1
        first = req.first_token_time is None
        if first:
            req.first_token_time = now
        at_limit = (
            len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= req.max_total_tokens
        )
        text, reason = settle_token(
            req, token, self.eos_token_ids, at_limit, primary_eos=self.primary_eos
        )
        req.output_text += text
        if reason is not None:
            self._finish(req, reason, now)
        return RequestDelta(
            request_id=req.request_id,
            token_ids=[token],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            output=req.output() if reason is not None else None,
            num_output_tokens=len(req.output_token_ids),
            first_token_metrics=req.output().metrics if first else None,
            at=now,
        )

    def _finish(self, req: _SimRequest, reason: str, now: float) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_blocks += req.blocks
        req.blocks = 0
        req.finish_reason = reason
        req.finish_time = now
        self.requests.pop(req.request_id, None)

    # --- telemetry -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        used = self.num_blocks - self._free_blocks
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=self.num_blocks,
            num_free_blocks=self._free_blocks,
            kv_usage=used / self.num_blocks,
            fragmentation=0.0,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=0,
            num_preemptions=0,
            num_steps=self.num_steps,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_tokens_computed=self.num_prompt_tokens_computed + self.num_generation_tokens,
        )
