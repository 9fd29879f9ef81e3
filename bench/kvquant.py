"""KV cache quantisation quality: unquantised KV vs int8 vs fp8 (e4m3) on the demo model.

Two measures, per model dtype (fp32, and bf16 where the CPU path runs it), each quantised
run against the unquantised-KV run of the same model dtype (``kv_cache_dtype=auto``):

- **Golden** (the field study's "EM drop after quantisation"): the golden set
  (``bench/data/golden.jsonl``, 230 prompts, answers up to EOS or 64 tokens) generated
  offline with the engine and scored against its references with ``bench.golden``'s
  scoring (EM, ROUGE-L). The drop is in points, with a paired bootstrap 95 % interval
  (``bench.paired_bootstrap``).
- **Agreement** (stricter): greedy outputs of 400 prompts (stdlib Q/A through the chat
  template, plus code prefixes cut from the stdlib; 32 tokens) scored against the
  unquantised run's own outputs: exact match of the whole output and ROUGE-L.

Also: KV bytes per token; the K/V reconstruction error of the scale per token per head
against a scale per block per head; and ``--schemes``, other scales simulated on the fp32
model (``bench.kvquant_schemes``, checked against the real runs) to see whether any of
them keeps fp8's quality.

    python -m bench.kvquant --out bench/results/cpu/kvquant.json
    python -m bench.kvquant --model-dtypes float32 --schemes none      # the quick look

Measured (CPU, torch backend, 2 shared cores; bench/results/cpu/kvquant.json) on the
checkpoint retrained on 2026-11-30 (loss 0.03: it knows the golden set's topics and answers
their held-out phrasings; ``bench/models/pystd-tiny/TRAINING.md``), golden answers ending at
EOS. Drops in points vs kv_cache_dtype=auto of the same model dtype, [paired bootstrap 95 %
interval]:

    model  KV          golden EM          golden ROUGE-L     agreement EM       agreement RL
    fp32   int8         3.9 [1.7, 6.5]     1.7 [0.5, 3.2]     6.0 [3.8, 8.5]     3.6 [2.1, 5.3]
    fp32   fp8 e4m3    10.4 [6.5, 14.3]    6.4 [3.9, 9.4]    16.8 [13.0, 20.5]  12.0 [9.1, 14.9]
    bf16   int8         2.2 [-0.4, 4.8]    1.5 [0.0, 3.3]     7.3 [4.8, 10.0]    4.2 [2.7, 6.1]
    bf16   fp8 e4m3     7.8 [4.3, 11.7]    5.3 [2.8, 8.1]    19.5 [15.8, 23.5]  13.9 [10.9, 17.0]

The target, a drop under 1 point, is not met (the barely trained checkpoint before it
dropped 15.2 / 45.6 golden EM points). What is left is near-ties: on the 184 clean golden
prompts int8 keeps 98.4 % exact (3 answers change, each at a token whose top two
log-probabilities were within 0.14 nats), on the 46 adversarial ones (typos, vague or
ambiguous questions, where the model is unsure) 87.0 %; fp8 96.2 % / 63.0 %. The agreement
set (stdlib Q/A and code, 32 tokens) is the model's least certain text. Rounding only the
KV to bf16 (simulated) drops golden EM 0.9 [0.0, 2.2] (2 answers changed) and agreement EM
1.5 [0.5, 2.8] points: even 16-bit KV is not shown to be under the bar on this model (only
its golden point estimate is), so the bar sits at this model's own noise; 8-bit is well
over it.

Simulated schemes on the fp32 model (golden EM / agreement EM drop; the calibrated ones
calibrated on 64 stdlib excerpts holding no measured answer): fp8 per token per head 10.4 / 16.8
(the shipped scheme; its simulation reproduces the real run token for token), amax -> 240
12.2 / 18.8, per block per head (append-only, 2x margin) 12.6 / 20.3, per tensor 12.2 /
21.3, Hadamard-rotated 12.2 / 20.0: no scale choice helps, since fp8's error is its 3
mantissa bits (K reconstruction error 2.1 % vs int8's 0.77 %). K is the sensitive half:
int8 K with fp8 V 5.7 / 11.5, fp8 K with int8 V 11.7 / 14.3. Two int8 K refinements: K
less its per-channel mean (free under softmax, as SageAttention does) 3.9 / 4.0, K's
channels smoothed by sqrt(amax) folded into q (QServe's SmoothAttention) 5.2 / 6.75;
earlier runs calibrated on the measured prompts' own caches (2.6 for centring), then on 40
top-level modules of which nine quote Q/A answers (3.0): leaks, both. A step attending over its own K/V unrounded (``*_exact_step``, as vLLM's
prefill does over an fp8 cache) 2.6 / 5.25 for int8, 8.7 / 12.25 for fp8: the best here,
but it makes a token depend on how its prompt was cut into steps (chunked prefill, prefix
hits read back quantised), which the shipped cache does not. None reaches the bar, so
none has kernels. KV bytes per token: 576 for
int8 and fp8 vs 2048 fp32 / 1024 bf16 (head_dim 32: 36/64 = 0.5625 of bf16; the fp32 scales
are 4 of each 36 bytes; at head_dim 128 it is 0.516).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from bench.golden import load_rows, score_items
from bench.kvquant_schemes import (
    SCHEMES,
    SHIPPED,
    CacheShape,
    Calibration,
    calibrate,
    simulating,
)
from bench.make_golden import OUT as GOLDEN
from bench.make_golden import fingerprint
from bench.paired_bootstrap import paired_drop
from bench.provenance import git_state
from bench.rouge import rouge_l
from bench.serve_stack import machine_info
from workers.engine import LLM, SamplingParams
from workers.engine.kernels.kv_quant import KV_QUANT_DTYPES, QMAX, dequantize, quantize

ROOT = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "pystd-tiny"
QA = ROOT / "data" / "stdlib_qa.jsonl"
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
MODEL_DTYPES = ("float32", "bfloat16")
TARGET_DROP_POINTS = 1.0


def chat_prompts(tokenizer, limit: int) -> list[list[int]]:
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


def _stdlib_defs(recursive: bool = False) -> Iterator[list[str]]:
    """Stdlib modules with a top-level ``def``, sorted by path: their lines from that one
    on (``recursive``: the packages' modules too, tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = root.rglob("*.py") if recursive else root.glob("*.py")
    for path in sorted(paths):
        parts = path.relative_to(root).parts
        if recursive and any(p in ("test", "tests", "site-packages", "idlelib") for p in parts):
            continue
        lines = path.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
        if first is not None:
            yield lines[first:]


def code_prompts(tokenizer, limit: int) -> list[list[int]]:
    """The first ``def`` line plus the next two lines of stdlib modules, sorted by name."""
    return [
        tokenizer.encode("\n".join(lines[:3]) + "\n")
        for lines in itertools.islice(_stdlib_defs(), limit)
    ]


def calibration_excerpts(skip: int, avoid: Iterable[str], limit: int = 64) -> list[str]:
    """Text the measured sets do not hold, for the calibrated schemes: 40 lines from the first
    ``def`` of stdlib modules (packages' too), leaving out the ``skip`` top-level modules that
    :func:`code_prompts` takes and any excerpt that contains one of ``avoid`` (the measured
    answers: a docstring the model is asked to recite must not calibrate it). Exactly
    ``limit`` of them, or ValueError: a shorter stdlib would change the figures silently."""
    taken = {tuple(lines[:3]) for lines in itertools.islice(_stdlib_defs(), skip)}
    needles = [a for a in avoid if len(a) >= 20]
    out: list[str] = []
    for lines in _stdlib_defs(recursive=True):
        text = "\n".join(lines[:40]) + "\n"
        if tuple(lines[:3]) in taken or any(n in text for n in needles):
            continue
        out.append(text)
        if len(out) == limit:
            return out
    raise ValueError(f"only {len(out)} stdlib excerpts qualify for calibration, {limit} wanted")


def calibration_prompts(tokenizer, excerpts: list[str]) -> list[list[int]]:
    """Up to 512 tokens of each excerpt."""
    return [tokenizer.encode(text)[:512] for text in excerpts]


def golden_prompts(tokenizer, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each golden row's messages through the chat template, as ``bench.make_golden`` (and
    the gateway) render them."""
    texts = [
        tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@dataclass(frozen=True)
class Workload:
    """Both prompt sets and how each is generated."""

    agreement: list[list[int]]
    agreement_params: SamplingParams
    calibration: list[list[int]]
    golden_rows: list[dict[str, Any]]
    golden: list[list[int]]
    golden_params: list[SamplingParams]


@dataclass(frozen=True)
class Run:
    """One configuration's outputs on both sets."""

    tokens: list[list[int]]
    texts: list[str]
    golden_texts: list[str]
    seconds: float


def generate(llm: LLM, work: Workload) -> Run:
    """Greedy outputs of both sets (agreement first: the order is the same for every run,
    so prefix-cache hits are too)."""
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=work.agreement, sampling_params=work.agreement_params)
    gold = llm.generate(prompt_token_ids=work.golden, sampling_params=work.golden_params)
    return Run(
        tokens=[o.token_ids for o in outs],
        texts=[o.text for o in outs],
        golden_texts=[o.text for o in gold],
        seconds=round(time.perf_counter() - start, 1),
    )


