"""What a step that is not a CUDA-graph replay costs, and where: host or device.

On the H200 a prefill step of one 600-token prompt on ``dummy:llama-1b`` took ~10 ms
whatever its size, where its arithmetic is ~1-2 ms (``bench/results/gpu/README.md``), and a
reading of the code put it on the host: ~96 Triton launches and ~260 torch calls per step.
This measures it. For each prompt length, one request is added to an idle engine and its
prefill step is timed (median of ``--repeats``): wall time of the forward (``execute``,
synchronised), the device's time for it (CUDA events), kernels launched per step, and the
host's costliest calls (``torch.profiler`` over one step). Wall far above device time with
kernels in the hundreds says: launch-bound, graphs are the fix.

    python -m bench.eager_step --model dummy:llama-1b --dtype bf16 --out eager_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from workers.engine import EngineArgs, LLMEngine, SamplingParams


def _engine(ns: argparse.Namespace) -> LLMEngine:
    over: dict[str, Any] = {}
    if ns.device == "cpu" or (ns.device == "auto" and not torch.cuda.is_available()):
        over["num_kv_blocks"] = 1024
    args = EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, policy="continuous",
        max_batch_size=8, max_seq_len=max(ns.lengths) + 16,
        enable_prefix_caching=False,  # every sample is the same prompt: all of it computed
        **over,
    )  # fmt: skip
    return LLMEngine(args)


def _prefill_once(engine: LLMEngine, n: int, tag: str) -> tuple[float, float]:
    """Add one ``n``-token prompt; run its prefill step; (wall ms, device ms) of its forward."""
    cuda = engine.device.type == "cuda"
    timed: dict[str, float] = {}
    execute = engine.runner.execute

    def measured(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = execute(*args, **kwargs)
        timed["launch"] = time.perf_counter() - t0
        if cuda:
            end.record()
            torch.cuda.synchronize()
            timed["device"] = start.elapsed_time(end) / 1e3
        timed["wall"] = time.perf_counter() - t0
        return out

    engine.runner.execute = measured  # type: ignore[method-assign]
    try:
        engine.add_request(tag, prompt_token_ids=[7] * n, params=SamplingParams(max_tokens=1))
        engine.step()
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    return timed["wall"] * 1e3, timed.get("device", float("nan")) * 1e3


def _profile(engine: LLMEngine, n: int) -> dict[str, Any]:
    """Kernels launched by one prefill step, and the host's costliest calls in it."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _prefill_once(engine, n, "profiled")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "kernels": len(kernels),
        "host_top": [
            {
                "name": e.key[:80],
                "calls": e.count,
                "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            }
            for e in top
        ],
    }


def run(ns: argparse.Namespace) -> dict[str, Any]:
    engine = _engine(ns)
    for n in ns.lengths:  # compile every kernel variant first: compiles are not the question
        _prefill_once(engine, n, f"warm-{n}")
    rows = []
    for n in ns.lengths:
        samples = [_prefill_once(engine, n, f"p{n}-{i}") for i in range(ns.repeats)]
        wall = statistics.median(s[0] for s in samples)
        device = statistics.median(s[1] for s in samples)
        rows.append(
            {
                "prompt_tokens": n,
                "forward_wall_ms": round(wall, 3),
                "forward_device_ms": round(device, 3),
                **_profile(engine, n),
            }
        )
        print(f"{n:6d} tokens: forward {wall:.2f} ms wall, {device:.2f} ms device", file=sys.stderr)
    return {
        "benchmark": "eager_step",
        "model": ns.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "backend": engine.backend,
        "torch": torch.__version__,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 600, 2048])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="write the JSON here too")
    ns = p.parse_args(argv)
    doc = run(ns)
    text = json.dumps(doc, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
