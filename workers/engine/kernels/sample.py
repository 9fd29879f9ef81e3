"""Temperature sampling in one pass over the logits: the Gumbel-max trick in Triton.

``argmax(logits / T + G)`` with ``G = -log(-log U)`` draws from ``softmax(logits / T)``; it
is the same exponential race the torch sampler runs (``argmax(p / E)``, ``E = -log U``),
taken in log space so no ``[B, V]`` probabilities or noise are ever written. Each row reads
its logits once and draws its uniforms from Philox keyed by its own 64-bit seed, so a row's
choice depends on its seed and logits only, never on the rest of the batch. Rows with
``T < 1e-5`` take the plain argmax (first index of the maximum, as ``torch.argmax``).

The caller derives the seeds (``workers.engine.sampler.philox_key``); filters (top-k, top-p, min-p) are not
handled here: rows that use them go through the torch sampler.

Each row's vocabulary is cut into chunks of ``chunk_blocks * block_v`` tokens, one program
per (row, chunk), and a second small kernel takes each row's best chunk: one program per
row left most SMs idle (the Philox draws and logs make this loop compute-bound), so the
kernel ran ~10x slower than its read of the logits on an H200 at 256 rows x 128k. The
choice does not depend on the chunking: every token's noise is keyed by its own index,
and ties go to the lowest index in both stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_chunk_kernel(
    logits_ptr,
    stride_row,
    temps_ptr,
    seeds_ptr,
    best_val_ptr,
    best_idx_ptr,
    vocab,
    num_chunks,
    CHUNK_BLOCKS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    seed = tl.load(seeds_ptr + row)
    sample = temp >= 1e-5
    inv_t = 1.0 / tl.maximum(temp, 1e-5)
    first = chunk * CHUNK_BLOCKS * BLOCK_V
    best_val = -float("inf")
    best_idx = first
    for b in range(0, tl.minimum(CHUNK_BLOCKS, tl.cdiv(vocab - first, BLOCK_V))):
        start = first + b * BLOCK_V
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        # int64: rows x a 128k vocabulary pass 2^31 at 16k rows.
        x = tl.load(
            logits_ptr + row.to(tl.int64) * stride_row + offs, mask=in_vocab, other=-float("inf")
        )
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
    tl.store(best_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(best_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _gumbel_argmax_merge_kernel(
    best_val_ptr, best_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(best_val_ptr + row * num_chunks + offs, mask=mask, other=-float("inf"))
    # A chunk of -inf only (masked tokens) must not beat an earlier one: keep the first max.
    vals = tl.where(mask, vals, -float("inf"))
    pick = tl.argmax(vals, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(best_idx_ptr + row * num_chunks + pick))


def gumbel_argmax(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    block_v: int = 2048,
    chunk_blocks: int = 4,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]`` (int64, on the logits' device).

    ``logits`` fp32, fp16 or bf16 (read as fp32); ``temperatures`` ``[B]`` float32 and
    ``seeds`` ``[B]`` int64, on the same device.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a [B, V] tensor with contiguous rows")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    num_chunks = triton.cdiv(vocab, chunk_blocks * block_v)
    best_val = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    # One chunk per row: its best is the answer, written straight into ``out``.
    best_idx = out if num_chunks == 1 else torch.empty_like(best_val, dtype=torch.int64)
    _gumbel_argmax_chunk_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        temperatures,
        seeds,
        best_val,
        best_idx,
        vocab,
        num_chunks,
        CHUNK_BLOCKS=chunk_blocks,
        BLOCK_V=block_v,
    )
    if num_chunks > 1:
        _gumbel_argmax_merge_kernel[(rows,)](
            best_val, best_idx, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks)
        )
    return out