def agreement(run: Run, base: Run) -> dict[str, Any]:
    """Exact match and ROUGE-L of ``run``'s outputs against ``base``'s, and the drops."""
    same = [float(a == b) for a, b in zip(run.tokens, base.tokens, strict=True)]
    rouge = [rouge_l(c, r).f1 for c, r in zip(run.texts, base.texts, strict=True)]
    ones = [1.0] * len(same)
    return {
        "exact_match_pct": round(100 * mean(same), 2),
        "rouge_l_pct": round(100 * mean(rouge), 2),
        "drop": {
            "exact_match": paired_drop(ones, same).as_dict(),
            "rouge_l": paired_drop(ones, rouge).as_dict(),
        },
    }


def golden(rows: list[dict[str, Any]], run: Run, base: Run | None) -> dict[str, Any]:
    """EM and ROUGE-L against the golden references (``bench.golden``'s scoring), overall and
    clean vs adversarial, and the drops from ``base`` with paired intervals."""
    items = score_items(rows, [{"text": t} for t in run.golden_texts])

    def pct(subset: list[dict[str, Any]]) -> dict[str, Any]:
        if not subset:
            return {"n": 0}
        return {
            "n": len(subset),
            "exact_match_pct": round(100 * mean(float(i["em"]) for i in subset), 2),
            "rouge_l_pct": round(100 * mean(i["rouge_l"] for i in subset), 2),
        }

    out: dict[str, Any] = {
        **pct(items),
        "clean": pct([i for i in items if not i["row"]["adversarial"]]),
        "adversarial": pct([i for i in items if i["row"]["adversarial"]]),
    }
    if base is not None:
        ref = score_items(rows, [{"text": t} for t in base.golden_texts])
        out["drop"] = {
            name: paired_drop(
                [float(i[key]) for i in ref], [float(i[key]) for i in items]
            ).as_dict()
            for name, key in (("exact_match", "em"), ("rouge_l", "rouge_l"))
        }
        # The drop nets answers the scheme broke against answers it happened to fix (a bf16
        # baseline is not all correct): how many answers changed at all says what it moved.
        changed = sum(a != b for a, b in zip(run.golden_texts, base.golden_texts, strict=True))
        out["answers_changed"] = changed
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


