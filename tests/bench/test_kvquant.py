"""bench/kvquant.py's measures and bench/kvquant_schemes.py's simulated schemes."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from bench import kvquant
from bench.kvquant_schemes import (
    SCHEMES,
    CacheShape,
    Calibration,
    _hadamard,
    calibrate,
    simulating,
)
from bench.make_golden import OUT as GOLDEN
from common.models import demo_model_path
from workers.engine import LLM, SamplingParams
from workers.engine.kernels import reference

SHAPE = CacheShape(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
CALIB = Calibration(k_amax=(3.0,), v_amax=(5.0,))


def _run(texts: list[str], tokens: list[list[int]] | None = None) -> kvquant.Run:
    return kvquant.Run(
        tokens=tokens or [[i] for i in range(len(texts))],
        texts=texts,
        golden_texts=texts,
        seconds=0.0,
    )


def test_golden_scores_against_the_references_and_the_drop_counts_changed_prompts_only() -> None:
    rows = [json.loads(line) for line in GOLDEN.read_text().splitlines()][:20]
    base = _run([r["reference"] for r in rows])
    worse = _run([r["reference"] for r in rows[:19]] + ["something else"])
    got = kvquant.golden(rows, worse, base)
    assert got["n"] == 20 and got["exact_match_pct"] == 95.0
    assert got["drop"]["exact_match"]["points"] == 5.0
    assert got["drop"]["rouge_l"]["points"] > 0
    assert kvquant.golden(rows, base, None)["exact_match_pct"] == 100.0
    assert got["answers_changed"] == 1
    # A wrong baseline that the scheme "fixes" while it breaks another nets no drop, yet
    # two answers changed.
    wrong_base = _run(["nope"] + [r["reference"] for r in rows[1:]])
    swapped = kvquant.golden(rows, worse, wrong_base)
    assert swapped["drop"]["exact_match"]["points"] == 0.0 and swapped["answers_changed"] == 2
    assert kvquant.target(got) == {
        "exact_match_drop_under_1": False,
        "exact_match_ci95_under_1": False,
        "rouge_l_drop_under_1": False,
        "rouge_l_ci95_under_1": False,
    }


def test_agreement_is_whole_output_token_equality_with_the_baseline() -> None:
    base = _run(["a b c", "d e", "f"], [[1, 2, 3], [4, 5], [6]])
    run = _run(["a b c", "d x", "f"], [[1, 2, 3], [4, 7], [6]])
    got = kvquant.agreement(run, base)
    assert got["exact_match_pct"] == pytest.approx(66.67)
    assert got["drop"]["exact_match"]["points"] == pytest.approx(33.33)
    assert 0 < got["drop"]["rouge_l"]["points"] < got["drop"]["exact_match"]["points"]


def test_block_scale_is_fixed_by_the_write_that_opens_the_block_and_later_tokens_saturate() -> None:
    q = SCHEMES["fp8_block_head"](SHAPE, CALIB)
    first = torch.zeros(1, 2, 8)
    first[0, :, 0] = 1.0
    assert torch.equal(q(first, 0, "k", torch.tensor([4])), first)  # amax -> 448 / 2, exact
    later = torch.zeros(1, 2, 8)
    later[0, :, 0] = 3.0  # 3x the opening amax: beyond the 2x margin
    assert torch.equal(q(later, 0, "k", torch.tensor([5]))[0, :, 0], torch.tensor([2.0, 2.0]))
    # Reopened (offset 0 again, as when the block is reused): a new scale, no saturation.
    assert torch.equal(q(later, 0, "k", torch.tensor([4])), later)
    # V keeps its own scales: its block 1 opened at amax 1, so 3 saturates there.
    q(first, 0, "v", torch.tensor([4]))
    assert torch.equal(q(later, 0, "v", torch.tensor([5]))[0, :, 0], torch.tensor([2.0, 2.0]))


def test_tensor_scale_maps_the_calibrated_amax_onto_448() -> None:
    q = SCHEMES["fp8_tensor"](SHAPE, CALIB)
    x = torch.tensor([5.0, -5.0, 9.0, 0.0]).repeat(2, 1)[None].repeat(1, 1, 2)
    out = q(x, 0, "v", torch.tensor([0]))
    assert out[0, 0, 0] == 5.0 and out[0, 0, 2] == 5.0  # saturates at the calibrated amax


def test_hadamard_rotation_is_its_own_inverse_and_needs_a_power_of_two() -> None:
    h = _hadamard(32)
    assert torch.allclose(h @ h, torch.eye(32), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        _hadamard(24)


def test_calibration_leaves_unwritten_slots_out_of_the_channel_figures() -> None:
    k = torch.zeros(2, 2, 1, 4)  # 4 slots, two of them written
    k[0, 0, 0] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    k[1, 1, 0] = torch.tensor([3.0, -4.0, 1.0, 0.5])
    calib = calibrate([k], [k])
    assert torch.equal(calib.k_channel_mean[0], torch.tensor([[2.0, -3.0, 2.0, 0.5]]))
    assert torch.equal(calib.k_channel_amax[0], torch.tensor([[3.0, 4.0, 3.0, 0.5]]))


def test_centring_k_quantises_what_is_left_after_the_mean_and_leaves_v_alone() -> None:
    torch.manual_seed(0)
    mean = torch.tensor([4.0, -3.0, 5.0, 2.0, -6.0, 1.0, 3.0, -2.0]).repeat(2, 1)
    calib = Calibration((1.0,), (1.0,), (mean,), (mean.abs(),))
    q = SCHEMES["int8_k_centred"](SHAPE, calib)
    x = mean + 0.01 * torch.randn(64, 2, 8)
    plain = SCHEMES["int8_token_head"](SHAPE, calib)(x, 0, "k", torch.arange(64))
    centred = q(x, 0, "k", torch.arange(64))
    assert (centred - x).abs().max() < (plain - x).abs().max() / 50
    assert torch.equal(q(x, 0, "v", torch.arange(64)), plain)


def test_smoothing_scales_are_equal_within_each_rope_pair() -> None:
    amax = torch.tensor([[1.0, 16.0, 4.0, 1.0, 9.0, 1.0, 1.0, 1.0]]).repeat(2, 1)
    calib = Calibration((1.0,), (1.0,), (), (amax,))
    q = SCHEMES["int8_k_smoothed"](SHAPE, calib)
    # A row shaped like the channel scales (3, 4, 2, 1 | 3, 4, 2, 1, normalised) survives int8
    # exactly when divided by them: every channel of it quantises to the same value.
    scale = torch.tensor([3.0, 4.0, 2.0, 1.0] * 2)
    scale = scale / scale.mean()
    x = scale.repeat(1, 2, 1)
    assert torch.allclose(q(x, 0, "k", torch.tensor([0])), x, rtol=1e-6)


def test_simulation_restores_the_store_even_when_the_run_fails() -> None:
    store = reference.store_kv_ref
    with pytest.raises(RuntimeError), simulating([], SHAPE, CALIB, "bf16"):
        assert reference.store_kv_ref is not store
        raise RuntimeError("boom")
    assert reference.store_kv_ref is store


@pytest.mark.parametrize(
    ("scheme", "kv_dtype"), [("int8_token_head", "int8"), ("fp8_token_head", "fp8_e4m3")]
)
def test_simulating_the_shipped_scheme_gives_the_real_quantised_runs_tokens(
    scheme: str, kv_dtype: str
) -> None:
    """What makes the other simulated schemes' figures worth anything."""
    model = str(demo_model_path())
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[0, *range(40 + 7 * i, 60 + 7 * i)] for i in range(6)]

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]

    real = tokens(LLM(model, dtype="float32", kv_cache_dtype=kv_dtype, num_kv_blocks=64))
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    layers = llm.engine.runner.kv_caches
    shape = CacheShape(len(layers), *layers[0].k.shape)
    with simulating([layer.k for layer in layers], shape, CALIB, scheme):
        simulated = tokens(llm)
    assert simulated == real
    # And the simulation does quantise: these prompts have tokens an fp32 cache changes.
    assert tokens(LLM(model, dtype="float32", num_kv_blocks=64)) != real


