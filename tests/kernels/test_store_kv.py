"""store_kv writes exactly the slots it is given, byte for byte like the reference."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.reference import store_kv_ref
from workers.engine.kernels.store_kv import store_kv


def _caches(num_blocks: int, block_size: int, n_kv: int, head_dim: int, dtype, device):
    # Random, not zero: a write to a wrong slot, or a missed one, changes bytes we compare.
    gen = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, n_kv, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


def _slots(n_tokens: int, num_slots: int, pad_every: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_slots, generator=gen)[:n_tokens].to(torch.int64)
    slots[::pad_every] = -1
    return slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 80])
@pytest.mark.parametrize("n_kv", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_store_kv_writes_scattered_slots_and_skips_padding(
    block_size: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    num_blocks, n_tokens = 4, block_size + 3
    k_cache, v_cache = _caches(num_blocks, block_size, n_kv, head_dim, dtype, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(n_tokens, n_kv, head_dim, device=device).to(dtype)
    v = torch.randn(n_tokens, n_kv, head_dim, device=device).to(dtype)
    slots = _slots(n_tokens, num_blocks * block_size, pad_every=5, device=device)

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, want_k, want_v, slots)

    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_store_kv_reads_strided_views_of_a_fused_qkv(device: torch.device) -> None:
    n_tokens, n_heads, n_kv, head_dim, block_size = 9, 8, 2, 32, 8
    qkv = torch.randn(n_tokens, (n_heads + 2 * n_kv) * head_dim, device=device)
    q_size, kv_size = n_heads * head_dim, n_kv * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(n_tokens, n_kv, head_dim)
    v = qkv[:, q_size + kv_size :].view(n_tokens, n_kv, head_dim)
    assert not k.is_contiguous()
    k_cache, v_cache = _caches(4, block_size, n_kv, head_dim, torch.float32, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = _slots(n_tokens, 4 * block_size, pad_every=4, device=device)

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, want_k, want_v, slots)

    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_store_kv_casts_fp32_activations_into_a_bf16_cache(device: torch.device) -> None:
    k_cache, v_cache = _caches(3, 16, 2, 64, torch.bfloat16, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(7, 2, 64, device=device)
    v = torch.randn(7, 2, 64, device=device)
    slots = torch.tensor([0, 17, 18, -1, 47, 3, 30], device=device)

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, want_k, want_v, slots)

    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_store_kv_all_padding_or_no_tokens_writes_nothing(device: torch.device) -> None:
    k_cache, v_cache = _caches(2, 8, 2, 16, torch.float32, device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(3, 2, 16, device=device)
    store_kv(k, k, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=device))
    empty = torch.empty(0, 2, 16, device=device)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before_k)
    assert torch.equal(v_cache, before_v)


def test_store_kv_rejects_a_cache_of_another_head_shape(device: torch.device) -> None:
    k_cache, v_cache = _caches(2, 8, 2, 16, torch.float32, device)
    k = torch.randn(3, 4, 16, device=device)
    with pytest.raises(ValueError, match="k_cache"):
        store_kv(k, k, k_cache, v_cache, torch.zeros(3, dtype=torch.int64, device=device))