def target(entry: dict[str, Any]) -> dict[str, bool]:
    """Whether each drop is under the target (point estimate, and the whole interval)."""
    out: dict[str, bool] = {}
    for key, drop in entry["drop"].items():
        out[f"{key}_drop_under_{TARGET_DROP_POINTS:g}"] = drop["points"] < TARGET_DROP_POINTS
        out[f"{key}_ci95_under_{TARGET_DROP_POINTS:g}"] = drop["ci95_high"] < TARGET_DROP_POINTS
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.kvquant", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--chat", type=int, default=300, help="agreement: Q/A prompts")
    ap.add_argument("--code", type=int, default=100, help="agreement: stdlib code prefixes")
    ap.add_argument("--max-tokens", type=int, default=32, help="agreement: tokens per prompt")
    ap.add_argument("--golden", default=str(GOLDEN), help="golden JSONL with references")
    ap.add_argument("--golden-limit", type=int, help="score this many golden prompts")
    ap.add_argument("--model-dtypes", default=",".join(MODEL_DTYPES))
    ap.add_argument(
        "--schemes", default="all", help="simulated schemes: all, none, or names, comma-separated"
    )
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--out", default="kvquant.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration; write and print the JSON report; return it."""
    args = parse_args(argv)
    torch.manual_seed(0)
    schemes = {"all": list(SCHEMES), "none": []}.get(args.schemes, args.schemes.split(","))

    def new_llm(dtype: str, kv: str) -> LLM:
        return LLM(
            args.model, dtype=dtype, kv_cache_dtype=kv, backend=args.backend,
            num_kv_blocks=4096, max_batch_size=64,
        )  # fmt: skip

    work: Workload | None = None
    shape: CacheShape | None = None
    runs: dict[tuple[str, str], Run] = {}
    report: dict[str, Any] = {
        "python": sys.version.split()[0],  # the stdlib the code and calibration text come from
        # Which weights and code: the figures moved 15.2 -> 3.9 points with a retrained
        # checkpoint, and nothing in the file said which one made them.
        "model_fingerprint": fingerprint(Path(args.model))
        if Path(args.model, "config.json").is_file()
        else None,
        "git": git_state(),
        "torch": torch.__version__,
        "machine": machine_info(),
        "kv_bytes_per_token": {},
        "golden": {},
        "agreement": {},
    }
    extra: dict[str, Any] = {}
    for dtype in args.model_dtypes.split(","):
        for kv in KV_DTYPES:
            llm = new_llm(dtype, kv)
            if work is None:
                work = _workload(args)
            runs[dtype, kv] = run = generate(llm, work)
            runner = llm.engine.runner
            report["kv_bytes_per_token"][f"{dtype}/{kv}"] = (
                runner.bytes_per_block() // runner.block_size
            )
            print(f"{dtype:>9} kv={kv:<8} {run.seconds:6.1f}s", flush=True)
            if (dtype, kv) == ("float32", "auto"):
                k = torch.stack([layer.k for layer in runner.kv_caches])
                v = torch.stack([layer.v for layer in runner.kv_caches])
                extra["scheme_rel_rms_error_on_K"] = scheme_errors(k.flatten(0, 1))
                extra["scheme_rel_rms_error_on_V"] = scheme_errors(v.flatten(0, 1))
                shape = CacheShape(len(k), *runner.kv_caches[0].k.shape)
            del llm
        base = runs[dtype, "auto"]
        assert work is not None
        report["golden"][dtype] = {
            kv: golden(work.golden_rows, runs[dtype, kv], None if kv == "auto" else base)
            for kv in KV_DTYPES
        }
        report["agreement"][dtype] = {kv: agreement(runs[dtype, kv], base) for kv in KV_DTYPES[1:]}
    assert work is not None
    if ("float32", "auto") in runs and ("bfloat16", "auto") in runs:
        # The model dtype's own cost, for scale: what fp32 -> bf16 weights and KV do.
        report["golden"]["bfloat16"]["auto"]["drop_vs_float32"] = golden(
            work.golden_rows, runs["bfloat16", "auto"], runs["float32", "auto"]
        )["drop"]
    if schemes:
        if shape is None:
            raise SystemExit("--schemes simulate on the fp32 model: add float32 to --model-dtypes")
        calib = _calibrate(new_llm("float32", "auto"), work.calibration)
        report["simulated_schemes"] = _simulate(schemes, new_llm, work, runs, shape, calib)
    for measure in ("golden", "agreement"):
        for by_kv in report[measure].values():
            for kv, entry in by_kv.items():
                if kv != "auto":
                    entry["target_met"] = target(entry)
    summary = {
        "command": " ".join(["python -m bench.kvquant", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model,
        "backend": args.backend,
        "golden_prompts": len(work.golden_rows),
        "agreement_prompts": len(work.agreement),
        "agreement_max_tokens": args.max_tokens,
        "baseline": "kv_cache_dtype=auto (the model dtype) of the same model dtype",
        "target_drop_points": TARGET_DROP_POINTS,
        **report,
        **extra,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def _simulate(
    schemes: list[str],
    new_llm: Any,
    work: Workload,
    runs: dict[tuple[str, str], Run],
    shape: CacheShape,
    calib: Calibration,
) -> dict[str, Any]:
    """Each scheme on the fp32 model, scored like the real runs; the shipped scheme's
    simulation must give the real run's tokens (else the simulation measures nothing)."""
    base = runs["float32", "auto"]
    out: dict[str, Any] = {}
    for name in schemes:
        llm = new_llm("float32", "auto")
        with simulating([layer.k for layer in llm.engine.runner.kv_caches], shape, calib, name):
            run = generate(llm, work)
        del llm
        print(f"  simulated {name:<24} {run.seconds:6.1f}s", flush=True)
        entry: dict[str, Any] = {
            "golden": golden(work.golden_rows, run, base),
            "agreement": agreement(run, base),
        }
        # Judged as the real runs are: a point estimate under the bar is not the bar met
        # (bf16 alone passed golden EM at 0.87 while its agreement interval was 0.5-2.75).
        for measure in ("golden", "agreement"):
            entry[measure]["target_met"] = target(entry[measure])
        if name in SHIPPED and ("float32", SHIPPED[name]) in runs:
            real = runs["float32", SHIPPED[name]]
            entry["reproduces_real_run"] = (run.tokens, run.golden_texts) == (
                real.tokens,
                real.golden_texts,
            )
        out[name] = entry
    return out