def test_exact_step_attends_over_its_own_rows_unrounded_and_leaves_them_quantised() -> None:
    """A prefill under ``int8_exact_step`` gives the unquantised run's first logprobs to the
    bit, and leaves the cache as the shipped int8 scheme would."""
    model = str(demo_model_path())
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    prompts = [[0, *range(40 + 7 * i, 60 + 7 * i)] for i in range(4)]

    def first_logprobs(llm: LLM) -> list[float]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return [o.logprobs[0] for o in outs if o.logprobs]

    exact = LLM(model, dtype="float32", num_kv_blocks=64)
    want = first_logprobs(exact)
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    layers = llm.engine.runner.kv_caches
    shape = CacheShape(len(layers), *layers[0].k.shape)
    with simulating([layer.k for layer in layers], shape, CALIB, "int8_exact_step"):
        got = first_logprobs(llm)
    assert len(got) == len(prompts) and got == want
    int8 = SCHEMES["int8_token_head"](shape, CALIB)
    for mine, theirs in zip(layers, exact.engine.runner.kv_caches, strict=True):
        for kind in ("k", "v"):
            rows = getattr(theirs, kind)
            assert torch.equal(getattr(mine, kind), int8(rows, 0, kind, torch.arange(1)))
    # Quantised for real: the shipped scheme, rounding before it attends, logs other values.
    shipped = LLM(model, dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8")
    assert first_logprobs(shipped) != want


def test_calibration_text_is_64_excerpts_holding_no_measured_answer() -> None:
    """It was the top-level modules after the code prompts' 100: 40 of them on Python 3.11,
    nine holding a Q/A answer word for word (zipfile's docstring is a golden prompt's)."""
    rows = [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]
    answers = kvquant._answers(rows)
    excerpts = kvquant.calibration_excerpts(100, answers)
    assert len(excerpts) == 64 and len(set(excerpts)) == 64
    assert not any(a in text for a in answers if len(a) >= 20 for text in excerpts)
    taken = {text.splitlines()[0] for text in [*map("\n".join, _first_defs(100))]}
    assert not any(text.splitlines()[0] in taken for text in excerpts)
    with pytest.raises(ValueError, match="qualify"):
        kvquant.calibration_excerpts(100, answers, limit=100_000)


def _first_defs(n: int) -> list[list[str]]:
    return [lines[:3] for lines in itertools.islice(kvquant._stdlib_defs(), n)]
