"""``qosserve bench NAME [ARGS]``: run one benchmark module of this package by name."""

from __future__ import annotations

import pkgutil
import runpy
import sys
from pathlib import Path

# Modules of bench/ that are not benchmarks.
_NOT_BENCHMARKS = {"__main__", "train_tiny", "report"}


def available() -> list[str]:
    """Benchmark names, one per module of this package."""
    here = Path(__file__).parent
    return sorted(
        m.name for m in pkgutil.iter_modules([str(here)]) if m.name not in _NOT_BENCHMARKS
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not args or args[0] in ("-h", "--help"):
        print("usage: qosserve bench NAME [ARGS]   (NAME --help for its options)")
        print("benchmarks: " + ", ".join(names))
        return 0 if args else 2
    name = args[0]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [f"qosserve bench {name}", *args[1:]]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
