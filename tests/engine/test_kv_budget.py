"""How much KV cache a GPU engine takes: its share of the device, bounded by what is free."""

from __future__ import annotations

from workers.engine.model_runner import FREE_MARGIN_FRACTION, kv_budget_bytes

GiB = 1 << 30
TOTAL = 140 * GiB


def test_an_engine_alone_takes_its_share_less_weights_and_working_memory() -> None:
    budget = kv_budget_bytes(
        total=TOTAL, free=139 * GiB, own=16 * GiB, working=4 * GiB, utilization=0.9
    )
    assert budget == int(0.9 * TOTAL) - 20 * GiB


def test_another_process_on_the_gpu_does_not_shrink_a_share_that_still_fits() -> None:
    """Two workers at 0.45: the second starts after the first took its 63 GiB."""
    first = kv_budget_bytes(
        total=TOTAL, free=130 * GiB, own=3 * GiB, working=1 * GiB, utilization=0.45
    )
    second = kv_budget_bytes(
        total=TOTAL, free=130 * GiB - first - 4 * GiB, own=3 * GiB, working=1 * GiB,
        utilization=0.45,
    )  # fmt: skip
    assert second == first == int(0.45 * TOTAL) - 4 * GiB


def test_what_is_free_bounds_the_cache_and_it_is_never_negative() -> None:
    crowded = kv_budget_bytes(
        total=TOTAL, free=20 * GiB, own=3 * GiB, working=1 * GiB, utilization=0.9
    )
    assert crowded == int(20 * GiB - 1 * GiB - TOTAL * FREE_MARGIN_FRACTION)
    assert kv_budget_bytes(total=TOTAL, free=GiB, own=GiB, working=2 * GiB, utilization=0.9) == 0


def test_a_whole_prompt_policy_longer_than_the_profile_is_warned_of(caplog) -> None:  # type: ignore[no-untyped-def]
    """The profile run reserves activations for at most 32k tokens; continuous, dynamic and
    static prefill a whole prompt in one forward, so a longer max_seq_len could run out of
    GPU memory mid-serving with nothing said at start-up."""
    import logging
    from types import SimpleNamespace

    from workers.engine.engine import LLMEngine

    def warned(policy: str, max_seq_len: int, profiled: int | None) -> bool:
        engine = SimpleNamespace(
            args=SimpleNamespace(policy=policy), max_seq_len=max_seq_len, _profiled_tokens=profiled
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, "workers.engine.engine"):
            LLMEngine._warn_if_prefill_outgrows_profile(engine)  # type: ignore[arg-type]
        return "may run out of GPU memory" in caplog.text

    assert warned("continuous", 131072, 32768)
    assert not warned("hybrid", 131072, 8192)  # chunked: never more than the budget
    assert not warned("continuous", 32768, 32768)
    assert not warned("continuous", 131072, None)  # not profiled: the CPU, a set budget
