"""The engine benchmark runs end to end and reports every policy side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine import main


def test_offline_bench_reports_each_policy_against_static(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    main(["--num-seqs", "6", "--min-len", "4", "--max-len", "12", "--max-batch-size", "4",
          "--max-wait-ms", "1", "--num-kv-blocks", "64", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert set(result["policies"]) == {"static", "dynamic", "continuous", "hybrid"}
    for r in result["policies"].values():
        assert r["output_tokens"] == result["workload"]["output_tokens"]
        assert r["output_tok_s"] > 0 and r["mean_ttft_ms"] > 0
    static = result["policies"]["static"]["output_tok_s"]
    for name, r in result["policies"].items():  # each ratio is its own rate over static's
        ratio = result["ratios_vs_static"][name]["output_tok_s"]
        assert ratio == pytest.approx(r["output_tok_s"] / static, rel=0.01), name
    assert result["roofline"]["example_step"]["predicted_step_ms"] > 0


def test_fixed_shape_bench_compares_decode_with_its_roofline(tmp_path: Path) -> None:
    out = tmp_path / "fixed.json"
    main(
        [
            "--fixed-batch",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--num-kv-blocks",
            "64",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["shape"] == {"batch": 4, "input_len": 16, "output_len": 6}
    assert result["run"]["output_tokens"] == 24
    assert result["decode_step_ms_median"] > 0 and result["decode_vs_roofline"] > 0


def test_fixed_shape_bench_measures_transformers_decode_step_on_the_same_prompts(
    tmp_path: Path,
) -> None:
    """--hf-baseline was silently ignored in the fixed-shape mode, which is where the
    headline speed-up over transformers is read: it now times transformers' decode step
    on the same batch, the same definition as the engine's (B / median step)."""
    out = tmp_path / "fixed.json"
    main(["--fixed-batch", "2", "--input-len", "8", "--output-len", "5", "--num-kv-blocks",
          "32", "--hf-baseline", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    hf = result["transformers"]
    assert hf["decode_step_ms"] > 0 and hf["decode_tok_s"] == pytest.approx(
        2 / (hf["decode_step_ms"] / 1e3), rel=0.01
    )
    assert hf["engine_speedup"] == pytest.approx(
        result["decode_tok_s"] / hf["decode_tok_s"], rel=0.02
    )
