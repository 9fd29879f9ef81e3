"""The configuration reference: every key described, and `qosserve config --explain`."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from common import cli
from common.config import BreakerConfig, Config, GroupConfig


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models inside a field's type: ``NatsConfig``, ``dict[str, GroupConfig]``'s
    ``GroupConfig``, an optional model's model."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    if get_origin(annotation) in (Union, types.UnionType, list, dict, tuple):
        for arg in get_args(annotation):
            yield from _models(arg)


def _all_fields(
    model: type[BaseModel], prefix: str = "", seen: set[type[BaseModel]] | None = None
) -> Iterator[tuple[str, Any]]:
    seen = set() if seen is None else seen
    seen.add(model)
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path, field
        for sub in _models(field.annotation):
            if sub not in seen:
                yield from _all_fields(sub, f"{path}.", seen)


def test_every_config_key_has_a_description() -> None:
    """An operator reads `qosserve config --explain`: a key added without a description
    would show there with none."""
    fields = dict(_all_fields(Config))
    # The walk reaches the group and breaker models through groups: dict[str, GroupConfig].
    assert "groups.max_batch" in fields and "groups.breaker.p99_kind" in fields
    assert "scheduler.move_cooldown_s" in fields and "worker.kv_host_cache_gib" in fields
    assert {GroupConfig, BreakerConfig} <= {
        m for f in fields.values() for m in _models(f.annotation)
    }
    missing = [path for path, field in fields.items() if not (field.description or "").strip()]
    assert not missing, f"config keys without a description: {missing}"
    short = [path for path, field in fields.items() if len(field.description.split()) < 4]
    assert not short, f"descriptions too short to explain anything: {short}"


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["config", "--explain", *argv]) == 0
    return capsys.readouterr().out


def _entry(out: str, key: str) -> str:
    """The lines of ``key``'s entry: its head line and the indented lines under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}  ("))
    end = start + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return "\n".join(lines[start:end])


def test_explain_lists_keys_with_type_default_and_description(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("QOS_")]:
        monkeypatch.delenv(name)
    out = _explain(capsys)
    expected = {
        "nats.url": "default: nats://127.0.0.1:4222",
        "scheduler.move_cooldown_s": "default: 60.0",
        "worker.kv_host_cache_gib": "default: 0.0",
        "groups.<name>.breaker.p99_kind": "default: e2e",
        "groups.<name>.max_batch": "realtime=1, short=16, long=2",
        "redis.kv_mac_secret": "default: unset",
        "log.access_log": "default: true",
    }
    for key, default in expected.items():
        entry = _entry(out, key)
        assert default in entry, entry
        assert len(entry.splitlines()) >= 2, entry  # a description under the head line
    assert "(float, >= 0)" in _entry(out, "scheduler.move_cooldown_s")
    assert '("e2e" | "ttft")' in _entry(out, "groups.<name>.breaker.p99_kind")
    assert "Raise it if replicas ping-pong" in _entry(out, "scheduler.move_cooldown_s")
    # Sections in the model's order, the group keys once, then the default groups' names.
    headers = [line for line in out.splitlines() if line.startswith("[")]
    assert headers == [
        "[nats]",
        "[redis]",
        "[groups]",
        "[groups.<name>.breaker]",
        "[gateway]",
        "[worker]",
        "[scheduler]",
        "[log]",
    ]
    assert "Default groups: realtime, short, long" in out
    assert "groups.realtime." not in out and "groups.short." not in out
    # Every key of every model, once; nothing from a configured value when all are defaults.
    keys = [
        line.split("  (")[0]
        for line in out.splitlines()
        if "  (" in line and not line.startswith(" ")
    ]
    assert len(keys) == len(set(keys))
    assert len(keys) == sum(
        1 for _, field in _all_fields(Config) if not list(_models(field.annotation))
    )
    assert "now:" not in out.replace("'now:'", "")
    assert max(len(line) for line in out.splitlines()) <= 100


def test_explain_shows_no_secret_and_says_what_a_file_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QOS_NATS__PASSWORD", "hunter2")
    monkeypatch.setenv("QOS_REDIS__KV_MAC_SECRET", "mac-secret-0123456789")
    monkeypatch.setenv("QOS_SCHEDULER__ALERT_WEBHOOK_URL", "https://hooks.example/T0/hook-secret")
    out = _explain(capsys)
    for secret in ("hunter2", "mac-secret", "hook-secret"):
        assert secret not in out
    assert "now: ***" in _entry(out, "nats.password")

    path = tmp_path / "qos.yaml"
    path.write_text(
        "nats: {url: 'nats://u:url-secret@nats:4222'}\n"
        "scheduler: {move_cooldown_s: 120}\n"
        "groups: {short: {breaker: {p99_kind: ttft}}}\n"
    )
    for argv in (["--config", str(path)], [str(path)]):
        out = _explain(capsys, *argv)
        assert "hunter2" not in out and "url-secret" not in out
        assert "now: nats://u:***@nats:4222" in _entry(out, "nats.url")
        assert "now: 120.0" in _entry(out, "scheduler.move_cooldown_s")
        assert "now: short=ttft" in _entry(out, "groups.<name>.breaker.p99_kind")
        assert "now:" not in _entry(out, "worker.kv_host_cache_gib")


def test_explain_is_in_the_help_and_a_bad_config_still_gets_the_reference(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as help_exit:
        cli.main(["config", "--help"])
    assert help_exit.value.code == 0 and "--explain" in capsys.readouterr().out
    monkeypatch.setenv("QOS_GATEWAY__PORT", "not-a-port")
    assert cli.main(["config", "--explain"]) == 2
    captured = capsys.readouterr()
    assert "gateway.port" in captured.err and "Traceback" not in captured.err
    assert "scheduler.move_cooldown_s  (" in captured.out
