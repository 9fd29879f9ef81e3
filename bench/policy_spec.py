"""Policy specs on benchmark command lines: ``hybrid`` or ``hybrid@0.5`` (prefill delay 0.5).

The stack benchmark (``bench/policies.py``) also takes ``dynamic/pool``: the policy on one
undivided pool of the same workers, every request on one queue -- traditional serving
without instance groups, the field study's baseline.

Stdlib only, so the stack benchmarks can parse them without importing the engine.
"""

from __future__ import annotations

# workers.engine.args.POLICIES, repeated: importing it would import torch (a test pins both).
POLICIES = ("static", "dynamic", "continuous", "hybrid")
DELAYING = ("continuous", "hybrid")  # the policies a prefill delay applies to
POOL_SUFFIX = "/pool"


def split_layout(spec: str) -> tuple[str, bool]:
    """``"dynamic/pool"`` -> ("dynamic", True); ``"hybrid@1"`` -> ("hybrid@1", False)."""
    if spec.endswith(POOL_SUFFIX):
        return spec[: -len(POOL_SUFFIX)], True
    return spec, False


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
