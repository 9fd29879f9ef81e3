"""Warm-up: run the step shapes a replica meets first before it takes any work.

Triton compiles a kernel the first time it meets a new variant: new ``constexpr`` values
(the prefill kernel's tile, chosen by the step's longest query) or a new specialisation of
an integer argument (Triton specialises on ``== 1`` and ``% 16 == 0``). Graph capture
compiles the decode kernels, and the KV-budget profile one long prefill; everything else
(short prefills, mixed decode + prefill steps, the sampling kernels) used to compile inside
the first users' requests: seconds of TTFT for them, and time on the worker's step
watchdog (``engine_stuck_s``). vLLM warms its compiled sizes the same way.

The warm-up goes through the engine's own step path, one prompt at a time so that each
step's longest query picks the tile being warmed, then a wave that mixes decodes with
prefills. Its requests use a salt of their own, the KV tier is detached while they run,
and afterwards the prefix cache and every counter are as a fresh engine's: a client can
neither hit nor time a warm-up block, and telemetry starts at zero.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.engine import LLMEngine

log = logging.getLogger(__name__)

# A salt per warm-up request: no two of them share a prefix block, so each computes the
# whole query it is meant to warm (the prefix cache is emptied afterwards anyway).
WARMUP_SALT = "qosserve-warm-up-"
# Each warm-up request decodes a few tokens: a decode after a prefill, and room for the
# mixed wave's newcomers to arrive while others decode.
WARMUP_OUTPUT_TOKENS = 3
# Sampling paths a request can take: greedy (argmax), seeded random (the Gumbel-max
# kernel), and the one with logprobs, penalties and top-k/top-p (sorts and scatters).
_GREEDY = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True)
WARMUP_SAMPLING = (
    _GREEDY,
    replace(_GREEDY, temperature=0.8, seed=0),
    replace(
        _GREEDY,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        logprobs=2,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
    ),
)


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up ran: its prompt lengths, steps, prompt tokens computed (every one:
    no warm-up request reuses another's blocks) and wall time."""

    prompt_lengths: tuple[int, ...]
    steps: int
    prompt_tokens: int
    seconds: float


def prompt_lengths(head_dim: int, group: int, dtype: torch.dtype, longest: int) -> tuple[int, ...]:
    """Prompt lengths up to ``longest`` that meet every prefill tile the kernel picks
    (:func:`default_prefill_config` by the step's longest query), each tile at its shortest
    query, and, where its range holds them, at a multiple of 16 and at a length that is
    neither that nor 1 (Triton's integer specialisations of the token count)."""
    # Here, not at the top: a CPU image has no Triton, and a torch engine never warms up.
    from workers.engine.kernels.prefill_attention import default_prefill_config

    def tile(n: int) -> object:
        return default_prefill_config(head_dim, group, n, dtype)

    # Query lengths [start, end] that share one tile, in order (the tile grows with n).
    ranges: list[tuple[int, int]] = []
    for n in range(1, longest + 1):
        if n == 1 or tile(n) != tile(n - 1):
            ranges.append((n, n))
        else:
            ranges[-1] = (ranges[-1][0], n)
    lengths: set[int] = set()
    for start, end in ranges:
        lengths.add(start)
        sixteen = -(-start // 16) * 16
        if sixteen <= end:
            lengths.add(sixteen)
        other = next((m for m in range(start, end + 1) if m != 1 and m % 16), None)
        if other is not None:
            lengths.add(other)
    return tuple(sorted(lengths))


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run the warm-up on ``engine`` (idle, freshly built) and leave it as it was."""
    if engine.has_unfinished() or engine.requests:
        raise RuntimeError("warm_up runs on an idle engine, before it takes requests")
    cfg = engine.model_config
    # A prompt must leave room for its output, and fit one step's token budget (a longer
    # one would be chunked, and its steps' queries be the budget, which is warmed anyway).
    longest = min(engine.max_seq_len - WARMUP_OUTPUT_TOKENS, engine.args.max_num_batched_tokens)
    if engine.backend == "triton":
        lengths = prompt_lengths(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads,
                                 engine.dtype, max(1, longest))  # fmt: skip
    else:  # torch kernels compile nothing: one short and one odd prompt run the paths
        lengths = tuple(sorted({1, min(17, max(1, longest))}))
    started = time.monotonic()
    steps = 0
    tier, evictions = engine.kv_tier, engine.pool.evictions
    engine.kv_tier = engine.batcher.kv_tier = None  # nothing of the warm-up reaches Redis
    engine.pool.evictions = None
    # Unseeded requests draw from torch's global generators, seeded by EngineArgs.seed:
    # the warm-up's draws must not move where the first client's start.
    cpu_rng = torch.get_rng_state()
    cuda = engine.device.type == "cuda"
    cuda_rng = torch.cuda.get_rng_state(engine.device) if cuda else None
    max_wait_s, engine.batcher.max_wait_s = engine.batcher.max_wait_s, 0.0  # dynamic: no wait
    try:
        # Alone: each step's longest query is this prompt's, so its tile compiles.
        for i, n in enumerate(lengths):
            _add(engine, f"alone-{i}", n, WARMUP_SAMPLING[i % len(WARMUP_SAMPLING)])
            steps += _run(engine)
        # Mixed: newcomers join requests that decode (continuous, hybrid), with every
        # sampling path in one batch.
        for i, params in enumerate(WARMUP_SAMPLING):
            _add(engine, f"mixed-{i}", lengths[min(i, len(lengths) - 1)], params)
            engine.step()
            steps += 1
        steps += _run(engine)
        if cuda:
            torch.cuda.synchronize(engine.device)
        computed = engine.num_prompt_tokens_computed
    finally:
        engine.kv_tier = engine.batcher.kv_tier = tier
        engine.pool.evictions = evictions
        engine.batcher.max_wait_s = max_wait_s
        for rid in list(engine.requests):  # only ours: it was idle (a step raised)
            engine.abort(rid)
        _run(engine)
        _forget(engine)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, engine.device)
    report = WarmupReport(lengths, steps, computed, time.monotonic() - started)
    log.info("warm-up: %d steps over prompts of %s tokens in %.2f s", report.steps,
             ", ".join(map(str, lengths)), report.seconds)  # fmt: skip
    return report


def _add(engine: LLMEngine, name: str, length: int, params: SamplingParams) -> None:
    vocab = engine.model_config.vocab_size
    ids = [(7 + 13 * k) % vocab for k in range(length)]
    engine.add_request(
        f"warm-up-{name}", prompt_token_ids=ids, params=params, cache_salt=WARMUP_SALT + name
    )


def _run(engine: LLMEngine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def _forget(engine: LLMEngine) -> None:
    """As a fresh engine: no named blocks, counters at zero."""
    pool, batcher = engine.pool, engine.batcher
    pool.reset_prefix_cache()
    pool.prefix_queries = pool.prefix_hits = 0
    batcher.num_preemptions = batcher.num_priority_preemptions = 0
    batcher.tier_query_tokens = batcher.tier_hit_tokens = 0
    engine.num_steps = 0
    engine.num_prompt_tokens_computed = engine.num_generation_tokens = 0
    engine.num_tokens_computed = 0
    engine.last_step_num_tokens = engine.last_step_num_seqs = 0
