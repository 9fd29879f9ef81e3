"""KV quantisation: quantise -> dequantise error bounds, and the quantised paged attention
paths (torch batched, Triton) against "dequantise the cache, then the plain reference"."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra.numpy import arrays

from workers.engine.kernels.kv_quant import AMAX_FLOOR, QMAX, dequantize, quantize
from workers.engine.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from workers.engine.kernels.torch_paged import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
)

QDTYPES = [torch.int8, torch.float8_e4m3fn]
QIDS = ["int8", "fp8"]

# Rows of K/V: normal values, exact zeros and rare outliers up to 1e4 (a real K has a few
# channels far above the rest: they set the scale and the small ones must survive it).
_rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 40)),
    elements=st.one_of(
        st.floats(-4, 4, width=32),
        st.just(0.0),
        st.floats(-1e4, 1e4, width=32),
    ),
)


def _error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Worst error per element: int8 half a step; fp8 e4m3 half an ulp (2^-4 relative, 3
    mantissa bits) or, in the subnormal range, half the 2^-9 spacing of the scaled value."""
    s = scale[..., None]
    if dtype == torch.int8:
        bound = 0.5 * s
    else:
        bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    return bound * (1 + 1e-5) + 1e-30  # fp32 rounding of x * (1 / scale)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@settings(max_examples=60, deadline=None)
@given(x=_rows)
def test_quantize_dequantize_error_is_within_half_a_step(x: np.ndarray, dtype: torch.dtype) -> None:
    t = torch.from_numpy(x)
    values, scale = quantize(t, dtype)
    assert values.dtype == dtype and scale.shape == t.shape[:-1]
    back = dequantize(values, scale)
    assert torch.all((back - t).abs() <= _error_bound(t, scale, dtype))
    # The largest magnitude of each row maps onto the top of the range exactly: a larger
    # scale would waste levels (values are clamped, so "<= QMAX" held for any scale).
    full = t.abs().amax(-1) > AMAX_FLOOR
    assert torch.all(values.float().abs().amax(-1)[full] == QMAX[dtype])


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_all_zero_and_near_fp32_min_rows_come_back_finite(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 2, 8)
    x[1, 1, 3] = -5.0
    x[2, 0, 0] = 1.2e-38  # 1 / (amax / QMAX) would overflow without the amax floor
    values, scale = quantize(x, dtype)
    assert scale[1, 1] == 5.0 / QMAX[dtype] and 0 < scale[0, 0] < 1e-32
    back = dequantize(values, scale)
    assert back.isfinite().all()
    assert torch.equal(back[:2], x[:2]) and back[2].abs().max() < 1e-32


