"""Build ``bench/data/golden.jsonl``: the golden set and its references, deterministically.

Prompts: every domain of :mod:`bench.golden_templates` crosses its four topics with its two
question forms (8 prompts), plus 8 stdlib questions from ``bench/data/stdlib_qa.jsonl``;
then a seeded quarter of those get an adversarial variant (typos, a vague rewrite, or an
ambiguous question with no referent), which makes the variants 20 % of the set.

References: Hugging Face ``transformers`` greedy decoding (``do_sample=False``) on the same
checkpoint the stack serves, up to EOS or ``max_tokens`` (the answer a client gets; the demo
model knows the domains' topics, see ``bench/train_tiny.py``, so answers are not blank;
``--ignore-eos`` decodes past EOS into whatever document the model starts next, a draw
the model cannot know, whose near-ties make every comparison fragile), one prompt at a
time (no padding, so nothing but the prompt shapes the numerics), the chat template
applied exactly as the gateway applies it. Each row records the checkpoint's fingerprint
(``reference_model``), so ``bench/golden.py`` can tell references of another checkpoint
from a serving bug. No network::

    python -m bench.make_golden                     # writes bench/data/golden.jsonl
    python -m bench.make_golden --no-references --out /tmp/prompts.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.field_mix import load_qa
from bench.golden_templates import AMBIGUOUS, DOMAINS, FORMS, STDLIB_QUESTIONS, VAGUE
from common.models import demo_model_path

OUT = Path(__file__).resolve().parent / "data" / "golden.jsonl"
ADVERSARIAL_SHARE = 0.2
PERTURBATIONS: tuple[tuple[str, float], ...] = (("typo", 5), ("vague", 3), ("ambiguous", 2))


def base_prompts(seed: int) -> list[dict[str, Any]]:
    """The clean prompts, in a fixed order: domain by domain, then stdlib."""
    rows: list[dict[str, Any]] = []
    for domain, (role, topics, forms) in DOMAINS.items():
        for topic in topics:
            for form in forms:
                question = FORMS[form].format(topic=topic, role=role)
                rows.append({"domain": domain, "topic": topic, "question": question})
    qa = load_qa()
    for item in random.Random(seed).sample(qa, STDLIB_QUESTIONS):
        named = re.search(r"`([^`]+)`", item.question)
        topic = named[1] if named else item.question
        rows.append({"domain": "stdlib", "topic": topic, "question": item.question})
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["domain"]] = counts.get(row["domain"], 0) + 1
        row["id"] = f"{row['domain']}-{counts[row['domain']]:02d}"
    return rows


def typo(text: str, rng: random.Random) -> str:
    """Two or three words of four letters or more get a swapped, dropped or doubled letter."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 4 and w.isalpha()]
    for i in rng.sample(candidates, min(len(candidates), rng.randint(2, 3))):
        w, j = words[i], rng.randrange(1, len(words[i]) - 1)
        edit = rng.choice(("swap", "drop", "double"))
        if edit == "swap":
            w = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
        elif edit == "drop":
            w = w[:j] + w[j + 1 :]
        else:
            w = w[:j] + w[j] + w[j:]
        words[i] = w
    return " ".join(words)


def adversarial(base: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """A variant of a seeded quarter of ``base``: 20 % of base + variants."""
    rng = random.Random(seed + 1)
    n = round(len(base) * ADVERSARIAL_SHARE / (1 - ADVERSARIAL_SHARE))
    kinds = [kind for kind, _ in PERTURBATIONS]
    weights = [weight for _, weight in PERTURBATIONS]
    rows = []
    for source in sorted(rng.sample(base, n), key=lambda r: r["id"]):
        kind = rng.choices(kinds, weights)[0]
        if kind == "typo":
            question = typo(source["question"], rng)
        elif kind == "vague":
            question = rng.choice(VAGUE).format(topic=source["topic"])
        else:
            question = rng.choice(AMBIGUOUS)
        rows.append(
            {"domain": source["domain"], "topic": source["topic"], "question": question,
             "id": f"{source['id']}-{kind}", "source_id": source["id"], "perturbation": kind}
        )  # fmt: skip
    return rows


def golden_rows(seed: int, max_tokens: int, ignore_eos: bool = False) -> list[dict[str, Any]]:
    """Every prompt of the set, clean then adversarial, without references."""
    base = base_prompts(seed)
    rows = [{**r, "perturbation": "none", "source_id": r["id"]} for r in base]
    rows += adversarial(base, seed)
    out = []
    for row in rows:
        out.append(
            {
                "id": row["id"],
                "domain": row["domain"],
                "adversarial": row["perturbation"] != "none",
                "perturbation": row["perturbation"],
                "source_id": row["source_id"],
                "messages": [{"role": "user", "content": row["question"]}],
                "max_tokens": max_tokens,
                "ignore_eos": ignore_eos,
            }
        )
    return out


def fingerprint(model: Path) -> str:
    """``<folder name> sha256:<16 hex>`` of the weights and config: what produced a reference."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((model / name).read_bytes())
    return f"{model.name} sha256:{digest.hexdigest()[:16]}"


def add_references(rows: list[dict[str, Any]], model: Path) -> str:
    """Fill ``reference`` (+ token ids) with transformers' greedy output; the generator."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos = lm.generation_config.eos_token_id
    lm.generation_config.max_length = None  # max_new_tokens decides (no warning per call)
    lm.generation_config.eos_token_id = None  # rows with ignore_eos decode past EOS
    for i, row in enumerate(rows):
        text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        stop = None if row.get("ignore_eos") else eos
        with torch.no_grad():
            out = lm.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=row["max_tokens"],
                do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        new = out[0, ids.shape[1] :].tolist()
        if stop is not None and new and new[-1] == stop:
            new = new[:-1]
        row["reference_token_ids"] = new
        row["reference"] = tok.decode(new, skip_special_tokens=True)  # as the gateway does
        row["prompt_tokens"] = ids.shape[1]
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(rows)} references", file=sys.stderr, flush=True)
    return (
        f"transformers {transformers.__version__} generate(do_sample=False), "
        f"torch {torch.__version__} float32 cpu, batch 1"
    )


def main(argv: list[str] | None = None) -> int:
    """Write the golden set; print a summary as JSON."""
    p = argparse.ArgumentParser(prog="bench.make_golden", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(demo_model_path()), help="checkpoint for references")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="decode past EOS up to --max-tokens")
    p.add_argument("--no-references", action="store_true", help="prompts only (fast)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = golden_rows(args.seed, args.max_tokens, args.ignore_eos)
    model = Path(args.model)
    if not args.no_references:
        print_model = fingerprint(model)
        generator = add_references(rows, model)
        if fingerprint(model) != print_model:
            raise SystemExit(f"{model} changed while the references were made: run again")
        for row in rows:
            row["reference_model"] = print_model
            row["reference_generator"] = generator
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    domains = sorted({r["domain"] for r in rows})
    summary = {
        "out": args.out,
        "prompts": len(rows),
        "domains": len(domains),
        "adversarial_share": round(sum(r["adversarial"] for r in rows) / len(rows), 3),
        "references": not args.no_references,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
