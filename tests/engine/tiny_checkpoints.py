"""Tiny random Hugging Face checkpoints saved by the tests themselves, and their reference
greedy outputs from ``transformers.generate``.

Random tiny models are nearly uniform over the vocabulary, so greedy ties would be decided
by rounding noise. The LM head (and, when tied, the embeddings) is scaled up so the top
token leads by a wide margin; fp32 on both sides then gives identical tokens.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

VOCAB = 300
EOS = 299  # rarely chosen: most tests run to max_tokens, a few stop on it

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=EOS,
    pad_token_id=0,
    initializer_range=0.2,
)

KINDS = ("llama", "qwen2", "qwen3", "mistral")


def _config(kind: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    if kind == "llama":  # GQA + Llama 3.1 RoPE scaling
        return tf.LlamaConfig(
            **COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
        )
    if kind == "qwen2":  # q/k/v bias, tied embeddings
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0)
    if kind == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        return tf.Qwen3Config(**COMMON, head_dim=32)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    raise ValueError(kind)


@cache
def checkpoint(kind: str, root: str) -> Path:
    """Save (once per session) a tiny confident random ``kind`` checkpoint under ``root``."""
    import transformers as tf

    torch.manual_seed(1234)
    cfg = _config(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Wider logits: clear greedy margins (see the module docstring).
        model.get_output_embeddings().weight.mul_(4.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)  # exercise the q/k/v biases, HF inits them to zero
    path = Path(root) / kind
    model.save_pretrained(path, safe_serialization=True)
    return path


_hf_cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by ``transformers.generate`` (stops after EOS, like the engine)."""
    key = (str(path), tuple(prompt), max_new_tokens)
    if key not in _hf_cache:
        model = _hf_model(str(path))
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=0,
            )
        _hf_cache[key] = out[0, len(prompt) :].tolist()
        if EOS in _hf_cache[key]:
            _hf_cache[key] = _hf_cache[key][: _hf_cache[key].index(EOS) + 1]
    return _hf_cache[key]


@cache
def _hf_model(path: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(block_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose lengths sit on and around block boundaries."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    return [torch.randint(2, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
