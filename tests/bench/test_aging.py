"""bench/aging.py: under a steady urgent stream only the aged run serves the less urgent."""

from __future__ import annotations

import json
from pathlib import Path

from bench import aging


def test_the_less_urgent_are_served_only_when_aged(tmp_path: Path) -> None:
    out = tmp_path / "aging.json"
    args = ["--max-batch", "2", "--prompt", "8", "--urgent-tokens", "4", "--urgent-waiting", "3",
            "--low", "2", "--low-every-s", "0.2", "--low-tokens", "2", "--aging-s", "0.3",
            "--duration-s", "2.5", "--out", str(out)]  # fmt: skip
    assert aging.main(args) == 0
    strict, aged = json.loads(out.read_text())["runs"]
    assert (strict["priority_aging_s"], aged["priority_aging_s"]) == (0.0, 0.3)
    assert strict["low_arrived"] == aged["low_arrived"] == 2
    # The urgent loop never lets the queue empty: strict priority serves none of them.
    assert strict["low_served"] == 0 and strict["low_ttft_is_a_floor"]
    assert aged["low_served"] == 2 and not aged["low_ttft_is_a_floor"]
    assert aged["low_ttft_ms"]["max"] < strict["low_ttft_ms"]["p50"]
    for run in (strict, aged):
        assert run["urgent_tok_s"] > 0 and run["urgent_ttft_ms"]["p50"] > 0
