"""bench.engine's online mode: requests reach the engine when they arrive, not before."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.engine import drive, main, make_workload, parse
from bench.policy_spec import POLICIES, split_spec
from workers.engine import EngineArgs, LLMEngine
from workers.engine.args import POLICIES as ENGINE_POLICIES


def test_requests_are_added_at_their_arrival_times() -> None:
    engine = LLMEngine(EngineArgs(model="dummy:tiny", max_batch_size=4, kv_cache_gib=0.05))
    work = make_workload(3, 4, 8, engine.model_config.vocab_size, seed=1)
    wall, outputs, _ = drive(engine, work, temperature=0.0, arrivals=[0.0, 0.25, 0.5])
    arrived = [o.metrics.arrival_time for o in outputs]
    assert wall >= 0.5
    assert arrived[1] - arrived[0] >= 0.24 and arrived[2] - arrived[1] >= 0.24
    assert all(o.metrics.first_token_time >= o.metrics.arrival_time for o in outputs)
    assert [len(o.token_ids) for o in outputs] == work.output_lens


def test_a_request_due_during_a_step_counts_its_wait_from_its_arrival() -> None:
    """Arriving 50 ms into a 300 ms step, a request is added after the step; its TTFT must
    still count from when it arrived, not from when the bench got round to it."""
    engine = LLMEngine(EngineArgs(model="dummy:tiny", max_batch_size=4, kv_cache_gib=0.05))
    work = make_workload(2, 4, 4, engine.model_config.vocab_size, seed=1)

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return engine.step()

    _, outputs, _ = drive(engine, work, temperature=0.0, arrivals=[0.0, 0.05], step=slow_step)
    arrived = [o.metrics.arrival_time for o in outputs]
    assert 0.04 <= arrived[1] - arrived[0] < 0.2


def test_a_policy_spec_names_its_prefill_delay_and_only_continuous_and_hybrid_take_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert split_spec("hybrid@0.5") == ("hybrid", 0.5) and split_spec("static") == ("static", 0)
    for bad in ("static@1", "hybrid@soon", "eager@1"):
        with pytest.raises(SystemExit):
            parse(["--policies", bad])
    capsys.readouterr()
    out = tmp_path / "online.json"
    main(["--policies", "continuous,continuous@1", "--num-seqs", "4", "--min-len", "4",
          "--max-len", "8", "--arrival-rate", "50", "--num-kv-blocks", "64", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"continuous", "continuous@1"}
    tokens = {p: r["output_tokens"] for p, r in result["policies"].items()}
    assert tokens["continuous"] == tokens["continuous@1"] == result["workload"]["output_tokens"]


def test_the_benchmarks_know_the_engines_policies() -> None:
    assert POLICIES == ENGINE_POLICIES
