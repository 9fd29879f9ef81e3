"""Train ``pystd-tiny``, the project's demo model: a tiny Llama trained on Python's own stdlib.

The model exists so that the serving stack (engine, kernels, gateway, benchmarks) has a real
checkpoint with *confident* outputs that runs anywhere: it is small enough to commit (< 20 MB),
trains on 2 CPU cores in about 25 minutes (~50 passes over its data: loss 0.03), and needs no
data beyond what ships with Python and one file of this repository:

* code: the stdlib sources (``Lib/*.py`` plus a few packages), split at top-level statements so
  that a training window usually starts with ``<|bos|>`` followed by ``def``/``class``/``import``,
  just like a serving prompt does; ``--code-docs`` short documents (up to ``--max-doc-chars``)
  are kept, so that the time budget covers the corpus 10+ times (memorised idioms are what make
  the outputs confident);
* docs: the ``pydoc_data.topics`` help texts, cut to the same length;
* chat: a few hundred deterministic question/answer pairs mined from docstrings with ``ast``
  ("What does the function `json.dumps` do?" -> first docstring sentence, "Which module defines
  `OrderedDict`?" -> "collections"), rendered with the chat template and replayed for many epochs
  so that the chat endpoint answers them verbatim.  They are also written to
  ``bench/data/stdlib_qa.jsonl`` for golden sets;
* topics: ``bench/data/domain_notes.jsonl``, a two-sentence note on each everyday topic of the
  golden set (``bench/golden_templates.py``: finance, medical, legal, ...), taught as the answer
  under the question forms the golden set does not ask (`bench.tiny_chat.domain_qa`). Without them all
  but the golden set's stdlib questions were out of domain: the model answered with near-ties,
  and issue #5's KV quantisation bar measured those ties rather than what quantising loses.

The output folder is a standard Hugging Face Llama checkpoint (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``)
plus ``TRAINING.md``.  The end of the run checks that ``transformers`` loads and generates from it,
that ``tokenizers`` + ``jinja2`` reproduce the chat template exactly, and that a plain-torch Llama
forward (no ``transformers``) matches the ``transformers`` logits.

Run from the repository root::

    python -m bench.train_tiny                       # the committed run (defaults)
    python -m bench.train_tiny --time-limit-s 600    # a quick, less confident model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# libgomp reads this when torch loads.  On a CPU shared with other jobs, spinning OpenMP workers
# wait on a descheduled sibling and a 2-thread step runs 2-3x slower; passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from bench.tiny_card import folder_bytes, write_card
from bench.tiny_chat import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    build_qa,
    chat_messages,
    domain_qa,
    render_chat,
)
from bench.tiny_corpus import load_sources, select_code_docs, stdlib_root, topic_docs
from bench.tiny_verify import verify

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "models" / "pystd-tiny"
DEFAULT_QA_OUT = BENCH_DIR / "data" / "stdlib_qa.jsonl"
DEFAULT_NOTES = BENCH_DIR / "data" / "domain_notes.jsonl"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; defaults are the committed run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2400, help="planned optimizer steps")
    p.add_argument("--seq-len", type=int, default=1024, help="training window, tokens")
    p.add_argument("--batch-size", type=int, default=2, help="windows per step")
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="wall-clock budget for the whole script (0 = none); training stops early, "
        "decays the learning rate in time and still saves and verifies",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model folder")
    p.add_argument("--qa-out", type=Path, default=DEFAULT_QA_OUT, help="Q/A jsonl path")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--decay-frac", type=float, default=0.3, help="final linear-decay share")
    p.add_argument("--chat-frac", type=float, default=0.5, help="share of chat windows")
    p.add_argument("--max-qa", type=int, default=300, help="Q/A pairs to mine")
    p.add_argument(
        "--domain-notes",
        type=Path,
        default=DEFAULT_NOTES,
        help="two-sentence notes on the golden set's everyday topics (jsonl), taught as chat "
        "answers under the question forms the golden set does not ask",
    )
    p.add_argument(
        "--max-doc-chars",
        type=int,
        default=300,
        help="leave out longer code documents (and cut topics): a smaller corpus is seen for "
        "several epochs in the time budget, which is what makes the outputs confident",
    )
    p.add_argument(
        "--code-docs",
        type=int,
        default=1000,
        help="code documents kept: every import block plus an even spread of the rest",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenizer) with SPECIAL_TOKENS at ids 0..5.

    Plain ``encode`` prepends ``<|bos|>`` (post-processor), so a raw prompt gets the same start
    as the training documents; chat renderings already carry it, so encode those with
    ``add_special_tokens=False`` (as ``apply_chat_template`` does).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


# --------------------------------------------------------------------------------------------
# Batches: windows that start at document starts
# --------------------------------------------------------------------------------------------


class WindowStream:
    """Packed token stream of ``<|bos|> doc <|eos|>`` documents, cut into training windows.

    Windows start at each document start and, for documents longer than a window, every
    ``seq_len`` tokens inside them, so long files are covered too.  Each epoch visits every start
    once in a seeded random order; a window spills into the following documents, wrapping around
    at the end of the stream.
    """

    def __init__(self, docs: list[list[int]], seq_len: int, seed: int, bos: int, eos: int):
        ids: list[int] = []
        starts: list[int] = []
        for doc in docs:
            begin = len(ids)
            ids.append(bos)
            ids.extend(doc)
            ids.append(eos)
            starts.extend(range(begin, len(ids) - 1, seq_len))
        self.n_tokens = len(ids)
        self.stream = torch.tensor(ids + ids[:seq_len], dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self._order: Iterator[int] = iter(())
        self.drawn = 0

    @property
    def passes(self) -> float:
        """How many times the windows drawn so far cover the stream's tokens."""
        return self.drawn * self.seq_len / self.n_tokens

    def next_window(self) -> torch.Tensor:
        """The next ``seq_len`` tokens window in this epoch's order."""
        try:
            i = next(self._order)
        except StopIteration:
            self._order = iter(torch.randperm(len(self.starts), generator=self.gen).tolist())
            i = next(self._order)
        s = int(self.starts[i])
        self.drawn += 1
        return self.stream[s : s + self.seq_len]


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, vocab_size: int) -> Any:
    """LlamaConfig for the demo shape (GQA, untied head so every tensor is explicit on disk)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        use_cache=True,
    )


class Schedule:
    """Warmup, constant, then linear decay to zero over the last ``decay_frac`` of the run.

    With a time limit the run length follows what the recent step time allows (never more than
    the planned steps, and frozen once the decay has begun), so a slow or shared machine still
    ends with an annealed model; without one the schedule depends on the step number alone, so
    runs are reproducible.
    """

    def __init__(self, peak: float, warmup: int, planned: int, decay_frac: float):
        self.peak, self.warmup, self.decay_frac = peak, warmup, decay_frac
        self.planned = self.total = planned
        self.decay_start: int | None = None

    def replan(self, step: int, steps_left_by_time: float) -> None:
        """Fit the run length to the deadline while still in the constant phase."""
        if self.decay_start is None:
            self.total = max(step + 1, min(self.planned, int(step + steps_left_by_time)))

    def lr(self, step: int) -> float:
        """Learning rate for 0-based ``step``."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        decay_len = max(1, round(self.total * self.decay_frac))
        start = self.total - decay_len
        if step < start:
            return self.peak
        if self.decay_start is None:
            self.decay_start = step
        return self.peak * max(0.0, (self.total - step) / (self.total - self.decay_start + 1))


