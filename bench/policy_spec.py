"""Policy specs on benchmark command lines: ``hybrid`` or ``hybrid@0.5`` (prefill delay 0.5).

The stack benchmark (``bench/policies.py``) also takes ``dynamic/pool``: the policy on one
undivided pool of the same workers, every request on one queue -- traditional serving
without instance groups, the field study's baseline.

Stdlib only, so the stack benchmarks can parse them without importing the engine.
"""

from __future__ import annotations

from typing import NamedTuple

# workers.engine.args.POLICIES, repeated: importing it would import torch (a test pins both).
POLICIES = ("static", "dynamic", "continuous", "hybrid")
DELAYING = ("continuous", "hybrid")  # the policies a prefill delay applies to
POOL_SUFFIX = "/pool"


class StackSpec(NamedTuple):
    """A stack benchmark's spec: the policy, its prefill delay, one undivided pool or not."""

    policy: str
    delay: float
    pooled: bool


def split_stack_spec(spec: str) -> StackSpec:
    """``"dynamic/pool"`` -> StackSpec("dynamic", 0.0, True); ``"hybrid@1"`` ->
    StackSpec("hybrid", 1.0, False). Raises ValueError as :func:`split_spec` does."""
    pooled = spec.endswith(POOL_SUFFIX)
    policy, delay = split_spec(spec.removesuffix(POOL_SUFFIX) if pooled else spec)
    return StackSpec(policy, delay, pooled)


def split_spec(spec: str) -> tuple[str, float]:
    """``"hybrid@0.5"`` -> ("hybrid", 0.5): a policy and its prefill delay factor (0 bare).
    Raises ValueError for an unknown policy, a bad number or a delay it cannot take."""
    policy, _, factor = spec.partition("@")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    try:
        delay = float(factor) if factor else 0.0
    except ValueError:
        raise ValueError(
            f"{spec!r}: a prefill delay factor is a number, as in hybrid@0.5"
        ) from None
    if delay and policy not in DELAYING:
        raise ValueError(f"{spec!r}: only continuous and hybrid delay prefills")
    return policy, delay
