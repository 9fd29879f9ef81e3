"""Batched torch attention over the paged KV cache: the CPU serving path.

The references in ``reference.py`` loop over sequences, which is right for tests and
slow for serving (the loop dominated CPU decode steps). Here a whole decode batch is one
gather of its blocks into a padded ``[B, L, n_kv, d]`` view plus two einsums with a length
mask; GQA is handled by grouping query heads per KV head instead of repeating K/V.
A prompt chunk attends in slices of queries (:func:`attend_causal_sliced`), each over the
keys up to its last query only, as two batched matrix products: torch's CPU
``scaled_dot_product_attention`` with a mask took ~240 ms a layer for a 1,984-token prompt
of the demo model (8 heads of 32), this ~60 ms, and long prompts' prefill is most of what a
CPU long-context worker does.
A quantised cache (``k_scale, v_scale`` given) is dequantised after the gather, so only the
batch's blocks are ever widened to fp32.
"""

from __future__ import annotations

import torch

from workers.engine.kernels.kv_quant import dequantize
from workers.engine.kernels.reference import gather_kv

# Scores of one slice of queries are [kv heads, group * slice, keys] fp32: the slice is as
# many queries as keep that near this many elements (at most 64, at least 16).
SLICE_SCORES = 8 << 20


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
    """One new token per sequence: ``q: [B, h, d]`` over its ``context_lens[b]`` cached tokens.

    The blocks are gathered with ``index_select`` (advanced indexing took 4× as long), and
    each KV head's scores and output are one batched product over a strided view of the
    gathered ``[B, L, n_kv, d]`` (BLAS reads it in place); einsums over that layout copied
    K and V into a head-major one first. The demo model's heads at B=16 and 2,048 tokens:
    7.4 → 2.7 ms (SDPA on contiguous K/V: 1.9; ``python -m bench.kernels``); its long
    decode throughput on one thread 427 → 765 tok/s (``bench/results/cpu/engine-long-decode.json``).
    """
    batch, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    n_blocks = max(1, (max_context_len + block_size - 1) // block_size)
    # Entries past a row's blocks are padding (-1 in some tables): any block, masked below.
    ids = block_tables[:, :n_blocks].reshape(-1).long().clamp_(min=0)
    length = n_blocks * block_size
    k = k_cache.index_select(0, ids).view(batch, length, n_kv, head_dim)
    v = v_cache.index_select(0, ids).view(batch, length, n_kv, head_dim)
    if k_scale is not None and v_scale is not None:
        k = dequantize(k, k_scale.index_select(0, ids).view(batch, length, n_kv))
        v = dequantize(v, v_scale.index_select(0, ids).view(batch, length, n_kv))
    k, v = k.float(), v.float()  # copies only for a 16-bit cache
    positions = torch.arange(length, device=q.device)
    pad = positions[None, :] >= context_lens[:, None].to(positions.dtype)  # [B, L]
    # The gathered V past a row's context (reused blocks, the padding table's block 0) may
    # hold anything, and a weight of 0 times an inf there was a NaN in another request's
    # output: zeroed. On a CPU row by row (the padding is each row's tail), as one masked
    # fill elsewhere (no host sync).
    if v.device.type == "cpu":
        for b, n in enumerate(context_lens.tolist()):
            if n < length:
                v[b, n:] = 0.0
    else:
        v.masked_fill_(pad[:, :, None, None], 0.0)
    group = n_heads // n_kv
    qg = q.reshape(batch, n_kv, group, head_dim).float()
    out = torch.empty(batch, n_kv, group, head_dim, dtype=torch.float32, device=q.device)
    for h in range(n_kv):
        scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)  # [B, g, L]
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        # An empty row (context 0) is zeros, as the kernels' (softmax of all -inf is NaN).
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        out[:, h] = torch.bmm(probs, v[:, :, h])
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
            out[start : start + n] = attend_causal_sliced(q[start : start + n], k, v, scale)
    return out


def attend_causal_sliced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of ``q: [n_q, h, d]`` placed at the end of ``k, v: [n_k, h_kv, d]``
    (``reference.attend_causal``'s contract), computed in fp32, a slice of queries at a
    time over the keys each slice can see."""
    n_q, n_heads, head_dim = q.shape
    n_k, n_kv, _ = k.shape
    group = n_heads // n_kv
    offset = n_k - n_q  # query i sits at position offset + i
    width = max(16, min(64, SLICE_SCORES // max(1, n_heads * n_k)))
    qg = (q.float() * scale).view(n_q, n_kv, group, head_dim).permute(1, 2, 0, 3)
    kt = k.float().permute(1, 2, 0)  # [h_kv, d, n_k]
    vt = v.float().permute(1, 0, 2)  # [h_kv, n_k, d]
    out = torch.empty(n_kv, group, n_q, head_dim, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(n_k, device=q.device)
    for first in range(0, n_q, width):
        last = min(n_q, first + width)
        rows, keys = last - first, offset + last  # keys past the slice's last query: unseen
        qs = qg[:, :, first:last].reshape(n_kv, group * rows, head_dim)
        scores = torch.bmm(qs, kt[:, :, :keys]).view(n_kv, group, rows, keys)
        query_pos = key_pos[offset + first : offset + last, None]
        scores.masked_fill_(key_pos[None, :keys] > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(n_kv, group * rows, keys)
        out[:, :, first:last] = torch.bmm(probs, vt[:, :keys]).view(n_kv, group, rows, head_dim)
    return out.permute(2, 0, 1, 3).reshape(n_q, n_heads, head_dim).to(q.dtype)
