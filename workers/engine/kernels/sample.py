"""Temperature sampling in one pass over the logits: the Gumbel-max trick in Triton.

``argmax(logits / T + G)`` with ``G = -log(-log U)`` draws from ``softmax(logits / T)``; it
is the same exponential race the torch sampler runs (``argmax(p / E)``, ``E = -log U``),
taken in log space so no ``[B, V]`` probabilities or noise are ever written. Each row reads
its logits once and draws its uniforms from Philox keyed by its own 64-bit seed, so a row's
choice depends on its seed and logits only, never on the rest of the batch. Rows with
``T < 1e-5`` take the plain argmax (first index of the maximum, as ``torch.argmax``).

The caller derives the seeds (``workers.engine.sampler.philox_key``); filters (top-k, top-p, min-p) are not
handled here: rows that use them go through the torch sampler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    stride_row,
    temps_ptr,
    seeds_ptr,
    out_ptr,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row)
    seed = tl.load(seeds_ptr + row)
    sample = temp >= 1e-5
    inv_t = 1.0 / tl.maximum(temp, 1e-5)
    best_val = -float("inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        x = tl.load(logits_ptr + row * stride_row + offs, mask=in_vocab, other=-float("inf"))
        x = x.to(tl.float32)
        # U in (0, 1): 0 would give an infinite G; Philox's [0, 1) never yields 1.
        u = tl.maximum(tl.rand(seed, offs), 1e-20)
        gumbel = -tl.log(-tl.log(u))
        x = tl.where(sample, x * inv_t + gumbel, x)
        x = tl.where(in_vocab, x, -float("inf"))
        blk_val = tl.max(x, axis=0)
        blk_idx = tl.argmax(x, axis=0) + start
        take = blk_val > best_val  # strict: the first block holding the maximum wins
        best_idx = tl.where(take, blk_idx, best_idx)
        best_val = tl.where(take, blk_val, best_val)
    tl.store(out_ptr + row, best_idx)


def gumbel_argmax(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, block_v: int = 2048
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]`` (int64, on the logits' device).

    ``temperatures`` ``[B]`` float32 and ``seeds`` ``[B]`` int64, on the same device.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a [B, V] tensor with contiguous rows")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](
            logits, logits.stride(0), temperatures, seeds, out, vocab, BLOCK_V=block_v
        )
    return out
