"""OpenAI's ``logit_bias``: the sampler adds it, the engine checks its ids against the vocabulary,
and greedy tokens under a bias equal ``transformers.generate`` with the same ``sequence_bias``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import InvalidRequestError
from tests.engine.test_sampler import random_logits, req
from tests.engine.tiny_checkpoints import EOS, VOCAB, _hf_model, checkpoint, hf_greedy, prompts
from workers.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from workers.engine.sampler import Sampler
from workers.engine.sampling_params import SamplingParamsError

MAX_TOKENS = 10


def test_a_ban_and_a_push_move_greedy_and_other_rows_keep_their_own() -> None:
    logits = random_logits(3, 40, seed=3)
    top = logits.argmax(-1).tolist()
    batch = [
        req(temperature=0, logit_bias={top[0]: -100}),
        req(temperature=0),
        req(temperature=0, logit_bias={7: 100.0}),
    ]
    before = logits.clone()
    out = Sampler().sample(logits, batch).token_ids
    second = logits[0].clone()
    second[top[0]] = float("-inf")
    assert out == [int(second.argmax()), top[1], 7]
    torch.testing.assert_close(logits, before)  # the caller's logits are left alone


def test_a_small_bias_adds_exactly_before_the_argmax() -> None:
    logits = torch.tensor([[1.0, 1.5, 0.2, 3.0]])
    assert Sampler().sample(logits, [req(temperature=0, logit_bias={1: 1.4})]).token_ids == [3]
    assert Sampler().sample(logits, [req(temperature=0, logit_bias={1: 1.6})]).token_ids == [1]


def test_half_precision_logits_take_the_bias_in_fp32() -> None:
    """fp16 has no step near 1000 small enough for a 0.5 bias: it is added after widening."""
    logits = torch.tensor([[1000.0, 999.75]], dtype=torch.float16)
    biased = req(temperature=0, logit_bias={1: 0.5})
    assert Sampler().sample(logits, [biased]).token_ids == [1]


def test_sampled_rows_never_draw_a_banned_token_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(64, 5)
    logits[:, 2] = 3.0
    batch = [
        req(temperature=1.0, seed=i, logit_bias={2: -100, 4: -100}, logprobs=1) for i in range(64)
    ]
    out = Sampler().sample(logits, batch)
    assert set(out.token_ids) <= {0, 1, 3} and len(set(out.token_ids)) == 3
    raw = torch.log_softmax(logits[0], -1)
    assert out.top_logprobs is not None and out.top_logprobs[0][0][0] == 2  # unbiased top
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-6)


def test_a_held_stop_id_stays_held_whatever_its_bias() -> None:
    """min_tokens holds EOS at -inf: a +100 bias on it must not bring it back."""
    logits = torch.zeros(1, 8)
    r = req(temperature=0, min_tokens=2, max_tokens=4, logit_bias={5: 100})
    r.eos_token_ids = frozenset({5})  # type: ignore[attr-defined]
    assert Sampler().sample(logits, [r]).token_ids != [5]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({3: 100.5}, r"\[-100, 100\]"),
        ({3: float("nan")}, r"\[-100, 100\]"),
        ({-1: 1.0}, "non-negative"),
        ({True: 1.0}, "non-negative"),
        ({3: "1"}, r"\[-100, 100\]"),
        ({i: 1.0 for i in range(1025)}, "at most 1024"),
    ],
)
def test_bad_biases_are_refused_naming_logit_bias(bias: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_an_empty_bias_asks_for_nothing() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


def hf_biased_greedy(path: Path, prompt: list[int], bias: dict[int, float]) -> list[int]:
    model = _hf_model(str(path))  # loaded once per checkpoint, as hf_greedy's
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
            sequence_bias={(t,): b for t, b in bias.items()},
        )
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_under_a_bias_equals_transformers_sequence_bias(kind: str, root: str) -> None:
    path = checkpoint(kind, root)
    batch = prompts(4, seed=2)
    plain = [hf_greedy(path, p, MAX_TOKENS) for p in batch]
    # Ban each prompt's own greedy tokens and push two others: every path changes.
    biases = [{**{t: -100.0 for t in set(out)}, 11: 2.5, 42: 1.0} for out in plain]
    want = [hf_biased_greedy(path, p, b) for p, b in zip(batch, biases, strict=True)]
    assert all(w != p for w, p in zip(want, plain, strict=True))
    llm = LLM(str(path), block_size=4, dtype="float32", num_kv_blocks=64, policy="hybrid")
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias=b) for b in biases]
    # One batch, biased and unbiased rows side by side: each row keeps its own.
    unbiased = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(batch)
    outs = llm.generate(prompt_token_ids=batch + batch, sampling_params=params + unbiased)
    assert [o.token_ids for o in outs] == want + plain


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_logit_bias(root: str) -> None:
    engine = LLMEngine(
        EngineArgs(str(checkpoint("llama", root)), dtype="float32", block_size=4, num_kv_blocks=32)
    )
    with pytest.raises(InvalidRequestError, match=f"vocabulary \\[0, {VOCAB}\\): {VOCAB}") as info:
        engine.add_request(
            "r", prompt_token_ids=[1, 2, 3], params=SamplingParams(logit_bias={5: 1, VOCAB: -100})
        )
    assert info.value.param == "logit_bias" and info.value.http_status == 400
    assert not engine.has_unfinished()
