"""The offline and step APIs: finish reasons, stop strings, logprobs, seeds, abort, stats."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from common.errors import ContextLengthExceededError
from common.models import demo_model_path
from tests.engine.tiny_checkpoints import EOS, checkpoint, hf_greedy, prompts
from workers.engine import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class LetterTokenizer:
    """Token i is one letter (i mod 26); EOS is special. Clean text for stop-string tests."""

    def __init__(self) -> None:
        self.eos_token_ids = {EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [LETTERS.index(c) + 2 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(LETTERS[i % 26] for i in ids if not (skip_special_tokens and i == EOS))


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("qwen3", str(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture
def llm(path: Path) -> LLM:
    return LLM(
        str(path), tokenizer=LetterTokenizer(), block_size=4, num_kv_blocks=64, dtype="float32"
    )


def greedy(n: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)  # type: ignore[arg-type]


def test_outputs_come_back_in_input_order_with_text_and_metrics(llm: LLM, path: Path) -> None:
    batch = prompts(4, seed=11)
    outs = llm.generate(prompt_token_ids=batch, sampling_params=greedy())
    assert [o.prompt_token_ids for o in outs] == batch
    for o, p in zip(outs, batch, strict=True):
        assert o.token_ids == hf_greedy(path, p, 12)
        assert o.text == LetterTokenizer().decode(o.token_ids)
        assert o.finish_reason == "length"
        m = o.metrics
        assert m.first_token_time is not None and m.finish_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_text_prompts_and_per_prompt_params(llm: LLM) -> None:
    outs = llm.generate(["abc", "hello"], [greedy(3), greedy(5)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[1].prompt == "hello" and outs[1].prompt_token_ids == LetterTokenizer().encode(
        "hello"
    )


def test_stop_reason_names_the_stop_string_the_text_was_cut_at(llm: LLM) -> None:
    """Two stop strings ending at the same character: the text is cut before the longer
    (it started first), and stop_reason named whichever came first in the list."""
    base = llm.generate(["abcabc"], greedy(16))[0]
    longer, shorter = base.text[3:6], base.text[4:6]
    out = llm.generate(["abcabc"], greedy(16, stop=[shorter, longer]))[0]
    assert out.text == base.text[: base.text.find(longer)]
    assert out.finish_reason == "stop" and out.stop_reason == longer


def test_stop_string_cuts_the_text_and_ends_the_request(llm: LLM) -> None:
    base = llm.generate(["abcabc"], greedy(16))[0]
    stop = base.text[4:6]
    cut = base.text.find(stop)
    out = llm.generate(["abcabc"], greedy(16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut]
    # Generation ran until the token that completed the stop string, no further.
    assert out.token_ids == base.token_ids[: cut + len(stop)]
    kept = llm.generate(["abcabc"], greedy(16, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == base.text[: cut + len(stop)]


def test_step_deltas_add_up_to_the_final_text_with_a_stop_string_held_back(path: Path) -> None:
    engine = LLMEngine(
        EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32"),
        tokenizer=LetterTokenizer(),
    )
    engine.add_request("base", "abcabc", greedy(16))
    base = ""
    while engine.has_unfinished():
        base += "".join(d.text for d in engine.step())
    stop = base[5:8]  # three letters: a partial match must be held back, not streamed
    engine.add_request("r", "abcabc", greedy(16, stop=[stop, "zzzz"]))
    streamed, final = "", None
    while engine.has_unfinished():
        for d in engine.step():
            streamed += d.text
            assert stop not in streamed
            final = d.output or final
    assert final is not None and streamed == final.text == base[: base.find(stop)]


def test_stop_token_ids_and_eos(llm: LLM, path: Path) -> None:
    base = llm.generate(["hello"], greedy(12))[0].token_ids
    stop_token = base[4]
    out = llm.generate(["hello"], greedy(12, stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == base[: base.index(stop_token) + 1]
    assert out.text == LetterTokenizer().decode(out.token_ids[:-1])  # its text stays out
    # This checkpoint answers "abcd" with EOS at once; ignore_eos runs on to max_tokens.
    eos = llm.generate(["abcd"], greedy(12))[0]
    assert eos.token_ids == [EOS] and eos.finish_reason == "stop" and eos.text == ""
    assert eos.stop_reason is None
    ignored = llm.generate(["abcd"], greedy(12, ignore_eos=True))[0]
    assert len(ignored.token_ids) == 12 and ignored.token_ids[0] == EOS


def test_logprobs_are_those_of_the_chosen_tokens(llm: LLM) -> None:
    out = llm.generate(["hello"], greedy(6, logprobs=3))[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) == 6
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs))
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp)  # greedy picks the top one
        assert lp <= 0 and math.isfinite(lp)
    plain = llm.generate(["hello"], greedy(6))[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    alone = llm.generate(["abc"], seeded)[0].token_ids
    crowd = llm.generate(
        ["xyz", "abc", "hello"], [SamplingParams(temperature=1.0, max_tokens=10), seeded, greedy()]
    )
    assert crowd[1].token_ids == alone
    other = llm.generate(["abc"], SamplingParams(temperature=1.0, max_tokens=10, seed=8))[0]
    assert other.token_ids != alone


def test_a_redelivered_seeded_request_continues_as_if_never_interrupted(llm: LLM) -> None:
    """A worker that resumes a request gets the delivered tokens at the end of its prompt.
    Its continuation must be what the first worker would have sampled: the same noise for
    the same output position, and penalties that count the delivered tokens as output."""
    params = dict(temperature=1.0, seed=7, presence_penalty=0.8, frequency_penalty=0.6)
    prompt = LetterTokenizer().encode("abc")
    whole = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=16, **params)
    )[0].token_ids
    for delivered in (1, 6):
        engine = llm.engine
        engine.add_request(
            f"resumed-{delivered}",
            None,
            SamplingParams(max_tokens=16 - delivered, **params),
            prompt_token_ids=[*prompt, *whole[:delivered]],
            resumed_tokens=delivered,
            delivered_text_len=delivered,
        )
        rest: list[int] = []
        while engine.has_unfinished():
            rest += [t for d in engine.step() for t in d.token_ids]
        assert rest == whole[delivered:]


def test_abort_frees_blocks_at_once_and_reports_abort_on_the_next_step(path: Path) -> None:
    engine = LLMEngine(
        EngineArgs(
            str(path),
            block_size=4,
            num_kv_blocks=64,
            dtype="float32",
            max_batch_size=2,
            max_num_batched_tokens=64,
        )
    )
    forever = greedy(50, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=list(range(2, 20)), params=forever)
    engine.add_request("b", prompt_token_ids=list(range(30, 40)), params=forever)
    engine.add_request("queued", prompt_token_ids=[5, 6], params=forever)
    for _ in range(3):
        engine.step()
    used = engine.pool.num_used_blocks
    assert engine.abort("a")
    assert engine.pool.num_used_blocks == used - 5  # 18 prompt + 2 tokens: 5 blocks, at once
    assert engine.abort("queued")
    deltas = engine.step()
    aborted = {d.request_id: d for d in deltas if d.finish_reason == "abort"}
    assert set(aborted) == {"a", "queued"}
    assert aborted["a"].output is not None and len(aborted["a"].output.token_ids) == 3
    assert {d.request_id for d in deltas if d.token_ids} == {"b"}
    assert engine.abort("b")
    engine.step()
    assert not engine.has_unfinished()
    assert engine.pool.num_used_blocks == 0


def test_max_seq_len_ends_generation_with_length(path: Path) -> None:
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="float32", max_seq_len=20)
    out = llm.generate(prompt_token_ids=[list(range(2, 17))], sampling_params=greedy(100))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_a_generate_that_fails_part_way_leaves_nothing_queued(path: Path) -> None:
    """A later prompt refused (too long) left the earlier ones queued: they ran inside the
    next generate(), holding blocks and steps for outputs nobody read."""
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, dtype="float32", max_seq_len=20)
    with pytest.raises(ContextLengthExceededError):
        llm.generate(prompt_token_ids=[[2, 3, 4], [5] * 40], sampling_params=greedy(4))
    out = llm.generate(prompt_token_ids=[[2, 3, 4]], sampling_params=greedy(4))
    assert len(out) == 1 and len(out[0].token_ids) == 4
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used_blocks == 0
    assert llm.engine.stats().num_prompt_tokens_computed == 3  # only the second call's


def test_stats_report_usage_cache_and_work(path: Path) -> None:
    engine = LLMEngine(
        EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32", policy="hybrid")
    )
    engine.add_request("a", prompt_token_ids=list(range(2, 12)), params=greedy(20))
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (1, 0)
    assert s.kv_usage == pytest.approx(3 / 64)
    assert s.fragmentation == pytest.approx(2 / 12)  # 10 tokens in 3 blocks of 4
    assert s.num_prompt_tokens_computed == 10 and s.num_generation_tokens == 1
    engine.add_request("b", prompt_token_ids=list(range(2, 12)), params=greedy(2))
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s.prefix_cache_hits == 8 and s.prefix_cache_queries == 20
    assert s.prefix_cache_hit_rate == pytest.approx(0.4)
    assert s.kv_usage == 0.0 and s.num_running == 0
    # Caching off: nothing is looked up, so nothing is counted (a 0 % hit rate read as a
    # useless cache rather than none).
    off = LLMEngine(EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32",
                               enable_prefix_caching=False))  # fmt: skip
    off.add_request("a", prompt_token_ids=list(range(2, 12)), params=greedy(2))
    while off.has_unfinished():
        off.step()
    assert (off.stats().prefix_cache_queries, off.stats().prefix_cache_hits) == (0, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_keeps_the_demo_models_fp32_greedy_tokens(dtype: str) -> None:
    """The trained demo model in half precision picks fp32's tokens on prompts where fp32
    is not near a tie, with log-probabilities close to fp32's (finite: no overflow)."""
    texts = ["What is a stop-loss order?", "def fibonacci(n):", "import os\nimport sys\n"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)

    def run(model_dtype: str) -> list[RequestOutput]:
        llm = LLM(str(demo_model_path()), dtype=model_dtype, num_kv_blocks=64)
        return llm.generate(texts, params)

    reference, half = run("float32"), run(dtype)
    for ref, got in zip(reference, half, strict=True):
        assert got.token_ids == ref.token_ids and len(got.token_ids) >= 6, (got.text, ref.text)
        assert math.isfinite(got.cumulative_logprob)
        assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=0.25)