def _calibrate(llm: LLM, prompts: list[list[int]]) -> Calibration:
    """Calibration figures from the caches of a fresh fp32 engine that prefilled ``prompts``."""
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1))
    layers = llm.engine.runner.kv_caches
    return calibrate([layer.k for layer in layers], [layer.v for layer in layers])


def _workload(args: argparse.Namespace) -> Workload:
    tok = _hf_tokenizer(args.model)
    rows = load_rows(Path(args.golden), args.golden_limit)
    return Workload(
        agreement=chat_prompts(tok, args.chat) + code_prompts(tok, args.code),
        agreement_params=SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        calibration=calibration_prompts(tok, calibration_excerpts(args.code, _answers(rows))),
        golden_rows=rows,
        golden=golden_prompts(tok, rows),
        golden_params=[
            SamplingParams(
                temperature=0.0,
                max_tokens=r["max_tokens"],
                ignore_eos=bool(r.get("ignore_eos", False)),
            )
            for r in rows
        ],
    )


def _answers(golden_rows: list[dict[str, Any]]) -> list[str]:
    """Every expected answer the measured sets hold: the Q/A answers and golden references."""
    qa = [json.loads(line)["answer"] for line in QA.read_text().splitlines() if line.strip()]
    return qa + [str(r.get("reference", "")) for r in golden_rows]


def _hf_tokenizer(model: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model)


if __name__ == "__main__":
    main()
