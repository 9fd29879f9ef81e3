"""common.services: real nats-server / redis-server processes for tests and `qosserve up`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from common import services
from common.errors import ConfigError
from common.services import (
    MIN_VERSIONS,
    NatsServer,
    RedisServer,
    ServerStartError,
    find_binary,
    free_port,
    parse_version,
)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _process_gone(pid: int) -> bool:
    """Gone or a zombie waiting for a reaper: either way it no longer runs."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("nats-server: v2.15.1\n", (2, 15, 1)),
        ("nats-server: v2.11.0-RC.1", (2, 11, 0)),
        ("Redis server v=8.2.3 sha=b5d43ceb:0 malloc=jemalloc-5.3.0 bits=64", (8, 2, 3)),
        ("Redis server v=6.2 sha=00000000:0", (6, 2, 0)),
    ],
)
def test_parse_version_reads_both_servers_formats(text: str, version: tuple[int, int, int]):
    assert parse_version(text) == version


def test_parse_version_rejects_text_without_a_version():
    with pytest.raises(ValueError, match="no version"):
        parse_version("command not found")


@pytest.mark.parametrize("name", ["nats-server", "redis-server"])
def test_find_binary_finds_a_new_enough_local_server(name: services.BinaryName):
    path = find_binary(name)
    assert path.is_file()
    assert services.binary_version(path) >= MIN_VERSIONS[name]


def test_missing_binary_error_names_it_and_how_to_install(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        find_binary("nats-server", candidates=[tmp_path])
    assert "nats-server" in err.value.message
    assert "make install" in err.value.message


def test_too_old_binary_is_rejected_with_its_version(tmp_path: Path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'Redis server v=6.0.9 sha=0:0'\n")
    fake.chmod(0o755)
    with pytest.raises(ConfigError, match=r"redis-server >= 6\.2\.0.*6\.0\.9"):
        find_binary("redis-server", candidates=[tmp_path])


def test_start_without_any_binary_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(services, "default_candidates", lambda name: [])
    server = NatsServer(store_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"nats-server >= 2\.10\.0 not found"):
        server.start()
    assert not server.running


def test_nats_kill_then_restart_comes_back_on_the_same_port(
    fresh_nats_server: Callable[..., NatsServer],
):
    server = fresh_nats_server()
    port, first_pid = server.port, server.pid
    assert server.url == f"nats://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{server.monitor_url}/healthz?js-enabled-only=true") as resp:
        assert resp.status == 200

    server.kill()
    assert not server.running
    assert _wait_for(lambda: not _port_open(port))

    server.restart()
    assert server.running
    assert server.port == port and server.pid != first_pid
    assert _port_open(port)
    assert "Server is ready" in server.log_tail(100)


def test_graceful_stop_ends_the_process(fresh_nats_server: Callable[..., NatsServer]):
    server = fresh_nats_server()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert _process_gone(pid)
    server.stop()  # idempotent


def test_bad_config_fails_start_with_the_servers_log(tmp_path: Path):
    server = NatsServer(store_dir=tmp_path, extra_config="this is { not valid")
    with pytest.raises(ServerStartError, match="exited"):
        server.start()
    assert not server.running


def test_explicit_port_that_is_taken_fails_with_the_reason(tmp_path: Path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = NatsServer(port=squatter.getsockname()[1], store_dir=tmp_path)
        with pytest.raises(ServerStartError, match=r"(?i)address already in use"):
            server.start()


def test_explicit_port_and_persistent_state_dir_outlive_close(tmp_path: Path):
    port = free_port()
    state = tmp_path / "state"
    with NatsServer(port=port, store_dir=state) as server:
        assert server.url == f"nats://127.0.0.1:{port}"
    assert not _port_open(port)
    assert (state / "js").is_dir()  # the JetStream store stays for the next `qosserve up`


def test_owned_temp_dir_is_removed_on_close():
    with RedisServer() as server:
        state = server.state_dir
        assert state.is_dir()
    assert not state.exists()


def test_redis_needs_its_password_and_then_sets_and_gets(
    fresh_redis_server: Callable[..., RedisServer],
):
    server = fresh_redis_server(password="s3cret")
    anonymous = redis.Redis.from_url(server.url)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    client = redis.Redis.from_url(server.url, password="s3cret")
    assert client.ping()
    client.set("k", b"v")
    assert client.get("k") == b"v"
    # No persistence: the KV tier is a cache.
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    anonymous.close()
    client.close()


def test_redis_restart_keeps_the_port_and_starts_empty(
    fresh_redis_server: Callable[..., RedisServer],
):
    server = fresh_redis_server()
    client = redis.Redis.from_url(server.url)
    client.set("k", b"v")
    port = server.port
    server.restart(hard=True)
    assert server.port == port
    assert client.get("k") is None  # redis-py reconnects; nothing was persisted
    client.close()


def test_session_redis_fixture_answers_ping(redis_server: RedisServer):
    assert redis_server.ping()


def test_server_dies_with_the_process_that_started_it(tmp_path: Path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from common.services import NatsServer
        server = NatsServer(store_dir={str(tmp_path)!r}).start()
        print(server.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no cleanup: a crash
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.strip())
    try:
        assert _wait_for(lambda: _process_gone(child)), "nats-server outlived its parent"
    finally:
        if not _process_gone(child):
            os.kill(child, signal.SIGKILL)
