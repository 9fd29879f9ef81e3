"""The decoder's elementwise glue as one Triton kernel each: RMSNorm (with the residual add),
RoPE and SiLU-and-mul.

In eager torch each of these is 5 to 8 tiny kernels (RMSNorm alone is cast, pow, mean, add,
rsqrt, mul, cast, mul); at decode batch sizes those launches, not the bytes, set the step
time. Each kernel here reproduces the torch code in ``models/llama.py`` rounding for rounding:
every intermediate the torch code stores in the model dtype is rounded to that dtype here
too, so RoPE and SiLU-and-mul are bit-exact and the norms differ at most by their reduction
order. Launches take no host syncs, so they are safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from workers.engine.kernels.decode_attention import interpreting

# FMA contraction would fuse ``x * cos + rot * sin`` into one rounding in fp32, where torch
# rounds twice; the kernels are memory bound, so keeping every rounding costs nothing.
_EXACT = dict(enable_fp_fusion=False)


@triton.jit
def _round(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` and widened back, as torch stores an intermediate.

    The Triton interpreter's fp32 -> bf16 cast truncates; ``RNE_BF16`` rounds to nearest
    even on the bits first so the cast is exact (GPUs round in hardware and skip this).
    """
    if RNE_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    inner,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    row = tl.program_id(0)
    # Rows are [A, B] over the leading dims (B > 1 for per-head norms of a strided q/k view).
    a = (row // inner).to(tl.int64)
    b = (row % inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + a * stride_xa + b * stride_xb
    h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r_row = res_ptr + a * stride_ra + b * stride_rb
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + r, dtype, RNE_BF16)
        tl.store(r_row + offs, h.to(dtype), mask=mask)
    var = tl.sum(h * h, axis=0) / HIDDEN
    # torch's rsqrtf is libdevice's; tl.math.rsqrt is the bare hardware approximation.
    inv = libdevice.rsqrt(var + eps) if LIBDEVICE else tl.math.rsqrt(var + eps)
    normed = _round(h * inv, dtype, RNE_BF16)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round(normed * w, dtype, RNE_BF16)
    tl.store(out_ptr + row.to(tl.int64) * HIDDEN + offs, out.to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a ``[A, B, hidden]`` view (a copy only if its leading dims cannot be viewed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x[None, None, :]
    if x.dim() == 2:
        return x[:, None, :]
    if x.dim() == 3:
        return x
    return x.reshape(-1, 1, x.shape[-1])


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight is {weight.dtype}, x is {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = _rows(x)
    r3 = x3
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                f"x {tuple(x.shape)} {x.dtype}"
            )
        r3 = _rows(residual)
        if r3.data_ptr() != residual.data_ptr() or residual.stride(-1) != 1:
            raise ValueError("residual is written in place: its rows must be addressable")
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(n_rows,)](
        x3,
        r3,
        weight.contiguous(),
        out,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        LIBDEVICE=not interpreting(),
        RNE_BF16=interpreting() and x.dtype == torch.bfloat16,
        num_warps=max(1, min(16, block // 512)),
        **_EXACT,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dim, in Hugging Face's numerics: fp32 math,
    the normalised value cast to ``x.dtype``, then the weight product rounded to it.

    ``x`` may be any ``[..., hidden]`` tensor (a strided ``[T, H, D]`` view of a fused QKV
    output included); the result is a new contiguous tensor of its shape.
    """
    return _norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place (rounded to the dtype, as torch's add), then return
    :func:`rms_norm` of the new ``residual``."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _rope_heads(
    ptr,
    cos_row,
    sin_row,
    stride_h,
    n_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Rotate ``n_heads`` rows of one token in place: ``x * cos + rotate_half(x) * sin``."""
    dtype = ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h[:, None] < n_heads) & mask_d[None, :]
    lo = ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    # rotate_half(x) = cat(-x2, x1); torch rounds each product and then the sum.
    o1 = _round(
        _round(x1 * c1, dtype, RNE_BF16) + _round(-x2 * s1, dtype, RNE_BF16), dtype, RNE_BF16
    )
    o2 = _round(
        _round(x2 * c2, dtype, RNE_BF16) + _round(x1 * s2, dtype, RNE_BF16), dtype, RNE_BF16
    )
    tl.store(lo, o1.to(dtype), mask=mask)
    tl.store(lo + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    N_Q: tl.constexpr,
    N_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos_row = cos_ptr + t * stride_cos
    sin_row = sin_ptr + t * stride_sin
    _rope_heads(
        q_ptr + t * stride_qt, cos_row, sin_row, stride_qh, N_Q, HALF, BLOCK_Q, BLOCK_HALF, RNE_BF16
    )
    _rope_heads(
        k_ptr + t * stride_kt, cos_row, sin_row, stride_kh, N_K, HALF, BLOCK_K, BLOCK_HALF, RNE_BF16
    )


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q: [T, Hq, D]`` and ``k: [T, Hk, D]`` in place by ``cos, sin: [T, D]`` (or
    ``[T, 1, D]``), all in one dtype, exactly as ``x * cos + rotate_half(x) * sin`` rounds.

    ``q`` and ``k`` may be strided views (slices of a fused QKV output) whose last
    dimension is contiguous.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be [T, H, D] with the same T and D, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    n_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    cos2 = cos.reshape(cos.shape[0], cos.shape[-1])
    sin2 = sin.reshape(sin.shape[0], sin.shape[-1])
    if cos2.shape != (n_tokens, head_dim) or sin2.shape != cos2.shape:
        raise ValueError(
            f"cos and sin must be [{n_tokens}, {head_dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError(
            f"dtypes differ: q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k are rotated in place: their last dimension must be contiguous")
    cos2 = cos2 if cos2.stride(-1) == 1 else cos2.contiguous()
    sin2 = sin2 if sin2.stride(-1) == 1 else sin2.contiguous()
    if n_tokens == 0:
        return
    half = head_dim // 2
    _rope_kernel[(n_tokens,)](
        q,
        k,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        N_Q=n_q,
        N_K=n_k,
        HALF=half,
        BLOCK_Q=triton.next_power_of_2(n_q),
        BLOCK_K=triton.next_power_of_2(n_k),
        BLOCK_HALF=triton.next_power_of_2(half),
        RNE_BF16=interpreting() and q.dtype == torch.bfloat16,
        num_warps=4 if n_q * head_dim >= 2048 else 1,
        **_EXACT,
    )


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    inter,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = out_ptr.dtype.element_ty
    row = x_ptr + t * stride_x
    g = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's silu is x / (1 + expf(-x)) with an IEEE division; tl.exp and "/" are the
    # fast approximations on GPUs, libdevice's expf and div_rn are torch's functions.
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    s = _round(tl.math.div_rn(g, 1.0 + e), dtype, RNE_BF16)
    out = _round(s * u, dtype, RNE_BF16)
    tl.store(out_ptr + t * inter + offs, out.to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up: [T, 2I]`` (gate the first half) as ``[T, I]``,
    rounded as torch rounds ``F.silu(gate) * up``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    n_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n_tokens == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(n_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        inter,
        BLOCK=block,
        LIBDEVICE=not interpreting(),
        RNE_BF16=interpreting() and gate_up.dtype == torch.bfloat16,
        num_warps=4 if block >= 512 else 1,
        **_EXACT,
    )
    return out
