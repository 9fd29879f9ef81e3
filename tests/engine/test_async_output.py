"""Asynchronous output (``EngineArgs.async_output``, on by default on CUDA) changes when
tokens come back, never which: the same requests give the same outputs as the synchronous
engine, through stops, preemption, penalties and aborts, and leave no block behind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine.stepping import drain_all
from tests.engine.test_engine_api import LetterTokenizer
from tests.engine.tiny_checkpoints import checkpoint
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.outputs import ENGINE_FAILED, RequestDelta, RequestOutput


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("llama", str(tmp_path_factory.mktemp("ckpt")))


def engine(path: Path, async_output: bool, **kw: object) -> LLMEngine:
    args = dict(block_size=4, num_kv_blocks=64, dtype="float32", max_batch_size=6,
                max_num_batched_tokens=48, async_output=async_output)  # fmt: skip
    args.update(kw)
    return LLMEngine(EngineArgs(str(path), **args), tokenizer=LetterTokenizer())  # type: ignore[arg-type]


def workload(stop_token: int | None) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy, seeded sampling, a stop token, a stop string, penalties, logprobs, max_tokens."""
    rng = random.Random(5)
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[stop_token] if stop_token is not None else []),
        SamplingParams(temperature=0.7, seed=9, max_tokens=20, stop=["q"]),
        SamplingParams(temperature=0.9, seed=4, max_tokens=9, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0.6, seed=1, top_k=5, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
    ]  # fmt: skip
    return [
        (f"r{i}", [rng.randrange(2, 290) for _ in range(rng.randint(3, 17))], p)
        for i, p in enumerate(params)
    ]


