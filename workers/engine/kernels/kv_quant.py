"""KV cache quantisation: int8 and fp8 (e4m3) values with one fp32 scale per token per head.

Scheme (the same for both dtypes): for each written token and KV head, ``amax`` over the head
dimension gives ``scale = amax / QMAX`` and the stored value is ``x / scale`` rounded (int8:
halves rounded up, as ``floor(y + 0.5)``, saturated to +-127; fp8: clamped to +-448 then cast, round to nearest
even). Dequantising is ``value * scale``. ``amax`` is floored at ``AMAX_FLOOR`` so that
``1 / scale`` stays finite: an all-zero row (or one of near-fp32-min values) gets a tiny
scale and comes back as zeros.

Why per token per head: a token's scale is fixed the moment it is written, so blocks stay
append-only (a per-block scale would have to rescale the block's earlier tokens whenever a
later token raised its amax) and prefix-cached and tier-loaded blocks are exact copies.
The scales cost 4 bytes per token-head against ``head_dim`` bytes of values.

Scale tensors are ``[num_blocks, block_size, n_kv]`` fp32, one for K and one for V per layer,
next to the ``[num_blocks, block_size, n_kv, head_dim]`` value tensors.
"""

from __future__ import annotations

import torch

# Engine-facing names -> storage dtype of the values.
KV_QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Largest stored magnitude: amax maps onto it.
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
}
SCALE_DTYPE = torch.float32
# Far below any activation; keeps 1/scale finite (amax 1e-38 would give 1/scale = inf).
AMAX_FLOOR = 1e-30


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype stores quantised values next to scales."""
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [..., d]`` -> (values ``[..., d]`` of ``dtype``, fp32 scales ``[...]``)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / qmax
    # Multiply by the reciprocal, as the store kernel does, so both round identically.
    y = xf * (1.0 / scale)[..., None]
    if dtype == torch.int8:
        values = torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    else:
        values = y.clamp_(-qmax, qmax).to(dtype)
    return values, scale


def dequantize(
    values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``values [..., d] * scale [...]`` as ``dtype``."""
    return (values.float() * scale.float()[..., None]).to(dtype)


def check_scales(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Whether the caches are quantised; ``ValueError`` unless the scales fit them (the
    kernels index both scale tensors with one set of strides)."""
    quantized = k_scale is not None and v_scale is not None
    if quantized != is_quantized(k_cache.dtype) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"a {k_cache.dtype} cache takes k_scale and v_scale iff int8/fp8")
    if k_scale is not None and v_scale is not None:
        shape = tuple(k_cache.shape[:3])
        if not (
            tuple(k_scale.shape) == tuple(v_scale.shape) == shape
            and k_scale.dtype == v_scale.dtype == SCALE_DTYPE
            and k_scale.stride() == v_scale.stride()
            and k_scale.stride(-1) == 1
        ):
            raise ValueError(f"scales must be fp32 {shape} with a contiguous last dimension")
    return quantized
