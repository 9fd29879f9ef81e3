"""bench.tracing_hooks times the services' real tracing hooks: what it queued is a whole
traced request on each side (2 gateway spans, 5 worker spans), and it says so."""

from __future__ import annotations

import json

import pytest

from bench import tracing_hooks


def test_the_hooks_it_times_record_every_span_of_a_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert tracing_hooks.main(["--requests", "40", "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gateway"]["spans_per_request"] == 2  # server, publish
    assert report["worker"]["spans_per_request"] == 5  # request, queue, prefill, decode, stream
    for side in ("gateway", "worker"):
        assert report[side]["encode_us_per_request"] > 0
