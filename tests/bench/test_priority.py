"""bench/priority.py: both runs on the same schedule, and the preemption shows."""

from __future__ import annotations

import json
from pathlib import Path

from bench import priority


def test_urgent_requests_preempt_only_when_switched_on(tmp_path: Path) -> None:
    out = tmp_path / "priority.json"
    args = ["--max-batch", "2", "--urgent", "3", "--urgent-every-s", "0.05",
            "--background-prompt", "16", "--background-tokens", "64",
            "--urgent-prompt", "8", "--urgent-tokens", "2", "--warmup-s", "0.0",
            "--out", str(out)]  # fmt: skip
    assert priority.main(args) == 0
    doc = json.loads(out.read_text())
    off, on = doc["runs"]
    assert (off["priority_preemption"], on["priority_preemption"]) == (False, True)
    assert off["urgent"] == on["urgent"] == 3
    assert off["priority_preemptions"] == 0 and on["priority_preemptions"] >= 1
    for run in (off, on):
        assert 0 < run["urgent_ttft_ms"]["p50"] <= run["urgent_e2e_ms"]["p50"]
    assert set(doc["ratios"]) == {
        "urgent_ttft_p50_off_over_on", "urgent_ttft_p90_off_over_on",
        "urgent_e2e_p90_off_over_on", "background_tokens_per_step_on_over_off",
        "background_tok_s_on_over_off",
    }  # fmt: skip
    for run in (off, on):  # one window for every figure: the steps carry the tokens
        assert 0 < run["background_tokens_per_step"] <= 2
