"""Attention over the paged KV cache, with one switch between backends.

The model calls :func:`write_kv` then :func:`attend`; the model runner fills one
:class:`AttentionMetadata` per step. ``torch`` (CPU default) runs the batched torch
paths in ``kernels/torch_paged.py`` (checked against ``kernels/reference.py``); ``triton`` (CUDA default) runs the Triton kernels.
A step is either all-decode (one new token per sequence, the decode kernel) or varlen
(prefill chunks, possibly mixed with decodes as one-token chunks, the prefill kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.engine.kernels import reference, torch_paged

BACKENDS = ("torch", "triton")


class LayerKV(NamedTuple):
    """One layer's paged cache: ``k, v: [num_blocks, block_size, n_kv, d]``; for an int8/fp8
    cache also its fp32 scales ``k_scale, v_scale: [num_blocks, block_size, n_kv]``."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What the attention of one step needs to know; built by the model runner.

    slot_mapping:  [T] int64, cache slot of each new token (-1 = padding, not written).
    block_tables:  [B, max_blocks] int32, the blocks of each sequence in order.
    context_lens:  [B] int32, KV length of each sequence once this step's tokens are written.
    cu_seqlens_q:  [B+1] int32, offsets of each sequence's new tokens in the packed batch
                   (varlen steps only; None for an all-decode step).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int
    max_context_len: int

    @property
    def is_decode(self) -> bool:
        return self.cu_seqlens_q is None


def write_kv(
    backend: str,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
) -> None:
    """Store this step's ``k, v: [T, n_kv, d]`` into the paged cache (quantised if it is)."""
    if backend == "triton":
        from workers.engine.kernels.store_kv import store_kv

        store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    else:
        reference.store_kv_ref(
            k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale
        )


def attend(
    backend: str,
    q: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q: [T, h, d]`` over the cache (after :func:`write_kv`); returns ``[T, h, d]``."""
    k_cache, v_cache, k_scale, v_scale = cache
    if backend == "triton":
        if meta.is_decode:
            from workers.engine.kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                max_context_len=meta.max_context_len,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        from workers.engine.kernels.prefill_attention import paged_prefill_attention

        assert meta.cu_seqlens_q is not None
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            scale,
            max_seqlen_q=meta.max_seqlen_q,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if meta.is_decode:
        return torch_paged.paged_decode_attention_torch(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
            meta.max_context_len, k_scale, v_scale,
        )  # fmt: skip
    assert meta.cu_seqlens_q is not None
    return torch_paged.paged_prefill_attention_torch(
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale,
        k_scale, v_scale,
    )  # fmt: skip
