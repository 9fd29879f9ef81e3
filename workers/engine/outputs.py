"""What the engine hands back: per-step deltas, final outputs, and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import Request

# stop_reason of a request ended with "error": the first part says why (the bridge answers
# a guided failure with a 400, the engine's own with a 500).
GUIDED_FAILED = "guided decoding failed"
ENGINE_FAILED = "the engine failed on this request"


@dataclass(frozen=True)
class RequestMetrics:
    """Times are ``time.time()`` seconds; ``first_token_time - arrival_time`` is the TTFT."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int
    num_preemptions: int
    kv_load_start: float | None = None  # the KV-tier load, for the trace's "kv load" phase
    kv_load_s: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @classmethod
    def of(cls, req: Request) -> RequestMetrics:
        """The request's times now."""
        return cls(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            kv_load_start=req.kv_load_start,
            kv_load_s=req.kv_load_s,
        )


@dataclass(frozen=True)
class RequestOutput:
    """A request's result. ``logprobs[i]`` is the logprob of ``token_ids[i]`` (when asked).

    ``prompt_logprobs[j]`` (``params.prompt_logprobs``) is the logprob of prompt token ``j``
    given those before it, with the top k there in ``prompt_top_logprobs[j]``; entry 0 is
    None. None when not asked, or when the request ended before its first token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    # "stop" | "length" | "abort" | "error" (its guided decoding failed, or the engine failed
    # on this request alone: stop_reason says which); None while running
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    metrics: RequestMetrics
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        """The final state of a request that has finished or been aborted (the engine drops
        it): its lists are handed over, not copied; a request of 2k prompt and 2k output
        tokens with 20 top logprobs each took 1.4 ms of the engine thread to copy."""
        asked = req.params.logprobs is not None
        return cls(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=req.output_text,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            cumulative_logprob=req.cumulative_logprob if asked else None,
            logprobs=req.logprobs if asked else None,
            top_logprobs=req.top_logprobs if asked else None,
            metrics=RequestMetrics.of(req),
            prompt_logprobs=req.prompt_logprobs,
            prompt_top_logprobs=req.prompt_top_logprobs,
        )


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to one request. ``output`` is set on the finishing delta only."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    output: RequestOutput | None = None
    num_output_tokens: int = 0  # tokens generated so far, these included
    # Set on the delta that carries the request's first token: its TTFT is known then.
    first_token_metrics: RequestMetrics | None = None
    # time.time() its tokens reached the host (0.0: not said): inter-token latency is the
    # engine's pace, not that of a loop that handles several steps' output at once.
    at: float = 0.0
    # Set, when asked, on the delta that carries the first token (see RequestOutput).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """Telemetry of one engine at one moment; counters are totals since start."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float
    fragmentation: float
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    num_tokens_computed: int
    kv_tier_queries: int = 0  # tokens asked of the KV tier (past the prefix-cache hit)
    kv_tier_hits: int = 0  # tokens loaded from it instead of computed
    # Of num_preemptions, those that let a more urgent waiting request in (hybrid).
    num_priority_preemptions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
