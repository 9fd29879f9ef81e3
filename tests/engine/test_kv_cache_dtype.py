"""The engine with an int8 / fp8 KV cache: validated, half the bytes, same tokens as an fp32
cache on a confident checkpoint (not all: quantised K/V move logits a little)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from tests.engine.tiny_checkpoints import checkpoint, prompts
from workers.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from workers.engine.model_runner import kv_bytes_per_block

QUANT = ["int8", "fp8_e4m3"]
FLOOR = {"int8": 0.95, "fp8_e4m3": 0.8}  # share of teacher-forced greedy steps that agree
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_kv_cache_dtype_must_be_auto_int8_or_fp8() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineArgs("dummy:tiny", kv_cache_dtype="fp16")


def test_quantized_block_bytes_count_the_scales_and_are_about_half_of_bf16() -> None:
    llama8b = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    bf16 = kv_bytes_per_block(llama8b, 16, torch.bfloat16)  # type: ignore[arg-type]
    for dtype in (torch.int8, torch.float8_e4m3fn):
        got = kv_bytes_per_block(llama8b, 16, dtype)  # type: ignore[arg-type]
        assert got == 2 * 32 * 16 * 8 * (128 + 4)  # 1 byte a value, 4 bytes a token-head
        assert got / bf16 == pytest.approx(0.515625)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_engine_with_quantized_kv_serves_dummy_tiny(kv_dtype: str) -> None:
    llm = LLM("dummy:tiny", num_kv_blocks=16, block_size=4, kv_cache_dtype=kv_dtype)
    runner = llm.engine.runner
    assert runner.kv_caches[0].k.dtype == {"int8": torch.int8}.get(kv_dtype, torch.float8_e4m3fn)
    assert runner.kv_caches[0].k_scale is not None
    outs = llm.generate(prompt_token_ids=[[5, 6, 7], list(range(3, 22))], sampling_params=GREEDY)
    assert [len(o.token_ids) for o in outs] == [12, 12]
    assert runner.kv_layout().quant == "per_token_head"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("llama", str(tmp_path_factory.mktemp("ckpt")))


def _greedy(
    path: Path, kv_dtype: str, batch: list[list[int]], max_tokens: int = 12
) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256, kv_cache_dtype=kv_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=params)]


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantized_kv_picks_the_fp32_kv_next_token_at_nearly_every_step_on_tiny_llama(
    tiny_llama: Path, kv_dtype: str
) -> None:
    """Teacher-forced: every prefix of the fp32-KV continuation, one greedy token each, so
    one near-tie flip counts once instead of derailing the rest of its sequence."""
    batch = prompts(4) + prompts(4, seed=1) + prompts(4, seed=2)
    want = _greedy(tiny_llama, "auto", batch)
    steps = [(p + w[:i], w[i]) for p, w in zip(batch, want, strict=True) for i in range(len(w))]
    got = _greedy(tiny_llama, kv_dtype, [p for p, _ in steps], max_tokens=1)
    same = sum(g == [w] for g, (_, w) in zip(got, steps, strict=True))
    # Observed (180 steps): int8 179 (99.4 %), fp8 160 (88.9 %). This random checkpoint's
    # top-2 margins go down to ~4e-3, within reach of fp8's ~2.4 % relative K/V error
    # (3 mantissa bits) and not of int8's ~0.5 %. The trained demo checkpoint is barely
    # less tied (bench/kvquant.py). A wrong scale or mask drops both to chance.
    assert same / len(steps) >= FLOOR[kv_dtype]


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_exported_quantized_blocks_carry_scales_and_import_back_bit_exact(kv_dtype: str) -> None:
    eng = LLMEngine(
        EngineArgs("dummy:tiny", block_size=4, num_kv_blocks=8, kv_cache_dtype=kv_dtype)
    )
    runner = eng.runner
    for layer in runner.kv_caches:
        assert layer.k_scale is not None and layer.v_scale is not None
        layer.k.copy_(torch.randn(layer.k.shape).to(layer.k.dtype))
        layer.v.copy_(torch.randn(layer.v.shape).to(layer.v.dtype))
        layer.k_scale.copy_(torch.rand(layer.k_scale.shape))
        layer.v_scale.copy_(torch.rand(layer.v_scale.shape))
    rows = runner.export_blocks([3, 1])
    assert rows.shape == (2, runner.bytes_per_block())
    # Scales first: [K|V, layer, token, head] fp32 of block 1 in row 1.
    n_layers, n_kv = len(runner.kv_caches), runner.kv_caches[0].k.shape[2]
    scale_bytes = 2 * n_layers * 4 * n_kv * 4
    scales = torch.from_numpy(rows[1, :scale_bytes].copy()).view(torch.float32)
    assert torch.equal(scales.view(2, n_layers, 4, n_kv)[1, 0], runner.kv_caches[0].v_scale[1])
    runner.import_blocks([6, 5], [memoryview(r) for r in rows])
    assert np.array_equal(runner.export_blocks([6, 5]), rows)
