"""KV cache quantisation quality: fp32 KV vs int8 vs fp8 (e4m3) on the demo model.

Greedy generations of the same prompts (stdlib Q/A through the chat template, plus code
prefixes cut from the stdlib) with each ``kv_cache_dtype``; each quantised run is scored
against the fp32-KV run: exact match of the whole output and ROUGE-L. Also reports KV bytes
per token, and the K/V reconstruction error of the chosen scheme (a scale per token per head)
against a scale per block per head, on the K/V the fp32 run actually wrote.

    python -m bench.kvquant --out kvquant.json

Measured (CPU, torch backend, 300 Q/A + 100 code prompts, greedy 32 tokens, vs fp32 KV):
int8 exact match 98.25 %, ROUGE-L 99.24; fp8 e4m3 exact match 95.0 %, ROUGE-L 96.87.
576 KV bytes per token for both vs 2048 fp32 / 1024 bf16 (head_dim 32: 36/64 = 0.5625 of
bf16). K reconstruction error, per token per head vs per block per head: int8 0.50 % vs
0.78 %, fp8 2.48 % vs 2.65 % (per-block never wins, and would need rescaling on append).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from bench.rouge import rouge_l
from workers.engine import LLM, SamplingParams
from workers.engine.kernels.kv_quant import KV_QUANT_DTYPES, QMAX, dequantize, quantize

ROOT = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "pystd-tiny"
QA = ROOT / "data" / "stdlib_qa.jsonl"
KV_DTYPES = ("auto", "int8", "fp8_e4m3")


def chat_prompts(tokenizer, limit: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The Q/A questions rendered with the model's chat template."""
    rows = [json.loads(line) for line in QA.read_text().splitlines() if line.strip()][:limit]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False
        )
        for r in rows
    ]
    # The template starts with <|bos|> already (see the model's TRAINING.md).
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def code_prompts(tokenizer, limit: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The first ``def`` line plus the next two lines of stdlib modules, sorted by name."""
    out: list[list[int]] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
        if first is None:
            continue
        out.append(tokenizer.encode("\n".join(lines[first : first + 3]) + "\n"))
        if len(out) == limit:
            break
    return out


def scheme_errors(k: torch.Tensor) -> dict[str, float]:
    """Relative RMS error of quantising written ``[blocks, block_size, n_kv, d]`` rows with a
    scale per token per head vs per block per head (the block's final amax: an upper bound
    on what an append-only per-block scale could do)."""
    rows = k[k.flatten(1).abs().amax(-1) > 0]  # blocks any token was written to
    out: dict[str, float] = {}
    for name, dtype in KV_QUANT_DTYPES.items():
        vals, scale = quantize(rows, dtype)
        tok = dequantize(vals, scale)
        block_amax = rows.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)
        block_scale = block_amax / QMAX[dtype]
        y = (rows / block_scale).clamp(-QMAX[dtype], QMAX[dtype])
        y = torch.floor(y + 0.5) if dtype == torch.int8 else y.to(dtype).float()
        blk = y * block_scale
        norm = rows.norm()
        out[f"{name}_per_token_head"] = float((tok - rows).norm() / norm)
        out[f"{name}_per_block_head"] = float((blk - rows).norm() / norm)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--chat", type=int, default=300, help="Q/A prompts")
    ap.add_argument("--code", type=int, default=100, help="stdlib code-prefix prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--out", default="kvquant.json")
    args = ap.parse_args()
    torch.manual_seed(0)

    results: dict[str, dict[str, object]] = {}
    texts: dict[str, list[str]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts: list[list[int]] = []
    for kv in KV_DTYPES:
        llm = LLM(
            args.model, dtype="float32", kv_cache_dtype=kv, backend=args.backend,
            num_kv_blocks=4096, max_batch_size=64,
        )  # fmt: skip
        if not prompts:
            tok = _hf_tokenizer(args.model)
            prompts = chat_prompts(tok, args.chat) + code_prompts(tok, args.code)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        runner = llm.engine.runner
        texts[kv] = [o.text for o in outs]
        results[kv] = {
            "kv_bytes_per_token": runner.bytes_per_block() // runner.block_size,
            "seconds": round(time.perf_counter() - start, 1),
            "tokens": [o.token_ids for o in outs],
        }
        if kv == "auto":
            k = torch.stack([layer.k for layer in runner.kv_caches])
            results["scheme_rel_rms_error_on_K"] = scheme_errors(k.flatten(0, 1))
            v = torch.stack([layer.v for layer in runner.kv_caches])
            results["scheme_rel_rms_error_on_V"] = scheme_errors(v.flatten(0, 1))
        del llm

    base_tokens = results["auto"]["tokens"]
    for kv in KV_DTYPES[1:]:
        toks = results[kv]["tokens"]
        exact = sum(a == b for a, b in zip(toks, base_tokens, strict=True))  # type: ignore[arg-type]
        rouge = [rouge_l(c, r).f1 for c, r in zip(texts[kv], texts["auto"], strict=True)]
        results[kv]["exact_match_pct"] = round(100 * exact / len(prompts), 2)
        results[kv]["rouge_l_pct"] = round(100 * sum(rouge) / len(rouge), 2)
    for kv in KV_DTYPES:
        results[kv].pop("tokens")
    bf16_bytes = results["auto"]["kv_bytes_per_token"] // 2  # type: ignore[operator]
    summary = {
        "model": args.model,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "reference": "fp32 KV (kv_cache_dtype=auto, model fp32)",
        "bf16_kv_bytes_per_token": bf16_bytes,
        **results,
    }
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def _hf_tokenizer(model: str):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model)


if __name__ == "__main__":
    main()
