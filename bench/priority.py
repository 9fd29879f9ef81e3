"""Urgent requests into a full engine, with and without priority preemption, side by side.

A ``hybrid`` engine is kept full by background requests of low priority (a closed loop:
each one that finishes is replaced at once, so every slot stays taken; their output
lengths are drawn uniformly up to twice ``--background-tokens``, so they finish spread out,
as a served group's do: equal lengths finished together and made the wait for a free slot
the wait for a whole generation), while urgent requests arrive on a fixed schedule.
Without priority preemption an urgent arrival waits for a background request to finish;
with it, it takes the tokens, slot or blocks it needs from less urgent ones at once.

Runs alternate off, on, on, off (``--rounds`` pairs), each on a fresh engine with the same
prompts, lengths and arrival times. Reported per run and per mode: the urgent requests'
TTFT and E2E from their due time (p50, p90, max), the background's output tokens per step
and per second over the same window, the steps, positions computed and preemptions; then
the ratios of the modes' means (off / on for urgent latency, on / off for the background:
what the urgent ones cost the rest). Per step is the sturdier cost figure on a shared host,
where the seconds move between runs.

    python -m bench.priority --out bench/results/cpu/priority.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.output import emit
from bench.percentiles import p50_p90_max
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
        device=ns.device,
        seed=ns.seed,
    )
    engine = LLMEngine(args)
    vocab = engine.model_config.vocab_size
    rng = random.Random(ns.seed)  # the same prompts and lengths in every run
    urgent = SamplingParams(temperature=0.0, max_tokens=ns.urgent_tokens, ignore_eos=True)
    urgent_prompts = [_prompt(rng, ns.urgent_prompt, vocab) for _ in range(ns.urgent)]
    backgrounds = [
        (_prompt(rng, ns.background_prompt, vocab), rng.randint(1, 2 * ns.background_tokens))
        for _ in range(4 * ns.max_batch + ns.urgent)
    ]
    n_background = 0

    def add_background() -> None:
        nonlocal n_background
        prompt, length = backgrounds[n_background % len(backgrounds)]
        n_background += 1
        params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
        engine.add_request(f"bg-{n_background}", params=params, priority=BACKGROUND_PRIORITY,
                           prompt_token_ids=prompt)  # fmt: skip

    for _ in range(ns.max_batch):
        add_background()
    # Until every slot decodes: the urgent ones meet a full engine, not one still filling.
    while engine.stats().num_running < ns.max_batch or any(
        r.is_prefilling for r in engine.batcher.running
    ):
        for d in engine.step():
            if d.finished:
                add_background()
    start = time.perf_counter()
    due = [start + ns.warmup_s + i * ns.urgent_every_s for i in range(ns.urgent)]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    added = 0
    background_tokens = 0
    before = None  # the engine's counters at the first arrival: one window for every figure
    while len(done) < ns.urgent:
        now = time.perf_counter()
        while added < ns.urgent and due[added] <= now:
            if before is None:
                before = engine.stats()
            engine.add_request(f"urgent-{added}", params=urgent, priority=URGENT_PRIORITY,
                               prompt_token_ids=urgent_prompts[added])  # fmt: skip
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[added] - now))
            continue
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.request_id.startswith("urgent-"):
                i = int(d.request_id.removeprefix("urgent-"))
                if d.token_ids and i not in first:
                    first[i] = now
                if d.finished:
                    done[i] = now
            else:
                if before is not None:
                    background_tokens += len(d.token_ids)
                if d.finished:
                    add_background()
    assert before is not None
    stats = engine.stats()
    window = max(done.values()) - due[0]
    steps = stats.num_steps - before.num_steps
    # From each one's due time: one that fell due during a step waited for it too.
    ttft = sorted((first[i] - due[i]) * 1e3 for i in range(ns.urgent))
    e2e = sorted((done[i] - due[i]) * 1e3 for i in range(ns.urgent))
    return {
        "priority_preemption": preemption,
        "urgent": ns.urgent,
        "urgent_ttft_ms": p50_p90_max(ttft),
        "urgent_e2e_ms": p50_p90_max(e2e),
        "background_tokens_per_step": round(background_tokens / max(1, steps), 3),
        "background_tok_s": round(background_tokens / window, 1),
        "window_s": round(window, 2),
        "steps": steps,
        "step_ms": round(window / max(1, steps) * 1e3, 2),
        # Positions computed in the window: a token per decode, plus prompts (the urgent
        # ones', and what victims recompute past their prefix-cache hits).
        "tokens_computed": stats.num_tokens_computed - before.num_tokens_computed,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "priority_preemptions": stats.num_priority_preemptions,
    }


def _mean(runs: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for r in runs:
        value: Any = r
        for key in keys:
            value = value[key]
        values.append(float(value))
    return statistics.fmean(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(demo_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--background-prompt", type=int, default=128)
    p.add_argument("--background-tokens", type=int, default=384, help="mean output length")
    p.add_argument("--urgent", type=int, default=40)
    p.add_argument("--urgent-prompt", type=int, default=32)
    p.add_argument("--urgent-tokens", type=int, default=16)
    p.add_argument("--urgent-every-s", type=float, default=0.25)
    p.add_argument("--warmup-s", type=float, default=0.5, help="before the first urgent one")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs: off, on, on, off, …")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    order = [False, True, True, False] * ((ns.rounds + 1) // 2)
    runs = [run(ns, preemption=on) for on in order[: 2 * ns.rounds]]
    off = [r for r in runs if not r["priority_preemption"]]
    on = [r for r in runs if r["priority_preemption"]]

    def ratio(a: list[dict[str, Any]], b: list[dict[str, Any]], *keys: str) -> float:
        den = _mean(b, *keys)
        return round(_mean(a, *keys) / den, 2) if den else float("nan")

    result = {
        "benchmark": "priority",
        "git": git_state(),
        "args": {k: v for k, v in vars(ns).items() if k != "out"},
        "runs": runs,
        "ratios": {
            "urgent_ttft_p50_off_over_on": ratio(off, on, "urgent_ttft_ms", "p50"),
            "urgent_ttft_p90_off_over_on": ratio(off, on, "urgent_ttft_ms", "p90"),
            "urgent_e2e_p90_off_over_on": ratio(off, on, "urgent_e2e_ms", "p90"),
            "background_tokens_per_step_on_over_off": ratio(on, off, "background_tokens_per_step"),
            "background_tok_s_on_over_off": ratio(on, off, "background_tok_s"),
        },
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