def quantized_paged_kv(
    make_paged_kv, lens: list[int], block_size: int, n_kv: int, head_dim: int, dtype: torch.dtype
):
    """A random paged cache quantised slot by slot: (kv, k_scale, v_scale, dequantised k, v)."""
    kv = make_paged_kv(lens, block_size, n_kv, head_dim, torch.float32)
    k_vals, k_scale = quantize(kv.k_cache, dtype)
    v_vals, v_scale = quantize(kv.v_cache, dtype)
    k_deq, v_deq = dequantize(k_vals, k_scale), dequantize(v_vals, v_scale)
    kv.k_cache, kv.v_cache = k_vals, v_vals
    return kv, k_scale, v_scale, k_deq, v_deq


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_store_kv_ref_writes_values_and_scales_of_its_slots_only(dtype: torch.dtype) -> None:
    k_cache = torch.zeros(3, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.full((3, 4, 2), -1.0)
    v_scale = torch.full((3, 4, 2), -1.0)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([0, 5, -1, 11, 6])
    store_kv_ref(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, 4)
        for src, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            want_vals, want_scale = quantize(src[i], dtype)
            assert torch.equal(cache[blk, off].view(torch.uint8), want_vals.view(torch.uint8))
            assert torch.equal(scales[blk, off], want_scale)
    written = {0, 5, 11, 6}
    untouched = [s for s in range(12) if s not in written]
    for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)):
        assert torch.all(scales.view(-1, 2)[untouched] == -1.0)
        assert not cache.view(12, -1)[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_torch_decode_over_a_quantized_cache_equals_reference_on_the_dequantized_cache(
    make_paged_kv, assert_close, dtype: torch.dtype
) -> None:
    lens = [1, 7, 8, 9, 29]
    kv, k_scale, v_scale, k_deq, v_deq = quantized_paged_kv(make_paged_kv, lens, 8, 2, 32, dtype)
    q = torch.randn(len(lens), 8, 32, device=kv.k_cache.device)
    got = paged_decode_attention_torch(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, max(lens),
        k_scale, v_scale,
    )  # fmt: skip
    want = paged_decode_attention_ref(q, k_deq, v_deq, kv.block_tables, kv.context_lens, 0.2)
    assert_close(got, want)
    ref_q = paged_decode_attention_ref(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, k_scale, v_scale
    )
    assert_close(ref_q, want)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_torch_prefill_over_a_quantized_cache_equals_reference_on_the_dequantized_cache(
    make_paged_kv, assert_close, dtype: torch.dtype
) -> None:
    lens = [5, 1, 20, 13]
    q_lens = [5, 1, 6, 0]
    kv, k_scale, v_scale, k_deq, v_deq = quantized_paged_kv(make_paged_kv, lens, 8, 2, 32, dtype)
    cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=kv.k_cache.device)
    q = torch.randn(sum(q_lens), 4, 32, device=kv.k_cache.device)
    got = paged_prefill_attention_torch(
        q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, 0.2, k_scale, v_scale
    )
    want = paged_prefill_attention_ref(q, k_deq, v_deq, cu, kv.context_lens, kv.block_tables, 0.2)
    assert_close(got, want)


# --- Triton kernels (the interpreter on CPU) ---------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("head_dim", [16, 80])
def test_store_kv_kernel_quantizes_like_the_reference(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> None:
    from workers.engine.kernels.store_kv import store_kv

    gen = torch.Generator().manual_seed(3)
    shape = (4, 8, 3, head_dim)
    k = torch.randn(11, 3, head_dim, generator=gen) * 3
    k[2, 1] = 0.0  # a zero row: tiny scale, zeros back
    k[4, 0, 5] = 300.0  # an outlier sets its row's scale alone
    k[5, 2, 1] = float("nan")  # a model gone wrong: its row must read back NaN, not finite
    v = torch.randn(11, 3, head_dim, generator=gen)
    slots = torch.randperm(32, generator=gen)[:11]
    slots[::4] = -1
    k, v, slots = k.to(device), v.to(device), slots.to(device)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(4)]
    scales = [torch.full(shape[:3], -1.0, device=device) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    store_kv_ref(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    for got, want in ((0, 2), (1, 3)):
        # Same arithmetic as the reference: bit-exact in the interpreter; on a GPU the
        # reciprocal may differ by an ulp, which moves a value by at most one step.
        nan_rows = scales[want].isnan()
        assert nan_rows.sum() == (1 if got == 0 and slots[5] >= 0 else 0)
        codes = (caches[got].float() - caches[want].float()).abs() / QMAX[dtype]
        codes[nan_rows] = 0  # the scale alone carries the NaN: any code reads back NaN
        assert codes.max() <= (0 if device.type == "cpu" else 1 / 127)
        torch.testing.assert_close(scales[got], scales[want], rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_over_a_quantized_cache_matches_the_dequantized_reference(
    make_paged_kv, assert_close, dtype: torch.dtype, q_dtype: torch.dtype, num_splits: int
) -> None:
    from workers.engine.kernels.decode_attention import DecodeConfig, paged_decode_attention

    lens = [1, 15, 16, 17, 53]
    kv, k_scale, v_scale, k_deq, v_deq = quantized_paged_kv(make_paged_kv, lens, 16, 2, 32, dtype)
    q = torch.randn(len(lens), 8, 32, device=kv.k_cache.device).to(q_dtype)
    got = paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.2, max(lens),
        num_splits=num_splits, config=DecodeConfig(block_n=16), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    want = paged_decode_attention_ref(q, k_deq, v_deq, kv.block_tables, kv.context_lens, 0.2)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "qbf16"])
def test_prefill_kernel_over_a_quantized_cache_matches_the_dequantized_reference(
    make_paged_kv, assert_close, dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    from workers.engine.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

    lens = [21, 1, 40, 9]  # a cached prefix before the new tokens in the first and third
    q_lens = [5, 1, 33, 9]
    kv, k_scale, v_scale, k_deq, v_deq = quantized_paged_kv(make_paged_kv, lens, 8, 2, 32, dtype)
    dev = kv.k_cache.device
    cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), 4, 32, device=dev).to(q_dtype)
    got = paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, cu, kv.context_lens, kv.block_tables, 0.2, max(q_lens),
        config=PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1),
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    want = paged_prefill_attention_ref(q, k_deq, v_deq, cu, kv.context_lens, kv.block_tables, 0.2)
    assert_close(got, want)


