"""Checks on a saved demo checkpoint (``bench/train_tiny.py``): ``transformers`` loads and
generates from it, ``tokenizers`` + ``jinja2`` reproduce its chat template, and a plain-torch
Llama forward matches the ``transformers`` logits."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from bench.tiny_chat import PAD, chat_messages, render_chat


def reference_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """Llama forward in plain torch from config.json + model.safetensors (no transformers).

    This is the contract a hand-written loader has to meet: HF parameter names, rotate-half RoPE,
    GQA by repeating KV heads, RMSNorm with weight, SwiGLU MLP, untied ``lm_head``.
    """
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    t = len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, -1)
        o = (att @ v).transpose(0, 1).reshape(t, nh * hd)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


CODE_PROMPTS = ["def __init__(self", "import os\n", "class ", "    def __repr__(self):\n"]


def qa_exact_match(model: Any, tok: Any, qa: list[dict[str, str]]) -> dict[str, float]:
    """Teacher-forced greedy check on every Q/A pair (no system prompt).

    A pair counts as exact when the argmax at every answer position (and at the closing eos)
    is the reference token, which is exactly when greedy decoding reproduces the answer.
    """
    rows = []
    for item in qa:
        msgs = chat_messages(item, False)
        p_ids = tok.encode(render_chat(msgs[:-1], True), add_special_tokens=False).ids
        full = tok.encode(render_chat(msgs), add_special_tokens=False).ids
        # Tokenized as in training (whole conversation); the answer is what follows the prompt.
        assert full[: len(p_ids)] == p_ids
        rows.append((full, len(p_ids)))
    pad = tok.token_to_id(PAD)
    exact, probs = 0, []
    with torch.no_grad():
        for i in range(0, len(rows), 64):
            chunk = rows[i : i + 64]
            width = max(len(full) for full, _ in chunk)
            # Right padding needs no mask: causal attention never looks at later positions.
            ids = torch.tensor([full + [pad] * (width - len(full)) for full, _ in chunk])
            logits = model(input_ids=ids).logits.float()
            for j, (full, n_prompt) in enumerate(chunk):
                pred = logits[j, n_prompt - 1 : len(full) - 1]
                target = torch.tensor(full[n_prompt:])
                exact += int(bool((pred.argmax(-1) == target).all()))
                sm = torch.softmax(pred, -1)
                probs.append(float(sm[torch.arange(len(target)), target].mean()))
    return {"exact": exact / len(qa), "mean_answer_token_prob": sum(probs) / len(probs)}


def greedy(model: Any, ids: list[int], max_new: int, eos: int) -> tuple[list[int], float]:
    """Greedy decode with transformers; returns new ids and the mean top-1 probability."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    top1 = [float(torch.softmax(s[0].float(), -1).max()) for s in out.scores]
    return new, sum(top1) / max(1, len(top1))


def verify(
    folder: Path,
    qa: list[dict[str, str]],
    notes_qa: list[dict[str, str]],
    heldout_qa: list[dict[str, str]],
) -> dict[str, Any]:
    """Load the saved folder three ways and generate; raise if anything disagrees."""
    import jinja2
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    hf_tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert isinstance(model, LlamaForCausalLM), type(model)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    eos = raw.token_to_id(tok_cfg["eos_token"])
    if eos is None:
        raise ValueError(f"{folder}: the tokenizer has no id for {tok_cfg['eos_token']!r}")

    # Chat template: plain jinja2 + tokenizers must equal transformers, string and ids.
    sample = qa[0]
    for with_system in (False, True):
        msgs = chat_messages(sample, with_system)[:-1]
        plain = jinja2.Template(tok_cfg["chat_template"]).render(
            messages=msgs,
            bos_token=tok_cfg["bos_token"],
            eos_token=tok_cfg["eos_token"],
            add_generation_prompt=True,
        )
        hf_text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert plain == hf_text, (plain, hf_text)
        assert plain.endswith("<|assistant|>\n")
        hf_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(hf_ids, dict) or hasattr(hf_ids, "input_ids"):
            hf_ids = hf_ids["input_ids"]
        assert list(hf_ids) == raw.encode(plain, add_special_tokens=False).ids
    assert hf_tok("class ").input_ids == raw.encode("class ").ids

    # Plain-torch reference forward must match transformers.
    probe = raw.encode("def __init__(self, name):\n    self.name = name\n").ids
    with torch.no_grad():
        hf_logits = model(input_ids=torch.tensor([probe])).logits[0].float()
    ref_diff = float((reference_logits(folder, probe) - hf_logits).abs().max())
    assert ref_diff < 1e-3, ref_diff

    samples = []
    for prompt in CODE_PROMPTS:
        new, conf = greedy(model, raw.encode(prompt).ids, 48, eos)
        samples.append({"prompt": prompt, "completion": raw.decode(new), "top1": conf})
    shown = [qa[0], qa[len(qa) // 2], qa[-1], *notes_qa[:1], *heldout_qa[:1]]
    for item in shown:
        text = render_chat(chat_messages(item, False)[:-1], add_generation_prompt=True)
        new, conf = greedy(model, raw.encode(text, add_special_tokens=False).ids, 48, eos)
        samples.append(
            {"prompt": text, "completion": raw.decode(new), "top1": conf, "ref": item["answer"]}
        )
    return {
        "samples": samples,
        "ref_max_abs_diff": ref_diff,
        "qa": qa_exact_match(model, raw, qa),
        "notes_qa": qa_exact_match(model, raw, notes_qa) if notes_qa else None,
        "heldout_qa": qa_exact_match(model, raw, heldout_qa) if heldout_qa else None,
    }
