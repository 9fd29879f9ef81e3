"""Paged decode attention (split-KV, GQA) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from workers.engine.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_plan,
    paged_decode_attention,
)
from workers.engine.kernels.reference import paged_decode_attention_ref

KV_HEADS = 2


def _lengths(block_size: int) -> list[int]:
    # Around every block edge, plus a sequence of several blocks.
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


def _run(make_paged_kv, lens, block_size, group, head_dim, dtype, **kwargs):
    kv = make_paged_kv(lens, block_size, KV_HEADS, head_dim, dtype)
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, device=kv.k_cache.device).to(dtype)
    scale = head_dim**-0.5
    got = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale, **kwargs
    )
    want = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale
    )
    return got, want


# Every block size meets every group; each of them runs both with one split and with three.
@pytest.mark.parametrize(
    ("block_size", "group", "num_splits"),
    [
        (bs, g, 3 if (i + j) % 2 else 1)
        for i, bs in enumerate((8, 16, 32))
        for j, g in enumerate((1, 2, 4, 8))
    ],
)
def test_decode_matches_reference_across_block_edges_and_gqa_groups(
    make_paged_kv, assert_close, block_size: int, group: int, num_splits: int
) -> None:
    lens = _lengths(block_size)
    got, want = _run(
        make_paged_kv, lens, block_size, group, 32, torch.float32,
        max_context_len=max(lens), num_splits=num_splits,
        config=DecodeConfig(block_n=16),
    )  # fmt: skip
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_decode_matches_reference_for_head_dims_and_dtypes(
    make_paged_kv, assert_close, head_dim: int, dtype: torch.dtype
) -> None:
    lens = _lengths(16)
    got, want = _run(make_paged_kv, lens, 16, 4, head_dim, dtype, num_splits=2)
    assert_close(got, want)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_bf16_with_default_config_and_split_heuristic(
    make_paged_kv, assert_close, group: int
) -> None:
    lens = [5, 200, 600, 64]
    got, want = _run(make_paged_kv, lens, 16, group, 64, torch.bfloat16, max_context_len=600)
    assert_close(got, want)


def test_decode_with_more_splits_than_tiles_leaves_empty_splits_harmless(
    make_paged_kv, assert_close
) -> None:
    lens = [1, 9, 40]
    got, want = _run(
        make_paged_kv, lens, 8, 2, 16, torch.float32, num_splits=16,
        config=DecodeConfig(block_n=16),
    )  # fmt: skip
    assert_close(got, want)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_sequence_of_length_zero_gives_zeros(
    make_paged_kv, assert_close, num_splits
) -> None:
    kv = make_paged_kv([0, 20, 0], 8, KV_HEADS, 16, torch.float32)
    q = torch.randn(3, KV_HEADS * 2, 16, device=kv.k_cache.device)
    got = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25, num_splits=num_splits
    )
    assert torch.isfinite(got).all()
    assert torch.count_nonzero(got[0]) == 0 and torch.count_nonzero(got[2]) == 0
    # The reference is asked about the real sequence only: SDPA over no keys is not its job.
    want = paged_decode_attention_ref(
        q[1:2], kv.k_cache, kv.v_cache, kv.block_tables[1:2], kv.context_lens[1:2], 0.25
    )
    assert_close(got[1:2], want)


def test_decode_reads_a_strided_q_and_writes_into_out(make_paged_kv, assert_close) -> None:
    lens, group, head_dim = [7, 30], 4, 32
    kv = make_paged_kv(lens, 8, KV_HEADS, head_dim, torch.float32)
    n_heads = KV_HEADS * group
    fused = torch.randn(len(lens), n_heads + 2 * KV_HEADS, head_dim, device=kv.k_cache.device)
    q = fused[:, :n_heads]
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3, num_splits=2, out=out
    )
    want = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3
    )
    assert got is out
    assert_close(out, want)


def test_decode_rejects_mismatched_dtypes_and_odd_block_sizes(make_paged_kv) -> None:
    kv = make_paged_kv([4], 8, KV_HEADS, 16, torch.float32)
    q = torch.randn(1, 4, 16, device=kv.k_cache.device)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(
            q.bfloat16(), kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0
        )
    odd = kv.k_cache.view(-1, 1, KV_HEADS, 16)[:12].reshape(2, 6, KV_HEADS, 16)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, odd, odd, kv.block_tables, kv.context_lens, 1.0)


def test_num_splits_is_a_pure_function_that_fills_the_gpu_and_respects_length() -> None:
    # Big batches already fill 132 SMs: few splits. One long sequence: many. Short: one.
    assert choose_num_splits(64, 8, 2048, 64) <= 2
    assert choose_num_splits(8, 8, 32768, 64) >= 8
    assert choose_num_splits(1, 8, 32768, 64) == 64
    assert choose_num_splits(1, 8, 100, 64) == 1
    # Pure: the same answer from the arguments alone (no device or global state), pinned.
    assert choose_num_splits(8, 8, 32768, 64) == 9
    for batch in (1, 3, 64, 1000):
        for length in (1, 255, 256, 4096, 1 << 20):
            splits = choose_num_splits(batch, 8, length, 64)
            assert 1 <= splits <= max(1, length // 256)


def test_decode_plan_pipelines_deeper_only_for_an_unsplit_half_precision_grid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QOSSERVE_DECODE_CONFIG", raising=False)
    cfg, splits = decode_plan(256, 8, 640, 128, cache_elem_bytes=2)
    assert splits == 1 and cfg.num_stages == 3
    cfg, splits = decode_plan(256, 8, 640, 128, cache_elem_bytes=4)  # fp32 tiles: no room
    assert splits == 1 and cfg.num_stages == 2
    cfg, splits = decode_plan(8, 8, 32768, 128, cache_elem_bytes=2)
    assert splits > 1 and cfg.num_stages == 2
    monkeypatch.setenv("QOSSERVE_DECODE_CONFIG", "32,8,4")
    cfg, splits = decode_plan(256, 8, 640, 128, cache_elem_bytes=2)
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, splits) == (32, 8, 4, 1)
    monkeypatch.setenv("QOSSERVE_DECODE_CONFIG", "fast")
    with pytest.raises(ValueError, match="QOSSERVE_DECODE_CONFIG"):
        decode_plan(256, 8, 640, 128, cache_elem_bytes=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_llama_like_heads_with_default_heuristics_on_gpu(
    make_paged_kv, assert_close
) -> None:
    lens = [1, 17, 1000, 2049, 4096, 300]
    got, want = _run(make_paged_kv, lens, 16, 4, 128, torch.bfloat16, max_context_len=4096)
    assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_replays_in_a_cuda_graph_with_new_lengths(make_paged_kv, assert_close) -> None:
    block_size, group, head_dim, bucket = 16, 4, 128, 512
    kv = make_paged_kv([bucket] * 4, block_size, KV_HEADS, head_dim, torch.bfloat16)
    q = torch.randn(4, KV_HEADS * group, head_dim, device="cuda", dtype=torch.bfloat16)
    lens = kv.context_lens
    lens.copy_(torch.tensor([1, 100, 300, 512], dtype=torch.int32))

    def step() -> torch.Tensor:
        return paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.1, max_context_len=bucket
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([5, 17, 511, 2], [512, 0, 33, 64]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q.normal_()
        graph.replay()
        real = lens > 0
        want = paged_decode_attention_ref(
            q[real], kv.k_cache, kv.v_cache, kv.block_tables[real], lens[real], 0.1
        )
        assert_close(out[real], want)
        assert torch.count_nonzero(out[~real]) == 0
