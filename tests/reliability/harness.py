"""What the reliability tests share: configs, the sim's reference answers, and a streaming
client that says how each request ended.

Every request a test sends ends in one of three ways (:class:`Outcome`): ``complete`` (a
finish reason and ``[DONE]``), ``error`` (an HTTP error status or an SSE error event, both
in OpenAI's error shape) or ``lost`` (anything else: a stream cut short without an error,
a hang past the client's timeout). A fault may turn completions into errors; it must
never produce a lost request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from common.config import Config, GatewayConfig, GroupConfig, NatsConfig, WorkerConfig
from common.services import die_with_parent, free_port
from common.tokenizer import BaseTokenizer
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello world! how are you today?"
Kind = Literal["complete", "error", "lost"]


def group(
    max_batch: int = 4, *, max_pending: int = 64, max_seq_len: int = 256, **extra: Any
) -> GroupConfig:
    """A group with test-sized limits and SLOs a loaded CI machine can meet."""
    settings: dict[str, Any] = {
        "max_batch": max_batch, "max_seq_len": max_seq_len, "slo_ttft_ms": 2000,
        "slo_e2e_p99_ms": 10_000, "policy": "continuous" if max_batch == 1 else "hybrid",
        "max_pending": max_pending,
    }  # fmt: skip
    return GroupConfig(**{**settings, **extra})


def nats_for(url: str, tag: str, **overrides: Any) -> NatsConfig:
    """Names of their own (``tag``) on the server at ``url``; fast reconnects."""
    return NatsConfig(
        url=url, subject_prefix=f"r{tag}", stream=f"R_{tag}", kv_bucket=f"r_{tag}",
        connect_timeout_s=2.0, reconnect_wait_s=0.1, **overrides,
    )  # fmt: skip


def stack_config(
    nats: NatsConfig,
    groups: dict[str, GroupConfig],
    worker: dict[str, Any] | None = None,
    **gateway: Any,
) -> Config:
    gateway.setdefault("default_max_tokens", 16)
    return Config(
        nats=nats,
        groups=groups,
        gateway=GatewayConfig(**gateway),
        worker=WorkerConfig(telemetry_interval_s=0.2, coalesce_ms=2.0, **(worker or {})),
    )


def sim_engine(tokenizer: BaseTokenizer, max_batch: int = 4, step_s: float = 0.02) -> SimEngine:
    """A sim engine whose every step costs ``step_s``: capacity is batch / step_s tokens/s."""
    return SimEngine(
        max_batch_size=max_batch, max_seq_len=256, tokenizer=tokenizer,
        cost=SimCost(base_s=step_s, prefill_s_per_token=0.0, decode_s_per_seq=0.0),
    )  # fmt: skip


@cache
def _expected(tokenizer: BaseTokenizer, prompt: str, max_tokens: int, seed: int) -> str:
    engine = sim_engine(tokenizer, step_s=0.0)
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
    engine.add_request("ref", None, params, prompt_token_ids=ids)
    while True:
        for delta in engine.step():
            if delta.output is not None:
                return delta.output.text


def expected_text(
    tokenizer: BaseTokenizer, max_tokens: int, seed: int, prompt: str = PROMPT
) -> str:
    """What a sim worker answers (``ignore_eos``): a pure function of seed and position."""
    return _expected(tokenizer, prompt, max_tokens, seed)


def same_text(got: str, want: str) -> bool:
    """Exact equality: a resumed stream must equal the reference character for character
    (a character split across the resume point is emitted whole by the resumed attempt's
    detokenizer; text held back for a stop string is restored from ``text_len``)."""
    return got == want


def body(model: str, seed: int, max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    """A completion (streamed, with usage, unless ``stream=False``) that
    :func:`expected_text` predicts."""
    payload = {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "seed": seed,
        "stream": True, "ignore_eos": True, **extra,
    }  # fmt: skip
    if payload["stream"]:
        payload.setdefault("stream_options", {"include_usage": True})
    return payload


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    kind: Kind
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    completion_tokens: int | None = None  # the usage the gateway reported, when asked

    @property
    def code(self) -> str | None:
        return None if self.error is None else self.error.get("code")


def _error_of(response_text: str) -> dict[str, Any] | None:
    try:
        error = json.loads(response_text).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and {"message", "type", "code"} <= set(error):
        return error
    return None


async def completion(
    http: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Outcome:
    """POST a completion (streamed or not) and classify how it ended."""
    try:
        async with http.stream("POST", url, json=payload, headers=headers) as response:
            hdrs = dict(response.headers)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = _error_of(text)
                kind: Kind = "error" if error is not None else "lost"
                return Outcome(kind, response.status_code, error=error, headers=hdrs, detail=text)
            if not payload.get("stream"):
                obj = json.loads(await response.aread())
                choice = obj["choices"][0]
                return Outcome(
                    "complete", 200, choice["text"], choice["finish_reason"], headers=hdrs,
                    completion_tokens=obj["usage"]["completion_tokens"],
                )  # fmt: skip
            return await _read_sse(response, hdrs)
    except httpx.HTTPError as exc:
        return Outcome("lost", detail=f"{type(exc).__name__}: {exc}")


async def _read_sse(response: httpx.Response, headers: dict[str, str]) -> Outcome:
    text, finish, error, done, tokens = "", None, None, False, None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            continue
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if not event.get("choices"):
            continue
        choice = event["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason") or finish
    if error is not None:
        return Outcome("error", 200, text, finish, error, headers)
    if done and finish is not None:
        return Outcome("complete", 200, text, finish, headers=headers, completion_tokens=tokens)
    return Outcome("lost", 200, text, finish, headers=headers, detail=f"done={done}")


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    """``{"complete": n, "error": n, "lost": n}``."""
    counts = dict.fromkeys(("complete", "error", "lost"), 0)
    for outcome in outcomes:
        counts[outcome.kind] += 1
    return counts


class Process:
    """A qosserve service as a child process (``python -m <module> …``), log in ``workdir``."""

    def __init__(
        self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None
    ):
        self.name = name
        self.argv = argv
        self.log_path = workdir / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        on_main = threading.current_thread() is threading.main_thread()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv], cwd=ROOT, env=self.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(os.getpid()) if on_main else None,
            )  # fmt: skip
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout_s``); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def write_config(config: Config, path: Path) -> Path:
    """``config`` as a YAML file a service loads as it is (its groups, not the defaults)."""
    data = {**config.model_dump(mode="json"), "groups_replace_defaults": True}
    path.write_text(yaml.safe_dump(data))
    return path


def gateway_process(
    config_file: Path, model_dir: Path, workdir: Path, name: str = "gateway"
) -> tuple[Process, str]:
    """``python -m gateway`` on a free port; (process, base URL)."""
    port = free_port()
    argv = ["-m", "gateway", "--config", str(config_file), "--model", str(model_dir),
            "--port", str(port)]  # fmt: skip
    return Process(name, argv, workdir), f"http://127.0.0.1:{port}"
