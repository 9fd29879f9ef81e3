"""``qosserve``: the umbrella command. Each subcommand runs one part of the system."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import textwrap
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

if TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

    from common.config import Config

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
    "provision": (
        "common.provision",
        "create or check the JetStream stream, consumers and bucket (as an admin NATS user)",
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qosserve",
        description="QoS-aware distributed LLM serving. `qosserve SUBCOMMAND --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, (_, help_text) in _MODULES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    sub.add_parser(
        "config",
        help="print the effective configuration (defaults + file + QOS_* env); "
        "--explain describes every key",
    )
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
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--changed",
        action="store_true",
        help="only what the file and QOS_* variables set (a file to keep and feed back)",
    )
    mode.add_argument(
        "--explain",
        action="store_true",
        help="a reference of every key: its dotted path, type, default and meaning (with a "
        "file or QOS_* variables, also the values they change)",
    )
    args = p.parse_args(argv)
    try:
        config = load_config(args.config or args.file)
    except ConfigError as exc:
        print(f"qosserve config: {exc}", file=sys.stderr)
        if args.explain:  # the reference still helps to fix it: defaults only
            _write("\n".join(explain_config()) + "\n")
        return 2
    if args.explain:
        _write("\n".join(explain_config(config)) + "\n")
        return 0
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
    _write(yaml.safe_dump(shown, sort_keys=False) + "\n")
    return 0


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `qosserve config | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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


# `qosserve config --explain`: lines wrap at this many columns.
EXPLAIN_WIDTH = 100


def explain_config(config: Config | None = None, width: int = EXPLAIN_WIDTH) -> list[str]:
    """``qosserve config --explain``: every key as a dotted path with its type, default and
    description, section by section in the model's order; the instance groups once, as
    ``groups.<name>.*``, then the default groups' names. With ``config``, also the values it
    changes from the defaults ("now:"). Secrets show as ``***`` or ``unset``, never a value."""
    from pydantic import BaseModel

    from common.config import Config, GroupConfig, default_groups

    def para(text: str, indent: str = "") -> list[str]:
        return textwrap.wrap(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    lines = [
        "qosserve configuration reference: every key, its type, default and meaning.",
        *para(
            "Set keys in a YAML file (--config FILE or $QOS_CONFIG) or by environment "
            "variables: QOS_ and the key upper-cased, __ between levels "
            "(scheduler.move_cooldown_s -> QOS_SCHEDULER__MOVE_COOLDOWN_S). Secrets show as "
            "*** or unset, never their value."
            + (" 'now:' is a value the file or the environment changes." if config else "")
        ),
    ]
    groups = default_groups()
    for section, section_field in Config.model_fields.items():
        lines.extend(["", f"[{section}]", *para(section_field.description or "")])
        model = GroupConfig if section == "groups" else section_field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        prefix = "groups.<name>" if section == "groups" else section
        for attrs, path, field in _config_keys(model, prefix):
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                lines.extend(["", f"[{path}]", *para(field.description or "")])
                continue
            name, default = attrs[-1], _field_default(field)
            shown = (
                "none, a new group sets it" if default is _REQUIRED else _value_text(default, name)
            )
            head = f"{path}  ({_type_text(field)})"
            if len(head) + len(shown) + 11 <= width:
                lines.extend(["", f"{head}  default: {shown}"])
            else:
                lines.extend(["", head, f"    default: {shown}"])
            now: str | None = None
            if section == "groups":
                per_group = {g: _attr(v, attrs) for g, v in groups.items()}
                if any(v != default for v in per_group.values()):
                    lines.extend(para("default groups: " + _per_group(per_group, name), "    "))
                if config is not None:
                    # The configured groups whose value is not their default: a default
                    # group's own, or for another group the key's default.
                    changed = {
                        g: value
                        for g, v in config.groups.items()
                        if (value := _attr(v, attrs)) != per_group.get(g, default)
                    }
                    if changed:
                        now = _per_group(changed, name)
            elif config is not None:
                value = _attr(getattr(config, section), attrs)
                if value != default:
                    now = _value_text(value, name)
            if now is not None:
                lines.extend(para(f"now: {now}", "    "))
            lines.extend(para(field.description or "", "    "))
        if section == "groups":
            lines.extend(
                [
                    "",
                    *para(
                        "Default groups: " + ", ".join(groups) + " (`qosserve config` prints "
                        "their settings). groups_replace_defaults: true, in the file or as "
                        "QOS_GROUPS_REPLACE_DEFAULTS=true, starts from no group instead."
                    ),
                ]
            )
            if config is not None and list(config.groups) != list(groups):
                lines.append("Configured groups: " + ", ".join(config.groups))
    return lines


# A field without a default (a group's limits): the default groups give them.
_REQUIRED = object()


def _config_keys(
    model: type[BaseModel], prefix: str, attrs: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, FieldInfo]]:
    """Every field under ``model``, depth first in declaration order: (its attribute path
    from ``model``, its dotted key, the field); a nested model comes before its keys."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        here = (*attrs, name)
        yield here, f"{prefix}.{name}", field
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _config_keys(annotation, f"{prefix}.{name}", here)


def _attr(value: Any, attrs: tuple[str, ...]) -> Any:
    for name in attrs:
        value = getattr(value, name)
    return value


def _field_default(field: FieldInfo) -> Any:
    if field.is_required():
        return _REQUIRED
    return field.get_default(call_default_factory=True)


def _value_text(value: Any, key: str) -> str:
    """A value as a YAML reader would write it, secrets and URL credentials masked."""
    value = redacted(value, key)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _per_group(values: dict[str, Any], key: str) -> str:
    return ", ".join(f"{group}={_value_text(value, key)}" for group, value in values.items())


def _type_text(field: FieldInfo) -> str:
    """``int, >= 1``; ``"e2e" | "ttft"``; ``str | None, pattern ^...$``."""
    text = _annotation_text(field.annotation)
    bounds = []
    for item in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{sign} {getattr(item, attr)}")
        if getattr(item, "min_length", None) is not None:
            bounds.append(f"at least {item.min_length} characters")
        if getattr(item, "pattern", None) is not None:
            bounds.append(f"pattern {item.pattern}")
    return ", ".join([text, *bounds])


def _annotation_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_annotation_text(arg) for arg in args)
    if origin is not None:
        inner = ", ".join(_annotation_text(arg) for arg in args)
        return f"{getattr(origin, '__name__', origin)}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


if __name__ == "__main__":
    sys.exit(main())
