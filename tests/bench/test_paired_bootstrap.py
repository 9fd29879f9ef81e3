"""The paired bootstrap behind bench/kvquant.py's "drop < 1 point" intervals."""

from __future__ import annotations

import random

import pytest

from bench.paired_bootstrap import paired_drop


def test_identical_runs_drop_nothing_with_a_zero_width_interval() -> None:
    rng = random.Random(1)
    scores = [rng.random() for _ in range(50)]
    assert len(set(scores)) == 50  # scores that differ: only pairing makes the width zero
    drop = paired_drop(scores, scores)
    assert (drop.points, drop.low, drop.high) == (0.0, 0.0, 0.0)


def test_ten_lost_of_a_hundred_is_a_ten_point_drop_whose_interval_excludes_zero() -> None:
    other = [0.0] * 10 + [1.0] * 90
    drop = paired_drop([1.0] * 100, other)
    assert drop.points == pytest.approx(10.0)
    assert 3.0 < drop.low < 10.0 < drop.high < 17.0


def test_pairing_keeps_hard_prompts_out_of_the_interval() -> None:
    """Half the prompts fail in both runs; only the one that changed widens the interval,
    where an unpaired bootstrap of two 50 % accuracies would span about +-20 points."""
    rng = random.Random(0)
    base = [float(rng.random() < 0.5) for _ in range(100)]
    other = list(base)
    flipped = base.index(1.0)
    other[flipped] = 0.0
    drop = paired_drop(base, other)
    assert drop.points == pytest.approx(1.0)
    assert drop.low >= 0.0 and drop.high <= 4.0


def test_a_gain_is_a_negative_drop() -> None:
    drop = paired_drop([0.0] * 20, [1.0] * 5 + [0.0] * 15)
    assert drop.points == pytest.approx(-25.0) and drop.high < 0


def test_same_inputs_same_interval_and_the_report_names_the_confidence() -> None:
    base, other = [1.0] * 40, [1.0] * 35 + [0.0] * 5
    assert paired_drop(base, other) == paired_drop(base, other)
    assert paired_drop(base, other, confidence=0.9).as_dict().keys() == {
        "points",
        "ci90_low",
        "ci90_high",
    }


@pytest.mark.parametrize("other", [[1.0], []])
def test_score_lists_must_pair_up(other: list[float]) -> None:
    with pytest.raises(ValueError, match="equal"):
        paired_drop([1.0, 0.0] if other else [], other)