def test_text_released_at_the_length_limit_that_completes_a_stop_string_ends_as_stop(
    llm: LLM,
) -> None:
    """At the last allowed token the detokenizer releases what it held back (an unfinished
    character); if that completes a stop string the request stopped on it, as vLLM reports."""

    class HoldsOneBack:
        def add(self, token: int) -> str:
            return ""

        def flush(self) -> str:
            return "q!"

    engine = llm.engine
    engine.add_request("r", "abc", greedy(1, stop=["q"]))
    engine.requests["r"].detokenizer = HoldsOneBack()
    (delta,) = engine.step()
    assert delta.finished and delta.finish_reason == "stop" and delta.text == ""
    assert delta.output is not None and delta.output.stop_reason == "q"


@pytest.mark.parametrize("async_output", [False, True])
def test_min_tokens_holds_eos_stop_ids_and_stop_strings_back(
    path: Path, async_output: bool
) -> None:
    """vLLM's min_tokens: EOS and stop ids are not sampled, and stop strings do not end the
    output, before that many tokens; the logprobs reported stay the model's own."""
    llm = LLM(str(path), tokenizer=LetterTokenizer(), block_size=4, num_kv_blocks=64,
              dtype="float32", async_output=async_output)  # fmt: skip
    # This checkpoint answers "abcd" with EOS at once.
    out = llm.generate(["abcd"], greedy(12, min_tokens=4, logprobs=2))[0]
    assert out.top_logprobs is not None
    assert EOS not in out.token_ids[:4] and len(out.token_ids) >= 4
    assert out.top_logprobs[0][0][0] == EOS  # still the model's favourite, as reported
    assert out.token_ids[0] == out.top_logprobs[0][1][0]  # the runner-up was taken
    # With ignore_eos too (vLLM holds every stop id): an EOS taken early would not end the
    # output, and the model went on from it, off the distribution vLLM samples.
    ignored = llm.generate(["abcd"], greedy(12, min_tokens=4, ignore_eos=True))[0]
    assert EOS not in ignored.token_ids[:4]
    base = llm.generate(["hello"], greedy(12))[0].token_ids
    stop_token = base[1]
    held = llm.generate(["hello"], greedy(12, stop_token_ids=[stop_token], min_tokens=5))[0]
    assert stop_token not in held.token_ids[:5] and len(held.token_ids) >= 5
    text = llm.generate(["abcabc"], greedy(16))[0].text  # a letter a token, no EOS
    stop = text[1:4]
    for m in range(8):
        cut = llm.generate(["abcabc"], greedy(16, stop=[stop], min_tokens=m))[0]
        # vLLM's rule: the first occurrence that ends past the first m tokens' text, one
        # that began before them included.
        ends = [j for j in range(len(text)) if text.startswith(stop, j) and j + len(stop) > m]
        assert cut.text == (text[: ends[0]] if ends else text), m


def test_an_extra_eos_id_of_the_generation_config_reports_its_id(
    llm: LLM, path: Path, tmp_path: Path
) -> None:
    """vLLM makes the generation config's EOS ids beyond the tokenizer's stop token ids:
    an output ending on one reports that id as its stop_reason (the tokenizer's: None)."""
    import json
    import shutil

    base = llm.generate(["hello"], greedy(12))[0].token_ids
    extra = base[4]
    folder = tmp_path / "ckpt"
    shutil.copytree(path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, extra]}))
    other = LLM(
        str(folder), tokenizer=LetterTokenizer(), block_size=4, num_kv_blocks=64, dtype="float32"
    )
    out = other.generate(["hello"], greedy(12))[0]
    assert out.token_ids == base[: base.index(extra) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", extra)
    eos = other.generate(["abcd"], greedy(12))[0]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([EOS], "stop", None)
