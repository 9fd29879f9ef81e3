"""The stack ``bench/serve.py --launch`` starts on loopback, and what it reads off the machine.

:class:`LocalStack`: a nats-server (JetStream in a temp folder), ``--replicas`` worker
processes of one group (``python -m workers``, sim or real engine) and one gateway process
(``python -m gateway``, uvicorn + uvloop), each its own process so the load generator
never shares an event loop with what it measures. A sim stack without ``--model`` gets a
word-level tokenizer written here, whose every token decodes to a whole word: each sim
token streams as its own text delta, as a real model's mostly do, so TTFT and ITL are
measured per token rather than per held-back byte sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.provenance import git_state
from common.config import NatsConfig, default_groups
from common.models import resolve_model, served_name
from common.services import NatsServer, die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
WORD_VOCAB = 1024
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]
READY_TIMEOUT_S = 180.0


def write_word_tokenizer(folder: Path, vocab_size: int = WORD_VOCAB) -> Path:
    """A Hugging Face tokenizer folder: ``<s>`` + whitespace-split words ``w4 … w<n-1>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux ``/proc``); -1 if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_info() -> dict[str, object]:
    """Cores and load average (the load generator and the stack share the same cores), and
    the code that ran: results are compared across commits."""
    return {
        "cores": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git_state(),
    }


class LocalStack:
    """nats-server, workers and a gateway for ``bench/serve.py``'s parsed arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.group = args.group or "short"  # routing by length sends short requests here
        self.dir = Path(tempfile.mkdtemp(prefix="qos-bench-serve-"))
        self.nats = NatsServer(store_dir=self.dir / "nats")
        self.port = free_port()
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.metrics_ports: dict[str, int] = {}  # worker name -> its /metrics port
        self.max_batch = default_groups()[self.group].max_batch
        if args.launch == "sim":
            self.model = args.model or str(write_word_tokenizer(self.dir / "sim-words"))
        else:
            self.model = resolve_model(args.model or "demo")
        self.model_name = served_name(self.model)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def nats_config(self) -> NatsConfig:
        """What a NATS-native client of this stack connects with (default names)."""
        return NatsConfig(url=self.nats.url)

    @property
    def gateway_pid(self) -> int | None:
        child = self.children.get("gateway")
        return child.pid if child is not None else None

    async def start(self) -> None:
        """Start everything and wait until the gateway sees every replica live."""
        await asyncio.to_thread(self.nats.start)
        config = self.dir / "qos.yaml"
        settings = {"nats": {"url": self.nats.url}, "worker": {"telemetry_interval_s": 0.5}}
        config.write_text(yaml.safe_dump(settings))
        a, group = self.args, self.group
        for i in range(a.replicas):
            self.metrics_ports[f"worker-{i}"] = free_port()
            argv = flags(
                config=config,
                group=group,
                engine=a.launch,
                model=self.model,
                worker_id=f"bench-{group}-{i}",
                metrics_port=self.metrics_ports[f"worker-{i}"],
            )
            if a.launch == "sim":
                argv += flags(
                    sim_base_ms=a.sim_base_ms,
                    sim_prefill_us_per_token=a.sim_prefill_us_per_token,
                    sim_decode_us_per_seq=a.sim_decode_us_per_seq,
                )
            else:
                argv += flags(device=a.device)
            self._spawn(f"worker-{i}", "workers", argv)
        gateway = flags(config=config, model=self.model, port=self.port, log_level="warning")
        self._spawn("gateway", "gateway", gateway)
        await self._wait_ready()

    def _spawn(self, name: str, module: str, argv: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with (self.dir / f"{name}.log").open("wb") as log:
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(os.getpid()),
            )

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                for name, child in self.children.items():
                    if child.poll() is not None:
                        raise RuntimeError(f"{name} exited {child.returncode}:\n{self.log(name)}")
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    health = (await client.get(f"{self.url}/health")).json()
                    if health["groups"][self.group]["live_workers"] >= self.args.replicas:
                        return
                await asyncio.sleep(0.1)
        raise TimeoutError(
            f"the stack was not ready after {READY_TIMEOUT_S:.0f}s (logs: {self.dir})"
        )

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each process of the stack has used so far, nats-server included."""
        pids = {name: child.pid for name, child in self.children.items()}
        if self.nats.pid is not None:
            pids["nats-server"] = self.nats.pid
        return {name: cpu_seconds(pid) for name, pid in pids.items()}

    def metrics_urls(self) -> dict[str, str]:
        """Where each process of the stack serves ``/metrics``."""
        urls = {"gateway": f"{self.url}/metrics"}
        urls.update((n, f"http://127.0.0.1:{p}/metrics") for n, p in self.metrics_ports.items())
        return urls

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    async def stop(self) -> None:
        """Gateway first, then the workers drain, then nats-server; the temp folder goes."""
        gateway = self.children.get("gateway")
        await _terminate([gateway] if gateway else [])
        await _terminate([c for name, c in self.children.items() if name != "gateway"])
        await asyncio.to_thread(self.nats.stop)
        shutil.rmtree(self.dir, ignore_errors=True)


def flags(**values: object) -> list[str]:
    """``flags(worker_id=3)`` → ``["--worker-id", "3"]``."""
    return [item for k, v in values.items() for item in (f"--{k.replace('_', '-')}", str(v))]


async def _terminate(children: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM (a graceful drain), then SIGKILL whoever outlives ``grace_s``."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            await asyncio.to_thread(child.wait, grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            await asyncio.to_thread(child.wait)
