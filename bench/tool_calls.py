"""What reading tool calls as they stream costs the gateway: each format's reader fed an
answer one character at a time (a token is rarely shorter), at two lengths, so that a
cost growing faster than the text shows as a ratio well over the lengths' ratio.

The answers are the shapes that once cost quadratic time (blanks between calls, a list
left open, blanks in content, Llama's leading blanks, one call's long arguments) and an
ordinary answer with two calls for scale.

    python -m bench.tool_calls --out bench/results/cpu/tool_calls.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.output import emit
from bench.provenance import git_state
from gateway.forced_calls import ForcedCalls
from gateway.tool_calls import HermesCalls, Llama3JsonCalls, MistralCalls, ToolCallStream

CALL = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
# name -> (reader, answer of about n characters)
SHAPES: dict[str, tuple[Callable[[], ToolCallStream], Callable[[int], str]]] = {
    "hermes_blanks_in_a_block": (HermesCalls, lambda n: "<tool_call>" + "\n" * n + "x"),
    "required_list_of_blanks": (ForcedCalls, lambda n: "[" + "\n" * n + "]"),
    "mistral_blanks_after_the_tag": (MistralCalls, lambda n: "[TOOL_CALLS]" + " " * n),
    "llama3_separators": (Llama3JsonCalls, lambda n: CALL + ";" * n),
    "content_blanks": (HermesCalls, lambda n: "hi" + " " * n + "x"),
    "llama3_leading_blanks": (Llama3JsonCalls, lambda n: "\n" * n + "x"),
    "mistral_long_word": (MistralCalls, lambda n: "[TOOL_CALLS]" + "a" * n),
    "long_arguments": (
        HermesCalls,
        lambda n: '<tool_call>{"name": "f", "arguments": {"a": "' + "y" * n + '"}}</tool_call>',
    ),
    "two_calls_and_text": (
        HermesCalls,
        lambda n: ("Let me look. " * (n // 13 + 1))[:n] + f"<tool_call>{CALL}</tool_call>" * 2,
    ),
}


def fed_per_character(make: Callable[[], ToolCallStream], text: str) -> float:
    """Seconds to feed ``text`` one character at a time and finish."""
    reader = make()
    t0 = time.perf_counter()
    for char in text:
        reader.feed(char)
    reader.finish()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.tool_calls", description=__doc__.split("\n")[0]
    )
    p.add_argument("--chars", type=int, nargs=2, default=[20_000, 80_000],
                   help="the two answer lengths (default: 20000 80000)")  # fmt: skip
    p.add_argument("--out", default=None, help="also write the JSON here")
    ns = p.parse_args(argv)
    small, large = ns.chars
    shapes: dict[str, Any] = {}
    for name, (make, answer) in SHAPES.items():
        a, b = fed_per_character(make, answer(small)), fed_per_character(make, answer(large))
        shapes[name] = {
            f"s_at_{small}": round(a, 4),
            f"s_at_{large}": round(b, 4),
            "us_per_char_at_large": round(1e6 * b / large, 2),
            "growth": round(b / a, 2) if a else None,  # linear: about large / small
        }
        print(f"{name:30s} {a:7.3f} s  {b:7.3f} s  x{b / a:5.2f}", file=sys.stderr)
    emit({"bench": "tool_calls", "git": git_state(), "length_ratio": large / small,
          "shapes": shapes}, ns.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
