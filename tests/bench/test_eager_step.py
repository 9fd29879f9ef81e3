"""bench/eager_step.py on the CPU: one prefill step per length, timed and profiled."""

from __future__ import annotations

import argparse

from bench import eager_step


def test_each_length_gets_a_timed_and_profiled_prefill_step() -> None:
    ns = argparse.Namespace(model="dummy:tiny", device="cpu", dtype="auto", lengths=[8, 40],
                            repeats=2, out=None)  # fmt: skip
    doc = eager_step.run(ns)
    assert [r["prompt_tokens"] for r in doc["rows"]] == [8, 40]
    for row in doc["rows"]:
        assert row["forward_wall_ms"] > 0 and row["kernels"] == 0  # no CUDA kernels on a CPU
        assert row["host_top"] and all(e["calls"] >= 1 for e in row["host_top"])
