"""bench/warmup.py on the CPU: both modes, each in its own process, serve the same traffic."""

from __future__ import annotations

import json
from pathlib import Path

from bench import warmup


def test_cold_and_warm_modes_serve_the_same_first_traffic(tmp_path: Path) -> None:
    out = tmp_path / "warmup.json"
    assert warmup.main(["--model", "dummy:tiny", "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cold, warm = doc["modes"]["cold"], doc["modes"]["warm"]
    requests = len(warmup.SINGLES) + len(warmup.BURST)
    for mode in (cold, warm):
        assert len(mode["ttft_ms"]) == requests and mode["max_ttft_ms"] > 0
    assert cold["warmup_steps"] == 0 and cold["warmup_prompt_lengths"] == []
    assert warm["warmup_steps"] > 0 and warm["warmup_prompt_lengths"]
    assert doc["max_ttft_cold_over_warm"] > 0
