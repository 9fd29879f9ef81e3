"""bench.engine's online mode: requests reach the engine when they arrive, not before."""

from __future__ import annotations

from bench.engine import drive, make_workload
from workers.engine import EngineArgs, LLMEngine


def test_requests_are_added_at_their_arrival_times() -> None:
    engine = LLMEngine(EngineArgs(model="dummy:tiny", max_batch_size=4, kv_cache_gib=0.05))
    work = make_workload(3, 4, 8, engine.model_config.vocab_size, seed=1)
    wall, outputs, _ = drive(engine, work, temperature=0.0, arrivals=[0.0, 0.25, 0.5])
    arrived = [o.metrics.arrival_time for o in outputs]
    assert wall >= 0.5
    assert arrived[1] - arrived[0] >= 0.24 and arrived[2] - arrived[1] >= 0.24
    assert all(o.metrics.first_token_time >= o.metrics.arrival_time for o in outputs)
    assert [len(o.token_ids) for o in outputs] == work.output_lens
