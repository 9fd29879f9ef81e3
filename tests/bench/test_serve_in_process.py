"""bench.serve's in-process baseline: its failures count as failures, as the HTTP and NATS
runs count theirs (counted as completions, they flattered the message plane's cost)."""

from __future__ import annotations

import pytest

from bench.serve_load import Req, run_in_process


@pytest.mark.asyncio
async def test_a_request_the_engine_rejects_is_a_failure_and_the_rest_complete() -> None:
    work = [Req([5] * 8, 4), Req([5] * 5000, 4), Req([6] * 8, 3)]  # 5000 > max_seq_len 4096
    results, duration = await run_in_process(work, [0.0, 0.0, 0.0], max_batch=4)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].status == 400 and results[1].error
    assert [r.output_tokens for r in results] == [4, 0, 3]
    assert duration > 0