def test_kernels_reject_a_quantized_cache_without_scales(make_paged_kv) -> None:
    from workers.engine.kernels.decode_attention import paged_decode_attention

    kv, *_ = quantized_paged_kv(make_paged_kv, [3], 8, 2, 16, torch.int8)
    q = torch.randn(1, 2, 16, device=kv.k_cache.device)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 1.0)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_an_fp16_model_keeps_the_small_weights_of_a_long_tail_over_a_quantized_cache(
    make_paged_kv, dtype: torch.dtype, kernel: str
) -> None:
    """An attention sink: key 0 takes almost all the weight, 256 others 1e-5 each. With the
    per-token V scale (~1e-2) folded into an fp16 probability, those weights fell below
    fp16's range (1e-5 x 2e-3 rounds to 0) and the output lost the tail's whole share."""
    n, bs, d = 257, 16, 16
    kv = make_paged_kv([n], bs, 1, d, torch.float32)
    k, v = torch.zeros(n, 1, d), torch.ones(n, 1, d)
    v[0] = 0.0
    sink = 11.5  # q·k0·scale: every other key gets exp(-11.5) ~ 1e-5 of the sink's weight
    k[0, 0, 0] = sink
    slots = torch.tensor(
        [int(kv.block_tables[0, p // bs]) * bs + p % bs for p in range(n)], device=kv.k_cache.device
    )
    k_cache = torch.zeros(kv.k_cache.shape[0] * bs, 1, d, dtype=dtype, device=slots.device)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(k_cache.shape[:2], device=slots.device)
    v_scale = torch.zeros_like(k_scale)
    kq, ks = quantize(k.to(slots.device), dtype)
    vq, vs = quantize(v.to(slots.device), dtype)
    k_cache[slots], v_cache[slots], k_scale[slots], v_scale[slots] = kq, vq, ks, vs
    shape = (-1, bs, 1, d)
    caches = (k_cache.view(shape), v_cache.view(shape))
    scales = (k_scale.view(-1, bs, 1), v_scale.view(-1, bs, 1))
    q = torch.zeros(1, 2, d, device=slots.device)  # two query heads on the one KV head
    q[:, :, 0] = 1.0
    q = q.half()
    tail = (n - 1) * float(torch.exp(torch.tensor(-sink)))
    want = tail / (1 + tail)  # every channel: the tail's share of the weight times V = 1
    if kernel == "decode":
        from workers.engine.kernels.decode_attention import paged_decode_attention

        got = paged_decode_attention(
            q, *caches, kv.block_tables, kv.context_lens, 1.0, n,
            k_scale=scales[0], v_scale=scales[1],
        )  # fmt: skip
    else:
        from workers.engine.kernels.prefill_attention import paged_prefill_attention

        cu = torch.tensor([0, 1], dtype=torch.int32, device=slots.device)
        got = paged_prefill_attention(
            q, *caches, cu, kv.context_lens, kv.block_tables, 1.0, 1,
            k_scale=scales[0], v_scale=scales[1],
        )  # fmt: skip
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), torch.full_like(got.float(), want), rtol=0.03, atol=0)
