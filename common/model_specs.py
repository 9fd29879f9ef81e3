"""What a model spec names and whether the engine can serve it, read without torch: the
launcher and a worker check a spec before anything starts (a typo like ``dummy:tinyy`` had
NATS, Redis, the scheduler and every worker up before the workers said so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Real shapes (from the models' config.json), for benchmarks with random weights.
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling=_LLAMA3_ROPE,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        eos_token_id=[128001, 128008, 128009],
    ),
}


class ModelLoadError(ConfigError):
    """The model cannot be loaded; the message names the file, tensor or architecture."""

    default_code = "model_load_error"


def is_dummy(model: str) -> bool:
    return model.startswith("dummy:")


def hf_config(model: str) -> dict[str, Any]:
    """A folder's ``config.json``, checked (a supported architecture, no quantization), or a
    dummy spec's shape; :class:`ModelLoadError` naming what is wrong otherwise."""
    if is_dummy(model):
        shape = model.split(":", 1)[1]
        if shape not in DUMMY_SHAPES:
            raise ModelLoadError(
                f"unknown dummy model {model!r}; known: "
                + ", ".join(f"dummy:{s}" for s in DUMMY_SHAPES)
            )
        return dict(DUMMY_SHAPES[shape])
    folder = Path(model)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {model!r} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a model folder needs config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if archs and not known:
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs}; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ModelLoadError(
            f"{path}: unsupported model_type {model_type!r}; supported: "
            + ", ".join(sorted(set(SUPPORTED_ARCHITECTURES.values())))
        )
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if quant:
        # Refused here, before the full-size unquantized model is allocated (which either
        # runs out of memory or fails on the first scale tensor).
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelLoadError(
            f"{path}: quantized checkpoints are not supported (quant_method={method!r}); "
            "serve the unquantized weights"
        )
    return cfg
