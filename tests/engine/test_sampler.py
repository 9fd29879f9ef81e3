"""workers.engine.sampler: greedy, filters, penalties, seeds, logprobs, distribution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from workers.engine.sampler import Sampler, apply_penalties
from workers.engine.sampling_params import SamplingParams, SamplingParamsError


@dataclass
class Req:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_ids_device: torch.Tensor | None = None
    output_ids_cache: Any = None
    guide: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    resumed_tokens: int = 0


# The CUDA half runs where a GPU is (the `cuda` marker); the sampler must agree there too.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def req(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    device: torch.device | str = "cpu",
    **params: Any,
) -> Req:
    """A request as the engine builds it: seeded ones carry a generator on the device."""
    p = SamplingParams(**params)
    gen = None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed)
    return Req(p, gen, list(prompt or []), output_token_ids=list(output or []))


def random_logits(
    rows: int, vocab: int, seed: int = 0, scale: float = 3.0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(device)


def draws(logits_row: torch.Tensor, n: int, **params: Any) -> list[int]:
    """``n`` unseeded draws for one distribution, as one batch of ``n`` identical rows."""
    batch = [req(device=logits_row.device, **params) for _ in range(n)]
    return Sampler().sample(logits_row.expand(n, -1).contiguous(), batch).token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_rows_are_exactly_the_argmax_alone_and_in_a_mixed_batch(
    device: torch.device,
) -> None:
    logits = random_logits(6, 1000, device=device)
    assert Sampler().sample(logits, [req(temperature=0) for _ in range(6)]).token_ids == (
        logits.argmax(-1).tolist()
    )
    batch = [
        req(temperature=0) if i % 2 else req(temperature=1.0, seed=i, device=device)
        for i in range(6)
    ]
    got = Sampler().sample(logits, batch).token_ids
    assert got[1::2] == logits.argmax(-1).tolist()[1::2]


def test_top_k_never_chooses_outside_the_k_largest() -> None:
    row = random_logits(1, 64, seed=1, scale=1.0)[0]
    allowed = set(row.topk(5).indices.tolist())
    chosen = set(draws(row, 2000, top_k=5))
    assert chosen <= allowed
    assert len(chosen) == 5  # the filter keeps k, not fewer


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    row = random_logits(1, 64, seed=2, scale=1.5)[0]
    temperature, top_p = 0.8, 0.6
    probs = torch.softmax(row / temperature, -1)
    ordered = probs.sort(descending=True)
    mass_before = ordered.values.cumsum(0) - ordered.values
    allowed = set(ordered.indices[mass_before < top_p].tolist())
    chosen = set(draws(row, 3000, temperature=temperature, top_p=top_p))
    assert chosen <= allowed
    assert len(chosen) >= len(allowed) - 1 and len(allowed) > 2


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    row = random_logits(1, 64, seed=3, scale=1.5)[0]
    probs = torch.softmax(row, -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    chosen = set(draws(row, 3000, min_p=0.2))
    assert chosen <= allowed and len(allowed) > 2
    assert len(chosen) >= len(allowed) - 1  # and not fewer: no over-filtering


def test_filters_combine_and_rows_keep_their_own_settings() -> None:
    logits = random_logits(3, 64, seed=4, scale=1.0)
    batch_params = [dict(top_k=3), dict(top_p=0.4), dict(top_k=10, top_p=0.9, min_p=0.05)]

    def nucleus(row: torch.Tensor, top_p: float, keep: torch.Tensor) -> set[int]:
        """The smallest set of ``keep``'s tokens (renormalised) whose mass reaches top_p."""
        probs = torch.softmax(row.masked_fill(~keep, float("-inf")), -1)
        ordered = probs.sort(descending=True)
        mass_before = ordered.values.cumsum(0) - ordered.values
        return set(ordered.indices[(mass_before < top_p) & (ordered.values > 0)].tolist())

    everything = torch.ones(64, dtype=torch.bool)
    top10 = torch.zeros(64, dtype=torch.bool)
    top10[logits[2].topk(10).indices] = True
    probs2 = torch.softmax(logits[2], -1)
    row2 = nucleus(logits[2], 0.9, top10) & set(
        torch.nonzero(probs2 >= 0.05 * probs2.max()).flatten().tolist()
    )
    allowed = [set(logits[0].topk(3).indices.tolist()), nucleus(logits[1], 0.4, everything), row2]
    # Each row's own filter: sets of different sizes, so a setting leaking across rows shows.
    assert len({len(a) for a in allowed}) == 3, [len(a) for a in allowed]
    chosen: list[set[int]] = [set(), set(), set()]
    for step in range(200):
        batch = [req(seed=step * 3 + i, **p) for i, p in enumerate(batch_params)]
        tokens = Sampler().sample(logits, batch).token_ids
        for row in range(3):
            assert tokens[row] in allowed[row], (row, tokens[row])
            chosen[row].add(tokens[row])
    for row in range(3):  # and no row filtered harder than its own settings say
        assert len(chosen[row]) >= len(allowed[row]) - 1, (row, chosen[row], allowed[row])


