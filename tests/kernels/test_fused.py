"""The fused decoder kernels reproduce the torch code they replace in ``models/llama.py``.

RoPE and SiLU-and-mul must be bit-exact (they only round what torch rounds); the norms sum
the squares in another order, so their normalised value may be one ulp off torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine.kernels.fused import add_rms_norm, rms_norm, rope_, silu_and_mul
from workers.engine.models.llama import RMSNorm, rotate_half

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ON_GPU = torch.cuda.is_available()


def _norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One ulp of each element of ``t`` in its dtype (as fp32)."""
    info = torch.finfo(t.dtype)
    # eps * |x| is between one and two ulps of x: round down to x's binade.
    return torch.exp2(torch.floor(torch.log2(info.eps * t.float().abs().clamp_min(info.tiny))))


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    worst = ((got.float() - want.float()).abs() / _ulp(want)).max().item()
    assert worst <= ulps, f"off by {worst} ulp"


# Ulps the normalised value may be off by. In fp32 another summation order alone moves the
# variance by a couple of ulps (torch's own is 1.2 ulp off the exact one at hidden=96); in
# fp16/bf16 that shows at most as the rounding of the normalised value going the other way.
NORM_ULPS = {torch.float32: 4.0, torch.float16: 1.0, torch.bfloat16: 1.0}


def _assert_norm_close(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """``got`` is torch's RMSNorm of ``x`` but for the normalised value being NORM_ULPS off
    before the weight product, which scales that by ``|w|`` and rounds once more."""
    want = _norm_ref(x, weight, eps)
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    bound = NORM_ULPS[x.dtype] * weight.float().abs() * _ulp(normed) + _ulp(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    excess = ((got.float() - want.float()).abs() - bound).max().item()
    assert excess <= 0, f"off by {excess} beyond one ulp of the normalised value"
    if x.dtype != torch.float32:
        # Flips are rare; rounding once instead of twice (h * w, then cast) changes a quarter.
        assert (got != want).float().mean().item() < 0.01


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 96), (37, 96), (37, 1000), (3, 4000)])
def test_add_rms_norm_adds_in_place_and_normalises_like_torch(
    tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> None:
    x = _randn((tokens, hidden), dtype, device, 0)
    residual = _randn((tokens, hidden), dtype, device, 1) * 4
    weight = _randn((hidden,), dtype, device, 2)
    want_residual = residual + x  # the torch layer's "x = x + attn(...)"

    got = add_rms_norm(x, residual, weight, 1e-6)

    assert torch.equal(residual, want_residual)
    _assert_norm_close(got, want_residual, weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 96), (37, 1000)])
def test_rms_norm_matches_torch(
    tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> None:
    x = _randn((tokens, hidden), dtype, device, 3) * 3
    weight = _randn((hidden,), dtype, device, 4)
    x_before = x.clone()

    got = rms_norm(x, weight, 1e-5)

    _assert_norm_close(got, x, weight, 1e-5)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_qkv_view(dtype: torch.dtype, device: torch.device) -> None:
    # Qwen3's q/k norm: [T, H, D] views into one fused projection output.
    tokens, n_q, n_k, d = 37, 4, 2, 48
    qkv = _randn((tokens, (n_q + 2 * n_k) * d), dtype, device, 5)
    k = qkv[:, n_q * d : (n_q + n_k) * d].view(tokens, n_k, d)
    weight = _randn((d,), dtype, device, 6)

    got = rms_norm(k, weight, 1e-6)

    _assert_norm_close(got, k, weight, 1e-6)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_on_strided_qkv_views_is_bit_exact(
    tokens: int, dtype: torch.dtype, device: torch.device
) -> None:
    n_q, n_k, d = 6, 2, 40  # head_dim/2 = 20: not a power of two
    qkv = _randn((tokens, (n_q + 2 * n_k) * d), dtype, device, 7) * 2
    q, k, v = qkv.split([n_q * d, n_k * d, n_k * d], dim=-1)
    q, k, v = q.view(tokens, n_q, d), k.view(tokens, n_k, d), v.view(tokens, n_k, d)
    # As LlamaForCausalLM builds them: fp32 angles, cast to the model dtype, [T, 1, D].
    positions = torch.randint(0, 4000, (tokens,), generator=torch.Generator().manual_seed(8))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    want_q, want_k, want_v = _rope_ref(q, cos, sin), _rope_ref(k, cos, sin), v.clone()

    rope_(q, k, cos, sin)

    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    assert torch.equal(v, want_v)  # the rest of the row is untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inter", [(1, 96), (37, 96), (37, 1500)])
def test_silu_and_mul_is_bit_exact(
    tokens: int, inter: int, dtype: torch.dtype, device: torch.device
) -> None:
    gate_up = _randn((tokens, 2 * inter), dtype, device, 9) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up

    got = silu_and_mul(gate_up)

    if ON_GPU or dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        # The interpreter's exp is numpy's, torch's CPU silu uses Sleef's: silu differs by a
        # few fp32 ulps, which survive in fp32 and, rarely, flip an fp16 rounding of silu
        # (one ulp of silu, up to two of the product).
        _assert_within_ulps(got, want, 4.0 if dtype == torch.float32 else 2.0)
        assert (got != want).float().mean().item() < (0.5 if dtype == torch.float32 else 0.01)


def test_silu_and_mul_rounds_silu_before_the_product(device: torch.device) -> None:
    # A kernel that skipped rounding silu(gate) to bf16 would differ on about a third of these.
    gate_up = _randn((64, 512), torch.bfloat16, device, 10) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    unrounded = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    want = F.silu(gate) * up
    assert (unrounded != want).float().mean().item() > 0.05  # the test can tell them apart

    assert torch.equal(silu_and_mul(gate_up), want)
