"""``qosserve up``'s own decisions, without starting the stack (tests/deploy start it)."""

from __future__ import annotations

import importlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from common import launcher
from common.config import load_config
from common.errors import ConfigError
from common.services import port_in_use


def settings(tmp_path: Path, yaml_text: str, argv: list[str], env: dict[str, str] | None = None):
    path = tmp_path / "qos.yaml"
    path.write_text(yaml_text)
    args = launcher._parse_args(["--config", str(path), *argv])
    return launcher.Settings.of(args, load_config(args.config, env=env or {}))


def test_the_config_decides_what_no_flag_names_and_a_flag_wins(tmp_path: Path) -> None:
    text = (
        "worker: {model: 'dummy:tiny', device: cuda}\n"
        "gateway: {host: 0.0.0.0, port: 9000, served_model_name: prod}\n"
    )
    got = settings(tmp_path, text, [])
    assert (got.model, got.device, got.host, got.port) == ("dummy:tiny", "cuda", "0.0.0.0", 9000)
    assert got.served_model_name == "prod"
    flags = settings(tmp_path, text, ["--model", "demo", "--device", "cpu", "--port", "8100"])
    assert (flags.model, flags.device, flags.port) == ("demo", "cpu", 8100)
    assert flags.served_model_name != "prod"  # named for the model the flag chose
    env = settings(tmp_path, "{}", [], env={"QOS_GATEWAY__PORT": "9100"})
    assert env.port == 9100
    # Nothing named: the local demo on the CPU (not worker.device's default, auto).
    plain = settings(tmp_path, "{}", [])
    assert (plain.model, plain.device, plain.host, plain.port) == ("demo", "cpu", "127.0.0.1", 8000)