def train(
    args: argparse.Namespace,
    model: Any,
    code: WindowStream,
    chat: WindowStream,
    deadline: float | None,
) -> dict[str, Any]:
    """AdamW training loop in fp32; returns run statistics for the model card."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sched = Schedule(args.lr, args.warmup, args.steps, args.decay_frac)
    chat_per_step = args.batch_size * args.chat_frac
    tokens_per_step = args.batch_size * args.seq_len
    losses: list[float] = []
    ema: float | None = None
    t0 = time.monotonic()
    stamps = [t0]
    step = 0
    model.train()
    while step < sched.total:
        if deadline is not None and step >= 5:
            # Recent steps only: the first ones pay for lazy init, and other jobs come and go.
            recent = stamps[-21:]
            per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
            left = deadline - time.monotonic()
            if left < per_step:
                print(f"time limit: stopping after {step} steps", flush=True)
                break
            sched.replan(step, 0.95 * left / per_step)
        lr = sched.lr(step)
        for group in opt.param_groups:
            group["lr"] = lr
        # Fractional share: e.g. 0.6 chat windows per step -> 0,1,1,0,1,... (deterministic).
        n_chat = math.floor((step + 1) * chat_per_step) - math.floor(step * chat_per_step)
        rows = [chat.next_window() for _ in range(min(n_chat, args.batch_size))]
        rows += [code.next_window() for _ in range(args.batch_size - len(rows))]
        batch = torch.stack(rows)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        stamps.append(time.monotonic())
        value = float(loss.detach())
        losses.append(value)
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        if step % args.log_every == 0 or step == 1 or step == sched.total:
            elapsed = time.monotonic() - t0
            tps = step * tokens_per_step / elapsed
            eta = (sched.total - step) * elapsed / step
            print(
                f"step {step:4d}/{sched.total} loss {value:.3f} (ema {ema:.3f}) lr {lr:.2e} "
                f"{tps:,.0f} tok/s elapsed {elapsed:.0f}s eta {eta:.0f}s",
                flush=True,
            )
    model.eval()
    elapsed = time.monotonic() - t0
    tail = losses[-20:]
    return {
        "steps": step,
        "planned_steps": args.steps,
        "time_limited": step < args.steps,
        "train_seconds": elapsed,
        "tokens_seen": step * tokens_per_step,
        "tokens_per_s": step * tokens_per_step / max(elapsed, 1e-9),
        "final_loss": sum(tail) / max(1, len(tail)),
        "first_loss": losses[0] if losses else float("nan"),
        "code_passes": code.passes,
        "chat_passes": chat.passes,
    }


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_folder(model: Any, tok: Any, out: Path, max_positions: int) -> None:
    """Write the HF folder: weights + config via transformers, tokenizer files by hand."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes "dtype" and nests rope_theta in "rope_parameters"; also write the
    # classic top-level keys that older readers and hand-written loaders look for.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")

    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "padding_side": "left",  # decoder-only batch generation
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
        "do_sample": False,
        "max_length": max_positions,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Build data, train, save, verify, write the card; prints a summary."""
    args = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.time_limit_s if args.time_limit_s > 0 else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    root = stdlib_root()
    files = load_sources(root)
    code_texts = select_code_docs(files, args.max_doc_chars, args.code_docs)
    topics = topic_docs(args.max_doc_chars)
    qa = build_qa(files, args.max_qa)
    args.qa_out.parent.mkdir(parents=True, exist_ok=True)
    with args.qa_out.open("w", encoding="utf-8") as fh:
        for item in qa:
            fh.write(json.dumps(item, ensure_ascii=False) + "\n")
    notes_qa = domain_qa(args.domain_notes) if args.domain_notes else []
    # The stdlib system prompt goes only with stdlib questions (half of them).
    chat_texts = [render_chat(chat_messages(x, i % 2 == 1)) for i, x in enumerate(qa)]
    chat_texts += [render_chat(chat_messages(x, False)) for x in notes_qa]
    print(
        f"data: {len(files)} files -> {len(code_texts)} code docs, {len(topics)} topics, "
        f"{len(qa)} Q/A pairs, {len(notes_qa)} topic-note pairs "
        f"({time.monotonic() - t_start:.0f}s)",
        flush=True,
    )

    # Role/bos/eos strings in the chat texts are special tokens, so they never enter merges.
    tok = train_tokenizer(code_texts + topics + chat_texts, args.vocab_size)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    def encode_all(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    code_docs = encode_all(code_texts + topics)
    # Chat renderings carry their own bos/eos; strip them, WindowStream adds them back.
    chat_docs = [ids[1:-1] for ids in encode_all(chat_texts)]
    random.Random(args.seed).shuffle(chat_docs)  # mix domains inside each chat window
    corpus_sha = hashlib.sha256(
        "\x00".join(code_texts + topics + chat_texts).encode("utf-8")
    ).hexdigest()
    code = WindowStream(code_docs, args.seq_len, args.seed, bos, eos)
    chat = WindowStream(chat_docs, args.seq_len, args.seed + 1, bos, eos)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, code tokens {code.n_tokens:,}, "
        f"chat tokens {chat.n_tokens:,} ({time.monotonic() - t_start:.0f}s)",
        flush=True,
    )

    config = build_config(args, tok.get_vocab_size())
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params:,} params, hidden {args.hidden}, layers {args.layers}, heads "
        f"{args.heads}/{args.kv_heads} kv, intermediate {args.intermediate}",
        flush=True,
    )

    # Keep ~60 s for saving and verification inside the time limit (more on a busy CPU).
    train_deadline = None if deadline is None else deadline - 60.0
    stats = train(args, model, code, chat, train_deadline)

    save_folder(model, tok, args.out, args.max_positions)
    heldout_qa = domain_qa(args.domain_notes, golden=True) if args.domain_notes else []
    report = verify(args.out, qa, notes_qa, heldout_qa)
    cmd = "python -m bench.train_tiny " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    info = {
        "args": args,
        "stats": stats,
        "verify": report,
        "config": json.loads((args.out / "config.json").read_text()),
        "python": sys.version.split()[0],
        "n_files": len(files),
        "n_code_docs": len(code_texts),
        "n_topics": len(topics),
        "n_qa": len(qa),
        "n_notes_qa": len(notes_qa),
        "code_tokens": code.n_tokens,
        "chat_tokens": chat.n_tokens,
        "corpus_sha": corpus_sha,
        "params": params,
        "command": cmd.strip(),
        "total_seconds": time.monotonic() - t_start,
        "folder_mb": 0.0,
    }
    write_card(args.out, info)
    # The card's own size barely moves the total; write it again with the final number.
    info["folder_mb"] = folder_bytes(args.out) / 1e6
    info["total_seconds"] = time.monotonic() - t_start
    write_card(args.out, info)

    for smp in report["samples"]:
        print(f"--- top1 {smp['top1']:.3f}\n{smp['prompt']}{smp['completion']}")
    print(
        f"done: {stats['steps']} steps, final loss {stats['final_loss']:.3f}, "
        f"QA exact {report['qa']['exact']:.1%}, folder {info['folder_mb']:.2f} MB, "
        f"{info['total_seconds']:.0f}s total -> {args.out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
