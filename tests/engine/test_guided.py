"""Guided decoding: whatever the model would say, the output matches the request's JSON
schema, regex, choice or grammar, under every batching policy, alongside unguided requests
(whose tokens it leaves alone), through preemption, asynchronous output and redelivery."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from common.errors import InvalidRequestError
from common.guided import GuidedSpec
from common.models import demo_model_path
from workers.engine import LLM, LLMEngine, SamplingParams
from workers.engine.args import EngineArgs
from workers.engine.sampling_params import SamplingParamsError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["def main():\n", "import os\n", "class Point:\n    ", "# a comment\n"]


def spec(kind: str, value: object) -> GuidedSpec:
    return GuidedSpec(kind, value if isinstance(value, str) else json.dumps(value))


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(str(demo_model_path()), device="cpu", max_batch_size=8)


def sampled(i: int, guided: GuidedSpec | None, max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, guided=guided)


@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous", "hybrid"])
def test_json_schema_output_validates_under_every_policy(policy: str) -> None:
    llm = LLM(str(demo_model_path()), device="cpu", policy=policy, max_batch_size=4,
              max_num_batched_tokens=8)  # fmt: skip  # chunked prefill under hybrid
    outs = llm.generate(PROMPTS, [sampled(i, spec("json_schema", PERSON)) for i in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.text == json.dumps(json.loads(out.text))  # json.dumps's spacing


def test_regex_choice_and_grammar_match_exactly(demo: LLM) -> None:
    cases = [
        (spec("regex", r"[0-9]{3}-[a-z]{2,6}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", t)),
        (spec("choice", ["yes", "no", "maybe so", "a.b|c"]),
         lambda t: t in ("yes", "no", "maybe so", "a.b|c")),
        (spec("grammar", 'root ::= "def " [a-z]{1,8} "(" [a-z]? "):"'),
         lambda t: re.fullmatch(r"def [a-z]{1,8}\([a-z]?\):", t)),
        (spec("grammar", 'start: "x = " NUMBER\n%import common.NUMBER'),
         lambda t: re.fullmatch(r"x = [0-9.eE+-]+", t)),
    ]  # fmt: skip
    for seed in range(3):
        outs = demo.generate([PROMPTS[seed]] * len(cases),
                             [sampled(seed, s, max_tokens=40) for s, _ in cases])  # fmt: skip
        for (s, check), out in zip(cases, outs, strict=True):
            assert check(out.text), (s, out.text, out.finish_reason)


def neighbours_keep_their_tokens(llm: LLM, plain: SamplingParams, reference: LLM) -> list[Any]:
    """``PROMPTS`` with ``plain`` beside as many guided requests: the plain ones' tokens are
    ``reference``'s for them alone, the guided ones validate. Returns the outputs."""
    alone = reference.generate(PROMPTS, plain)
    mixed = llm.generate(
        PROMPTS * 2, [plain] * 4 + [sampled(i, spec("json_schema", PERSON)) for i in range(4)]
    )
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.text), PERSON)
    return mixed


def test_unguided_neighbours_keep_their_tokens(demo: LLM) -> None:
    neighbours_keep_their_tokens(demo, SamplingParams(temperature=0, max_tokens=24), demo)


def test_greedy_guided_is_the_models_best_allowed_token(demo: LLM) -> None:
    """The mask only removes tokens: where the model's own greedy choice is allowed, it is
    kept (the choice of a whole prompt continuation the model already writes)."""
    free = demo.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=8))[0]
    first_line = free.text.split("\n")[0] + "\n"
    choices = [first_line, "zzz"]
    out = demo.generate(["import os\n"], SamplingParams(
        temperature=0, max_tokens=16, guided=spec("choice", choices)))[0]  # fmt: skip
    assert out.text == first_line and out.finish_reason == "stop"


