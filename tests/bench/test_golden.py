"""The golden set: its shape, its determinism, and ten prompts scored through a real stack."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench import golden
from bench.make_golden import OUT, fingerprint, golden_rows
from common.models import demo_model_path

REFERENCE_KEYS = {"reference", "reference_token_ids", "reference_model", "reference_generator"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in OUT.read_text().splitlines()]


def test_the_set_has_200_prompts_over_20_domains_a_fifth_adversarial(rows: list[dict]) -> None:
    assert len(rows) >= 200
    assert len({r["domain"] for r in rows}) >= 20
    assert {"finance", "medical", "legal", "ecommerce_support", "code", "stdlib"} <= {
        r["domain"] for r in rows
    }
    share = sum(r["adversarial"] for r in rows) / len(rows)
    assert 0.18 <= share <= 0.22
    kinds = Counter(r["perturbation"] for r in rows if r["adversarial"])
    assert {"typo", "vague", "ambiguous"} <= set(kinds)
    assert len({r["id"] for r in rows}) == len(rows)


def test_prompts_are_regenerated_identically_from_the_seed(rows: list[dict]) -> None:
    stored = [
        {k: v for k, v in r.items() if k not in REFERENCE_KEYS | {"prompt_tokens"}} for r in rows
    ]
    assert (
        golden_rows(seed=2024, max_tokens=rows[0]["max_tokens"], ignore_eos=rows[0]["ignore_eos"])
        == stored
    )


def test_references_come_from_the_demo_checkpoint_as_it_is_now(rows: list[dict]) -> None:
    current = fingerprint(demo_model_path())
    assert {r["reference_model"] for r in rows} == {current}, "re-run python -m bench.make_golden"
    assert all("transformers" in r["reference_generator"] for r in rows)
    assert all(isinstance(r["reference"], str) for r in rows)


def test_ten_prompts_through_the_served_stack_match_transformers_exactly(tmp_path: Path) -> None:
    out = tmp_path / "golden.json"
    code = golden.main(["--policies", "hybrid", "--limit", "10", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["set"]["prompts"] == 10 and report["set"]["same_checkpoint"]
    result = report["results"]["hybrid"]["auto"]
    assert result["errors"] == 0
    # Same checkpoint, fp32 KV, greedy: the served text is transformers' text.
    assert result["exact_match"] == 1.0, json.dumps(result["mismatches"], indent=1)
    assert result["rouge_l"] == 1.0


def test_kv_dtypes_are_checked_against_the_worker_config_before_any_stack_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert golden.parse_args(["--kv-dtypes", "auto,int8,fp8_e4m3"]).kv_dtypes == [
        "auto", "int8", "fp8_e4m3",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        golden.parse_args(["--kv-dtypes", "auto,int4"])
    assert (
        "unknown KV cache dtype int4; choose from auto, int8, fp8_e4m3" in capsys.readouterr().err
    )
