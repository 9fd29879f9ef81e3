"""What-if KV quantisation schemes, simulated on the torch backend without new kernels.

A scheme is simulated by quantising and dequantising each step's K and V rows before an
fp32 cache stores them (:func:`simulating` wraps the torch backend's store). The torch
attention path dequantises a quantised cache to fp32 before it attends, so this computes
exactly what a real cache with that scheme would: ``bench/kvquant.py`` checks it by
simulating the shipped scheme (a scale per token per KV head) and comparing with the real
``kv_cache_dtype`` runs token for token. Only a scheme that beats the shipped one is worth
its kernels (store, decode and prefill in Triton and torch).

Schemes (``SCHEMES``), each for K and V separately:

- ``bf16``: no quantisation, K/V rounded to bf16: what 16-bit KV alone costs (the floor).
- ``int8_token_head`` / ``fp8_token_head``: the shipped scheme (``kv_quant.quantize``).
- ``fp8_token_head_amax240``: amax maps to 240 instead of 448 (a margin below the top).
- ``fp8_block_head``: one scale per block per KV head, fixed by the write that opens the
  block (a prefill's part of the block, a decode's first token) with a 2x margin; later
  tokens reuse it and saturate beyond it: what append-only blocks allow.
- ``fp8_tensor``: one scale per layer for K and one for V, calibrated on the fp32 run's
  cache (its amax maps to 448).
- ``k_int8_v_fp8`` / ``k_fp8_v_int8``: which of K and V is the sensitive one.
- ``fp8_hadamard``: rows rotated by an orthonormal Hadamard matrix before quantising
  (QuaRot: it spreads outlier channels over the row; a kernel would rotate q and the
  output instead of rotating back).
- ``int8_k_centred``: K less a static per-channel mean (per layer and KV head, calibrated)
  before quantising. Free in a kernel: ``q·(k - m)`` differs from ``q·k`` by ``q·m``, the
  same for every key of a query, and softmax ignores it (SageAttention smooths K this way).
- ``int8_k_smoothed``: K divided per channel by ``sqrt(amax)`` (calibrated, equal within
  each RoPE pair, mean 1) before quantising, as if q were multiplied by it (QServe's
  SmoothAttention): it tames outlier channels.
- ``int8_exact_step`` / ``fp8_exact_step``: the shipped scale, but a step's attention uses
  its own new K/V unrounded and only later steps read them quantised (vLLM's prefill over
  an fp8 cache does this). The price: a token's output then depends on how its prompt was
  cut into steps (chunked prefill, a prefix-cache or tier hit read back quantised), where
  the shipped cache, read back for every key, gives the same tokens however it is cut.

The calibrated schemes are calibrated on prompts the measured sets do not contain
(``bench.kvquant.calibration_prompts``): calibrated on the measured prompts' own caches, K
centring looked twice as good as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from workers.engine.attention import AttentionMetadata, LayerKV
from workers.engine.kernels import reference
from workers.engine.kernels.kv_quant import AMAX_FLOOR, dequantize, quantize
from workers.engine.models import llama

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows [T, n_kv, d] fp32, the layer, "k" or "v", the step's slot mapping -> dequantised rows.
Quantiser = Callable[[torch.Tensor, int, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CacheShape:
    """What a stateful scheme needs to know of the cache it stands in for."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Calibration:
    """Per-layer amax of the K and V an fp32 run wrote (for per-tensor scales); per layer,
    K's per-channel mean and amax ``[n_kv, d]`` over the slots it wrote (for the K schemes)."""

    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]
    k_channel_mean: tuple[torch.Tensor, ...] = ()
    k_channel_amax: tuple[torch.Tensor, ...] = ()


def calibrate(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor]) -> Calibration:
    """A :class:`Calibration` from an fp32 run's caches (``[blocks, block, n_kv, d]`` each);
    slots never written (all zero) are left out of the per-channel figures."""
    means, amaxes = [], []
    for k in k_layers:
        rows = k.reshape(-1, *k.shape[-2:])
        rows = rows[rows.abs().sum((-1, -2)) > 0]
        means.append(rows.mean(0))
        amaxes.append(rows.abs().amax(0))
    return Calibration(
        tuple(float(t.abs().max()) for t in k_layers),
        tuple(float(t.abs().max()) for t in v_layers),
        tuple(means),
        tuple(amaxes),
    )


