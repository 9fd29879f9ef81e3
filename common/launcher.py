"""``qosserve up``: the whole stack on one machine, for a first look and for demos.

Starts a real ``nats-server`` (JetStream, data under the state folder) and ``redis-server``,
one worker process per replica of each instance group, the scheduler and the gateway;
prints what runs where, waits until every group has a live worker, and on Ctrl-C (or
SIGTERM, or SIGHUP: a closed terminal) stops everything — gateway first, workers drained,
servers last — leaving no orphan process. Killed outright (SIGKILL), it can do none of
that: on Linux its children are tied to it with PR_SET_PDEATHSIG and die with it (no
drain); elsewhere they outlive it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.config import Config, load_config, with_settings
from common.errors import ConfigError
from common.models import check_model_folder, resolve_model, served_name
from common.services import (
    NatsServer,
    RedisServer,
    ServerStartError,
    die_with_parent,
    free_port,
    log_tail,
    port_in_use,
)

log = logging.getLogger("qosserve.up")


@dataclass
class Child:
    """One service process started by the launcher."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    log_start: int = 0  # where this run's lines begin in the (appended) log

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.log_start = out.tell()
            self.proc = subprocess.Popen(
                self.argv,
                env={**env, **self.extra_env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(os.getpid()) if sys.platform == "linux" else None,
                # Out of the terminal's process group: Ctrl-C reaches only the launcher,
                # which stops the children in order.
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def child_python(env: Mapping[str, str]) -> dict[str, str]:
    """How a child's Python finds qosserve: every child runs ``python -m <package>``, which
    puts the working folder first on the import path, and started from a project with its
    own ``common/`` (or ``gateway/``...) each child imported that one and died with a
    traceback. Safe path, then this launcher's own package root first on ``PYTHONPATH``:
    the children import the code the launcher runs, installed or a bare checkout."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", "PYTHONPATH": path}


def parse_replicas(text: str, config: Config) -> dict[str, int]:
    """``"short=2,long=1"`` → per-group counts; groups not named get one replica."""
    counts = dict.fromkeys(config.groups, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in config.groups:
            raise ConfigError(
                f"--replicas: unknown group {name!r} (groups: {', '.join(config.groups)})"
            )
        if not value.isdigit():
            raise ConfigError(f"--replicas: {part!r} must look like group=count")
        counts[name] = int(value)
    return counts


def _redis_memory(value: str) -> str:
    """A Redis memory size (``512mb``, ``2gb``, bytes): what ``maxmemory`` accepts."""
    if not re.fullmatch(r"[1-9][0-9]*(?:[kmg]b?)?", value.strip().lower()):
        raise argparse.ArgumentTypeError(f"{value!r} is no memory size (say 512mb or 2gb)")
    return value.strip().lower()


def local_redis(port: int, state_dir: Path, maxmemory: str) -> RedisServer:
    """The local stack's redis-server, bounded as compose's is: every full KV block is
    written through with an hour's TTL (a few GB a minute on a GPU), and an unbounded
    Redis grew until the host ran out; past ``maxmemory`` the least recently used go."""
    return RedisServer(
        port=port,
        state_dir=state_dir,
        extra_config=f"maxmemory {maxmemory}\nmaxmemory-policy allkeys-lru",
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qosserve up", description=__doc__.split("\n\n")[0])
    # A flag given wins; otherwise the config (file, then QOS_* env) decides, as in every
    # service, and only what it leaves unset falls back to the local demo's choice.
    p.add_argument("--config", help="YAML config file (defaults + QOS_* env otherwise)")
    p.add_argument(
        "--model", help="HF folder, dummy:<shape>, or 'demo' (default: worker.model, 'demo')"
    )
    p.add_argument(
        "--device", help="cpu, cuda or auto (default: worker.device if configured, else cpu)"
    )
    p.add_argument(
        "--engine", default="real", choices=["real", "sim"],
        help="worker engine: the project's engine, or a simulated one (default: real)",
    )  # fmt: skip
    p.add_argument(
        "--replicas", default="", help="per-group replicas, e.g. short=2,long=1 (default: 1 each)"
    )
    p.add_argument("--host", help="gateway address (default: gateway.host, 127.0.0.1)")
    p.add_argument("--port", type=_tcp_port, help="gateway port (default: gateway.port, 8000)")
    p.add_argument("--state-dir", default=".qosserve", help="NATS store, logs (default .qosserve)")
    p.add_argument("--no-scheduler", action="store_true", help="do not start the scheduler")
    p.add_argument(
        "--redis-maxmemory",
        type=_redis_memory,
        default="2gb",
        help="the local Redis KV tier's memory limit, least recently used blocks evicted "
        "past it (default: 2gb, as the compose file; every full KV block is written through)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for readiness (default: 180)",
    )
    return p.parse_args(argv)


# The local stack's own nats-server and redis-server take no credentials and speak no TLS:
# a deployment's settings for them (a file passed with --config) made every child fail.
LOCAL_SERVERS_OPEN = {
    **{f"QOS_NATS__{key}": "null" for key in ("USER", "CREDS_FILE", "NKEY_SEED_FILE",
                                               "TLS_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE")},
    "QOS_NATS__PASSWORD": "",  # secrets are taken as written: "" is unset
    "QOS_NATS__TOKEN": "",
    "QOS_NATS__TLS_HANDSHAKE_FIRST": "false",
    "QOS_REDIS__USERNAME": "null",
    "QOS_REDIS__PASSWORD": "",
    "QOS_REDIS__TLS_CA_FILE": "null",
    "QOS_REDIS__TLS_CERT_FILE": "null",
    "QOS_REDIS__TLS_KEY_FILE": "null",
    # One local server: a deployment's stream replicas (3 for a cluster) are refused by it.
    "QOS_NATS__REPLICAS": "1",
}  # fmt: skip


def _tcp_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def _port_or_free(preferred: int, taken: set[int]) -> int:
    """``preferred`` if it is free and not ``taken`` by another of the stack's servers
    (the gateway binds its port last: `--port 9300` went to the scheduler first), else a
    free one; the port chosen joins ``taken``."""
    import socket

    port = preferred
    with socket.socket() as sock:
        try:
            if preferred in taken:
                raise OSError
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            port = free_port()
            while port in taken:
                port = free_port()
    taken.add(port)
    return port


def _say(text: str) -> None:
    """Print a line of the launcher's; a closed stdout (`qosserve up | tee` stopped by the
    same Ctrl-C) must not cut the ordered shutdown short."""
    with contextlib.suppress(OSError):
        print(text, flush=True)


# Straight to the gateway: an http_proxy in the environment must not carry a loopback probe.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _health(url: str) -> dict | None:
    try:
        with _DIRECT.open(url, timeout=1.0) as resp:
            return json.loads(resp.read())
    except Exception:
        return None


def _nvidia_gpu_present() -> bool:
    """An NVIDIA driver is loaded: a hint, read without importing torch into the launcher
    (seconds of start-up for one line of advice)."""
    return Path("/proc/driver/nvidia/version").exists()


def _live_workers(health: dict | None) -> dict[str, int]:
    if not health:
        return {}
    groups = health.get("groups") or {}
    return {g: int((info or {}).get("live_workers", 0)) for g, info in groups.items()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, ServerStartError, OSError) as exc:
        # One line, as the services print theirs: the message already says what to do.
        print(f"qosserve up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the servers start, before its handler is in
        print("qosserve up: interrupted", file=sys.stderr)
        return 130


@dataclass(frozen=True)
class Settings:
    """What the stack runs: a flag given wins, then the config (file, then ``QOS_*`` env),
    then the local demo's choice for what neither names (CPU, not ``auto``)."""

    model: str
    device: str
    host: str
    port: int
    served_model_name: str

    @classmethod
    def of(cls, args: argparse.Namespace, config: Config) -> Settings:
        worker_set = config.worker.model_fields_set  # what the file or QOS_* env named
        model = args.model or config.worker.model
        named = args.model is None and config.gateway.served_model_name
        return cls(
            model=model,
            device=args.device or (config.worker.device if "device" in worker_set else "cpu"),
            host=args.host or config.gateway.host,
            # 0 (the config's "pick one") becomes a free port here: the launcher probes it.
            port=(config.gateway.port if args.port is None else args.port) or free_port(),
            served_model_name=named or served_name(model),
        )


def gpu_share_env(config: Config, device: str, workers: int) -> dict[str, str]:
    """Every worker of the local stack runs on the same device: on a GPU, each takes an
    equal part of the default 0.9 of its memory (one alone would size its KV cache to
    nearly all of it and leave the next nothing). What the config sets is kept."""
    chosen = config.worker.model_fields_set & {"gpu_memory_utilization", "kv_cache_gib"}
    if device == "cpu" or workers < 2 or chosen:
        return {}
    share = config.worker.gpu_memory_utilization / workers
    return {"QOS_WORKER__GPU_MEMORY_UTILIZATION": f"{share:.4f}"}


def worker_argv(
    python: str, group: str, model: str, engine: str, worker_id: str, device: str
) -> list[str]:
    """The command line of one local worker. ``--metrics-port 0``: every worker of the
    stack shares this machine, so each takes a free port (put in its heartbeat, where
    workers.scrape_targets finds it); a port pinned by --config (the Kubernetes ConfigMap's
    9400) left every worker after the first without /metrics."""
    return [
        python, "-m", "workers", "--group", group, "--model", model, "--engine", engine,
        "--worker-id", worker_id, "--device", device, "--metrics-port", "0",
    ]  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    replicas = parse_replicas(args.replicas, config)
    settings = Settings.of(args, config)
    model_name, device, host, port = settings.model, settings.device, settings.host, settings.port
    # A bad flag is one line before anything starts, not a stack whose workers all exit 2.
    with_settings(config, "flags", worker={"device": device})
    served = settings.served_model_name
    if port_in_use(host, port):
        raise ConfigError(
            f"the gateway's port {port} on {host} is in use (another `qosserve up`?); "
            "stop it, or pass --port and a --state-dir of its own"
        )
    model = model_name if args.engine == "sim" else resolve_model(model_name)
    if args.engine != "sim":
        check_model_folder(model)
    state = Path(args.state_dir).resolve()
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    taken = {port}
    nats = NatsServer(
        port=_port_or_free(4222, taken),
        store_dir=state / "nats",
        max_payload=config.nats.max_payload_bytes,
    )  # the services' own limit
    redis = local_redis(_port_or_free(6379, taken), state / "redis", args.redis_maxmemory)
    nats.own_session = redis.own_session = True
    print(f"starting nats-server and redis-server (state in {state}) …", flush=True)
    nats.start()
    try:
        redis.start()
    except BaseException:
        nats.stop()
        raise

    env = dict(os.environ)
    env.update(
        QOS_NATS__URL=nats.url,
        QOS_REDIS__URL=redis.url,
        **LOCAL_SERVERS_OPEN,
        **child_python(env),
        # Several torch processes share the cores: one thread each avoids oversubscription.
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    if "kv_redis" not in config.worker.model_fields_set:  # the local stack shares its Redis
        env["QOS_WORKER__KV_REDIS"] = "true"
    if "metrics_port" not in config.scheduler.model_fields_set:
        # 9300 may be taken (another stack, Elasticsearch's transport port): the scheduler
        # then died at start and took the whole stack down with it.
        env["QOS_SCHEDULER__METRICS_PORT"] = str(_port_or_free(9300, taken))
    env.update(gpu_share_env(config, device, sum(replicas.values())))
    if args.config:
        env["QOS_CONFIG"] = str(Path(args.config).resolve())
    try:  # what every child will load: a bad combination is one line now, not N crashes
        load_config(args.config, env)
    except ConfigError:
        redis.stop()
        nats.stop()
        raise
    py = sys.executable
    children: list[Child] = []
    if not args.no_scheduler:
        children.append(Child("scheduler", [py, "-m", "scheduler"], logs / "scheduler.log"))
    for group, count in replicas.items():
        for i in range(count):
            worker_id = f"up-{group}-{i}"
            argv_w = worker_argv(py, group, model, args.engine, worker_id, device)
            children.append(Child(f"worker {worker_id}", argv_w, logs / f"worker-{worker_id}.log"))
    gateway_argv = [
        py,
        "-m",
        "gateway",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served,
    ]
    children.append(Child("gateway", gateway_argv, logs / "gateway.log"))

    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():  # a second Ctrl-C: no more waiting for drains
            _say("killing …")
            for child in children:
                if child.alive:
                    assert child.proc is not None
                    child.proc.kill()
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)  # the terminal closed, the ssh session dropped
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        # Inside the try: a child that cannot start, or a stdout closed under us
        # (`qosserve up | head`), still stops what did start, in order.
        for child in children:
            child.start(env)
        _say(f"  nats-server   {nats.url}  (monitor {nats.monitor_url}, log {nats.log_path})")
        _say(f"  redis-server  {redis.url}  (log {redis.log_path})")
        for child in children:
            pid = child.proc.pid if child.proc else "-"
            _say(f"  {child.name:<22} pid {pid:<7} log {child.log_path}")
        metrics_port = env.get("QOS_SCHEDULER__METRICS_PORT", str(config.scheduler.metrics_port))
        if not args.no_scheduler and metrics_port != "0":  # it moves when 9300 is taken
            _say(f"  scheduler metrics http://127.0.0.1:{metrics_port}/metrics")
        _say(f"  model {served} ({model_name}) on {device}, {args.engine} engine")
        if device == "cpu" and args.engine == "real" and _nvidia_gpu_present():
            _say("  (a GPU is present: pass --device cuda to use it)")
        _say(f"waiting for the gateway on {base} and a live worker in every group …")
        return _wait_ready(
            args, base, replicas, children, (nats, redis), stop, logs,
            keyed=bool(config.gateway.api_key_sha256), served=served,
        )  # fmt: skip
    finally:
        grace = config.gateway.shutdown_grace_s
        _say(f"stopping … (open requests get up to {grace:.0f}s to finish; Ctrl-C again to "
             "stop at once)")  # fmt: skip
        _shutdown(children, grace)
        nats.stop(SERVER_STOP_S)
        redis.stop(SERVER_STOP_S)
        _say("stopped.")


# While waiting for readiness: a line this often even when nothing changed, so a slow model
# load reads as progress, not a hang.
PROGRESS_EVERY_S = 15.0


def _wait_ready(
    args: argparse.Namespace,
    base: str,
    replicas: dict[str, int],
    children: list[Child],
    servers: tuple[NatsServer, RedisServer],
    stop: threading.Event,
    logs: Path,
    *,
    keyed: bool,
    served: str,
) -> int:
    """Watch the stack until ``stop``: report readiness once, and end (1) when a server or
    a child dies, or (1) when it is not ready within ``--ready-timeout``."""
    ready = False
    started = time.monotonic()
    last_report, last_said = "", started
    gateway_answered = False
    while not stop.is_set():
        for server in servers:
            if not server.running:
                _say(f"{server.binary_name} exited; last log lines:")
                _say(server.log_tail(15))
                return 1
        dead = [c for c in children if not c.alive]
        if dead:
            for c in dead:
                _say(f"{c.name} exited ({c.proc.returncode if c.proc else '?'}); last log lines:")
                _say(log_tail(c.log_path, c.log_start, 15))
            return 1
        if not ready:
            health = _health(f"{base}/health")
            gateway_answered = gateway_answered or health is not None
            live = _live_workers(health)
            waiting = [g for g, n in replicas.items() if n and live.get(g, 0) < 1]
            report = ", ".join(f"{g} {live.get(g, 0)}/{n}" for g, n in replicas.items() if n)
            now = time.monotonic()
            if report != last_report or now - last_said >= PROGRESS_EVERY_S:
                _say(f"  live workers: {report}  ({now - started:.0f}s)")
                last_report, last_said = report, now
            if live and not waiting:
                ready = True
                _print_ready(base, served, now - started, keyed)
            elif now - started > args.ready_timeout:
                why = (
                    f"no live worker yet in {', '.join(waiting)}"
                    if gateway_answered
                    else "the gateway never answered /health"
                )
                _say(
                    f"not ready after {args.ready_timeout:.0f}s ({why}); see the logs in {logs}, "
                    "or give a slow model load more time with --ready-timeout SECONDS"
                )
                return 1
        stop.wait(0.5)
    return 0


WORKER_GRACE_S = 30.0  # workers' --grace-s default: how long they drain on SIGTERM
# Past a child's own graceful period: its hand-back, last telemetry and flush get to run
# (killed at the same moment, the gateway lost its aborts and the workers their naks).
STOP_MARGIN_S = 5.0
SERVER_STOP_S = 10.0  # nats-server's and redis-server's SIGTERM, then SIGKILL after this


def shutdown_time_s(gateway_grace_s: float) -> float:
    """The longest the ordered stop (:func:`_shutdown`, then the two servers) may take
    with ``gateway.shutdown_grace_s`` = ``gateway_grace_s``: what a caller that SIGTERMs
    ``qosserve up`` must wait before a SIGKILL, which leaves the drains unfinished."""
    gateway = gateway_grace_s + STOP_MARGIN_S
    workers = WORKER_GRACE_S + STOP_MARGIN_S
    scheduler = STOP_MARGIN_S
    return gateway + workers + scheduler + 2 * SERVER_STOP_S


def _shutdown(children: list[Child], gateway_grace_s: float) -> None:
    """Gateway first (no new work), then workers drain, then the scheduler (which saw
    them leave: stopped with them, it could read their drain as a group's outage)."""
    gateways = [c for c in children if c.name == "gateway"]
    schedulers = [c for c in children if c.name == "scheduler"]
    workers = [c for c in children if c not in gateways and c not in schedulers]
    for child in gateways:
        child.terminate()
        child.wait_or_kill(time.monotonic() + gateway_grace_s + STOP_MARGIN_S)
    for child in workers:
        child.terminate()
    deadline = time.monotonic() + WORKER_GRACE_S + STOP_MARGIN_S
    for child in workers:
        child.wait_or_kill(deadline)
    for child in schedulers:
        child.terminate()
        child.wait_or_kill(time.monotonic() + STOP_MARGIN_S)


def _print_ready(base: str, model: str, took: float, keyed: bool = False) -> None:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is a stop-loss order?"}],
            "max_tokens": 64,
            "temperature": 0,
        }
    )
    auth = ' -H "Authorization: Bearer $QOSSERVE_API_KEY"' if keyed else ""
    _say(f"\nqosserve is up in {took:.1f}s — OpenAI API at {base}/v1  (Ctrl-C stops everything)\n")
    _say(
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{body}'\n"
    )
    if keyed:
        # Not QOS_API_KEY: every QOS_* variable is read as a configuration key, and an
        # unknown one stops every later qosserve command.
        _say("  (API keys are configured: set QOSSERVE_API_KEY to one of them first)\n")


if __name__ == "__main__":
    sys.exit(main())
