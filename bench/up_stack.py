"""A whole stack on loopback for benchmarks and tests: ``qosserve up`` in a child process.

``bench/serve.py``'s :class:`~bench.serve_stack.LocalStack` starts workers of one group; the
field mix (long documents, conversations, short generation) needs every group, so this runs
``common/launcher.py`` — nats-server, redis-server, one worker per group replica and the
gateway — with a config file of our own, and waits until every group that has replicas has
a live worker. Stopping sends SIGTERM, so the launcher drains workers and stops servers in
order; the launcher dies with this process (PR_SET_PDEATHSIG) and takes its children along.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from common.config import load_config
from common.launcher import STOP_MARGIN_S, shutdown_time_s
from common.services import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]


class UpStack:
    """``qosserve up --engine ENGINE`` with ``config`` (a dict written as YAML), on a free port.

    Real-engine workers run on ``device`` (``cpu`` unless asked: a test must not grab a GPU).
    """

    def __init__(
        self,
        *,
        engine: str = "sim",
        model: str = "demo",
        device: str = "cpu",
        config: dict[str, Any] | None = None,
        replicas: dict[str, int] | None = None,
        scheduler: bool = False,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 180.0,
    ) -> None:
        self.engine, self.model, self.device = engine, model, device
        self.replicas = replicas or {}
        self.scheduler = scheduler
        self.ready_timeout_s = ready_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="qos-upstack-"))
        self.config_path = self.dir / "qos.yaml"
        self.config_path.write_text(yaml.safe_dump(config or {}))
        self.port = free_port()
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.nats_url = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "launcher.log"

    def start(self) -> UpStack:
        """Start the launcher and wait until each group with replicas has a live worker."""
        argv = [sys.executable, "-m", "common.launcher", "--engine", self.engine]
        argv += ["--model", self.model, "--device", self.device, "--port", str(self.port)]
        argv += ["--config", str(self.config_path), "--state-dir", str(self.dir / "state")]
        argv += ["--ready-timeout", str(self.ready_timeout_s)]
        if self.replicas:
            argv += ["--replicas", ",".join(f"{g}={n}" for g, n in self.replicas.items())]
        if not self.scheduler:
            argv.append("--no-scheduler")
        # Our own QOS_* variables would be read as configuration keys by every child.
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.extra_env)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(os.getpid()),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"qosserve up exited {self.proc.returncode}:\n{self.log()}")
                try:
                    groups = client.get(f"{self.url}/health").json()["groups"]
                except (httpx.HTTPError, KeyError, ValueError):
                    groups = {}
                wanted = {g for g in groups if self.replicas.get(g, 1) > 0}
                if groups and all(groups[g]["live_workers"] >= 1 for g in wanted):
                    match = re.search(r"nats-server\s+(nats://\S+)", self.log())
                    self.nats_url = match[1] if match else ""
                    return
                time.sleep(0.25)
        raise TimeoutError(f"not ready after {self.ready_timeout_s:.0f}s:\n{self.log()}")

    def log(self, chars: int = 4000) -> str:
        """The launcher's output (its children log under ``state/logs``)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def child_log(self, name: str, chars: int = 4000) -> str:
        """A service's log, e.g. ``gateway`` or ``worker-up-short-0``."""
        path = self.dir / "state" / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    @property
    def stop_timeout_s(self) -> float:
        """How long :meth:`stop` waits for the launcher's ordered stop before a SIGKILL:
        its worst case for this stack's ``gateway.shutdown_grace_s`` (the gateway's grace,
        the workers' drain, the scheduler, nats-server and redis-server), plus a margin. A
        fixed 60 s killed it mid-drain (the gateway's grace alone may be 60 s)."""
        qos_env = {k: v for k, v in self.extra_env.items() if k.startswith("QOS_")}
        grace = load_config(self.config_path, env=qos_env).gateway.shutdown_grace_s
        return shutdown_time_s(grace) + STOP_MARGIN_S

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM: the launcher stops the gateway, drains workers, stops the servers;
        SIGKILL after ``timeout_s`` (default :attr:`stop_timeout_s`)."""
        if self.proc is not None and self.proc.poll() is None:
            if timeout_s is None:
                timeout_s = self.stop_timeout_s
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> UpStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
