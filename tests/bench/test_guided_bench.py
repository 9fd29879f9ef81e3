"""bench/guided.py: both runs generate the same number of tokens, the mask is timed."""

from __future__ import annotations

import json
from pathlib import Path

from bench import guided


def test_both_runs_make_every_token_and_the_mask_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "guided.json"
    args = ["--requests", "3", "--max-tokens", "6", "--out", str(out)]
    assert guided.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["unguided"]["output_tokens"] == doc["guided_regex"]["output_tokens"] == 18
    assert doc["guided_over_unguided_tok_s"] > 0
    assert doc["mask"]["steps"] > 50 and doc["mask"]["median_us"] > 0
