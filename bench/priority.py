"""Urgent requests into a full engine, with and without priority preemption, side by side.

A ``hybrid`` engine is kept full by background requests of low priority (a closed loop:
each one that finishes is replaced at once, so every slot stays taken), while urgent
requests arrive on a fixed schedule. Without priority preemption an urgent arrival waits
for a background request to finish, up to a whole background generation; with it, it
preempts the least urgent and newest one and starts at the next step. Both runs take the
same prompts and arrival times, each on a fresh engine; reported per run: the urgent
requests' TTFT and E2E (p50/p99), the background's output tok/s over the same window, the
preemptions; then the ratios (off / on for the urgent latencies, on / off for the
background throughput: what the urgent ones cost the rest).

    python -m bench.priority --out bench/results/cpu/priority.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.output import emit
from bench.percentiles import pct
from bench.provenance import git_state
from common.models import demo_model_path
from workers.engine import EngineArgs, LLMEngine, SamplingParams

BACKGROUND_PRIORITY, URGENT_PRIORITY = 10, 0


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def run(ns: argparse.Namespace, preemption: bool) -> dict[str, Any]:
    """One engine, full of background requests, taking the urgent ones on schedule."""
    args = EngineArgs(
        model=ns.model,
        policy="hybrid",
        max_batch_size=ns.max_batch,
        max_num_batched_tokens=ns.token_budget,
        priority_preemption=preemption,
        dtype=ns.dtype,
        device="cpu" if ns.device == "cpu" else ns.device,
        seed=ns.seed,
    )
    engine = LLMEngine(args)
    vocab = engine.model_config.vocab_size
    rng = random.Random(ns.seed)  # the same prompts in both runs
    background = SamplingParams(temperature=0.0, max_tokens=ns.background_tokens, ignore_eos=True)
    urgent = SamplingParams(temperature=0.0, max_tokens=ns.urgent_tokens, ignore_eos=True)
    urgent_prompts = [_prompt(rng, ns.urgent_prompt, vocab) for _ in range(ns.urgent)]
    n_background = 0

    def add_background() -> None:
        nonlocal n_background
        n_background += 1
        engine.add_request(f"bg-{n_background}", params=background, priority=BACKGROUND_PRIORITY,
                           prompt_token_ids=_prompt(rng, ns.background_prompt, vocab))  # fmt: skip

    for _ in range(ns.max_batch):
        add_background()
    # Until every slot decodes: the urgent ones meet a full engine, not one still filling.
    while engine.stats().num_running < ns.max_batch or any(
        r.is_prefilling for r in engine.batcher.running
    ):
        engine.step()
    start = time.perf_counter()
    due = [start + ns.warmup_s + i * ns.urgent_every_s for i in range(ns.urgent)]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    background_tokens = 0
    before = engine.stats()
    steps_before = before.num_steps
    while len(done) < ns.urgent:
        now = time.perf_counter()
        while len(added) < ns.urgent and due[len(added)] <= now:
            rid = f"urgent-{len(added)}"
            engine.add_request(rid, params=urgent, priority=URGENT_PRIORITY,
                               prompt_token_ids=urgent_prompts[len(added)])  # fmt: skip
            added[rid] = now
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[len(added)] - now))
            continue
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.request_id.startswith("urgent-"):
                if d.token_ids and d.request_id not in first:
                    first[d.request_id] = now
                if d.finished:
                    done[d.request_id] = now
            else:
                if added:  # counted from the first urgent arrival on
                    background_tokens += len(d.token_ids)
                if d.finished:
                    add_background()
    window = max(done.values()) - min(added.values())
    ttft = sorted((first[r] - added[r]) * 1e3 for r in added)
    e2e = sorted((done[r] - added[r]) * 1e3 for r in added)
    stats = engine.stats()
    return {
        "priority_preemption": preemption,
        "urgent": len(added),
        "urgent_ttft_ms": _percentiles(ttft) | {"max": round(ttft[-1], 1)},
        "urgent_e2e_ms": _percentiles(e2e),
        "background_tok_s": round(background_tokens / window, 1),
        "window_s": round(window, 2),
        "steps": stats.num_steps - steps_before,
        # Positions computed in the window: a token per decode, plus prompts (the urgent
        # ones', and what victims recompute past their prefix-cache hits).
        "tokens_computed": stats.num_tokens_computed - before.num_tokens_computed,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "priority_preemptions": stats.num_priority_preemptions,
    }


def _percentiles(sorted_ms: list[float]) -> dict[str, float]:
    return {"p50": round(pct(sorted_ms, 50), 1), "p99": round(pct(sorted_ms, 99), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(demo_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--background-prompt", type=int, default=128)
    p.add_argument("--background-tokens", type=int, default=384)
    p.add_argument("--urgent", type=int, default=20)
    p.add_argument("--urgent-prompt", type=int, default=32)
    p.add_argument("--urgent-tokens", type=int, default=16)
    p.add_argument("--urgent-every-s", type=float, default=0.5)
    p.add_argument("--warmup-s", type=float, default=0.5, help="before the first urgent one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    off, on = run(ns, preemption=False), run(ns, preemption=True)

    def ratio(a: dict[str, Any], b: dict[str, Any], *keys: str) -> float:
        for key in keys:
            a, b = a[key], b[key]
        return round(a / b, 2) if b else float("nan")  # type: ignore[operator]

    result = {
        "benchmark": "priority",
        "git": git_state(),
        "args": {k: v for k, v in vars(ns).items() if k != "out"},
        "runs": [off, on],
        "ratios": {
            "urgent_ttft_p50_off_over_on": ratio(off, on, "urgent_ttft_ms", "p50"),
            "urgent_ttft_p99_off_over_on": ratio(off, on, "urgent_ttft_ms", "p99"),
            "urgent_e2e_p99_off_over_on": ratio(off, on, "urgent_e2e_ms", "p99"),
            "background_tok_s_on_over_off": ratio(on, off, "background_tok_s"),
        },
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
