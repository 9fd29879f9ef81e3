"""bench/host_step.py: both layouts timed and equal in content."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import host_step


def test_each_size_is_timed_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "host_step.json"
    assert host_step.main(["--batch", "8", "--repeats", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["blocks_per_row"] for r in doc["block_tables"]] == [32, 136, 512]
    assert [r["output_tokens"] for r in doc["penalty_ids"]] == [256, 1024, 2048]
    for row in doc["block_tables"] + doc["penalty_ids"]:
        assert row["from_lists_ms"] > 0 and row["from_arrays_ms"] > 0 and row["ratio"] > 0


def test_the_layout_pads_each_row_to_the_widest() -> None:
    ids = host_step._layout([np.array([1, 2, 3]), [4]], 9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]]
