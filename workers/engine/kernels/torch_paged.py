"""Batched torch attention over the paged KV cache: the CPU serving path.

The references in ``reference.py`` loop over sequences, which is right for tests and
slow for serving (the loop dominated CPU decode steps). Here a whole decode batch is one
gather of its blocks into a padded ``[B, L, n_kv, d]`` view plus two einsums with a length
mask; GQA is handled by grouping query heads per KV head instead of repeating K/V.
A quantised cache (``k_scale, v_scale`` given) is dequantised after the gather, so only the
batch's blocks are ever widened to fp32.
"""

from __future__ import annotations

import torch

from workers.engine.kernels.kv_quant import dequantize
from workers.engine.kernels.reference import attend_causal, gather_kv


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence: ``q: [B, h, d]`` over its ``context_lens[b]`` cached tokens."""
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    n_blocks = max(1, (max_context_len + block_size - 1) // block_size)
    ids = block_tables[:, :n_blocks].long()
    length = n_blocks * block_size
    k = k_cache[ids].reshape(batch, length, n_kv, head_dim)
    v = v_cache[ids].reshape(batch, length, n_kv, head_dim)
    if k_scale is not None and v_scale is not None:
        k = dequantize(k, k_scale[ids].reshape(batch, length, n_kv))
        v = dequantize(v, v_scale[ids].reshape(batch, length, n_kv))
    group = n_heads // n_kv
    qg = q.reshape(batch, n_kv, group, head_dim).float()
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    positions = torch.arange(length, device=q.device)
    pad = positions[None, :] >= context_lens[:, None].to(positions.dtype)  # [B, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    # An empty row (context 0) is zeros, as the kernels' (softmax of all -inf is NaN); the
    # gathered V past a row's context (reused blocks, the padding table's block 0) may hold
    # anything, and a weight of 0 times an inf there was a NaN in another request's output.
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    v = v.float().masked_fill_(pad[:, :, None, None], 0.0)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v)
    return out.reshape(batch, n_heads, head_dim).to(q.dtype)


def paged_prefill_attention_torch(
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
    """Varlen causal attention for a mixed step: one-token rows (decodes riding along with
    prefill chunks) go through the batched decode path, prompt chunks one by one."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts = cu_seqlens_q[:-1].tolist()
    out = torch.empty_like(q)
    singles = [b for b, n in enumerate(q_lens) if n == 1]
    if singles:
        rows = torch.tensor([starts[b] for b in singles], device=q.device)
        idx = torch.tensor(singles, device=q.device)
        lens = context_lens[idx]
        out[rows] = paged_decode_attention_torch(
            q[rows], k_cache, v_cache, block_tables[idx], lens, scale, int(lens.max()),
            k_scale, v_scale,
        )  # fmt: skip
    for b, n in enumerate(q_lens):
        if n > 1:
            start = starts[b]
            length = int(context_lens[b])
            k, v = gather_kv(k_cache, v_cache, block_tables[b], length, k_scale, v_scale)
            out[start : start + n] = attend_causal(q[start : start + n], k, v, scale)
    return out
