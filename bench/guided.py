"""What guided decoding costs the engine: output tok/s of one request set unguided and
guided, side by side in one run, and the host time of a row's mask.

The guided requests follow a regex no output of this length can complete
(``[a-z ]{1000}``), so both runs generate exactly ``--max-tokens`` per request and the
ratio is the price of the masks alone (on a GPU it also includes the lost overlap of
asynchronous output: a guided step is synchronous). The mask time is measured on the
model's tokenizer by stepping a JSON-schema matcher through an output it accepts.

    python -m bench.guided --out bench/results/cpu/guided.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.output import emit
from bench.provenance import git_state
from common.guided import GuidedSpec
from common.models import demo_model_path
from workers.engine import LLM, SamplingParams
from workers.engine.guided import packed_masks

NEVER_DONE = GuidedSpec("regex", "[a-z ]{1000}")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}


def throughput(
    llm: LLM, prompts: list[str], max_tokens: int, guided: GuidedSpec | None
) -> dict[str, Any]:
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, guided=guided
        )
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 1),
    }


def mask_us(llm: LLM, steps: int) -> dict[str, Any]:
    """Host microseconds of one row's mask, median over a JSON output's steps."""
    engine = llm.engine
    text = json.dumps({"name": "a" * 40, "tags": [f"tag number {i}" for i in range(steps)]})
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:steps]
    guide = engine.guide(GuidedSpec("json_schema", json.dumps(SCHEMA)))
    times = []
    for token in ids:
        t0 = time.perf_counter()
        packed_masks([guide])
        times.append(time.perf_counter() - t0)
        guide.consume(token)
    return {"vocab": engine.model_config.vocab_size, "steps": len(times),
            "median_us": round(statistics.median(times) * 1e6, 1),
            "p99_us": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e6, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.guided", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(demo_model_path()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    llm = LLM(ns.model, device=ns.device, max_batch_size=ns.requests)
    prompts = [f"def function_{i}(value):\n" for i in range(ns.requests)]
    throughput(llm, prompts[:2], 4, NEVER_DONE)  # warm: first compile and first steps
    plain = throughput(llm, prompts, ns.max_tokens, None)
    guided = throughput(llm, prompts, ns.max_tokens, NEVER_DONE)
    result = {
        "benchmark": "guided",
        "git": git_state(),
        "model": ns.model,
        "device": ns.device,
        "requests": ns.requests,
        "max_tokens": ns.max_tokens,
        "unguided": plain,
        "guided_regex": guided,
        "guided_over_unguided_tok_s": round(guided["output_tok_s"] / plain["output_tok_s"], 3),
        "mask": mask_us(llm, 256),
    }
    emit(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
