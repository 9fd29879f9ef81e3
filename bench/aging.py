"""Less urgent requests under a steady stream of urgent ones, strict priority vs aging.

A ``hybrid`` engine is kept busy by urgent requests in a closed loop that always leaves
some waiting (each one that finishes is replaced at once, arriving then), while less
urgent requests arrive on a fixed schedule. Under strict priority (``priority_aging_s``
0, vLLM's) the less urgent ones wait for as long as the urgent stream lasts; aged, one
goes ahead of urgent arrivals ``levels x priority_aging_s`` seconds younger than it.

Runs alternate strict, aged, aged, strict (``--rounds`` pairs), each on a fresh engine
with the same prompts and schedule, for ``--duration-s`` after the first less urgent
arrival. Reported per run: how many less urgent requests got their first token within
the window and their TTFT from arrival (one never served counts as the whole window: a
floor), the urgent ones' TTFT and output tokens per second (what aging costs them).

    python -m bench.aging --out bench/results/cpu/aging.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.output import emit
from bench.percentiles import p50_p90_max
from bench.provenance import git_state
from common.models import demo_model_path
from workers.engine import EngineArgs, LLMEngine, SamplingParams

URGENT_PRIORITY = 0


def run(ns: argparse.Namespace, aging_s: float) -> dict[str, Any]:
    """One engine, the urgent loop, the less urgent arrivals; ``aging_s`` 0 is strict."""
    engine = LLMEngine(
        EngineArgs(
            model=ns.model, policy="hybrid", max_batch_size=ns.max_batch,
            max_num_batched_tokens=ns.token_budget, priority_aging_s=aging_s, dtype=ns.dtype,
            device=ns.device, seed=ns.seed,
        )
    )  # fmt: skip
    vocab = engine.model_config.vocab_size
    rng = random.Random(ns.seed)  # the same prompts and lengths in every run

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    urgent_work = [(prompt(ns.prompt), rng.randint(1, 2 * ns.urgent_tokens)) for _ in range(64)]
    low_prompts = [prompt(ns.prompt) for _ in range(ns.low)]
    low_params = SamplingParams(temperature=0.0, max_tokens=ns.low_tokens, ignore_eos=True)
    n_urgent = 0
    urgent_added: dict[str, float] = {}
    urgent_first: dict[str, float] = {}
    urgent_tokens = 0

    def add_urgent() -> None:
        nonlocal n_urgent
        ids, length = urgent_work[n_urgent % len(urgent_work)]
        rid = f"urgent-{n_urgent}"
        n_urgent += 1
        params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
        engine.add_request(rid, params=params, priority=URGENT_PRIORITY, prompt_token_ids=ids)
        urgent_added[rid] = time.perf_counter()

    for _ in range(ns.max_batch + ns.urgent_waiting):
        add_urgent()
    start = time.perf_counter()
    due = [start + i * ns.low_every_s for i in range(ns.low)]
    end = start + ns.duration_s
    low_first: dict[int, float] = {}
    added = 0
    while (now := time.perf_counter()) < end:
        while added < ns.low and due[added] <= now:
            engine.add_request(f"low-{added}", params=low_params, priority=ns.low_priority,
                               prompt_token_ids=low_prompts[added])  # fmt: skip
            added += 1
        for d in engine.step():
            t = time.perf_counter()
            if d.request_id.startswith("low-"):
                i = int(d.request_id.removeprefix("low-"))
                if d.token_ids and i not in low_first:
                    low_first[i] = t
                continue
            urgent_tokens += len(d.token_ids)
            if d.token_ids and d.request_id not in urgent_first:
                urgent_first[d.request_id] = t
            if d.finished:
                add_urgent()
    window = time.perf_counter() - start
    # A less urgent request never served waited at least until the window closed.
    low_ttft = sorted(
        ((low_first[i] if i in low_first else start + window) - due[i]) * 1e3 for i in range(added)
    )
    urgent_ttft = sorted(
        (urgent_first[r] - urgent_added[r]) * 1e3 for r in urgent_first if r in urgent_added
    )
    return {
        "priority_aging_s": aging_s,
        "low_arrived": added,
        "low_served": len(low_first),
        "low_ttft_ms": p50_p90_max(low_ttft),
        "low_ttft_is_a_floor": len(low_first) < added,
        "urgent_ttft_ms": p50_p90_max(urgent_ttft),
        "urgent_tok_s": round(urgent_tokens / window, 1),
        "window_s": round(window, 2),
        "preemptions": engine.stats().num_preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aging", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(demo_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--urgent-tokens", type=int, default=24, help="urgent mean output length")
    p.add_argument("--urgent-waiting", type=int, default=4, help="urgent ones kept queued")
    p.add_argument("--low", type=int, default=8, help="less urgent requests")
    p.add_argument("--low-priority", type=int, default=1)
    p.add_argument("--low-tokens", type=int, default=8)
    p.add_argument("--low-every-s", type=float, default=1.0)
    p.add_argument("--aging-s", type=float, default=2.0, help="the aged runs' priority_aging_s")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=1, help="pairs: strict, aged, aged, strict, …")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    if ns.low * ns.low_every_s >= ns.duration_s:
        p.error("--low x --low-every-s must end before --duration-s")
    order = [0.0, ns.aging_s, ns.aging_s, 0.0] * ((ns.rounds + 1) // 2)
    runs = []
    for aging_s in order[: 2 * ns.rounds]:
        print(f"run: priority_aging_s={aging_s:g} for {ns.duration_s:g} s", file=sys.stderr)
        runs.append(run(ns, aging_s))
    result = {
        "benchmark": "aging",
        "git": git_state(),
        "args": {k: v for k, v in vars(ns).items() if k != "out"},
        "runs": runs,
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
