"""SimEngine: the step API, the cost model and deterministic tokens, without NATS."""

from __future__ import annotations

import pytest

from common.errors import ContextLengthExceededError
from common.tokenizer import ByteTokenizer
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine, sim_token


def run(engine: SimEngine) -> dict[str, list]:
    """Step until idle: request id -> its deltas."""
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).append(delta)
    return out


def test_step_time_follows_the_cost_model() -> None:
    slept: list[float] = []
    cost = SimCost(base_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
    engine = SimEngine(cost=cost, sleep=slept.append)
    engine.add_request("a", params=SamplingParams(max_tokens=3), prompt_token_ids=[1] * 10)
    engine.add_request("b", params=SamplingParams(max_tokens=3), prompt_token_ids=[1] * 20)
    run(engine)
    # Step 1 prefills both (30 tokens); steps 2 and 3 decode both.
    assert slept == pytest.approx([0.01 + 0.03, 0.01 + 0.004, 0.01 + 0.004])
    engine.set_slowdown(0.5)
    engine.add_request("c", params=SamplingParams(max_tokens=1), prompt_token_ids=[1])
    run(engine)
    assert slept[-1] == pytest.approx(0.01 + 0.001 + 0.5)


def test_tokens_are_a_function_of_seed_and_position_so_a_resumed_request_continues_exactly() -> (
    None
):
    engine = SimEngine(cost=SimCost(0, 0, 0))
    params = SamplingParams(max_tokens=8, seed=7)
    engine.add_request("full", params=params, prompt_token_ids=[5, 6, 7])
    full = [t for d in run(engine)["full"] for t in d.token_ids]
    assert full == [sim_token(7, 3 + i) for i in range(8)]
    engine.add_request(
        "resumed",
        params=SamplingParams(max_tokens=5, seed=7),
        prompt_token_ids=[5, 6, 7, *full[:3]],
    )
    assert [t for d in run(engine)["resumed"] for t in d.token_ids] == full[3:]


def test_batch_cap_limits_the_running_batch() -> None:
    engine = SimEngine(max_batch_size=4, cost=SimCost(0, 0, 0))
    engine.set_max_batch_size(2)
    for i in range(3):
        engine.add_request(f"r{i}", params=SamplingParams(max_tokens=4), prompt_token_ids=[1])
    engine.step()
    assert (engine.stats().num_running, engine.stats().num_waiting) == (2, 1)
    engine.set_max_batch_size(99)  # clamped to the size it was built with
    assert engine.max_batch_size == 4


def test_stop_token_max_tokens_and_ignore_eos() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0), eos_token_ids=frozenset({sim_token(0, 2)}))
    engine.add_request("eos", params=SamplingParams(max_tokens=9), prompt_token_ids=[1, 2])
    engine.add_request(
        "ignore", params=SamplingParams(max_tokens=4, ignore_eos=True), prompt_token_ids=[1, 2]
    )
    stop_at = sim_token(0, 5)
    engine.add_request(
        "stop",
        params=SamplingParams(max_tokens=9, stop_token_ids=[stop_at]),
        prompt_token_ids=[3] * 4,
    )
    out = run(engine)
    assert [d.num_output_tokens for d in out["eos"]][-1] == 1 and out["eos"][
        -1
    ].finish_reason == "stop"
    assert out["ignore"][-1].num_output_tokens == 4 and out["ignore"][-1].finish_reason == "length"
    assert out["stop"][-1].token_ids == [stop_at] and out["stop"][-1].finish_reason == "stop"


def test_abort_frees_blocks_and_reports_abort() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0), num_kv_blocks=64, block_size=16)
    engine.add_request("a", params=SamplingParams(max_tokens=100), prompt_token_ids=[1] * 40)
    engine.step()
    assert engine.stats().num_free_blocks == 64 - 9  # ceil(140 / 16) reserved
    assert engine.abort("a") and not engine.abort("a")
    assert engine.stats().num_free_blocks == 64
    (delta,) = engine.step()
    assert delta.finish_reason == "abort" and not engine.has_unfinished()


