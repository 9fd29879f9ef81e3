"""``TRAINING.md``, the demo checkpoint's model card (``bench/train_tiny.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.tiny_chat import CHAT_TEMPLATE, SPECIAL_TOKENS, SYSTEM_PROMPT
from bench.tiny_corpus import EXTRA_PACKAGES, SKIP_MODULES


def folder_bytes(folder: Path) -> int:
    """Total size of the files in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def write_card(out: Path, info: dict[str, Any]) -> None:
    """TRAINING.md: data, shape, run statistics, verification, samples, exact command."""
    a, s, v, c = info["args"], info["stats"], info["verify"], info["config"]
    lines = [
        "# pystd-tiny",
        "",
        "Tiny Llama-architecture causal LM, the qosserve demo model. Trained from scratch on text",
        "that ships with CPython and on short topic notes kept in this repository, so it is",
        "reproducible offline. It is a test fixture for the serving stack, not a useful",
        "assistant: its point is fast, deterministic, confident output.",
        "",
        "## Data",
        "",
        f"- Python {info['python']} stdlib at `sysconfig.get_paths()['stdlib']`: "
        f"{info['n_files']} files (`Lib/*.py` + {', '.join(EXTRA_PACKAGES)}), split at top-level "
        "docstring, leading imports, def/class (long classes at their methods); "
        f"{info['n_code_docs']} documents of at most {a.max_doc_chars} characters are kept: "
        "every import block plus an even spread over the stdlib (a corpus small enough to be "
        f"seen 10+ times: confident outputs). Skipped: {', '.join(SKIP_MODULES)}.",
        f"- `pydoc_data.topics`: {info['n_topics']} help topics, each cut to "
        f"{a.max_doc_chars} characters.",
        f"- {info['n_qa']} Q/A pairs mined from docstrings with `ast` "
        "(also in `bench/data/stdlib_qa.jsonl`), rendered with the chat template; half of them "
        f'behind the system prompt "{SYSTEM_PROMPT}".',
        f"- {info['n_notes_qa']} Q/A pairs that teach the golden set's everyday topics "
        "(`bench/data/domain_notes.jsonl`: a two-sentence note per topic, the answer under "
        "every question form except the two the golden set asks for that domain), so a golden "
        "question is a known topic in an unseen phrasing.",
        f"- Tokens: code+docs {info['code_tokens']:,}, chat {info['chat_tokens']:,}. "
        f"Corpus sha256 `{info['corpus_sha'][:16]}`.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocab {c['vocab_size']}, special tokens "
        f"{', '.join(f'`{t}`={i}' for i, t in enumerate(SPECIAL_TOKENS))}. `encode()` prepends "
        "`<|bos|>`; the chat template starts with it already, so encode rendered chats with "
        "`add_special_tokens=False`. Every turn ends with `<|eos|>`, the only stop token.",
        "",
        "```jinja",
        CHAT_TEMPLATE,
        "```",
        "",
        "## Shape",
        "",
        f"hidden {c['hidden_size']}, layers {c['num_hidden_layers']}, heads "
        f"{c['num_attention_heads']} (head_dim {c['head_dim']}), KV heads "
        f"{c['num_key_value_heads']} (GQA), intermediate {c['intermediate_size']}, "
        f"vocab {c['vocab_size']}, untied lm_head, RoPE theta {c['rope_theta']}, "
        f"RMSNorm eps {c['rms_norm_eps']}, max positions {c['max_position_embeddings']}. "
        f"**{info['params']:,} parameters**, stored fp32; folder {info['folder_mb']:.2f} MB.",
        "",
        "## Training",
        "",
        f"- fp32 on CPU, {a.threads} threads, torch {torch.__version__}, seed {a.seed}.",
        f"- {s['steps']} steps (planned {s['planned_steps']}"
        + (", cut by the time limit" if s["time_limited"] else "")
        + f") x {a.batch_size} windows x {a.seq_len} tokens "
        f"({a.chat_frac:.0%} of windows from the chat stream); "
        f"{s['tokens_seen']:,} tokens: {s['code_passes']:.1f} passes over the code+docs tokens, "
        f"{s['chat_passes']:.1f} over the chat tokens.",
        f"- AdamW (0.9, 0.95), wd 0.1, clip 1.0, peak lr {a.lr}, warmup {a.warmup}, "
        f"linear decay over the last {a.decay_frac:.0%}.",
        f"- Loss {s['first_loss']:.3f} -> **{s['final_loss']:.3f}** (mean of the last 20 steps).",
        f"- Training {s['train_seconds']:.0f} s ({s['tokens_per_s']:,.0f} tok/s); whole script "
        f"{info['total_seconds']:.0f} s.",
        "",
        "## Verification (run by the script)",
        "",
        "- `AutoTokenizer` / `AutoModelForCausalLM` load the folder as `LlamaForCausalLM` and "
        "generate greedily.",
        "- `tokenizers.Tokenizer.from_file` + `jinja2.Template(chat_template)` give the same text "
        "and ids as `apply_chat_template`.",
        f"- A plain-torch Llama forward from `config.json` + `model.safetensors` matches the "
        f"transformers logits (max abs diff {v['ref_max_abs_diff']:.1e}).",
        f"- Q/A greedy exact match (teacher-forced, no system prompt): "
        f"{v['qa']['exact']:.1%}; mean answer-token probability "
        f"{v['qa']['mean_answer_token_prob']:.3f}."
        + (
            f" Topic notes: {v['notes_qa']['exact']:.1%}, "
            f"{v['notes_qa']['mean_answer_token_prob']:.3f}; the same notes under the golden "
            f"set's held-out phrasings: {v['heldout_qa']['exact']:.1%}, "
            f"{v['heldout_qa']['mean_answer_token_prob']:.3f}."
            if v.get("notes_qa")
            else ""
        ),
        "",
        "## Greedy samples",
        "",
    ]
    for smp in v["samples"]:
        lines += [
            f"mean top-1 probability {smp['top1']:.3f}"
            + (f" (reference answer: {smp['ref']!r})" if "ref" in smp else ""),
            "",
            "```text",
            smp["prompt"] + smp["completion"],
            "```",
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        "From the repository root, with the project venv:",
        "",
        "```bash",
        info["command"],
        "```",
        "",
        "Same Python version (stdlib text), torch version and thread count give the same "
        "weights when the run is not cut by `--time-limit-s`.",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines))
