"""Write one step's K and V into their paged-cache slots (Triton).

One program per token: it reads the token's slot, skips padding (``slot < 0``) and copies
the ``[n_kv, d]`` rows of K and V into ``cache[slot // block_size, slot % block_size]``.
A quantised cache (int8 / fp8 with scales, see ``kv_quant.py``) is written the same way
after quantising each ``[d]`` row on the fly: ``amax`` -> scale -> round and saturate.
The contract is :func:`workers.engine.kernels.reference.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.kernels.decode_attention import interpreting
from workers.engine.kernels.kv_quant import AMAX_FLOOR as _AMAX_FLOOR
from workers.engine.kernels.kv_quant import QMAX, check_scales

AMAX_FLOOR: tl.constexpr = tl.constexpr(_AMAX_FLOOR)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_blk,
    stride_kc_off,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_off,
    stride_vc_h,
    stride_sc_blk,
    stride_sc_off,
    block_size,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,  # 0: store as is; else quantise to [-QMAX, QMAX]
    ROUND: tl.constexpr,  # int8: round to an integer here; fp8: the cast rounds
    FP8_GRID: tl.constexpr,  # round onto the e4m3 grid before the cast (interpreter only)
):
    token = tl.program_id(0)
    # int64: slot * stride overflows int32 on caches of a few GiB.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < N_KV) & (offs_d[None, :] < HEAD_DIM)

    src_k = k_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = (
        k_cache_ptr
        + blk * stride_kc_blk
        + off * stride_kc_off
        + offs_h[:, None] * stride_kc_h
        + offs_d[None, :]
    )
    dst_v = (
        v_cache_ptr
        + blk * stride_vc_blk
        + off * stride_vc_off
        + offs_h[:, None] * stride_vc_h
        + offs_d[None, :]
    )
    k = tl.load(src_k, mask=mask, other=0.0)  # zero padding: it must not raise an amax
    v = tl.load(src_v, mask=mask, other=0.0)
    if QMAX > 0:
        # Scales are [num_blocks, block_size, n_kv] with a contiguous head dimension.
        scale_off = blk * stride_sc_blk + off * stride_sc_off + offs_h
        k = _quantize_rows(k, k_scale_ptr + scale_off, offs_h < N_KV, QMAX, ROUND)
        v = _quantize_rows(v, v_scale_ptr + scale_off, offs_h < N_KV, QMAX, ROUND)
        if FP8_GRID:
            k = _round_to_e4m3_grid(k)
            v = _round_to_e4m3_grid(v)
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, scale_ptr, mask_h, QMAX: tl.constexpr, ROUND: tl.constexpr):
    """Store each row's scale ``amax / QMAX``; return the rows divided by it, saturated."""
    x = x.to(tl.float32)
    # IEEE divisions (div_rn): '/' compiles to the approximate one on GPUs, and a value
    # at a .5 boundary then rounded one step off from torch's (kv_quant.quantize).
    amax = tl.maximum(tl.max(tl.abs(x), 1), AMAX_FLOOR)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + QMAX)
    # max/maximum skip NaN (maxnum): a NaN row got a finite scale and the NaN became -QMAX,
    # plausible attention instead of the visible NaN the reference (and a 16-bit cache)
    # gives. A NaN scale makes the whole row read back NaN, as there.
    has_nan = tl.max((x != x).to(tl.int32), 1) > 0
    scale = tl.where(has_nan, float("nan"), scale)
    tl.store(scale_ptr, scale, mask=mask_h)
    # Same arithmetic as kv_quant.quantize: multiply by the reciprocal.
    y = x * tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)[:, None]
    if ROUND:
        y = tl.floor(y + 0.5)
    return tl.minimum(tl.maximum(y, -QMAX), QMAX)


@triton.jit
def _round_to_e4m3_grid(y):
    """Round to the nearest e4m3 value (ties to even) in fp32, so the cast is exact.

    The Triton interpreter's fp32 -> e4m3 cast loses the carry into the next exponent
    (124.8 becomes 64 instead of 128); GPUs convert in hardware and skip this.
    """
    bits = y.to(tl.int32, bitcast=True)
    # Grid step: 2^(exponent - 3) for normals, 2^-9 below 2^-6 (subnormals).
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds ties to even
    return ((y / step + magic) - magic) * step


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k, v: [T, n_kv, d]`` into the cache slots named by ``slot_mapping: [T]``.

    With ``k_scale, v_scale: [num_blocks, block_size, n_kv]`` fp32 the caches are int8 or
    fp8: each row is quantised and its scale written next to it.

    ``k_cache, v_cache: [num_blocks, block_size, n_kv, d]`` are written in place; a slot of
    ``-1`` is padding and writes nothing. ``k`` and ``v`` may be strided views (e.g. slices
    of a fused QKV projection) as long as their last dimension is contiguous.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [T, n_kv, d], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n_tokens, n_kv, head_dim = k.shape
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (n_kv, head_dim):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {n_kv}, {head_dim}], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (n_tokens,):
        raise ValueError(f"slot_mapping must be [{n_tokens}], got {tuple(slot_mapping.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    if n_tokens == 0:
        return
    # A cast on the host rounds exactly like torch (the interpreter's in-kernel bf16 cast
    # truncates); activations normally come in the cache dtype and skip this.
    if k.dtype != k_cache.dtype and not quantized:
        k = k.to(k_cache.dtype)
    if v.dtype != v_cache.dtype and not quantized:
        v = v.to(v_cache.dtype)
    # Unused pointer slots of an unquantised cache: any tensor will do.
    k_scale_arg = k_scale if k_scale is not None else k_cache
    v_scale_arg = v_scale if v_scale is not None else v_cache
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()

    _store_kv_kernel[(n_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale_arg,
        v_scale_arg,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *scale_strides,
        k_cache.shape[1],
        N_KV=n_kv,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(n_kv),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QMAX=QMAX.get(k_cache.dtype, 0.0),
        ROUND=k_cache.dtype == torch.int8,
        FP8_GRID=k_cache.dtype == torch.float8_e4m3fn and interpreting(),
        num_warps=4 if n_kv * head_dim >= 1024 else 1,
    )
