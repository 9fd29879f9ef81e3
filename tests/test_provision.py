"""``qosserve provision`` on a real nats-server: it creates the stream, the groups'
consumers and the bucket, says so, and is safe to run again."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import provision
from common.config import Config
from common.services import NatsServer


def test_provision_creates_everything_and_is_idempotent(
    fresh_nats_server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    server: NatsServer = fresh_nats_server()
    monkeypatch.setenv("QOS_NATS__URL", server.url)
    monkeypatch.delenv("QOS_CONFIG", raising=False)
    for _ in range(2):  # the second run finds them and changes nothing
        assert provision.main([]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [
            "ok: stream QOS_REQ (qos.req.*)",
            *(f"ok: consumer grp-{g} ({g})" for g in Config().groups),
            "ok: KV bucket qos_state",
        ]


def test_provision_says_in_one_line_when_nats_is_not_there(capsys) -> None:
    from common.services import free_port

    code = provision.main(["--nats-url", f"nats://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("qosserve provision:") and err.count("\n") == 1