def test_text_comes_from_the_tokenizer_and_long_prompts_are_rejected() -> None:
    engine = SimEngine(cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer(), max_seq_len=32)
    engine.add_request("t", "hi", SamplingParams(max_tokens=6, ignore_eos=True))
    deltas = run(engine)["t"]
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert text == ByteTokenizer().decode(ids) != ""  # the tokenizer's text of its tokens
    assert text == deltas[-1].output.text
    assert deltas[-1].output.prompt_token_ids == ByteTokenizer().encode("hi")
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("long", prompt_token_ids=[1] * 32)


@pytest.mark.parametrize("resume_at", [3, 6])
def test_a_resumed_request_sends_the_text_its_first_attempt_held_for_a_stop_string(
    tmp_path, resume_at: int
) -> None:
    from bench.serve_stack import write_word_tokenizer
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(str(write_word_tokenizer(tmp_path)))
    prompt = tok.encode("tell me a story", add_special_tokens=True)

    def deltas(params: SamplingParams, ids: list[int], **resume: int) -> list:
        engine = SimEngine(cost=SimCost(0, 0, 0), tokenizer=tok, vocab_size=tok.vocab_size)
        engine.add_request("r", params=params, prompt_token_ids=ids, **resume)
        return run(engine)["r"]

    plain = deltas(SamplingParams(max_tokens=10, seed=4, ignore_eos=True), prompt)
    words = [d.text for d in plain]
    assert all(words)
    # A stop string that starts with the word at the resume point and never completes:
    # the first attempt holds that word back when it is generated.
    stop = SamplingParams(
        max_tokens=10, seed=4, ignore_eos=True, stop=[words[resume_at - 1] + "\x07never"]
    )
    first = deltas(stop, prompt)
    whole = "".join(d.text for d in first)
    assert whole == "".join(words)
    tokens = [t for d in first for t in d.token_ids]
    delivered = "".join(d.text for d in first[:resume_at])
    assert len(delivered) < len("".join(words[:resume_at]))  # the caller lacks that word
    resumed = deltas(
        SamplingParams(max_tokens=10 - resume_at, seed=4, ignore_eos=True, stop=stop.stop),
        prompt + tokens[:resume_at],
        resumed_tokens=resume_at,
        delivered_text_len=len(delivered),
    )
    assert delivered + "".join(d.text for d in resumed) == whole


EOS = ByteTokenizer.EOS


@pytest.mark.parametrize(
    ("script", "params", "text", "stop_reason"),
    [
        # A stop id ends it while a partial stop string is held: the held text is sent.
        ([*b"abxy!"], {"stop": ["xyz"], "stop_token_ids": [ord("!")]}, "abxy", ord("!")),
        # include_stop_str_in_output sends a stop id's own text.
        ([*b"ab!"], {"stop_token_ids": [33], "include_stop_str_in_output": True}, "ab!", 33),
        # EOS after half a character: the held bytes come out as decode() shows them (they
        # went with the hidden EOS, and so did a whole "\ufffd" the model had written).
        ([*b"ab\xc3", EOS], {}, "ab\ufffd", None),
        ([*b"ab\xef\xbf\xbd", EOS], {}, "ab\ufffd", None),
        # A token that is both EOS and a stop id ends as EOS (stop_reason None), as in vLLM.
        ([*b"a", EOS], {"stop_token_ids": [EOS]}, "a", None),
    ],
)
def test_the_sim_ends_requests_and_releases_text_as_the_engine_does(
    monkeypatch: pytest.MonkeyPatch,
    script: list[int],
    params: dict,
    text: str,
    stop_reason: int | None,
) -> None:
    """The sim had its own copy of the stop rules, and it differed from the engine's in
    these cases (the worker's tests, run on the sim, checked other semantics)."""
    import workers.sim as sim

    monkeypatch.setattr(sim, "sim_token", lambda seed, position, vocab: script[position - 3])
    engine = SimEngine(cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer())
    engine.add_request("r", "Hi", SamplingParams(max_tokens=10, **params))  # BOS + 2 bytes
    deltas = run(engine)["r"]
    assert "".join(d.text for d in deltas) == text
    out = deltas[-1].output
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_reason)


