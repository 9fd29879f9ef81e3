"""Paged decode attention, split-KV ("flash-decoding"), GQA-aware (Triton).

Stage 1 runs one program per (sequence, KV head, split). It walks its share of the block
table and computes, for all query heads that share that KV head at once, a partial softmax:
the normalised partial output and its log-sum-exp. Loading K/V once per group rather than
once per query head is what makes GQA decode cheap: decode is bound by reading the cache.
The group is padded to 16 rows so both products run on tensor cores (``tl.dot``).
Stage 2 merges the splits of each head with their log-sum-exps. With one split, stage 1
writes the output directly and stage 2 is skipped.

Each sequence's context is cut into ``num_splits`` equal, tile-aligned parts, so short and
long sequences in one batch all get the same number of programs. ``num_splits`` is picked on
the host from the batch size, the KV heads and ``max_context_len`` (a host int), so there is
no device sync and the grid is fixed for a fixed batch and length bucket: CUDA-graph safe.
An int8/fp8 cache (``k_scale, v_scale`` given) is dequantised in the loop: its tiles are
cast exactly to q's dtype and the per-token scales are folded into the scores (K) and into
the probabilities (V), which is ``(value * scale)`` without a multiply per element.
The contract is :func:`workers.engine.kernels.reference.paged_decode_attention_ref`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.engine.kernels.kv_quant import check_scales

_LOG2E = 1.4426950408889634
# Stage-1 programs per SM to aim for: a few resident CTAs per SM keep enough loads in flight.
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64
# Fewer tiles than this per split and the setup and the merge outweigh the extra parallelism.
_MIN_TILES_PER_SPLIT = 4
# With this many (sequence, KV head) programs per SM the grid is full without splitting: on
# the H200, B=64 x 8 KV heads ran 4-8 % faster unsplit than in 2 splits (bench/kernels.py).
_UNSPLIT_PROGRAMS_PER_SM = 2
# Tuning override, "block_n,num_warps,num_stages" (benchmarks; the engine's default is
# decode_plan's choice).
CONFIG_ENV = "QOSSERVE_DECODE_CONFIG"


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the stage-1 kernel (tokens per tile, warps, pipeline stages)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config(head_dim: int) -> DecodeConfig:
    """A config that suits Hopper for this head size (bench/kernels.py sweeps alternatives)."""
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2)


@functools.lru_cache(maxsize=4)
def _config_override(text: str) -> DecodeConfig | None:
    if not text:
        return None
    try:
        block_n, num_warps, num_stages = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"{CONFIG_ENV} must be 'block_n,num_warps,num_stages', got {text!r}"
        ) from None
    return DecodeConfig(block_n, num_warps, num_stages)


def decode_plan(
    batch: int,
    n_kv_heads: int,
    max_context_len: int,
    head_dim: int,
    cache_elem_bytes: int,
    num_sms: int = 132,
) -> tuple[DecodeConfig, int]:
    """The launch config and split count for a decode batch (host ints only: graph safe).

    An unsplit grid streams each sequence's K/V in one program, so a third pipeline stage
    keeps more loads in flight (H200, bf16, B=64 x 8 KV heads: +5-8 %); with splits the grid
    is small and the extra shared memory per program cost more than it gave (B=8, L=32k:
    -28 %). fp32 caches keep two stages: three tiles of fp32 K and V do not fit.
    """
    override = _config_override(os.environ.get(CONFIG_ENV, ""))
    cfg = override or default_decode_config(head_dim)
    splits = choose_num_splits(batch, n_kv_heads, max_context_len, cfg.block_n, num_sms)
    if override is None and splits == 1 and cache_elem_bytes <= 2:
        cfg = DecodeConfig(cfg.block_n, cfg.num_warps, num_stages=3)
    return cfg, splits


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get fp32-accurate products (3 tf32 passes): one tf32 pass loses ~3 digits.

    Half-precision inputs ignore this: their products are exact in fp32 accumulators.
    """
    return "tf32x3" if dtype == torch.float32 else "tf32"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter."""
    knobs = getattr(triton, "knobs", None)  # Triton < 3.3 has no knobs, only the variable
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dot(dtype: torch.dtype) -> bool:
    """The Triton interpreter multiplies bf16 tiles as raw uint16: upcast them there."""
    return interpreting() and dtype == torch.bfloat16


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    batch: int, n_kv_heads: int, max_context_len: int, block_n: int, num_sms: int = 132
) -> int:
    """Splits per sequence so that stage 1 fills the GPU without splits of a handful of tiles.

    Pure function of host ints: the same batch and length bucket always give the same grid.
    """
    base = max(1, batch * n_kv_heads)
    if base >= _UNSPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, base)
    by_length = max(1, max_context_len // (_MIN_TILES_PER_SPLIT * block_n))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2e,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_h,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_sc_blk,
    stride_sc_off,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kc_h + offs_d[None, :]
    v_base = v_cache_ptr + kv_head * stride_vc_h + offs_d[None, :]
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        # int64: block id * block stride overflows int32 on large caches.
        blk = tl.load(table + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        off = pos % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_base + blk[:, None] * stride_kc_blk + off[:, None] * stride_kc_off,
            mask=kv_mask,
            other=0.0,
        )
        if QUANT:  # int8 and e4m3 values are exact in fp16/bf16/fp32
            k = k.to(tl.float32 if UPCAST_DOT else q_ptr.dtype.element_ty)
            sc = blk * stride_sc_blk + off * stride_sc_off + kv_head
            k_sc = tl.load(k_scale_ptr + sc, mask=mask_n, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANT:
            s = s * k_sc[None, :]
        s = tl.where(mask_n[None, :], s * scale_log2e, float("-inf"))
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
            v_sc = tl.load(v_scale_ptr + sc, mask=mask_n, other=0.0)
            # Relative to the tile's largest scale, and that one after the product: a scale
            # (~1e-2) folded whole would push fp16 probabilities of a long tail below fp16's
            # range (1e-5 x 2e-3 rounds to 0).
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
        m_i = m_new

    # An empty split (or an empty sequence) has l_i == 0: its output is 0, its lse -inf.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask_o = mask_g[:, None] & mask_d[None, :]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_o,
        )
    else:
        tl.store(
            mid_o_ptr
            + seq * stride_mo_b
            + heads[:, None] * stride_mo_h
            + split * stride_mo_s
            + offs_d[None, :],
            o,
            mask=mask_o,
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + seq * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        mid_lse_ptr + seq * stride_ml_b + head * stride_ml_h + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    o = tl.load(
        mid_o_ptr
        + seq * stride_mo_b
        + head * stride_mo_h
        + offs_s[:, None] * stride_mo_s
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, 0)
    # Every split empty (context length 0): weights 0, output 0, no NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    quantized: bool,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, n_heads, head_dim], got {tuple(q.shape)}")
    batch, n_heads, head_dim = q.shape
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
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables' last dimension must be contiguous")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: ``q: [B, h, d]`` attends to its ``context_lens[b]`` cached tokens.

    ``max_context_len`` is a host-side upper bound of ``context_lens`` (a CUDA-graph length
    bucket); it only sizes the split count, never a loop. ``None`` uses the block table's
    capacity. ``num_splits`` and ``config`` override the heuristics (tests, benchmarks).
    A sequence of length 0 (batch padding) gets a zero output. Returns ``[B, h, d]``.
    An int8/fp8 cache comes with ``k_scale, v_scale: [num_blocks, block_size, n_kv]`` fp32.
    """
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, quantized)
    batch, n_heads, head_dim = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
    plan_cfg, plan_splits = decode_plan(
        batch, n_kv, max_context_len, head_dim, k_cache.element_size(), sms
    )
    cfg = config or plan_cfg
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {cfg.block_n}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = (
            plan_splits
            if config is None
            else choose_num_splits(batch, n_kv, max_context_len, cfg.block_n, sms)
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    single = num_splits == 1
    if single:
        # Never read: stage 1 writes `out` itself. Any float tensor fills the pointer slots.
        mid_o = mid_lse = out
        mo_strides: tuple[int, int, int] = (0, 0, 0)
        ml_strides: tuple[int, int] = (0, 0)
    else:
        mid_o = torch.empty(
            (batch, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty((batch, n_heads, num_splits), dtype=torch.float32, device=q.device)
        mo_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
        ml_strides = (mid_lse.stride(0), mid_lse.stride(1))

    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_stage1_kernel[(batch, n_kv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        mid_o,
        mid_lse,
        k_scale if k_scale is not None else out,  # unused pointer slots when not quantised
        v_scale if v_scale is not None else out,
        scale * _LOG2E,
        num_splits,
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
        *mo_strides,
        *ml_strides,
        *((k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)),
        PAGE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.dtype),
        QUANT=quantized,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not single:
        _decode_stage2_kernel[(batch, n_heads)](
            mid_o,
            mid_lse,
            out,
            num_splits,
            *mo_strides,
            *ml_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
