"""Variable-length causal prefill attention over the paged KV cache (Triton).

Flash-attention style: one program per (query tile, KV head, sequence) keeps a running
softmax (max, sum, accumulator) while it walks the sequence's block table up to the causal
limit of its tile. A tile's rows are (token, query head) pairs of the KV head's whole group,
so K/V are loaded once per group rather than once per query head, and a one-token row (a
decode mixed into the step) still fills ``group`` rows of the tile.

The new tokens' K/V are already in the cache (the engine writes them first): the queries of
sequence ``b`` are the last ``q_len`` of its ``context_lens[b]`` tokens, and any cached
prefix is the part before them. Key tiles wholly below the tile's first query are visible to
every row and run without a mask; only the diagonal tiles pay for the causal mask.
An int8/fp8 cache is dequantised in the loop as in the decode kernel: exact casts of the
tiles to q's dtype, the per-token scales folded into the scores (K) and probabilities (V).
The contract is :func:`workers.engine.kernels.reference.paged_prefill_attention_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.engine.kernels.decode_attention import dot_precision, upcast_dot
from workers.engine.kernels.kv_quant import check_scales

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters: tile rows (token x head pairs), keys per tile, warps, stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_prefill_config(
    head_dim: int, group: int, max_seqlen_q: int, dtype: torch.dtype = torch.bfloat16
) -> PrefillConfig:
    """A config that suits Hopper for this shape (bench/kernels.py sweeps alternatives).

    Short queries (decode-heavy mixed steps) get short tiles: rows past the last query are
    pure waste, and the step is bound by reading the cache rather than by the products.
    fp32 tiles are twice the bytes and its 3-pass products twice the registers: halve them.
    """
    wide = dtype == torch.float32
    block_m = 64 if wide or head_dim > 128 else 128
    rows_needed = max(16, triton.next_power_of_2(max(1, max_seqlen_q) * group))
    block_m = max(min(block_m, rows_needed), triton.next_power_of_2(group), 16)
    if wide:
        return PrefillConfig(block_m=block_m, block_n=32, num_warps=4, num_stages=2)
    # head_dim > 128: three stages of 64-key K and V tiles plus the Q tile come near a
    # Hopper block's 227 KB of shared memory; two leave room.
    return PrefillConfig(
        block_m=block_m,
        block_n=64,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2 if head_dim > 128 else 3,
    )


@triton.jit
def _attend_tile(
    q,
    q_ptr,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    table,
    n0,
    q_pos,
    kv_end,
    stride_kc_blk,
    stride_kc_off,
    stride_vc_blk,
    stride_vc_off,
    scale_log2e,
    offs_n,
    mask_d,
    k_scale_base,
    v_scale_base,
    stride_sc_blk,
    stride_sc_off,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    pos = n0 + offs_n
    if CAUSAL:
        mask_n = pos < kv_end
        # int64: block id * block stride overflows int32 on large caches.
        blk = tl.load(table + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        mask_n = pos >= 0  # all true: a full tile
        blk = tl.load(table + pos // PAGE).to(tl.int64)
        kv_mask = mask_d[None, :]
    off = pos % PAGE
    k = tl.load(
        k_base + blk[:, None] * stride_kc_blk + off[:, None] * stride_kc_off,
        mask=kv_mask,
        other=0.0,
    )
    if QUANT:  # int8 and e4m3 values are exact in fp16/bf16/fp32
        k = k.to(tl.float32 if UPCAST_DOT else q_ptr.dtype.element_ty)
        sc = blk * stride_sc_blk + off * stride_sc_off
        k_sc = tl.load(k_scale_base + sc, mask=mask_n, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if QUANT:
        s = s * k_sc[None, :]
    s = s * scale_log2e
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
    # Every row has seen at least one key before or in this tile, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_base + blk[:, None] * stride_vc_blk + off[:, None] * stride_vc_off,
        mask=kv_mask,
        other=0.0,
    )
    if QUANT:  # scale each key's probability instead of each value element
        v = v.to(tl.float32 if UPCAST_DOT else q_ptr.dtype.element_ty)
        v_sc = tl.load(v_scale_base + sc, mask=mask_n, other=0.0)
        # Relative to the tile's largest scale, that one after the product: folded whole, a
        # scale (~1e-2) pushes fp16 probabilities of a long tail below fp16's range.
        v_top = tl.maximum(tl.max(v_sc, 0), 1e-30)
        p = p * (v_sc / v_top)[None, :]
    # p is rounded to q's (the unquantised cache's) dtype as the tensor-core product needs.
    p = p.to(q_ptr.dtype.element_ty)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    if QUANT:
        pv = pv * v_top
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# stride_bt, the widest block table of the step, changes from step to step: specialised
# (== 1, % 16 == 0, other) it compiled each tile up to three times while serving, variants
# the engine's warm-up (one table width) could not all meet. Read once per program.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_h,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_sc_blk,
    stride_sc_off,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    # Last tiles first: they walk the most keys, so the long programs start earliest.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tok0 = tile * TOKENS_PER_TILE
    if tok0 >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tok0 + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)

    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = prefix + tok  # absolute position: keys 0..q_pos are visible

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kc_h + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[None, :]
    k_scale_base = k_scale_ptr + kv_head  # scales: [num_blocks, block_size, n_kv]
    v_scale_base = v_scale_ptr + kv_head
    last_tok = tl.minimum(tok0 + TOKENS_PER_TILE, q_len) - 1
    kv_end = prefix + last_tok + 1
    # Keys below the tile's first query position are visible to every row of the tile.
    full_end = ((prefix + tok0 + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, q_ptr, m_i, l_i, acc, k_base, v_base, table, n0, q_pos, kv_end,
            stride_kc_blk, stride_kc_off, stride_vc_blk, stride_vc_off, scale_log2e,
            offs_n, mask_d, k_scale_base, v_scale_base, stride_sc_blk, stride_sc_off,
            PAGE, False, DOT_PRECISION, UPCAST_DOT, QUANT,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, q_ptr, m_i, l_i, acc, k_base, v_base, table, n0, q_pos, kv_end,
            stride_kc_blk, stride_kc_off, stride_vc_blk, stride_vc_off, scale_log2e,
            offs_n, mask_d, k_scale_base, v_scale_base, stride_sc_blk, stride_sc_off,
            PAGE, True, DOT_PRECISION, UPCAST_DOT, QUANT,
        )  # fmt: skip

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & mask_d[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    *,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention of packed ``q: [T, h, d]`` over paged KV.

    Sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` (possibly none, or
    one for a decode in a mixed step); they are the last ``q_len`` of its ``context_lens[b]``
    cached tokens. ``max_seqlen_q`` is a host-side upper bound of the ``q_len``s that sizes the
    grid; ``None`` uses ``T`` (no device sync either way). Returns ``[T, h, d]``.
    An int8/fp8 cache comes with ``k_scale, v_scale: [num_blocks, block_size, n_kv]`` fp32.
    """
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, n_heads, head_dim], got {tuple(q.shape)}")
    n_tokens, n_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches must be [num_blocks, block_size, n_kv, {head_dim}] and alike, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if n_heads % n_kv:
        raise ValueError(f"n_heads {n_heads} is not a multiple of the KV heads {n_kv}")
    if not quantized and (q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"q {q.dtype} and the caches {k_cache.dtype} must share a dtype")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_q.dim() != 1 or batch < 0:
        raise ValueError(f"cu_seqlens_q must be [B+1], got {tuple(cu_seqlens_q.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables' last dimension must be contiguous")

    group = n_heads // n_kv
    if max_seqlen_q is None:
        max_seqlen_q = n_tokens
    cfg = config or default_prefill_config(head_dim, group, max_seqlen_q, q.dtype)
    if cfg.block_m < group or cfg.block_m < 16 or cfg.block_n < 16:
        raise ValueError(f"block_m must be >= max(16, group={group}) and block_n >= 16: {cfg}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if n_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out

    tokens_per_tile = cfg.block_m // group
    grid = (triton.cdiv(max_seqlen_q, tokens_per_tile), n_kv, batch)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        k_scale if k_scale is not None else out,  # unused pointer slots when not quantised
        v_scale if v_scale is not None else out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *((k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)),
        PAGE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.dtype),
        QUANT=quantized,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
