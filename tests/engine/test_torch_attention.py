"""The batched torch attention (CPU serving path) equals the per-sequence references."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from workers.engine.kernels.torch_paged import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
)


def _cache(num_blocks: int, block_size: int, n_kv: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g)
    return k, v, g


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_batched_decode_equals_reference_on_shuffled_blocks(block_size: int, group: int) -> None:
    n_kv, head_dim, num_blocks = 2, 16, 48
    k_cache, v_cache, g = _cache(num_blocks, block_size, n_kv, head_dim, seed=block_size + group)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    max_blocks = (max(lens) + block_size - 1) // block_size
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).int()
    context = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), n_kv * group, head_dim, generator=g)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, context, 0.25)
    got = paged_decode_attention_torch(q, k_cache, v_cache, tables, context, 0.25, max(lens))
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_an_empty_row_is_zeros_and_junk_past_a_context_stays_out_of_it() -> None:
    """As the kernels and the reference: a row of context 0 was NaN (softmax of all -inf),
    and an inf in V past a row's context (a reused block, the padding table's block 0) made
    that row NaN (a weight of 0 times inf)."""
    block_size, n_kv, head_dim = 4, 2, 8
    k_cache, v_cache, g = _cache(8, block_size, n_kv, head_dim, seed=3)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    context = torch.tensor([0, 9], dtype=torch.int32)
    v_cache[5, 3] = float("inf")  # row 1's slot 23: past its 9 tokens
    q = torch.randn(2, n_kv * 2, head_dim, generator=g)
    got = paged_decode_attention_torch(q, k_cache, v_cache, tables, context, 0.25, 9)
    assert torch.isfinite(got).all()
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    expected = paged_decode_attention_ref(q[1:], k_cache, v_cache, tables[1:], context[1:], 0.25)
    torch.testing.assert_close(got[1:], expected, atol=2e-6, rtol=1e-5)


def test_mixed_step_with_decodes_and_prompt_chunks_equals_reference() -> None:
    block_size, n_kv, head_dim, num_blocks, group = 8, 2, 16, 64, 2
    k_cache = torch.zeros(num_blocks, block_size, n_kv, head_dim)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator().manual_seed(7)
    # (cached prefix, new tokens): decodes, a fresh prompt, a chunk after a cached prefix.
    seqs = [(9, 1), (0, 13), (16, 1), (8, 5), (0, 1)]
    tables: list[list[int]] = []
    q_lens: list[int] = []
    free = torch.randperm(num_blocks, generator=g).tolist()
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range((total + block_size - 1) // block_size)]
        tables.append(blocks + [0] * (4 - len(blocks)))
        k = torch.randn(total, n_kv, head_dim, generator=g)
        v = torch.randn(total, n_kv, head_dim, generator=g)
        pos = torch.arange(total)
        store_kv_ref(
            k,
            v,
            k_cache,
            v_cache,
            torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size,
        )
        q_lens.append(new)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), n_kv * group, head_dim, generator=g)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, cu, context, block_tables, 0.3)
    got = paged_prefill_attention_torch(q, k_cache, v_cache, cu, context, block_tables, 0.3)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("n_q", "n_k"), [(1, 1), (2, 9), (150, 150), (70, 301), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_causal_attention_equals_the_reference_across_slices(
    group: int, n_q: int, n_k: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt chunks attend a slice of queries at a time over the keys each slice sees (4x
    torch's masked SDPA on a CPU); slices of 16 here, so every case crosses several, a
    cached prefix (n_k > n_q) included."""
    from workers.engine.kernels import torch_paged
    from workers.engine.kernels.reference import attend_causal

    monkeypatch.setattr(torch_paged, "SLICE_SCORES", 1)  # the narrowest slices: 16 queries
    g = torch.Generator().manual_seed(n_q * 1000 + n_k + group)
    n_kv, head_dim = 2, 16
    q = torch.randn(n_q, n_kv * group, head_dim, generator=g).to(dtype)
    k = torch.randn(n_k, n_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(n_k, n_kv, head_dim, generator=g).to(dtype)
    got = torch_paged.attend_causal_sliced(q, k, v, 0.25)
    assert got.dtype == dtype
    tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, attend_causal(q, k, v, 0.25), **tol)