def test_repetition_presence_frequency_penalties_match_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [1.0, 1.0, -1.0, -1.0, 0.0, 4.0]])
    batch = [
        req(prompt=[0, 1], output=[3, 3, 1], repetition_penalty=1.5),
        req(prompt=[5], output=[2, 2, 2, 0], presence_penalty=0.5, frequency_penalty=0.25),
    ]
    got = apply_penalties(logits, batch)

    expected = logits.clone()
    for token in {0, 1, 3}:  # HF: seen in prompt or output; divide if > 0, else multiply
        x = float(logits[0, token])
        expected[0, token] = x / 1.5 if x > 0 else x * 1.5
    for token, count in {2: 3, 0: 1}.items():  # OpenAI: output tokens only
        expected[1, token] -= 0.25 * count + 0.5
    torch.testing.assert_close(got, expected)


def test_the_repetition_penalty_reads_the_prompt_from_ids_kept_on_the_device() -> None:
    """A step's host work must not grow with the prompt: its distinct ids are made once per
    request and kept; the penalty is the same at every later step."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    r = req(prompt=[4, 0, 4, 4, 0], output=[2], repetition_penalty=2.0)
    first = apply_penalties(logits, [r])
    assert r.prompt_ids_device is not None and r.prompt_ids_device.tolist() == [0, 4]
    kept = r.prompt_ids_device
    expected = torch.tensor([[1.0, -1.0, 0.25, 3.0, -4.0, 0.0]])
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(apply_penalties(logits, [r]), expected)
    assert r.prompt_ids_device is kept


def test_penalties_follow_the_output_step_by_step_from_a_copy_grown_in_place() -> None:
    """The output the penalties count is copied a step at a time (at batch 256 with 2k-token
    outputs, rebuilding it from the list took ~34 ms of host time a step): a placeholder
    still on the device is left to ``pending``, a token taken back and replaced is seen."""
    vocab = 6

    def expected(r: Req, pending: int | None = None) -> torch.Tensor:
        counts = torch.zeros(vocab)
        for t in [*r.prompt_token_ids[len(r.prompt_token_ids) - r.resumed_tokens :],
                  *(t for t in r.output_token_ids if t >= 0)]:  # fmt: skip
            counts[t] += 1
        if pending is not None:
            counts[pending] += 1
        return -(0.25 * counts + 0.5 * (counts > 0))

    r = req(prompt=[5, 3], output=[], presence_penalty=0.5, frequency_penalty=0.25)
    r.resumed_tokens = 1  # 3 was output before a redelivery
    logits = torch.zeros(1, vocab)
    steps = [[1], [1, 2], [1, 2, 2], [1, 2, 2, -1], [1, 2, 2, 4], [1, 2], [1, 2, 0]]
    cache = None
    for i, output in enumerate(steps):
        r.output_token_ids = list(output)
        pending = 3 if output[-1] < 0 else None
        got = apply_penalties(logits, [r], None if pending is None else torch.tensor([pending]))
        torch.testing.assert_close(got[0], expected(r, pending), msg=str(output))
        if cache is None:
            cache = r.output_ids_cache
            assert cache is not None
        if i < 5:  # grown in place until the output was taken back (step 5)
            assert r.output_ids_cache is cache


def test_a_resumed_requests_delivered_tokens_count_as_output_for_penalties() -> None:
    """Redelivered, a request's prompt ends with the tokens its caller already has; the
    presence/frequency penalties must count them as the first worker did."""
    logits = torch.zeros(1, 6)
    resumed = req(prompt=[5, 1, 2, 2], output=[4], presence_penalty=0.5, frequency_penalty=0.25)
    resumed.resumed_tokens = 3  # 1, 2, 2 were output before the redelivery; 5 is the prompt
    got = apply_penalties(logits, [resumed])
    expected = torch.zeros(1, 6)
    for token, count in {1: 1, 2: 2, 4: 1}.items():
        expected[0, token] -= 0.25 * count + 0.5
    torch.testing.assert_close(got, expected)


def test_penalties_steer_greedy_and_leave_the_callers_logits_alone(device: torch.device) -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]], device=device)
    before = logits.clone()
    repeated = req(output=[0], temperature=0, repetition_penalty=1.2)
    assert Sampler().sample(logits, [repeated]).token_ids == [1]
    fresh = req(output=[0], temperature=0, frequency_penalty=0.2)
    assert Sampler().sample(logits, [fresh]).token_ids == [1]
    assert Sampler().sample(logits, [req(output=[0], temperature=0)]).token_ids == [0]
    torch.testing.assert_close(logits, before)


def test_seeded_request_gets_the_same_tokens_alone_and_anywhere_in_any_batch(
    device: torch.device,
) -> None:
    vocab, steps = 500, 12
    step_logits = [
        random_logits(1, vocab, seed=100 + s, scale=1.0, device=device)[0] for s in range(steps)
    ]
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, device=device)

    alone_req = req(**params)
    alone = [Sampler().sample(lg.unsqueeze(0), [alone_req]).token_ids[0] for lg in step_logits]

    for position in (0, 2, 4):
        target = req(**params)
        others = [
            req(temperature=1.0),
            req(temperature=0),
            req(temperature=0.7, seed=99, device=device),
            req(temperature=1.2, min_p=0.1, repetition_penalty=1.3, prompt=[1, 2, 3]),
        ]
        batch = [*others[:position], target, *others[position:]]
        noise = random_logits(len(batch), vocab, seed=position, device=device)
        in_batch = []
        for lg in step_logits:
            logits = noise.clone()
            logits[position] = lg
            in_batch.append(Sampler().sample(logits, batch).token_ids[position])
        assert in_batch == alone, position

    other_seed = req(**{**params, "seed": 4321})
    differs = [Sampler().sample(lg.unsqueeze(0), [other_seed]).token_ids[0] for lg in step_logits]
    assert differs != alone


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (dict(temperature=1.0), None),
        (dict(temperature=0.5), None),
        (dict(temperature=1.0, top_k=3), 3),
    ],
)
def test_sampling_distribution_matches_the_softmax(
    params: dict[str, Any], keep: int | None, device: torch.device
) -> None:
    torch.manual_seed(2024)  # unseeded rows draw from the global generator
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    n = 20_000
    tokens = draws(row.to(device), n, **params)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    probs = torch.softmax(row / params["temperature"], -1)
    if keep is not None:
        probs[probs.argsort(descending=True)[keep:]] = 0
        probs /= probs.sum()
    # 5 degrees of freedom: chi2 > 40 has probability ~1e-7 when the sampler is right.
    assert chi_square(counts, probs) < 40
    # A sampler that ignored temperature or filtering would be far off.
    assert chi_square(counts, torch.softmax(row * 0.5, -1)) > 200


def test_logprobs_are_raw_log_softmax_before_penalties_and_temperature(
    device: torch.device,
) -> None:
    logits = random_logits(3, 50, seed=5, device=device)
    batch = [
        req(
            temperature=0.3,
            repetition_penalty=2.0,
            output=[1, 2],
            logprobs=3,
            seed=1,
            device=device,
        ),
        req(temperature=0, logprobs=0),
        req(temperature=1.0),
    ]
    out = Sampler().sample(logits, batch)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(float(raw[row, token]), abs=1e-6)
    top_ids = raw[0].topk(3).indices.tolist()
    assert [t for t, _ in out.top_logprobs[0]] == top_ids
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(raw[0, top_ids].tolist())
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_no_logprobs_unless_asked() -> None:
    out = Sampler().sample(random_logits(2, 10), [req(), req(temperature=0)])
    assert out.logprobs is None and out.top_logprobs is None


def test_logits_that_do_not_match_the_batch_are_refused() -> None:
    with pytest.raises(ValueError, match="batch of 1"):
        Sampler().sample(random_logits(2, 10), [req()])


def test_a_request_names_at_most_64_stop_token_ids() -> None:
    SamplingParams(stop_token_ids=list(range(64))).validate()
    with pytest.raises(SamplingParamsError, match="at most 64"):
        SamplingParams(stop_token_ids=list(range(65))).validate()


def test_a_stop_string_has_at_most_1024_characters() -> None:
    """Each is matched against every token's text on the engine thread, for the whole batch:
    a huge one slowed every request of the group."""
    SamplingParams(stop=["x" * 1024]).validate()
    with pytest.raises(SamplingParamsError, match="1024 characters"):
        SamplingParams(stop=["x" * 1025]).validate()
