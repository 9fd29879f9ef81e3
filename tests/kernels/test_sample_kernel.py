"""The Gumbel-max sampling kernel (interpreter on CPU) and the sampler's fused path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from workers.engine.kernels.sample import gumbel_argmax
from workers.engine.sampler import Sampler, philox_key
from workers.engine.sampling_params import SamplingParams


def _logits(
    rows: int, vocab: int, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 3).to(device)


def _draw(logits: torch.Tensor, temps: list[float], seeds: list[int], block_v: int = 64):
    dev = logits.device
    t = torch.tensor(temps, dtype=torch.float32, device=dev)
    s = torch.tensor(seeds, dtype=torch.int64, device=dev)
    return gumbel_argmax(logits, t, s, block_v=block_v).tolist()


def test_greedy_rows_are_torch_argmax_across_blocks_and_a_ragged_tail(device) -> None:
    logits = _logits(5, 300, device=device)  # 300 = 4 blocks of 64 + 44
    logits[2, 250] = 100.0  # the maximum in the ragged last block
    logits[3, :] = 1.0  # all tied: the first index, like torch.argmax
    got = _draw(logits, [0.0] * 5, list(range(5)))
    assert got == logits.argmax(-1).tolist() and got[3] == 0


def test_a_row_depends_on_its_seed_and_logits_only(device) -> None:
    logits = _logits(6, 200, seed=1, device=device)
    seeds = [11, 12, 13, 14, 15, 16]
    temps = [1.0, 0.7, 1.3, 1.0, 0.5, 2.0]
    full = _draw(logits, temps, seeds)
    for row in range(6):
        alone = _draw(logits[row : row + 1].clone(), [temps[row]], [seeds[row]])
        assert alone == [full[row]]
    moved = _draw(logits.flip(0).contiguous(), temps[::-1], seeds[::-1])
    assert moved == full[::-1]
    reseeded = [_draw(logits[:1].clone(), [1.0], [s])[0] for s in range(100, 140)]
    assert len(set(reseeded)) > 5  # the seed matters


def test_masked_tokens_are_never_drawn(device) -> None:
    logits = torch.zeros(64, 100, device=device)
    logits[:, 10:] = float("-inf")
    assert set(_draw(logits, [1.5] * 64, list(range(64)))) <= set(range(10))


def test_draws_follow_softmax_over_temperature(device) -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    n, temperature = 3000, 0.7
    logits = row.expand(n, -1).contiguous().to(device)
    tokens = _draw(logits, [temperature] * n, [philox_key(7, i) for i in range(n)], block_v=8)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()

    def chi_square(probs: torch.Tensor) -> float:
        expected = probs * n
        return float(((counts - expected) ** 2 / expected).sum())

    # 5 degrees of freedom: chi2 > 40 has probability ~1e-7 when the sampler is right.
    assert chi_square(torch.softmax(row / temperature, -1)) < 40
    assert chi_square(torch.softmax(row, -1)) > 100  # temperature ignored: far off


@dataclass
class _Req:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_ids_device: torch.Tensor | None = None
    output_ids_cache: Any = None
    guide: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    resumed_tokens: int = 0


def test_fused_sampler_keeps_seeded_rows_batch_invariant_and_filters_on_the_torch_path(
    device,
) -> None:
    logits = _logits(4, 96, seed=3, device=device)
    target = _Req(SamplingParams(temperature=0.9, seed=42), output_token_ids=[5, 6])
    alone = Sampler(fused=True).sample(logits[2:3].clone(), [target]).token_ids
    filtered = _Req(SamplingParams(temperature=1.0, top_k=3))
    batch = [_Req(SamplingParams(temperature=0)), filtered, target, _Req(SamplingParams())]
    out = Sampler(fused=True).sample(logits, batch).token_ids
    assert out[2] == alone[0]
    assert out[0] == int(logits[0].argmax())
    assert out[1] in set(logits[1].topk(3).indices.tolist())
    # The next output position draws new noise: over many positions the token varies.
    seen = set()
    for n in range(30):
        target.output_token_ids = [0] * n
        seen.update(Sampler(fused=True).sample(logits[2:3].clone(), [target]).token_ids)
    assert len(seen) > 3


def test_philox_keys_are_63_bit_and_differ_by_seed_and_position() -> None:
    keys = {philox_key(s, d) for s in (0, 1, 2**64 - 1) for d in range(50)}
    assert len(keys) == 150 and all(0 <= k < 2**63 for k in keys)


def test_logits_must_have_contiguous_rows() -> None:
    with pytest.raises(ValueError, match="contiguous rows"):
        gumbel_argmax(torch.zeros(4, 6).t(), torch.ones(6), torch.zeros(6, dtype=torch.int64))


def test_the_choice_does_not_depend_on_how_the_vocabulary_is_chunked(device) -> None:
    logits = _logits(6, 530, seed=5, device=device)
    logits[1, :] = 2.0  # ties everywhere: the first index in every chunking
    logits[2, :400] = float("-inf")  # the maximum sits in a late chunk
    logits[3, 100] = logits[3, 420] = 50.0  # a tie across chunks: the earlier one
    temps = [0.0, 0.0, 1.0, 0.0, 0.8, 1.7]
    seeds = [philox_key(3, i) for i in range(6)]
    t = torch.tensor(temps, dtype=torch.float32, device=logits.device)
    s = torch.tensor(seeds, dtype=torch.int64, device=logits.device)
    draws = [gumbel_argmax(logits, t, s, block_v=32, chunk_blocks=c).tolist() for c in (1, 3, 17)]
    assert draws[0] == draws[1] == draws[2]
    assert draws[0][1] == 0 and draws[0][2] >= 400 and draws[0][3] == 100
    half = gumbel_argmax(logits.to(torch.bfloat16), t, s, block_v=32, chunk_blocks=3)
    assert (
        half.tolist()
        == gumbel_argmax(
            logits.to(torch.bfloat16).float(), t, s, block_v=32, chunk_blocks=3
        ).tolist()
    )  # half-precision logits are read as their exact fp32 values


def test_filtered_rows_are_drawn_by_the_kernel_from_what_their_filters_keep(device) -> None:
    """On the fused path a row with top-k/top-p/min-p is filtered in torch, then drawn by
    the Gumbel-max kernel with its seed's Philox key: no per-row generator (the gateway
    seeds every request, and generation configs set top-k/top-p for all of them)."""
    row = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 3.0, -2.0, 0.0])
    n, temperature = 400, 0.8
    logits = row.expand(n, -1).contiguous().to(device)
    reqs = [
        _Req(SamplingParams(temperature=temperature, top_k=3, seed=9), output_token_ids=[0] * i)
        for i in range(n)
    ]
    tokens = Sampler(fused=True).sample(logits, reqs).token_ids
    keep = row.topk(3).indices  # 5, 0, 1
    assert set(tokens) <= set(keep.tolist())
    # The kernel's own draw of the filtered row, with each request's key.
    filtered = torch.full_like(row, float("-inf"))
    filtered[keep] = row[keep] / temperature
    keys = [philox_key(9, i) for i in range(n)]
    assert tokens == _draw(filtered.expand(n, -1).contiguous().to(device), [1.0] * n, keys)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()[keep]
    expected = torch.softmax(row[keep] / temperature, -1) * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 30  # 2 dof: p ~ 3e-7


def test_a_seeded_filtered_row_draws_the_same_alone_and_in_a_batch(device) -> None:
    logits = _logits(5, 120, seed=8, device=device)
    target = _Req(
        SamplingParams(temperature=1.1, top_p=0.9, min_p=0.01, seed=5), output_token_ids=[1]
    )
    alone = Sampler(fused=True).sample(logits[3:4].clone(), [target]).token_ids
    batch = [
        _Req(SamplingParams(temperature=0.7, top_k=4)),
        _Req(SamplingParams(temperature=0)),
        _Req(SamplingParams(temperature=1.0, seed=1)),
        target,
        _Req(SamplingParams(temperature=0.5, top_p=0.5, seed=2)),
    ]
    assert Sampler(fused=True).sample(logits, batch).token_ids[3] == alone[0]
