"""Golden-set evaluation of the *served* stack: exact match and ROUGE-L against references.

Every prompt of ``bench/data/golden.jsonl`` (``bench/make_golden.py``) goes through a real
stack — gateway, NATS, a real-engine worker of the ``short`` group — greedy
(``temperature 0``), ``--concurrency`` at a time so the engine batches them, once per
batching policy (and per KV-cache dtype of ``--kv-dtypes``). The answers are scored against
the references, which Hugging Face ``transformers`` produced greedily on the same
checkpoint: exact match (EM) and ROUGE-L F1 (:mod:`bench.rouge`), overall, clean vs
adversarial, per domain, plus the first mismatches with where they diverge. The field
study's bar is EM > 85 % and ROUGE-L > 92 %; on the same checkpoint with fp32 or bf16 KV
anything short of ~100 % is a serving bug (or batch-dependent numerics) to explain.

    python -m bench.golden                                  # all four policies, full set
    python -m bench.golden --policies hybrid --limit 20     # a quick look
    python -m bench.golden --kv-dtypes auto,int8,fp8_e4m3   # quantised KV, where built
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any, get_args

import httpx

from bench.make_golden import OUT as GOLDEN
from bench.make_golden import fingerprint
from bench.rouge import exact_match, rouge_l, tokens
from bench.serve_stack import machine_info
from bench.up_stack import UpStack
from common.config import WorkerConfig
from common.models import resolve_model

POLICIES = ("static", "dynamic", "continuous", "hybrid")
BAR = {"exact_match": 0.85, "rouge_l": 0.92}


def load_rows(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The golden rows (the first ``limit``, spread over domains when limited)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit is not None and limit < len(rows):
        step = len(rows) / limit
        rows = [rows[int(i * step)] for i in range(limit)]
    return rows


async def serve_all(url: str, rows: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    """Each row's answer from the gateway (greedy, whole response); errors kept, not raised."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(row: dict[str, Any]) -> dict[str, Any]:
            body = {
                "model": model,
                "messages": row["messages"],
                "max_tokens": row["max_tokens"],
                "temperature": 0,
                "ignore_eos": bool(row.get("ignore_eos", False)),
            }
            async with gate:
                resp = await client.post("/v1/short/chat/completions", json=body)
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            choice = resp.json()["choices"][0]
            return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}

        return await asyncio.gather(*(one(row) for row in rows))


def first_difference(a: str, b: str) -> int:
    """Index of the first differing character (the shorter length if one is a prefix)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def score_items(rows: list[dict[str, Any]], answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each answer against its row's reference: ``em`` (bool) and ``rouge_l`` (F1); an
    errored answer scores 0 on both."""
    items: list[dict[str, Any]] = []
    for row, answer in zip(rows, answers, strict=True):
        text = answer.get("text", "")
        items.append(
            {
                "row": row,
                "em": "error" not in answer and exact_match(text, row["reference"]),
                "rouge_l": rouge_l(text, row["reference"]).f1 if "error" not in answer else 0.0,
                "answer": answer,
            }
        )
    return items