def test_a_secondary_eos_id_reports_its_id_as_a_stop_token_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM turns the generation config's extra EOS ids (Llama 3's <|eot_id|> beside
    <|end_of_text|>) into stop token ids: ending on one reports its id, its text hidden;
    the tokenizer's own EOS reports none. Both read None here before."""
    import workers.sim as sim

    extra = ord("#")
    for script, reason in (([*b"ab#"], extra), ([*b"ab", EOS], None)):
        monkeypatch.setattr(
            sim, "sim_token", lambda seed, position, vocab, s=script: s[position - 3]
        )
        engine = SimEngine(
            cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer(), eos_token_ids=frozenset({EOS, extra})
        )
        engine.add_request("r", "Hi", SamplingParams(max_tokens=10))
        deltas = run(engine)["r"]
        out = deltas[-1].output
        assert "".join(d.text for d in deltas) == "ab"
        assert (out.finish_reason, out.stop_reason) == ("stop", reason)
    # ignore_eos ignores every EOS id, the secondary ones too (vLLM adds them as stop ids
    # only without ignore_eos).
    monkeypatch.setattr(sim, "sim_token", lambda seed, position, vocab: [*b"ab#cd"][position - 3])
    engine = SimEngine(
        cost=SimCost(0, 0, 0), tokenizer=ByteTokenizer(), eos_token_ids=frozenset({EOS, extra})
    )
    engine.add_request("r", "Hi", SamplingParams(max_tokens=5, ignore_eos=True))
    out = run(engine)["r"][-1].output
    assert (out.finish_reason, out.stop_reason, out.text) == ("length", None, "ab#cd")


def test_the_sim_refuses_and_withholds_what_the_engine_does() -> None:
    """Looser than the engine, it let tests pass that the real engine would fail: prompt ids
    past the vocabulary, stop strings with no tokenizer to match them, EOS before min_tokens."""
    from common.errors import InvalidRequestError

    engine = SimEngine(cost=SimCost(0, 0, 0), vocab_size=100)
    with pytest.raises(InvalidRequestError):
        engine.add_request("big", prompt_token_ids=[5, 100])
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("stop", params=SamplingParams(stop=["x"]), prompt_token_ids=[5])
    assert info.value.param == "stop"
    # With every token but one an EOS id, the first min_tokens still avoid them all.
    eos = frozenset(range(100)) - {42}
    engine = SimEngine(cost=SimCost(0, 0, 0), vocab_size=100, eos_token_ids=eos)
    params = SamplingParams(max_tokens=8, min_tokens=3, seed=1)
    engine.add_request("r", params=params, prompt_token_ids=[5])
    tokens = [t for d in run(engine)["r"] for t in d.token_ids]
    assert tokens[:3] == [42, 42, 42] and tokens[3] in eos and len(tokens) == 4
    # logit_bias: an id past the vocabulary is refused, and a ban (-100) is never drawn.
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("far", params=SamplingParams(logit_bias={100: 1}), prompt_token_ids=[5])
    assert info.value.param == "logit_bias"
    banned = {t: -100.0 for t in range(100) if t % 10}
    engine.add_request(
        "ban", params=SamplingParams(max_tokens=20, ignore_eos=True, logit_bias=banned),
        prompt_token_ids=[5],
    )  # fmt: skip
    tokens = [t for d in run(engine)["ban"] for t in d.token_ids]
    assert len(tokens) == 20 and all(t % 10 == 0 for t in tokens)


@pytest.mark.parametrize("aging_s", [0.0, 10.0])
def test_the_sim_ages_priorities_as_the_engine_does(aging_s: float) -> None:
    from workers.bridge import apply_group_scheduling

    engine = SimEngine(max_batch_size=1, cost=SimCost(0, 0, 0))
    apply_group_scheduling(engine, True, 0.0, aging_s)
    one = SamplingParams(max_tokens=1)
    engine.add_request("low", params=one, prompt_token_ids=[1], priority=5, arrival_time=1.0)
    engine.add_request("urgent", params=one, prompt_token_ids=[1], priority=0, arrival_time=60.0)
    first = [d.request_id for d in engine.step()]
    assert first == (["low"] if aging_s else ["urgent"])  # 59 s: past 5 levels of 10 s