def test_asynchronous_output_and_preemption_keep_the_match() -> None:
    """With asynchronous output a guided step waits for the token in flight (its mask
    needs it); a tiny cache preempts and recomputes guided requests mid-output."""
    llm = LLM(str(demo_model_path()), device="cpu", async_output=True, num_kv_blocks=24,
              block_size=4, max_batch_size=8)  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = LLM(str(demo_model_path()), device="cpu", max_batch_size=8)
    outs = neighbours_keep_their_tokens(llm, plain, reference)
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_a_redelivered_request_continues_its_match_and_a_wrong_one_is_refused() -> None:
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    tok = engine.tokenizer
    prompt = tok.encode("def main():\n")
    said = tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False)
    guided = spec("json_schema", PERSON)
    engine.add_request("r", prompt_token_ids=prompt + said, resumed_tokens=len(said),
                       params=SamplingParams(temperature=1.0, seed=5, max_tokens=60,
                                             guided=guided))  # fmt: skip
    text = ""
    while engine.has_unfinished():
        for delta in engine.step():
            text += delta.text
    jsonschema.validate(json.loads('{"name": "Ada", "age": 3' + text), PERSON)
    wrong = tok.encode("[1, 2", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="does not match"):
        engine.add_request("w", prompt_token_ids=prompt + wrong, resumed_tokens=len(wrong),
                           params=SamplingParams(guided=guided))  # fmt: skip
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_byte_vocabulary_model_is_guided_too() -> None:
    """``dummy:*`` models speak bytes (ByteTokenizer): random weights, valid JSON."""
    llm = LLM("dummy:tiny", device="cpu", dtype="float32")
    outs = llm.generate(
        ["hi"] * 3, [sampled(i, spec("json_schema", PERSON), 200) for i in range(3)]
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json_schema", "{nope", "not JSON"),
        ("json_schema", '{"$ref": "#/missing"}', "missing"),
        ("regex", "(", "unclosed group"),
        ("choice", "[]", "non-empty JSON list"),
        ("grammar", "root ::= (((", "cannot read the grammar"),
    ],
)
def test_a_spec_that_cannot_compile_is_refused_naming_why(
    kind: str, value: str, message: str
) -> None:
    """Compiled by the engine (off a worker's event loop): an InvalidRequestError."""
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    with pytest.raises(InvalidRequestError, match=message) as caught:
        engine.add_request("r", "x", SamplingParams(guided=GuidedSpec(kind, value)))
    assert caught.value.param == "guided" and not engine.has_unfinished()


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [("xml", "<a/>", "unknown kind"), ("regex", "a" * (256 * 1024 + 1), "longer than")],
)
def test_a_spec_of_the_wrong_shape_is_refused_by_the_params(
    kind: str, value: str, message: str
) -> None:
    with pytest.raises(SamplingParamsError, match=message) as caught:
        SamplingParams(guided=GuidedSpec(kind, value))
    assert caught.value.param == "guided"


def test_a_hold_the_grammar_leaves_no_way_around_gives_way_to_the_grammar(demo: LLM) -> None:
    """min_tokens holds the stop ids, but the grammar allows only one: the row would have
    nothing to draw (token 0 came out, appended to the match)."""
    tok = demo.engine.tokenizer
    (x,) = tok.encode("x", add_special_tokens=False)
    out = demo.generate(["import os\n"], SamplingParams(
        temperature=1.0, seed=2, max_tokens=5, min_tokens=3, stop_token_ids=[x],
        guided=spec("choice", ["x"])))[0]  # fmt: skip
    assert (out.text, out.finish_reason) == ("x", "stop")


def test_a_redelivery_whose_match_was_complete_ends_at_once() -> None:
    """Its final chunk was lost: the grammar allows nothing more, so nothing is drawn."""
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    tok = engine.tokenizer
    prompt, said = tok.encode("pick:"), tok.encode("yes", add_special_tokens=False)
    engine.add_request("r", prompt_token_ids=prompt + said, resumed_tokens=len(said),
                       params=SamplingParams(guided=spec("choice", ["yes", "no"])))  # fmt: skip
    deltas = engine.step()
    assert [(d.token_ids, d.finished, d.finish_reason) for d in deltas] == [([], True, "stop")]
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_guided_aborts_free_everything() -> None:
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], sampled(i, spec("json_schema", PERSON)))
    engine.step()
    engine.step()
    for i in range(3):
        assert engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_complete_match_ends_the_output_even_when_eos_is_ignored(demo: LLM) -> None:
    """Nothing may follow a complete match; ``ignore_eos`` would otherwise have the request
    write on past it with every token forbidden."""
    out = demo.generate(["import os\n"], SamplingParams(
        temperature=1.0, seed=1, max_tokens=30, ignore_eos=True,
        guided=spec("choice", ["yes", "no"])))[0]  # fmt: skip
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_graphs_and_async_output_guided_rows_match_and_others_keep_theirs() -> None:
    """The device path: the masks unpacked on the GPU, a guided step waiting for the step in
    flight's sampling, asynchronous output and CUDA graphs around them."""
    llm = LLM(str(demo_model_path()), device="cuda", backend="triton", async_output=True,
              max_batch_size=8)  # fmt: skip
    neighbours_keep_their_tokens(llm, SamplingParams(temperature=0, max_tokens=30), llm)


