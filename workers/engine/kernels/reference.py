"""Plain torch references for the paged-KV kernels.

Slow and obvious on purpose: the Triton kernels are tested against these, and the
`torch` attention backend uses them on machines without a GPU.

Cache layout (one pair per layer): ``k_cache, v_cache: [num_blocks, block_size, n_kv, d]``.
A slot is ``block_id * block_size + offset``; slot ``-1`` means "padding, do not write".
A quantised cache (int8/fp8, see ``kv_quant.py``) also has ``k_scale, v_scale:
[num_blocks, block_size, n_kv]``; the references quantise on write and dequantise on read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.engine.kernels.kv_quant import dequantize, quantize


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k, v: [T, n_kv, d]`` into the cache slots named by ``slot_mapping: [T]``.

    With ``k_scale, v_scale`` the cache is quantised: values and scales are both written.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scale is None:
            cache[blocks, offsets] = x[valid].to(cache.dtype)
        else:
            values, scales = quantize(x[valid], cache.dtype)
            cache[blocks, offsets] = values
            scale[blocks, offsets] = scales


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's first ``length`` keys and values as ``[length, n_kv, d]``
    (fp32 when the cache is quantised: only the gathered blocks are dequantised)."""
    block_size = k_cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    ids = block_table[:n_blocks].long()
    k = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:length]
    v = v_cache[ids].reshape(-1, *v_cache.shape[2:])[:length]
    if k_scale is not None and v_scale is not None:
        k = dequantize(k, k_scale[ids].reshape(-1, k_cache.shape[2])[:length])
        v = dequantize(v, v_scale[ids].reshape(-1, v_cache.shape[2])[:length])
    return k, v


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q: [n_q, h, d]`` placed at the end of ``k, v: [n_kv_len, h_kv, d]``."""
    n_q, n_heads, _ = q.shape
    n_k, n_kv_heads, _ = k.shape
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # Query i sits at absolute position n_k - n_q + i and sees keys 0..that position.
    q_pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
    k_pos = torch.arange(n_k, device=q.device)[None, :]
    mask = k_pos <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: ``q: [B, h, d]`` attends to its ``context_lens[b]`` cached tokens."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        k, v = gather_kv(k_cache, v_cache, block_tables[b], length, k_scale, v_scale)
        out[b] = attend_causal(q[b : b + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention over paged KV.

    ``q: [T, h, d]`` packs every sequence's new tokens (``cu_seqlens_q: [B+1]``); their K/V are
    already in the cache, so sequence ``b`` attends over ``context_lens[b]`` cached tokens of
    which its queries are the last ``q_len``. A cached prefix is simply the part before them.
    """
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.shape[0] - 1):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        length = int(context_lens[b])
        k, v = gather_kv(k_cache, v_cache, block_tables[b], length, k_scale, v_scale)
        out[start:end] = attend_causal(q[start:end], k, v, scale)
    return out
