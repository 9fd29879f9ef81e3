"""bench/engine.py --repeats: rounds in rotated order, ratios paired within a round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import engine


def test_rounds_rotate_the_order_and_ratios_are_the_median_of_each_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run once in a fixed order, the policy ratios measured the host's drift and each
    policy's place in the order (the same code read continuous 1.33x, 0.87x, 0.78x static)."""
    order: list[str] = []
    rates = iter([100.0, 150.0, 300.0, 200.0, 100.0, 130.0])  # made-up drift, by call

    def fake_summarize(wall: float, outputs: Any, log: Any, roof: Any) -> dict[str, Any]:
        rate = next(rates)
        return {"output_tok_s": rate, "req_s": rate / 10, "mean_ttft_ms": 1000 / rate}

    real_args = engine.engine_args

    def recording_args(ns: Any, policy: str, **kwargs: Any) -> Any:
        order.append(policy)
        return real_args(ns, policy, **kwargs)

    monkeypatch.setattr(engine, "engine_args", recording_args)
    monkeypatch.setattr(engine, "summarize", fake_summarize)
    out = tmp_path / "engine.json"
    engine.main(["--policies", "static,continuous", "--repeats", "3", "--num-seqs", "2",
                 "--min-len", "4", "--max-len", "6", "--device", "cpu", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert order == ["static", "continuous", "continuous", "static", "static", "continuous"]
    # Rounds: static 100 / 200 / 100, continuous 150 / 300 / 130: per round 1.5, 1.5, 1.3.
    ratio = doc["ratios_vs_static"]["continuous"]
    assert ratio["output_tok_s"] == 1.5 and ratio["output_tok_s_range"] == [1.3, 1.5]
    assert doc["policies"]["continuous"]["rounds_output_tok_s"] == [150.0, 300.0, 130.0]
    assert doc["policies"]["continuous"]["output_tok_s"] == 150.0  # the median round
    assert "--repeats 3" in doc["command"]
    with pytest.raises(SystemExit):
        engine.parse(["--repeats", "0"])
