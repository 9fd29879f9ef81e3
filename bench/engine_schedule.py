"""The batching policies with no model: how many steps each needs, at what batch size.

Runs the real :class:`Batcher` and :class:`BlockPool` over a workload, every sampled token
arriving at once and each request finishing at its ``max_tokens``. If every step cost the
same, a policy's throughput would be inversely proportional to its step count, so the
ratio of step counts is the most a policy can gain over another on this workload with
this many batch slots and KV blocks; the real engine's ratio is that bound times how a
step's cost changes with its batch (bigger decode batches cost more; prefill steps differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engine.batcher import Batcher
from workers.engine.block_pool import BlockPool
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams


def count_steps(
    policy: str,
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    *,
    max_batch_size: int,
    max_num_batched_tokens: int,
    num_blocks: int,
    block_size: int,
    max_seq_len: int,
    watermark: float = 0.01,
) -> dict[str, Any]:
    """Steps, decode steps, mean decode batch and preemptions of ``policy`` on the workload."""
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=True, watermark=watermark)
    batcher = Batcher(pool, policy, max_batch_size, max_num_batched_tokens, max_wait_ms=0.0)
    for i, (prompt, n_out) in enumerate(zip(prompts, output_lens, strict=True)):
        batcher.add(
            Request(
                request_id=str(i),
                prompt_token_ids=list(prompt),
                params=SamplingParams(max_tokens=n_out, ignore_eos=True),
                arrival_time=float(i),
                max_total_tokens=min(len(prompt) + n_out, max_seq_len),
            )
        )
    steps = decode_steps = decode_rows = 0
    while batcher.has_unfinished():
        plan = batcher.schedule()
        if plan.is_empty:
            raise RuntimeError(f"{policy}: nothing schedulable with {num_blocks} blocks")
        batcher.commit(plan)
        steps += 1
        if plan.is_decode:
            decode_steps += 1
            decode_rows += len(plan.seqs)
        for seq, req in zip(plan.seqs, plan.requests, strict=True):
            if seq.sample:
                req.append_token(0)
                if req.num_tokens >= req.max_total_tokens:
                    batcher.finish(req, "length")
    return {
        "steps": steps,
        "decode_steps": decode_steps,
        "mean_decode_batch": round(decode_rows / decode_steps, 2) if decode_steps else 0,
        "preemptions": batcher.num_preemptions,
    }
