"""common.guided: a spec is compiled once, good or bad (a client resending a bad grammar
costs one compile, not one per request)."""

from __future__ import annotations

from common.guided import _compiled, problem


def test_a_bad_spec_is_compiled_once_and_refused_each_time_naming_why() -> None:
    _compiled.cache_clear()
    for _ in range(3):
        assert "unclosed group" in (problem("regex", "(ab") or "")
        assert problem("regex", "ab+") is None
    assert _compiled.cache_info().misses == 2


def test_a_spec_nested_past_the_json_parser_is_refused_not_raised() -> None:
    """json.loads raises RecursionError, no ValueError, at ~1,000 levels: the gateway
    answered 500, and a worker handed the request back until it gave up."""
    deep = "[" * 5000 + "]" * 5000
    assert "nested too deeply" in (problem("json_schema", deep) or "")
    assert "non-empty JSON list" in (problem("choice", deep) or "")
