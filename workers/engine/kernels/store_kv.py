"""Write one step's K and V into their paged-cache slots (Triton).

One program per token: it reads the token's slot, skips padding (``slot < 0``) and copies
the ``[n_kv, d]`` rows of K and V into ``cache[slot // block_size, slot % block_size]``.
The contract is :func:`workers.engine.kernels.reference.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
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
    block_size,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k, k, mask=mask)
    tl.store(dst_v, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k, v: [T, n_kv, d]`` into the cache slots named by ``slot_mapping: [T]``.

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
    if n_tokens == 0:
        return
    # A cast on the host rounds exactly like torch (the interpreter's in-kernel bf16 cast
    # truncates); activations normally come in the cache dtype and skip this.
    if k.dtype != k_cache.dtype:
        k = k.to(k_cache.dtype)
    if v.dtype != v_cache.dtype:
        v = v.to(v_cache.dtype)
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
        k_cache.shape[1],
        N_KV=n_kv,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(n_kv),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if n_kv * head_dim >= 1024 else 1,
    )