def test_guided_steps_keep_asynchronous_output() -> None:
    """A guided step waits only for the step in flight's sampling, then defers its own
    tokens like any other step (they used to make every step of their batch synchronous)."""
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu", async_output=True))
    engine.add_request("g", "def main():\n", sampled(1, spec("json_schema", PERSON)))
    deferred = 0
    text = ""
    while engine.has_unfinished():
        text += "".join(d.text for d in engine.step())
        deferred += engine._inflight is not None
    assert deferred > 5
    jsonschema.validate(json.loads(text), PERSON)


def guides_fail_after(monkeypatch: pytest.MonkeyPatch, tokens: int) -> list[int]:
    """Every matcher reports the error "limit" once ``tokens`` tokens were fed to any (as
    one reaching a parser limit of llguidance's would); returns those tokens as they come."""
    from workers.engine.guided import Guide

    consumed: list[int] = []
    real = Guide.consume
    monkeypatch.setattr(Guide, "consume", lambda self, t: (consumed.append(t), real(self, t)))
    failing = property(lambda self: "limit" if len(consumed) >= tokens else None)
    monkeypatch.setattr(Guide, "error", failing)
    return consumed


def test_a_matcher_that_fails_mid_output_ends_with_an_error_not_a_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parser limit reached mid-output leaves text that matches nothing whole: reported
    as ``error`` (the worker sends an error chunk), never as a complete ``stop``."""
    consumed = guides_fail_after(monkeypatch, 3)
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    engine.add_request("r", "def main():\n", sampled(0, spec("json_schema", PERSON)))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert deltas[-1].finish_reason == "error" and len(consumed) == 3
    assert deltas[-1].output is not None
    assert deltas[-1].output.stop_reason == "guided decoding failed: limit"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_the_tokenizer_view_is_built_once_and_a_failed_build_is_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import time

    import workers.engine.engine as engine_module

    builds: list[int] = []

    class Failing:
        def __init__(self, *args: Any) -> None:
            builds.append(1)
            time.sleep(0.05)  # long enough for the other threads to arrive meanwhile
            raise RuntimeError("bad tokenizer.json")

    monkeypatch.setattr(engine_module, "Guides", Failing)
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            engine.guide(spec("regex", "a"))
        except InvalidRequestError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ask()
    assert len(builds) == 1 and len(errors) == 5
    # The details stay in the worker's log (they can name files); tried again later.
    assert all("unavailable" in str(e) and "tokenizer.json" not in str(e) for e in errors)
    monkeypatch.setattr(engine_module, "GUIDES_RETRY_S", 0.0)
    ask()
    assert len(builds) == 2


def test_a_grammar_after_a_token_leaves_the_output_free_up_to_it(demo: LLM) -> None:
    """A reasoning model thinks, then answers in shape: with ``guided_after`` (its
    ``</think>``), the tokens up to that one are the model's own, the grammar holds after."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    free = demo.generate(["import os\n"], greedy)[0].token_ids
    marker = free[2]  # a token the model writes by itself: the "</think>" of this test
    assert marker not in free[:2]
    digits = spec("regex", "[0-9]{3}")
    params = SamplingParams(temperature=0.0, max_tokens=12, guided=digits, guided_after=marker)
    out = demo.generate(["import os\n"], params)[0]
    assert out.token_ids[:3] == free[:3]  # free up to and including the marker
    answer = demo.engine.tokenizer.decode(out.token_ids[3:])
    assert re.fullmatch("[0-9]{3}", answer) and out.finish_reason == "stop", answer
    # Redelivered after the marker and a digit, the grammar goes on from there.
    engine = LLMEngine(EngineArgs(model=str(demo_model_path()), device="cpu"))
    said = out.token_ids[:4]
    prompt = engine.tokenizer.encode("import os\n")
    engine.add_request("r", prompt_token_ids=prompt + said, resumed_tokens=len(said),
                       params=params)  # fmt: skip
    text = ""
    while engine.has_unfinished():
        for delta in engine.step():
            text += delta.text
    assert re.fullmatch("[0-9]{2}", text), text
    with pytest.raises(SamplingParamsError, match="guided_after"):
        SamplingParams(guided_after=marker)  # with guided only


def test_before_its_grammar_holds_an_answer_cannot_end(demo: LLM) -> None:
    """It ended "stop" at once (this prompt's greedy answer is EOS), nothing in shape;
    now only max_tokens ends it before the marker comes."""
    assert demo.generate(["def main():\n"], SamplingParams(temperature=0.0))[0].token_ids == [1]
    params = SamplingParams(temperature=0.0, max_tokens=5, guided=spec("regex", "[0-9]{3}"),
                            guided_after=4000)  # fmt: skip
    out = demo.generate(["def main():\n"], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert 1 not in out.token_ids