def score(rows: list[dict[str, Any]], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """EM and ROUGE-L overall, clean vs adversarial, per domain; the first mismatches."""
    items = score_items(rows, answers)

    def figures(subset: list[dict[str, Any]]) -> dict[str, Any]:
        if not subset:
            return {"n": 0}
        return {
            "n": len(subset),
            "exact_match": round(mean(i["em"] for i in subset), 4),
            "rouge_l": round(mean(i["rouge_l"] for i in subset), 4),
        }

    domains = sorted({i["row"]["domain"] for i in items})
    mismatches = [
        {
            "id": i["row"]["id"],
            "rouge_l": round(i["rouge_l"], 3),
            "diverges_at_char": first_difference(
                i["answer"].get("text", ""), i["row"]["reference"]
            ),
            "reference": i["row"]["reference"][:160],
            "served": i["answer"].get("text", i["answer"].get("error", ""))[:160],
        }
        for i in items
        if not i["em"]
    ]
    overall = figures(items)
    return {
        **overall,
        "errors": sum("error" in i["answer"] for i in items),
        "meets_bar": overall.get("exact_match", 0) > BAR["exact_match"]
        and overall.get("rouge_l", 0) > BAR["rouge_l"],
        "clean": figures([i for i in items if not i["row"]["adversarial"]]),
        "adversarial": figures([i for i in items if i["row"]["adversarial"]]),
        "per_domain": {d: figures([i for i in items if i["row"]["domain"] == d]) for d in domains},
        "mismatches": mismatches[:15],
        "mismatch_count": len(mismatches),
    }


def kv_dtypes(arg: str) -> list[str]:
    """The ``--kv-dtypes`` list, each checked against what a worker can be configured with
    (a typo would otherwise start a stack only to fail its config check)."""
    allowed = get_args(WorkerConfig.model_fields["kv_cache_dtype"].annotation)
    chosen = [k for k in arg.split(",") if k]
    unknown = [k for k in chosen if k not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown KV cache dtype {', '.join(unknown) or '(none)'}; choose from {', '.join(allowed)}"
        )
    return chosen


def run_one(
    args: argparse.Namespace, rows: list[dict[str, Any]], policy: str, kv: str
) -> dict[str, Any]:
    """Start a stack for ``policy``/``kv``, serve every row, score."""
    worker: dict[str, Any] = {"telemetry_interval_s": 0.5}
    if kv != "auto":
        worker["kv_cache_dtype"] = kv
    config = {"groups": {"short": {"policy": policy}}, "worker": worker}
    started = time.perf_counter()
    with UpStack(
        engine="real", model=args.model, config=config, replicas={"realtime": 0, "long": 0}
    ) as stack:
        ready = time.perf_counter() - started
        t0 = time.perf_counter()
        answers = asyncio.run(serve_all(stack.url, rows, args.concurrency))
        serve_s = time.perf_counter() - t0
    result = score(rows, answers)
    result["timing_s"] = {"stack_start": round(ready, 1), "serve": round(serve_s, 1)}
    print(
        f"{policy:>10} kv={kv:<8} EM {result['exact_match']:.3f}  ROUGE-L {result['rouge_l']:.3f}  "
        f"errors {result['errors']}  ({serve_s:.1f}s)",
        file=sys.stderr,
        flush=True,
    )
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.golden", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(GOLDEN), help="golden JSONL (bench/make_golden.py)")
    p.add_argument("--model", default="demo", help="the checkpoint the references came from")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--kv-dtypes",
        type=kv_dtypes,
        default="auto",
        help="comma-separated KV cache dtypes to compare: auto, int8, fp8_e4m3",
    )
    p.add_argument("--limit", type=int, help="score this many prompts (spread over the set)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    """Evaluate; JSON on stdout; exit 1 when a request failed."""
    args = parse_args(argv)
    rows = load_rows(Path(args.data), args.limit)
    served = fingerprint(Path(resolve_model(args.model)))
    references = sorted({r.get("reference_model", "(none)") for r in rows})
    results: dict[str, dict[str, Any]] = {}
    for policy in [p for p in args.policies.split(",") if p]:
        results[policy] = {}
        for kv in args.kv_dtypes:
            results[policy][kv] = run_one(args, rows, policy, kv)
    report = {
        "benchmark": "golden",
        "command": " ".join(["python -m bench.golden", *args.argv]),
        "machine": machine_info(),
        "set": {
            "path": args.data,
            "prompts": len(rows),
            "domains": len({r["domain"] for r in rows}),
            "adversarial_share": round(mean(r["adversarial"] for r in rows), 3),
            # The demo model often answers with blank lines: such references have no ROUGE
            # tokens, so only exact match tells a served blank answer from a wrong one.
            "references_without_words": sum(not tokens(r["reference"]) for r in rows),
            "reference_model": references,
            "served_model": served,
            "same_checkpoint": references == [served],
            "reference_generator": rows[0].get("reference_generator"),
        },
        "bar": BAR,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    failed = any(r.get("errors") for by_kv in results.values() for r in by_kv.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
