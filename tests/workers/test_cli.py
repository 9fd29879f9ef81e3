"""``qosserve-worker`` argument handling (the process itself runs in test_replicas)."""

from __future__ import annotations

import pytest

from common.subjects import is_subject_token
from workers.__main__ import default_worker_id, main


def test_the_default_worker_id_is_a_subject_token() -> None:
    assert is_subject_token(default_worker_id())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--group", "nope", "--engine", "sim"], "--group 'nope'"),
        (["--group", "short", "--engine", "sim", "--worker-id", "a.b"], "--worker-id 'a.b'"),
        (["--group", "short", "--coalesce-ms", "-1", "--engine", "sim"], "coalesce_ms"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QOS_CONFIG", raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
