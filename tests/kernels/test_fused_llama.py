"""The decoder on the fused kernels gives the torch path's logits and K/V.

Both paths run the same weights through a varlen prefill of two sequences and then a
decode step; the fused one runs its Triton kernels in the interpreter when there is no GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.engine.attention import AttentionMetadata, LayerKV
from workers.engine.loader import load_model, load_model_config
from workers.engine.models.llama import LlamaForCausalLM, ModelConfig

BLOCK = 4
# fp32: the norms' reduction order is the only difference (a few ulps; logits move ~4e-7).
# bf16: equal in the interpreter, but a norm one ulp off (2^-8) may flip later roundings.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}


def _model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    net = load_model("dummy:tiny", cfg, device, dtype, "torch", seed=0)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():  # dummy norms are all ones: random ones catch a swapped weight
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen, device=device))
    return net


def _steps(device: torch.device) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """(positions, metadata) of a prefill of 5 + 3 tokens, then one decode step of both."""

    def ints(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    tables = ints([[0, 1], [2, 3]], torch.int32)
    prefill = AttentionMetadata(
        slot_mapping=ints([0, 1, 2, 3, 4, 8, 9, 10], torch.int64),
        block_tables=tables,
        context_lens=ints([5, 3], torch.int32),
        cu_seqlens_q=ints([0, 5, 8], torch.int32),
        max_seqlen_q=5,
        max_context_len=5,
    )
    decode = AttentionMetadata(
        slot_mapping=ints([5, 11], torch.int64),
        block_tables=tables,
        context_lens=ints([6, 4], torch.int32),
        cu_seqlens_q=None,
        max_seqlen_q=1,
        max_context_len=6,
    )
    return [
        (ints([0, 1, 2, 3, 4, 0, 1, 2], torch.int64), prefill),
        (ints([5, 3], torch.int64), decode),
    ]


def _run(net: LlamaForCausalLM, device: torch.device) -> tuple[list[torch.Tensor], list[LayerKV]]:
    cfg = net.config
    shape = (4, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    dtype = net.model.embed_tokens.dtype
    caches = [
        LayerKV(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    gen = torch.Generator().manual_seed(2)
    logits = []
    with torch.no_grad():
        for positions, meta in _steps(device):
            ids = torch.randint(0, cfg.vocab_size, positions.shape, generator=gen).to(device)
            logits.append(net.compute_logits(net(ids, positions, meta, caches)))
    return logits, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_fused_decoder_gives_the_torch_paths_logits(
    qk_norm: bool, dtype: torch.dtype, device: torch.device
) -> None:
    cfg = dataclasses.replace(load_model_config("dummy:tiny"), num_layers=2, qk_norm=qk_norm)
    net = _model(cfg, dtype, device)

    net.fused_ops = False
    want_logits, want_kv = _run(net, device)
    net.fused_ops = True
    got_logits, got_kv = _run(net, device)

    tol = TOLERANCE[dtype]
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for got_layer, want_layer in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(got_layer.k, want_layer.k, atol=tol, rtol=tol)
        torch.testing.assert_close(got_layer.v, want_layer.v, atol=tol, rtol=tol)


def test_fused_kernels_run_only_on_cuda_with_the_triton_backend() -> None:
    cfg = load_model_config("dummy:tiny")
    with torch.device("meta"):
        triton_net, torch_net = LlamaForCausalLM(cfg, "triton"), LlamaForCausalLM(cfg, "torch")

    assert not triton_net.use_fused(torch.zeros(1))
    assert not torch_net.use_fused(torch.zeros(1))
    if torch.cuda.is_available():
        assert triton_net.use_fused(torch.zeros(1, device="cuda"))
        assert not torch_net.use_fused(torch.zeros(1, device="cuda"))
