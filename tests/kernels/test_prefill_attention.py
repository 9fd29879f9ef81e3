"""Varlen causal prefill over paged KV against the torch reference.

A batch mixes what a chunked-prefill step holds: fresh prompts, chunks after a cached prefix
(block-aligned or not), one-token decode rows, and sequences with no tokens this step.
"""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.decode_attention import paged_decode_attention
from workers.engine.kernels.prefill_attention import PrefillConfig, paged_prefill_attention
from workers.engine.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)

KV_HEADS = 2


def _mixed_batch(block_size: int) -> list[tuple[int, int]]:
    """(q_len, context_len) pairs; the prefix is context_len - q_len."""
    bs = block_size
    return [
        (bs + 1, bs + 1),  # fresh prompt just past a block edge
        (5, 3 * bs),  # short chunk after a cached prefix
        (1, 2 * bs + 3),  # a decode in a mixed step
        (0, bs),  # nothing to do this step
        (bs - 1, bs - 1),  # fresh prompt just short of a block
        (2 * bs, 2 * bs + 7),  # chunk after an unaligned prefix
    ]


def _run(make_paged_kv, seqs, block_size, group, head_dim, dtype, **kwargs):
    kv = make_paged_kv([ctx for _, ctx in seqs], block_size, KV_HEADS, head_dim, dtype)
    device = kv.k_cache.device
    q_lens = torch.tensor([q for q, _ in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    cu = cu.to(device)
    q = torch.randn(int(cu[-1]), KV_HEADS * group, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, scale)
    got = paged_prefill_attention(*args, **kwargs)
    want = paged_prefill_attention_ref(*args)
    return got, want


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_matches_reference_on_a_mixed_chunked_batch(
    make_paged_kv, assert_close, block_size: int, group: int
) -> None:
    seqs = _mixed_batch(block_size)
    # Small tiles: several query tiles per sequence, and prefixes long enough for key tiles
    # that skip the causal mask.
    config = PrefillConfig(block_m=max(32, 8 * group), block_n=16, num_warps=4, num_stages=2)
    got, want = _run(
        make_paged_kv, seqs, block_size, group, 32, torch.float32,
        max_seqlen_q=max(q for q, _ in seqs), config=config,
    )  # fmt: skip
    assert_close(got, want)


def test_prefill_causal_edge_holds_for_every_prefix_offset_in_a_key_tile(
    make_paged_kv, assert_close
) -> None:
    # The unmasked key tiles end below each query tile's first position: one key too many
    # shows only when a prefix ends at particular offsets inside a tile, so try them all.
    block_n = 16
    seqs = [(3, prefix + 3) for prefix in range(block_n + 2)]
    config = PrefillConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2)
    got, want = _run(make_paged_kv, seqs, 8, 1, 16, torch.float32, max_seqlen_q=3, config=config)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_prefill_matches_reference_for_head_dims_and_dtypes(
    make_paged_kv, assert_close, head_dim: int, dtype: torch.dtype
) -> None:
    got, want = _run(make_paged_kv, _mixed_batch(16), 16, 2, head_dim, dtype)
    assert_close(got, want)


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_default_config_over_a_long_cached_prefix(
    make_paged_kv, assert_close, group: int
) -> None:
    # Prefix of 150 tokens: the default 64-key tiles run unmasked before the diagonal.
    seqs = [(50, 200), (70, 70), (1, 129)]
    got, want = _run(make_paged_kv, seqs, 16, group, 64, torch.bfloat16, max_seqlen_q=70)
    assert_close(got, want)


def test_prefill_of_one_token_rows_equals_the_decode_kernel(make_paged_kv, assert_close) -> None:
    lens, group, head_dim = [1, 9, 16, 17, 40], 4, 32
    kv = make_paged_kv(lens, 8, KV_HEADS, head_dim, torch.float32)
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, device=kv.k_cache.device)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device)
    prefill = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, 0.2, max_seqlen_q=1
    )
    decode = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, num_splits=2
    )
    want = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2
    )
    assert_close(prefill, want)
    assert_close(decode, want)


def test_prefill_without_max_seqlen_q_and_into_a_given_out(make_paged_kv, assert_close) -> None:
    seqs = [(3, 10), (12, 12)]
    kv = make_paged_kv([c for _, c in seqs], 8, KV_HEADS, 16, torch.float32)
    q = torch.randn(15, KV_HEADS * 2, 16, device=kv.k_cache.device)
    cu = torch.tensor([0, 3, 15], dtype=torch.int32, device=q.device)
    out = torch.full_like(q, float("nan"))
    args = (q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, 0.25)
    got = paged_prefill_attention(*args, out=out)
    assert got is out
    assert_close(out, paged_prefill_attention_ref(*args))


def test_prefill_rejects_tiles_narrower_than_the_group(make_paged_kv) -> None:
    kv = make_paged_kv([4], 8, KV_HEADS, 16, torch.float32)
    q = torch.randn(4, KV_HEADS * 32, 16, device=kv.k_cache.device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="block_m"):
        paged_prefill_attention(
            q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, 1.0,
            config=PrefillConfig(block_m=16),
        )  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_llama_like_heads_with_default_config_on_gpu(make_paged_kv, assert_close) -> None:
    seqs = [(1000, 1000), (512, 4096), (1, 777), (0, 64), (300, 333)]
    got, want = _run(make_paged_kv, seqs, 16, 4, 128, torch.bfloat16, max_seqlen_q=1000)
    assert_close(got, want)