def run(
    eng: LLMEngine, work: list[tuple[str, list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for rid, prompt, params in work:
        eng.add_request(rid, prompt_token_ids=prompt, params=params)
    outs: dict[str, RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for d in eng.step():
            assert all(t >= 0 for t in d.token_ids)  # no placeholder ever leaves the engine
            streamed.setdefault(d.request_id, []).extend(d.token_ids)
            if d.output is not None:
                outs[d.request_id] = d.output
    assert not eng.has_unfinished() and eng.pool.num_used_blocks == 0
    for rid, out in outs.items():
        assert streamed.get(rid, []) == out.token_ids  # deltas add up to the output
    return outs


def summary(outs: dict[str, RequestOutput]) -> dict[str, tuple]:
    # Logprobs to 4 decimals: a recomputed prefix may be batched differently (last-bit noise).
    return {
        rid: (o.token_ids, o.text, o.finish_reason, o.stop_reason,
              [round(lp, 4) for lp in o.logprobs or []])
        for rid, o in outs.items()
    }  # fmt: skip


@pytest.mark.parametrize("policy", ["continuous", "hybrid", "static"])
def test_async_outputs_equal_sync_outputs(path: Path, policy: str) -> None:
    probe = run(engine(path, False, policy=policy), workload(None))
    stop_token = probe["r2"].token_ids[4]  # stops request r2 mid-way in the real run
    want = summary(run(engine(path, False, policy=policy), workload(stop_token)))
    got = summary(run(engine(path, True, policy=policy), workload(stop_token)))
    assert got == want
    assert want["r2"][2] == "stop" and len(want["r2"][0]) <= 5


def test_async_outputs_equal_sync_outputs_under_preemption(path: Path) -> None:
    # 14 blocks of 4 tokens for 8 requests that grow to ~40 tokens: preemption is certain.
    small = dict(num_kv_blocks=14, max_seq_len=48)
    sync_engine = engine(path, False, **small)
    want = summary(run(sync_engine, workload(None)))
    async_engine = engine(path, True, **small)
    got = summary(run(async_engine, workload(None)))
    assert got == want
    assert sync_engine.stats().num_preemptions > 0 and async_engine.stats().num_preemptions > 0


def test_abort_with_a_token_in_flight_drops_it_and_frees_everything(path: Path) -> None:
    eng = engine(path, True)
    forever = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("a", prompt_token_ids=[5, 6, 7], params=forever)
    eng.add_request("b", prompt_token_ids=[8, 9], params=forever)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None  # a step's tokens are on their way back
    assert eng.abort("a")
    deltas = eng.step()
    aborted = [d for d in deltas if d.request_id == "a"]
    assert [d.finish_reason for d in aborted] == ["abort"]
    assert aborted[0].output is not None and all(t >= 0 for t in aborted[0].output.token_ids)
    assert not any(d.token_ids for d in deltas if d.request_id == "a")
    assert eng.abort("b")
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_used_blocks == 0


def test_the_last_allowed_token_is_never_scheduled_past(path: Path) -> None:
    # max_seq_len 12: an 8-token prompt may grow by 4; async must not schedule a 5th.
    eng = engine(path, True, max_seq_len=12)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    out = run(eng, [("y", list(range(2, 10)), params)])["y"]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def assert_ended_alone_with_an_error(deltas: list[RequestDelta]) -> None:
    """The request whose token could not be settled ended with an error of its own (an
    exception out of the step failed every running request with a 500)."""
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].finish_reason == "error"
    output = deltas[0].output
    assert output is not None and str(output.stop_reason).startswith(ENGINE_FAILED)
    assert "RuntimeError" in str(output.stop_reason)


class FailingOnce(LetterTokenizer):
    """Its decode raises once when asked to (a tokenizer bug on one token)."""

    fail_next = False

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("decode failed")
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("seed", [None, 5])
def test_a_token_that_fails_to_land_leaves_no_placeholder_for_the_others(
    path: Path, seed: int | None
) -> None:
    """Reading back a step's tokens, one request's accept raising left the next request's
    placeholder (-1) in its tokens, and every later step embedded it (IndexError on the
    CPU, a device-side assert on CUDA). Seeded, the discarded step had taken a draw from
    b's generator, and the redone token (and every later one) came from the next."""
    temperature = 0.0 if seed is None else 1.0
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=6, ignore_eos=True)
    ref = LLMEngine(EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32"),
                    tokenizer=LetterTokenizer())  # fmt: skip
    ref.add_request("b", prompt_token_ids=[5, 6, 7], params=params)
    want = drain_all(ref)["b"]
    tok = FailingOnce()
    eng = LLMEngine(EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32",
                               async_output=True), tokenizer=tok)  # fmt: skip
    eng.add_request("a", prompt_token_ids=[3, 4], params=params)
    eng.add_request("b", prompt_token_ids=[5, 6, 7], params=params)
    got: dict[str, list[int]] = {}
    for d in eng.step():  # the prefill, launched: nothing read back yet
        got.setdefault(d.request_id, []).extend(d.token_ids)
    tok.fail_next = True  # a's token lands first and its decode fails
    ended = [d for d in eng.step() if d.request_id == "a"]
    assert_ended_alone_with_an_error(ended)  # the step does not raise: a alone ends
    # Only the token of the step now in flight may still be a placeholder.
    assert all(t >= 0 for r in eng.requests.values() for t in r.output_token_ids[:-1])
    for rid, tokens in drain_all(eng).items():
        got.setdefault(rid, []).extend(tokens)
    assert got["b"][-5:] == want[-5:] and len(want) == 6  # b went on, its tokens intact


@pytest.mark.parametrize("policy", ["hybrid", "continuous"])
@pytest.mark.parametrize("failing", ["accept", "sampler"])
def test_a_synchronous_step_that_fails_after_its_kv_is_written_stalls_no_request(
    path: Path, failing: str, policy: str
) -> None:
    """The synchronous path settled tokens one by one: an accept that raised left the
    requests after it without their token, and a sampler that raised left every request
    without one, while their KV counted the step: hybrid never scheduled them again (no
    token left to compute), the whole-prompt policies scheduled an empty chunk forever."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = engine(path, False, policy=policy)
    ref.add_request("b", prompt_token_ids=[5, 6, 7], params=params)
    want = drain_all(ref)["b"]
    tok = FailingOnce()
    eng = LLMEngine(EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32",
                               async_output=False, policy=policy), tokenizer=tok)  # fmt: skip
    eng.add_request("a", prompt_token_ids=[3, 4], params=params)
    eng.add_request("b", prompt_token_ids=[5, 6, 7], params=params)
    got: dict[str, list[int]] = {}
    for d in eng.step():
        got.setdefault(d.request_id, []).extend(d.token_ids)
    if failing == "accept":
        tok.fail_next = True  # a's token is settled first and its decode fails
    else:
        sample = eng.sampler.sample

        def fails_once(*args: object, **kwargs: object) -> object:
            eng.sampler.sample = sample  # type: ignore[method-assign]
            raise RuntimeError("sampling failed")

        eng.sampler.sample = fails_once  # type: ignore[method-assign]
    if failing == "accept":
        ended = []
        for d in eng.step():
            if d.request_id == "a":
                ended.append(d)
            else:
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert_ended_alone_with_an_error(ended)
    else:
        with pytest.raises(RuntimeError, match="failed"):
            eng.step()
        eng.abort("a")
    for _ in range(20):  # bounded: a stalled request would keep the engine unfinished
        if not eng.has_unfinished():
            break
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert not eng.has_unfinished()
    assert got["b"] == want and len(want) == 6  # b went on, its tokens intact


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=2.0,
                       frequency_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
    ],
    ids=["logprobs", "presence-frequency", "repetition"],
)  # fmt: skip
def test_logprobs_and_penalties_ride_along_with_the_deferred_tokens(
    path: Path, params: SamplingParams
) -> None:
    """One request asking for logprobs or penalties made every step of its batch
    synchronous: now logprobs are copied back with the tokens, and penalties count the
    token still on the device there. Same tokens and logprobs as the synchronous engine."""
    outs = {}
    for async_output in (False, True):
        eng = engine(path, async_output)
        # Greedy repeats one token four times after this prompt: a penalty that misses the
        # token still on the device lets it repeat.
        eng.add_request("r", prompt_token_ids=[20, 21, 22, 23], params=params)
        deltas = eng.step()
        assert (eng._inflight is not None) == async_output  # deferred, not synchronous
        while eng.has_unfinished():
            deltas += eng.step()
        (outs[async_output],) = [d.output for d in deltas if d.output is not None]
    sync, deferred = outs[False], outs[True]
    assert deferred.token_ids == sync.token_ids
    if params.logprobs is not None:
        assert deferred.logprobs == pytest.approx(sync.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in deferred.top_logprobs or []] == [
            [t for t, _ in top] for top in sync.top_logprobs or []
        ]


def test_a_request_preempted_with_a_token_in_flight_gets_it_only_where_it_samples() -> None:
    """A step that preempts a request whose token is still on the device, then fails: the
    request waits with its placeholder, and re-admitted in prefill chunks, the in-flight
    token was written over the last input token of a chunk that does not sample (wrong K/V,
    never recomputed: silently wrong output)."""
    eng = LLMEngine(EngineArgs("dummy:tiny", block_size=4, dtype="float32", max_batch_size=4,
                               max_num_batched_tokens=8, async_output=True, device="cpu",
                               num_kv_blocks=12, enable_prefix_caching=False))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"r{i}", prompt_token_ids=list(range(10 + i, 24 + i)), params=params)
    execute, armed, fed_wrong = eng.runner.execute, [True], []

    def checked(plan, feed=None):  # type: ignore[no-untyped-def]
        if armed[0] and any(r.pending_row >= 0 for r in plan.preempted):
            armed[0] = False
            raise RuntimeError("injected: the step fails after preempting")
        if feed is not None:
            rows = zip(plan.seqs, feed.rows, strict=True)
            fed_wrong.extend(s.request_id for s, row in rows if row >= 0 and not s.sample)
        return execute(plan, feed)

    eng.runner.execute = checked  # type: ignore[method-assign]
    for _ in range(300):
        if not eng.has_unfinished():
            break
        try:
            eng.step()
        except RuntimeError:
            for r in list(eng.batcher.running):  # what the worker's bridge does
                eng.abort(r.request_id)
    assert not armed[0], "the scenario did not happen"
    assert fed_wrong == [] and not eng.has_unfinished()
