"""``qosserve``: the umbrella command. Each subcommand runs one part of the system."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

# subcommand -> (module run as __main__, one-line help)
_MODULES: dict[str, tuple[str, str]] = {
    "up": (
        "common.launcher",
        "run the whole stack locally: NATS, Redis, scheduler, workers, gateway",
    ),
    "gateway": ("gateway", "run the OpenAI-compatible gateway"),
    "worker": ("workers", "run one worker replica of an instance group"),
    "scheduler": ("scheduler", "run the scheduler service (breakers, rebalancing)"),
    "bench": ("bench", "run a benchmark (engine, kernels, serve, kvtier, …)"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qosserve",
        description="QoS-aware distributed LLM serving. `qosserve SUBCOMMAND --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (_, help_text) in _MODULES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    sub.add_parser("config", help="print the effective configuration (defaults + file + QOS_* env)")
    sub.add_parser("version", help="print the version")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qosserve`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in _MODULES:
        module = _MODULES[command][0]
        sys.argv = [f"qosserve {command}", *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    if command == "config":
        return _print_config(rest)
    if command == "version":
        from importlib.metadata import version

        print(version("qosserve"))
        return 0
    parser.error(f"unknown subcommand {command!r}")
    return 2


def _print_config(argv: list[str]) -> int:
    """``qosserve config [--config FILE]`` (a bare FILE works too): the effective config."""
    import yaml

    from common.config import changed_settings, load_config
    from common.errors import ConfigError

    p = argparse.ArgumentParser(
        prog="qosserve config",
        description="Print the effective configuration: defaults <- YAML file <- QOS_* env.",
    )
    p.add_argument("file", nargs="?", help="YAML config file (same as --config)")
    p.add_argument("--config", help="YAML config file (default: $QOS_CONFIG, else none)")
    p.add_argument(
        "--changed",
        action="store_true",
        help="only what the file and QOS_* variables set (a file to keep and feed back)",
    )
    args = p.parse_args(argv)
    try:
        config = load_config(args.config or args.file)
    except ConfigError as exc:
        print(f"qosserve config: {exc}", file=sys.stderr)
        return 2
    if not args.changed:
        # A full dump names every key, and `qosserve up` takes a key a file names as chosen
        # (the demo's CPU device, Redis tier and GPU share then no longer apply).
        print("# Every key, defaults included; to keep as a config file, use --changed.")
        print("# Secrets show as ***: put the real ones back before reusing this.")
    dump = changed_settings(config) if args.changed else config.model_dump(mode="json")
    shown = redacted(dump)
    if args.changed and shown != dump:  # a file that would not load back as it was
        print("# Secrets show as ***: put the real ones back (or set them by QOS_* "
              "variables) before feeding this back.")  # fmt: skip
    try:
        print(yaml.safe_dump(shown, sort_keys=False))
        sys.stdout.flush()
    except BrokenPipeError:  # `qosserve config | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def redacted(value: Any, key: str = "") -> Any:
    """The dumped config fit to print: secrets (passwords, tokens, the alert webhook, whose
    URL is often its credential) as ``***``, credentials inside URLs masked."""
    from common.config import SECRET_KEYS
    from common.logging import redact_url

    if isinstance(value, dict):
        return {k: redacted(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v, key) for v in value]
    if isinstance(value, str) and value and key in SECRET_KEYS:
        return "***"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
