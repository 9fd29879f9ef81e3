"""Loading: sharded checkpoints, fused projections, dummy shapes of real models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.tiny_checkpoints import checkpoint, hf_greedy, prompts
from workers.engine import LLM, SamplingParams
from workers.engine.loader import load_model, load_model_config


def test_sharded_checkpoint_loads_through_its_index(tmp_path: Path) -> None:
    import transformers as tf

    src = checkpoint("llama", str(tmp_path))
    model = tf.AutoModelForCausalLM.from_pretrained(src)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    batch = prompts(4, seed=9)
    llm = LLM(str(sharded), dtype="float32", block_size=4, num_kv_blocks=32)
    outs = llm.generate(
        prompt_token_ids=batch, sampling_params=SamplingParams(temperature=0, max_tokens=6)
    )
    assert [o.token_ids for o in outs] == [hf_greedy(src, p, 6) for p in batch]


def test_qkv_and_gate_up_are_fused_in_checkpoint_order(tmp_path: Path) -> None:
    path = checkpoint("qwen2", str(tmp_path))
    cfg = load_model_config(str(path))
    net = load_model(str(path), cfg, torch.device("cpu"), torch.float32, "torch")
    hf = load_file(path / "model.safetensors")
    attn = net.model.layers[1].self_attn
    want = torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, want)
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None  # Qwen2: q/k/v bias only
    mlp = net.model.layers[1].mlp
    want = torch.cat([hf[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)
    assert net.lm_head is None  # tied: the head is the embedding


@pytest.mark.parametrize(
    ("spec", "billions"),
    [("dummy:qwen2-0.5b", 0.494), ("dummy:llama-1b", 1.236), ("dummy:llama-8b", 8.03)],
)
def test_dummy_specs_have_the_real_models_shapes(spec: str, billions: float) -> None:
    assert load_model_config(spec).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_dummy_weights_give_finite_logits() -> None:
    llm = LLM("dummy:tiny", num_kv_blocks=16)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    assert out.logprobs is not None and all(torch.isfinite(torch.tensor(out.logprobs)))
