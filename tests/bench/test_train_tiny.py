"""The demo model's topic notes: every golden topic taught, the golden phrasings held out."""

from __future__ import annotations

from bench.golden_templates import DOMAINS, FORMS
from bench.make_golden import base_prompts
from bench.train_tiny import DEFAULT_NOTES, domain_qa


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