def test_a_busy_gateway_port_is_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = launcher.main(["--engine", "sim", "--port", str(port),
                              "--state-dir", str(tmp_path / "state")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"port {port}" in err and "--port" in err and "Traceback" not in err
    assert not (tmp_path / "state" / "nats").exists()  # no server was started


def test_a_missing_config_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--config", "/nonexistent/qos.yaml"]) == 2
    err = capsys.readouterr().err
    assert "config file not found" in err and "Traceback" not in err


def test_the_readiness_probe_ignores_an_http_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"groups": {"short": {"live_workers": 1}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # A proxy that is not there, set before the launcher starts: through it, no answer.
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        fresh = importlib.reload(launcher)
        got = fresh._health(f"http://127.0.0.1:{server.server_port}/health")
        assert fresh._live_workers(got) == {"short": 1}
    finally:
        server.shutdown()
        monkeypatch.undo()
        importlib.reload(launcher)


def test_qosserve_config_takes_help_a_flag_or_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from common import cli

    path = tmp_path / "qos.yaml"
    path.write_text("gateway: {port: 9001}\n")
    for argv in (["config", "--config", str(path)], ["config", str(path)]):
        assert cli.main(argv) == 0
        assert "port: 9001" in capsys.readouterr().out
    with pytest.raises(SystemExit) as help_exit:
        cli.main(["config", "--help"])
    assert help_exit.value.code == 0 and "effective configuration" in capsys.readouterr().out
    assert cli.main(["config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "config file not found" in err and "Traceback" not in err


def test_a_port_the_last_run_left_in_time_wait_is_free_and_port_0_picks_one(
    tmp_path: Path,
) -> None:
    # A connection closed from the server side leaves the server's port in TIME_WAIT, as the
    # readiness probes of the last `qosserve up` do.
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side waits
    client.close()
    server.close()
    assert not port_in_use("127.0.0.1", port)
    got = settings(tmp_path, "gateway: {port: 0}\n", [])
    assert got.port > 0


def test_workers_sharing_a_gpu_split_its_memory_and_a_configured_share_is_kept(
    tmp_path: Path,
) -> None:
    """Two workers on one GPU with the per-worker default (0.9) would each size a KV cache
    to nearly the whole device: the first takes it, the second fails to start."""
    plain = load_config(None)
    assert launcher.gpu_share_env(plain, "cuda", 2) == {
        "QOS_WORKER__GPU_MEMORY_UTILIZATION": "0.4500"
    }
    assert launcher.gpu_share_env(plain, "auto", 3)["QOS_WORKER__GPU_MEMORY_UTILIZATION"] == (
        "0.3000"
    )
    assert launcher.gpu_share_env(plain, "cpu", 2) == {}
    assert launcher.gpu_share_env(plain, "cuda", 1) == {}
    for setting in ("gpu_memory_utilization: 0.8", "kv_cache_gib: 12"):
        path = tmp_path / "qos.yaml"
        path.write_text(f"worker:\n  {setting}\n")
        assert launcher.gpu_share_env(load_config(str(path)), "cuda", 2) == {}


def test_qosserve_config_prints_no_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It dumped the passwords, tokens and webhook URL as they were."""
    from common import cli

    monkeypatch.setenv("QOS_NATS__PASSWORD", "nats-secret-1")
    monkeypatch.setenv("QOS_REDIS__URL", "redis://:redis-secret-2@cache:6379/0")
    monkeypatch.setenv("QOS_SCHEDULER__ALERT_WEBHOOK_URL", "https://hooks.example/T0/secret-3")
    path = tmp_path / "qos.yaml"
    # Cluster seeds, each with its credentials: the second one's went through.
    path.write_text(
        "nats: {token: tok-secret-4, url: 'nats://u:nats-secret-5@nats:4222,"
        "nats://u:nats-secret-6@nats-b:4222,nats://tok-secret-7@nats-c:4222'}\n"
    )
    assert cli.main(["config", str(path)]) == 0
    out = capsys.readouterr().out
    for secret in ("nats-secret-1", "redis-secret-2", "secret-3", "tok-secret-4", "nats-secret-5",
                   "nats-secret-6", "tok-secret-7"):  # fmt: skip
        assert secret not in out
    assert "nats-b:4222" in out and "nats-c:4222" in out
    assert "password: '***'" in out and "cache:6379" in out  # the rest still shows


def test_qosserve_config_changed_prints_only_what_was_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full dump names every key; fed back to `qosserve up` as a file, every key read
    as chosen (the demo's CPU device, Redis tier and GPU share stopped applying)."""
    import yaml

    from common import cli

    monkeypatch.setenv("QOS_GATEWAY__PORT", "9002")
    assert cli.main(["config", "--changed"]) == 0
    changed = yaml.safe_load(capsys.readouterr().out)
    assert changed == {"gateway": {"port": 9002}}
    path = tmp_path / "kept.yaml"
    path.write_text(yaml.safe_dump(changed))
    monkeypatch.delenv("QOS_GATEWAY__PORT")
    config = load_config(str(path))
    assert config.worker.model_fields_set == set()  # the launcher's demo choices still apply
    assert cli.main(["config"]) == 0
    assert capsys.readouterr().out.startswith("# Every key")
    # With a secret set, what --changed prints does not load back as it was: it says so.
    monkeypatch.setenv("QOS_NATS__PASSWORD", "nats-secret-8")
    assert cli.main(["config", "--changed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Secrets show as ***") and "nats-secret-8" not in out


def test_an_address_the_machine_lacks_or_a_port_out_of_range_is_said_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both read "port 8000 in use (another qosserve up?)", or a traceback."""
    argv = ["--host", "10.255.255.1", "--port", "8123", "--state-dir", str(tmp_path)]
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 10.255.255.1:8123" in err and "in use" not in err
    with pytest.raises(SystemExit) as bad:
        launcher.main(["--port", "70000"])
    assert bad.value.code == 2 and "not a TCP port" in capsys.readouterr().err


def test_a_taken_scheduler_metrics_port_is_one_line_naming_it() -> None:
    from common.errors import ConfigError
    from scheduler.metrics import SchedulerMetrics

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"scheduler.metrics_port {port}"):
            SchedulerMetrics().serve(port)


def test_a_deployment_config_s_tls_and_credentials_do_not_reach_the_local_servers(
    tmp_path: Path,
) -> None:
    """`qosserve up --config prod.yaml` starts its own plain, open nats-server and
    redis-server: the file's TLS and credentials made every child fail at start (a CA file
    with the local redis:// URL is refused, TLS against a plain NATS never connects)."""
    from common.config import load_config
    from common.launcher import LOCAL_SERVERS_OPEN

    prod = tmp_path / "prod.yaml"
    prod.write_text(
        "nats: {url: tls://nats:4222, user: qos-gateway, password: pw, tls_ca_file: /ca.pem,"
        " tls_handshake_first: true, token: t, replicas: 3}\n"
        "redis: {url: 'rediss://r:6380/0', username: u, password: pw, tls_ca_file: /ca.pem,"
        " tls_cert_file: /c.pem, tls_key_file: /k.pem}\n"
    )
    local = {"QOS_NATS__URL": "nats://127.0.0.1:4222", "QOS_REDIS__URL": "redis://127.0.0.1:6379/0"}
    with pytest.raises(ConfigError, match="rediss://"):
        load_config(prod, env=local)  # what the children loaded before
    cfg = load_config(prod, env=local | LOCAL_SERVERS_OPEN)
    assert (cfg.nats.user, cfg.nats.tls_ca_file, cfg.nats.tls_handshake_first) == (
        None,
        None,
        False,
    )
    assert not cfg.nats.password and not cfg.nats.token
    assert (cfg.redis.username, cfg.redis.tls_ca_file, cfg.redis.password) == (None, None, "")
    assert (cfg.redis.tls_cert_file, cfg.redis.tls_key_file) == (None, None)
    assert cfg.nats.replicas == 1  # a single local server refuses a cluster's stream replicas


def test_the_stacks_ports_never_collide_with_the_gateways_or_each_other() -> None:
    """`--port 9300` (or 4222, 6379): the port was free when each server was placed, so
    the scheduler took it first and the gateway, binding last, failed."""
    from common.launcher import _port_or_free

    for gateway in (9300, 4222, 6379):
        taken = {gateway}
        chosen = [_port_or_free(p, taken) for p in (4222, 6379, 9300)]
        assert len({gateway, *chosen}) == 4, (gateway, chosen)


def test_a_bad_flag_or_replica_count_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device gpu started NATS, Redis, the scheduler, the gateway and every worker, which
    each exited 2; --replicas short=x exited 1 with no prefix."""
    for flags in (["--device", "gpu"], ["--replicas", "short=x"]):
        state = tmp_path / flags[0].strip("-")
        argv = [*flags, "--engine", "sim", "--port", "0", "--state-dir", str(state)]
        assert launcher.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("qosserve up: ") and len(err.splitlines()) == 1, err
        assert not (state / "nats").exists()  # nothing started


def test_a_dead_childs_log_tail_is_this_runs_not_an_earlier_ones(tmp_path: Path) -> None:
    """Logs are appended to across runs: a failed start printed the previous run's errors
    (already fixed) before its own."""
    import os
    import sys
    import time

    from common.services import log_tail

    log_path = tmp_path / "worker.log"
    log_path.write_text("an earlier run's error\n" * 20)
    child = launcher.Child(
        "worker", [sys.executable, "-c", "print('this run: bad model')"], log_path
    )
    child.start(dict(os.environ))
    assert child.proc is not None and child.proc.wait(10) == 0
    time.sleep(0.05)
    assert log_tail(child.log_path, child.log_start, 15) == "this run: bad model"
    assert log_tail(tmp_path / "none.log") == "(no log)"


@pytest.mark.parametrize("folder", ["nowhere", "empty"])
def test_a_model_folder_that_is_not_one_is_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], folder: str
) -> None:
    """The whole stack used to start, NATS, Redis, scheduler and three workers, before a
    worker's log said the folder was missing."""
    (tmp_path / "empty").mkdir()
    code = launcher.main(["--model", str(tmp_path / folder), "--port", "0",
                          "--state-dir", str(tmp_path / "state")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert ("no such folder" if folder == "nowhere" else "needs config.json") in err
    assert not (tmp_path / "state" / "nats").exists()


def test_saying_something_to_a_closed_stdout_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`qosserve up | tee up.log`, then Ctrl-C: tee dies too, and the shutdown's first line
    raised BrokenPipeError, skipping the drain and the servers' stop. The shutdown speaks
    only through :func:`launcher._say` (checked below), which swallows it."""

    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError

        def flush(self) -> None:
            raise BrokenPipeError

    monkeypatch.setattr("sys.stdout", Closed())
    launcher._say("stopping …")  # says nothing, raises nothing
    import inspect

    assert "print(" not in inspect.getsource(launcher._shutdown)


def test_the_local_redis_is_bounded_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    """qosserve up's Redis had no maxmemory: the KV tier writes every full block through
    with an hour's TTL, and it grew until the host ran out of memory."""
    import redis as redis_client

    from common.launcher import _parse_args, local_redis
    from common.services import free_port

    assert _parse_args([]).redis_maxmemory == "2gb"
    server = local_redis(free_port(), tmp_path / "redis", _parse_args(["--redis-maxmemory",
                                                                       "64MB"]).redis_maxmemory)  # fmt: skip
    server.start()
    try:
        client = redis_client.Redis.from_url(server.url)
        assert client.config_get("maxmemory")["maxmemory"] == str(64 << 20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        client.close()
    finally:
        server.stop()
    with pytest.raises(SystemExit):
        _parse_args(["--redis-maxmemory", "lots"])


class _Recorded:
    """A child that records what the shutdown asked of it, in one shared log."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self._log = name, log

    def terminate(self) -> None:
        self._log.append(f"terminate {self.name}")

    def wait_or_kill(self, deadline: float) -> None:
        self._log.append(f"wait {self.name}")


def test_the_scheduler_stops_after_the_workers_have_drained() -> None:
    """It was told to stop with the workers: it could read their drain as a group's
    outage (the docstring already said "then the scheduler")."""
    log: list[str] = []
    names = ["scheduler", "worker short-1", "worker long-1", "gateway"]
    launcher._shutdown([_Recorded(n, log) for n in names], 1.0)  # type: ignore[list-item]
    assert log == [
        "terminate gateway", "wait gateway",
        "terminate worker short-1", "terminate worker long-1",
        "wait worker short-1", "wait worker long-1",
        "terminate scheduler", "wait scheduler",
    ]  # fmt: skip


class _Running:
    running = True
    alive = True


def test_not_ready_in_time_names_what_it_waits_for_and_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slow first load ended with "not ready after 180s; see the logs": nothing said which
    group lagged, whether the gateway answered, or that --ready-timeout exists."""
    health = {"groups": {"short": {"live_workers": 1}, "long": {"live_workers": 0}}}
    monkeypatch.setattr(launcher, "_health", lambda url: health)
    args = launcher._parse_args(["--ready-timeout", "0.2"])
    code = launcher._wait_ready(
        args, "http://127.0.0.1:1", {"short": 1, "long": 1}, [_Running()],  # type: ignore[list-item]
        (_Running(), _Running()), threading.Event(), Path("/tmp/logs"),  # type: ignore[arg-type]
        keyed=False, served="m",
    )  # fmt: skip
    said = capsys.readouterr().out
    assert code == 1
    assert "no live worker yet in long" in said and "--ready-timeout" in said
    monkeypatch.setattr(launcher, "_health", lambda url: None)
    launcher._wait_ready(
        args, "http://127.0.0.1:1", {"short": 1}, [],
        (_Running(), _Running()), threading.Event(), Path("/tmp/logs"),  # type: ignore[arg-type]
        keyed=False, served="m",
    )  # fmt: skip
    assert "the gateway never answered /health" in capsys.readouterr().out


def test_the_ready_line_with_api_keys_prints_a_curl_that_sends_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher._print_ready("http://127.0.0.1:8000", "m", 1.0, keyed=True)
    said = capsys.readouterr().out
    assert "Authorization: Bearer $QOSSERVE_API_KEY" in said and "API keys are configured" in said
    # The variable the user is told to export: a QOS_* one would be read as a configuration
    # key by every later qosserve command, and refused as an unknown one.
    (variable,) = set(re.findall(r"\$(\w+)", said)) | set(re.findall(r"set (\w+) to", said))
    load_config(env={variable: "sk-local"})
    launcher._print_ready("http://127.0.0.1:8000", "m", 1.0)
    assert "Authorization" not in capsys.readouterr().out


def test_local_workers_take_free_metrics_ports_whatever_the_config_pins(tmp_path: Path) -> None:
    """Every local worker shares one machine: a worker.metrics_port from --config (the
    Kubernetes ConfigMap's 9400) left all but the first without /metrics."""
    from workers.__main__ import _apply_flags, build_parser

    pinned = tmp_path / "qos.yaml"
    pinned.write_text("worker: {metrics_port: 9400}\n")
    ports = set()
    for i in range(2):
        argv = launcher.worker_argv("python", "short", "demo", "sim", f"up-short-{i}", "cpu")
        assert argv[:3] == ["python", "-m", "workers"]
        args = build_parser().parse_args(argv[3:])
        ports.add(_apply_flags(load_config(pinned, env={}), args).worker.metrics_port)
    assert ports == {0}  # a free port each, put in its heartbeat


def test_an_up_stack_waits_out_the_launchers_ordered_stop_before_killing_it() -> None:
    """A SIGKILL before the gateway's grace, the workers' drain and the servers' stop are
    over cuts the drains short (a fixed 60 s did, with a 60 s gateway grace alone)."""
    from bench.up_stack import UpStack

    for grace, env in ((None, {}), (120.0, {}), (90.0, {"QOS_GATEWAY__SHUTDOWN_GRACE_S": "90"})):
        config = {"gateway": {"shutdown_grace_s": grace}} if grace == 120.0 else None
        stack = UpStack(config=config, env=env)
        try:
            gateway = grace or load_config(env={}).gateway.shutdown_grace_s
            worst = launcher.shutdown_time_s(gateway)
            assert worst >= gateway + launcher.WORKER_GRACE_S + 2 * launcher.SERVER_STOP_S
            assert stack.stop_timeout_s > worst
        finally:
            stack.stop()


def test_children_import_the_installed_packages_whatever_folder_the_stack_starts_in(
    tmp_path: Path,
) -> None:
    """``python -m scheduler`` puts the working folder first on the import path: started from
    a project with a ``common/`` package of its own, every child imported that one and died
    with a traceback while NATS and Redis were already up."""
    import os
    import subprocess
    import sys

    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "config.py").write_text("# another project's\n")
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**base, **launcher.child_python(base)}
    done = subprocess.run([sys.executable, "-m", "scheduler", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("model", ["dummy:tinyy", "quantized"])
def test_a_model_the_engine_cannot_serve_is_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """Only the spec's form was checked: the stack started (NATS, Redis, scheduler, workers,
    gateway), every worker died on the typo or the quantized checkpoint, and up said 1."""
    if model == "quantized":
        folder = tmp_path / "quantized"
        folder.mkdir()
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "quantization_config": {"quant_method": "awq"}}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        model = str(folder)
    code = launcher.main(["--model", model, "--port", "0",
                          "--state-dir", str(tmp_path / "state")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "unknown dummy model" in err or "quantized checkpoints" in err
    assert not (tmp_path / "state" / "nats").exists()  # no server was started


def test_a_standalone_gateway_on_a_busy_port_is_one_line_before_it_reaches_nats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """uvicorn binds only after the app's start-up (NATS, streams), then exits 3 with a log
    line: the same mistake was rc 2 and one line from ``qosserve up``."""
    from gateway.__main__ import main as gateway_main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # No NATS at this URL: reaching for it would fail differently (rc 1).
        code = gateway_main(["--port", str(port), "--host", "127.0.0.1"])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port}" in err and "Traceback" not in err
