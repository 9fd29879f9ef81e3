"""bench.tool_calls runs end to end on small answers and reports every shape."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tool_calls


def test_the_bench_times_every_shape_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "tool_calls.json"
    assert tool_calls.main(["--chars", "200", "800", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["length_ratio"] == 4 and set(doc["shapes"]) == set(tool_calls.SHAPES)
    for shape in doc["shapes"].values():
        assert shape["s_at_800"] > 0 and shape["us_per_char_at_large"] > 0


def test_every_shape_reads_the_same_whole_and_fed_a_character_at_a_time() -> None:
    """The timed feeding is the real reading: what it returns is what split() returns."""
    for make, answer in tool_calls.SHAPES.values():
        text = answer(300)
        reader = make()
        pieces = [p for char in text for p in reader.feed(char)] + reader.finish()
        content, calls = make().split(text)
        streamed = "".join(v for k, v in pieces if k == "content")
        assert streamed == (content or "") and sum(k == "call" for k, _ in pieces) == len(calls)
