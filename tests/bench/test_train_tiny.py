"""The demo model's topic notes: every golden topic taught, the golden phrasings held out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.golden_templates import DOMAINS, FORMS
from bench.make_golden import base_prompts
from bench.tiny_chat import domain_qa
from bench.train_tiny import DEFAULT_NOTES

ROOT = Path(__file__).resolve().parents[2]
# A few steps of a model a hundredth the demo's size: the whole script in ~10 s.
SMALL = ["--steps", "3", "--seq-len", "128", "--code-docs", "50", "--max-qa", "20",
         "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
         "--intermediate", "64", "--vocab-size", "512"]  # fmt: skip


def test_every_golden_topic_has_a_note_taught_under_the_forms_the_golden_set_does_not_ask() -> None:
    taught = domain_qa(DEFAULT_NOTES)
    held_out = domain_qa(DEFAULT_NOTES, golden=True)
    topics = sum(len(t) for _, t, _ in DOMAINS.values())
    assert len(taught) == topics * (len(FORMS) - 2) and len(held_out) == topics * 2
    golden_questions = {r["question"] for r in base_prompts(seed=2024)}
    assert not golden_questions & {q["question"] for q in taught}
    # The held-out pairs are exactly the golden set's clean domain questions.
    domain_questions = {r["question"] for r in base_prompts(seed=2024) if r["domain"] != "stdlib"}
    assert {q["question"] for q in held_out} == domain_questions
    for item in taught + held_out:
        assert item["answer"].isascii() and 140 <= len(item["answer"]) <= 240


def _train(out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "bench.train_tiny", *SMALL, "--out", str(out / "model"),
         "--qa-out", str(out / "qa.jsonl")],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip


def test_training_is_reproducible_and_its_checkpoint_passes_the_scripts_own_checks(
    tmp_path: Path,
) -> None:
    """The script end to end, twice: data, tokenizer, training, save, and its checks against
    transformers (a failed check exits non-zero); the same seed gives the same bytes."""
    _train(tmp_path / "a")
    _train(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        a, b = (tmp_path / run / "model" / name for run in ("a", "b"))
        assert a.read_bytes() == b.read_bytes(), name
    assert (tmp_path / "a" / "qa.jsonl").read_bytes() == (tmp_path / "b" / "qa.jsonl").read_bytes()
    assert "python -m bench.train_tiny" in (tmp_path / "a" / "model" / "TRAINING.md").read_text()
