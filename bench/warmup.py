"""What a fresh replica's first requests cost with and without the engine's warm-up.

Each mode runs in a process of its own with an empty Triton cache (``TRITON_CACHE_DIR`` in
a new temporary folder), as a replica on a new node would: ``cold`` builds the engine with
``warmup=False``, ``warm`` with the warm-up (the CUDA default). Both then serve the same
first traffic: single prompts of several lengths one after another, then a burst that
joins requests already decoding, with seeded and greedy sampling, logprobs on some. Per
request the TTFT (from ``add_request`` to the step that returned its first token), and the
slowest step; for ``warm`` also what the warm-up took at start (build time includes it).

On CPU (torch kernels) nothing compiles and the two modes should match; the figure is for a
GPU (``bench/gpu_check.sh``, step ``bench_warmup``):

    python -m bench.warmup --model dummy:llama-1b --dtype bf16 --out warmup.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from bench.output import emit
from bench.provenance import git_state

# First traffic: (prompt length, seeded?) one at a time, then a burst of these lengths
# arriving while the first of them decode.
SINGLES = ((37, False), (5, True), (300, False), (1200, True), (90, False))
BURST = (12, 64, 200, 7, 512, 33, 130, 18)


def _serve(ns: argparse.Namespace, warmup: bool) -> dict[str, Any]:
    """In the child: build the engine, serve the first traffic, time it."""
    from workers.engine import EngineArgs, LLMEngine, SamplingParams

    args = EngineArgs(model=ns.model, dtype=ns.dtype, device=ns.device, policy=ns.policy,
                      max_batch_size=64, warmup=warmup)  # fmt: skip
    if ns.device == "cpu":  # no free-memory profile there: a cache the traffic fits
        args.num_kv_blocks = 2048
    started = time.perf_counter()
    engine = LLMEngine(args)
    build_s = time.perf_counter() - started
    vocab = engine.model_config.vocab_size
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    steps: list[float] = []

    def add(rid: str, n: int, seeded: bool, logprobs: bool) -> None:
        params = SamplingParams(
            temperature=0.8 if seeded else 0.0, seed=1 if seeded else None, max_tokens=8,
            ignore_eos=True, logprobs=2 if logprobs else None,
        )  # fmt: skip
        ids = [(zlib.crc32(rid.encode()) + 31 * k) % vocab for k in range(n)]  # same in both
        added[rid] = time.perf_counter()
        engine.add_request(rid, prompt_token_ids=ids, params=params)

    def step() -> None:
        t0 = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        steps.append(now - t0)
        for d in deltas:
            if d.token_ids and d.request_id not in ttft:
                ttft[d.request_id] = now - added[d.request_id]

    for i, (n, seeded) in enumerate(SINGLES):
        add(f"single-{i}", n, seeded, logprobs=i % 2 == 0)
        while engine.has_unfinished():
            step()
    for i, n in enumerate(BURST):
        add(f"burst-{i}", n, seeded=i % 2 == 1, logprobs=i % 3 == 0)
        step()  # the next one arrives while these run
    while engine.has_unfinished():
        step()
    report = engine.warmup
    return {
        "build_s": build_s,
        "warmup_s": report.seconds if report else 0.0,
        "warmup_steps": report.steps if report else 0,
        "warmup_prompt_lengths": list(report.prompt_lengths) if report else [],
        "ttft_ms": {rid: round(s * 1e3, 3) for rid, s in ttft.items()},
        "max_ttft_ms": round(max(ttft.values()) * 1e3, 3),
        "max_step_ms": round(max(steps) * 1e3, 3),
        "steps": len(steps),
    }


def _child(ns: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One mode in a fresh process with an empty Triton cache."""
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        argv = [sys.executable, "-m", "bench.warmup", "--child", mode, "--model", ns.model,
                "--dtype", ns.dtype, "--device", ns.device, "--policy", ns.policy]  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=ns.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warmup", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per mode")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        print(json.dumps(_serve(ns, warmup=ns.child == "warm")))
        return 0
    modes = {mode: _child(ns, mode) for mode in ("cold", "warm")}
    cold, warm = modes["cold"], modes["warm"]
    result = {
        "benchmark": "warmup",
        "args": {k: v for k, v in vars(ns).items() if k != "child" and k != "out"},
        "git": git_state(),
        "modes": modes,
        # What the first users gain, and what the start pays for it.
        "max_ttft_cold_over_warm": round(cold["max_ttft_ms"] / warm["max_ttft_ms"], 2),
        "build_s_added": round(warm["build_s"] - cold["build_s"], 2),
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