def _token_head(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        values, scale = quantize(x, dtype)
        return dequantize(values, scale)

    return fn


def _fp8_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated onto e4m3 (round to nearest even), times ``scale``."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def _fp8_amax_to(top: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) / top
        return _fp8_with_scale(x, scale)

    return fn


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two); symmetric,
    so it is its own inverse."""
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _rows(
    k: Callable[[torch.Tensor], torch.Tensor], v: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[CacheShape, Calibration], Quantiser]:
    """A stateless scheme: one function of the rows for K, one for V."""

    def make(shape: CacheShape, calib: Calibration) -> Quantiser:
        return lambda x, layer, kind, slots: (k if kind == "k" else v)(x)

    return make


def _fp8_tensor(shape: CacheShape, calib: Calibration) -> Quantiser:
    def fn(x: torch.Tensor, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        amax = (calib.k_amax if kind == "k" else calib.v_amax)[layer]
        return _fp8_with_scale(x, torch.tensor(max(amax, AMAX_FLOOR) / FP8_MAX))

    return fn


def _fp8_block_head(margin: float) -> Callable[[CacheShape, Calibration], Quantiser]:
    def make(shape: CacheShape, calib: Calibration) -> Quantiser:
        scales = torch.zeros(shape.num_layers, 2, shape.num_blocks, shape.num_kv_heads)

        def fn(x: torch.Tensor, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
            table = scales[layer, 0 if kind == "k" else 1]
            blocks = slots // shape.block_size
            # Blocks fill from offset 0: a write there (re)opens the block and sets its scale.
            opened = torch.unique(blocks[slots % shape.block_size == 0])
            amax = torch.zeros_like(table).scatter_reduce(
                0,
                blocks[:, None].expand(-1, shape.num_kv_heads),
                x.abs().amax(-1),
                reduce="amax",
            )
            table[opened] = amax[opened].clamp_min(AMAX_FLOOR) * margin / FP8_MAX
            return _fp8_with_scale(x, table[blocks][..., None])

        return fn

    return make


def _fp8_hadamard(shape: CacheShape, calib: Calibration) -> Quantiser:
    h = _hadamard(shape.head_dim)
    fp8 = _token_head(FP8)
    return lambda x, layer, kind, slots: fp8(x @ h) @ h


def _int8_k_centred(shape: CacheShape, calib: Calibration) -> Quantiser:
    int8 = _token_head(torch.int8)

    def fn(x: torch.Tensor, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        if kind == "v":
            return int8(x)
        mean = calib.k_channel_mean[layer]
        return int8(x - mean) + mean  # the scores shift by q·mean for every key alike

    return fn


def _int8_k_smoothed(shape: CacheShape, calib: Calibration) -> Quantiser:
    int8 = _token_head(torch.int8)
    scales = []
    for amax in calib.k_channel_amax:
        half = amax.shape[-1] // 2  # RoPE rotates channel i with i + d/2: one scale per pair
        pair = torch.maximum(amax[..., :half], amax[..., half:]).clamp_min(AMAX_FLOOR).sqrt()
        scale = torch.cat([pair, pair], -1)
        scales.append(scale / scale.mean(-1, keepdim=True))

    def fn(x: torch.Tensor, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        if kind == "v":
            return int8(x)
        return int8(x / scales[layer]) * scales[layer]

    return fn


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


SCHEMES: dict[str, Callable[[CacheShape, Calibration], Quantiser]] = {
    "bf16": _rows(_bf16, _bf16),
    "int8_token_head": _rows(_token_head(torch.int8), _token_head(torch.int8)),
    "fp8_token_head": _rows(_token_head(FP8), _token_head(FP8)),
    "fp8_token_head_amax240": _rows(_fp8_amax_to(240.0), _fp8_amax_to(240.0)),
    "fp8_block_head": _fp8_block_head(margin=2.0),
    "fp8_tensor": _fp8_tensor,
    "k_int8_v_fp8": _rows(_token_head(torch.int8), _token_head(FP8)),
    "k_fp8_v_int8": _rows(_token_head(FP8), _token_head(torch.int8)),
    "fp8_hadamard": _fp8_hadamard,
    "int8_k_centred": _int8_k_centred,
    "int8_k_smoothed": _int8_k_smoothed,
    "int8_exact_step": _rows(_token_head(torch.int8), _token_head(torch.int8)),
    "fp8_exact_step": _rows(_token_head(FP8), _token_head(FP8)),
}
# Schemes whose step attends over its own K/V unrounded (stored quantised after it attends).
EXACT_STEP = frozenset({"int8_exact_step", "fp8_exact_step"})
# Simulations of what kv_cache_dtype ships: they must reproduce the real runs exactly.
SHIPPED = {"int8_token_head": "int8", "fp8_token_head": "fp8_e4m3"}


@contextlib.contextmanager
def simulating(
    layers: list[torch.Tensor], shape: CacheShape, calib: Calibration, scheme: str
) -> Iterator[None]:
    """While inside, the torch backend stores K/V through ``scheme`` into the fp32 caches
    whose K tensors are ``layers`` (in layer order). An :data:`EXACT_STEP` scheme stores
    the rows unrounded, lets the step attend, then stores them quantised."""
    quantiser = SCHEMES[scheme](shape, calib)
    layer_of = {t.data_ptr(): i for i, t in enumerate(layers)}
    store = reference.store_kv_ref
    attend = llama.attend
    # Per layer: the step's rows stored unrounded, to quantise once the step has attended.
    pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def store_simulated(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        if k_cache.dtype != torch.float32 or k_scale is not None:
            raise ValueError("a simulated scheme stores into an fp32 cache (model dtype fp32)")
        layer = layer_of[k_cache.data_ptr()]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        k, v = k[valid].float(), v[valid].float()
        if scheme in EXACT_STEP:
            pending[layer] = (k, v, slots)
            store(k, v, k_cache, v_cache, slots)
            return
        store(
            quantiser(k, layer, "k", slots),
            quantiser(v, layer, "v", slots),
            k_cache,
            v_cache,
            slots,
        )

    def attend_then_quantise(
        backend: str, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = attend(backend, q, cache, meta, scale)
        layer = layer_of.get(cache.k.data_ptr())
        if layer is not None and layer in pending:
            k, v, slots = pending.pop(layer)
            store(
                quantiser(k, layer, "k", slots),
                quantiser(v, layer, "v", slots),
                cache.k,
                cache.v,
                slots,
            )
        return out

    reference.store_kv_ref = store_simulated
    llama.attend = attend_then_quantise
    try:
        yield
    finally:
        reference.store_kv_ref = store
        llama.attend = attend
