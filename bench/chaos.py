"""Chaos soak: steady load through the gateway while random faults hit the stack.

    python -m bench.chaos --quick               # 60 s, every fault kind once
    python -m bench.chaos                       # 10 minutes, a random fault every ~30 s
    python -m bench.chaos --duration 1800 --rps 12 --out chaos.json

The stack is real processes on loopback: nats-server (JetStream file store), redis-server,
the scheduler, ``--workers`` sim workers of one group (fixed step cost) and the gateway.
Streaming clients (httpx) send completions at ``--rps``; a trickle of bad input goes
along. Faults, one at a time: ``worker`` (SIGKILL a worker, restart it), ``nats``
(SIGKILL nats-server, restart it on its store), ``redis``, ``scheduler`` and ``gateway``
(SIGKILL, restart on the same port). The sim's tokens are a pure function of (seed,
position) and the tokenizer decodes each to a whole word, so every answer is checked
against the reference exactly.

A request ends ``complete`` (exact or not), ``error`` (an HTTP error status, an SSE error
event, or a transport error when its gateway was killed) or ``lost`` (no end and no
error before the client's timeout, a stream cut short without one, or still running when
the soak's wait for stragglers ran out). The JSON report: load held, faults injected and
recovered, p99 during and after each fault, bad inputs and their 5xx count, requests lost,
errors no fault explains, tokens duplicated or missing, gateway RSS.

Per fault: ``down_s`` is kill → restart done (the down time the soak chose, 1 s or 0.5 s,
plus starting the part again), ``recovered_s`` kill → the first exact answer to a probe
(probes start once the part is restarted), ``recovered_after_restart_s`` the difference.
``survived`` judges ``recovered_s``, from the kill: the stricter clock, the down time
counts against the target. A fault's window runs from the kill to its recovery (to the
probe's ``RECOVERY_LIMIT_S`` when it never recovers); ``requests_during`` /
``errors_during`` / ``lost_during`` count the load's requests whose time in flight,
``[started, started + seconds]`` (a lost one's up to where the client gave up), overlaps
it, so a request already in flight at the kill counts: the ones a fault hurts most.
Errors are expected in a fault's window (a killed gateway cuts its streams), not outside:
``errors_outside_faults`` counts the load's errors that overlap no window widened by
``ERROR_GRACE_S`` after its recovery. The bad-input probes are not the load: their 4xx
(and a 0 when the gateway was down) are counted apart, under ``bad_inputs``.

Targets: 0 lost, 0 duplicated, 0 errors outside faults, 0 5xx for bad input, NATS
recovered within 10 s of its kill, the rest within 30 s; the exit code is 1 when missed.
Redis is restarted too, but sim workers do not use the KV tier: that fault does not touch
the data path here (``tests/reliability/test_redis_faults.py`` covers a real engine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_stack import ChaosStack, rss_mb
from bench.percentiles import pct
from common.tokenizer import BaseTokenizer, load_tokenizer
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine

FAULTS = ("worker", "nats", "redis", "scheduler", "gateway")
TARGET_RECOVERY_S = {"nats": 10.0, "worker": 30.0, "redis": 30.0, "scheduler": 30.0,
                     "gateway": 30.0}  # fmt: skip
PROMPTS = [" ".join(f"w{(i * 7 + j) % 900 + 4}" for j in range(6 + i % 5)) for i in range(16)]
DEADLINE_MS = 30_000
CLIENT_TIMEOUT_S = 45.0
RECOVERY_LIMIT_S = 120.0  # the probe gives up this long after the kill
# After a recovery, the backlog the fault built still drains: errors this soon after it are
# the fault's; later ones are the stack's own failures.
ERROR_GRACE_S = 5.0


# --------------------------------------------------------------------------- load


@dataclass
class Result:
    started: float  # monotonic
    kind: str  # complete | mismatch | error | lost
    seconds: float
    status: int = 0
    code: str | None = None
    got_tokens: int = 0
    want_tokens: int = 0


class Reference:
    """What a sim worker answers, computed here with the same tokenizer."""

    def __init__(self, tokenizer: BaseTokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, prompt: str, max_tokens: int, seed: int) -> str:
        engine = SimEngine(max_seq_len=512, tokenizer=self.tokenizer,
                           cost=SimCost(0.0, 0.0, 0.0))  # fmt: skip
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        engine.add_request("ref", None, SamplingParams(max_tokens=max_tokens, seed=seed,
                                                       ignore_eos=True), prompt_token_ids=ids)  # fmt: skip
        while True:
            for delta in engine.step():
                if delta.output is not None:
                    return delta.output.text


async def one_request(
    http: httpx.AsyncClient, url: str, model: str, ref: Reference, rng: random.Random
) -> Result:
    prompt, seed, max_tokens = rng.choice(PROMPTS), rng.randrange(2**31), rng.randint(8, 48)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "seed": seed,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.monotonic()
    text, finish, done, error, tokens = "", None, False, None, 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body,
                               headers={"X-QoS-Deadline-Ms": str(DEADLINE_MS)}) as response:  # fmt: skip
            if response.status_code != 200:
                raw = await response.aread()
                code = _error_code(raw)
                kind = "error" if code is not None else "lost"
                return Result(started, kind, time.monotonic() - started, response.status_code, code)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"].get("code", "error")
                    continue
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    text += event["choices"][0].get("text") or ""
                    finish = event["choices"][0].get("finish_reason") or finish
    except (httpx.TransportError, httpx.DecodingError) as exc:
        kind = "lost" if isinstance(exc, httpx.TimeoutException) else "error"
        return Result(
            started, kind, time.monotonic() - started, 0, f"transport:{type(exc).__name__}"
        )
    seconds = time.monotonic() - started
    if error is not None:
        return Result(started, "error", seconds, 200, error)
    if not (done and finish):
        return Result(started, "lost", seconds, 200, "truncated")
    ok = text == ref.text(prompt, max_tokens, seed)
    return Result(started, "complete" if ok else "mismatch", seconds, 200, None, tokens, max_tokens)


def _error_code(raw: bytes) -> str | None:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(raw).get("error")
        if isinstance(error, dict):
            return str(error.get("code"))
    return None


# Bad input: (name, method, path, raw body, headers). None is ever a 5xx.
def bad_inputs(model: str) -> list[tuple[str, bytes, dict[str, Any]]]:
    m = model.encode()
    j = {"content-type": "application/json"}
    return [
        ("nan", b'{"model":"%s","prompt":"hi","temperature":NaN}' % m, j),
        ("infinity", b'{"model":"%s","prompt":"hi","top_p":Infinity}' % m, j),
        ("huge_int", b'{"model":"%s","prompt":"hi","top_k":18446744073709551616}' % m, j),
        ("negative", b'{"model":"%s","prompt":"hi","max_tokens":-1}' % m, j),
        ("1e308", b'{"model":"%s","prompt":"hi","max_tokens":1e308}' % m, j),
        ("invalid_utf8", b'{"model":"%s","prompt":"\xff\xfe"}' % m, j),
        ("lone_surrogate", b'{"model":"%s","prompt":"\\ud800"}' % m, j),
        ("unknown_model", b'{"model":"gpt-9","prompt":"hi"}', j),
        ("group_wildcard", b'{"model":"%s","prompt":"hi"}' % m, {**j, "X-QoS-Group": "short.>"}),
        ("group_unicode", b'{"model":"%s","prompt":"hi"}' % m,
         {**j, "X-QoS-Group": "sh\u00f6rt".encode()}),
        ("oversized", b'{"model":"%s","prompt":"%s"}' % (m, b"x" * (5 << 20)), j),
        ("deep_nesting", b"[" * 20_000 + b"]" * 20_000, j),
        ("garbage", os.urandom(256), j),
        ("too_long_prompt", json.dumps({"model": model, "prompt": "w5 " * 2000}).encode(), j),
    ]  # fmt: skip


# --------------------------------------------------------------------------- the run


@dataclass
class Fault:
    kind: str
    at: float  # monotonic: the kill
    restarted_at: float | None = None  # the part was started again (inject() returned)
    recovered_at: float | None = None  # the first exact answer to a probe after that
    note: str = ""

    def window(self, grace_s: float = 0.0) -> tuple[float, float]:
        """The fault's span, kill to recovery (to the probe's limit when it never
        recovered), widened by ``grace_s`` after its end."""
        end = self.recovered_at if self.recovered_at is not None else self.at + RECOVERY_LIMIT_S
        return self.at, end + grace_s


def overlaps(r: Result, window: tuple[float, float]) -> bool:
    """Whether ``r`` was in flight during ``window``: its span ``[started, started +
    seconds]`` meets it (started before and still running counts; a lost request's span
    runs to where the client gave up)."""
    a, b = window
    return r.started < b and r.started + r.seconds >= a


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    bad: dict[str, dict[int, int]] = field(default_factory=dict)
    rss: list[float] = field(default_factory=list)


async def inject(stack: ChaosStack, kind: str, rng: random.Random) -> str:
    """Cause ``kind`` and bring the part back; a note on what was done."""
    if kind == "worker":
        victim = rng.choice(stack.workers)
        victim.kill()
        await asyncio.sleep(1.0)
        victim.start()
        return victim.name
    if kind == "nats":
        stack.nats.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.nats.start)
        return "SIGKILL, restart on the same store"
    if kind == "redis":
        stack.redis.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.redis.start)
        return "SIGKILL, restart (sim workers use no KV tier)"
    if kind == "scheduler":
        stack.scheduler.kill()
        await asyncio.sleep(1.0)
        stack.scheduler.start()
        return "SIGKILL, restart"
    stack.gateway.kill()
    await asyncio.sleep(0.5)
    stack.gateway.start()
    return "SIGKILL, restart on the same port"


async def probe_until_recovered(
    stack: ChaosStack, fault: Fault, ref: Reference, rng: random.Random, limit_s: float
) -> None:
    """First exact answer to a request started after the fault: the recovery time."""
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, trust_env=False) as http:
        while time.monotonic() - fault.at < limit_s:
            result = await one_request(http, stack.url, stack.model, ref, rng)
            if result.kind == "complete":
                fault.recovered_at = time.monotonic()
                return
            await asyncio.sleep(0.25)


async def soak(args: argparse.Namespace, stack: ChaosStack, ref: Reference) -> Run:
    run = Run()
    rng = random.Random(args.seed)
    start = time.monotonic()
    end = start + args.duration
    tasks: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)

    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits, trust_env=False) as http:

        async def record() -> None:
            started = time.monotonic()
            try:
                run.results.append(await one_request(http, stack.url, stack.model, ref, rng))
            except asyncio.CancelledError:
                # Still running when the wait for stragglers ended: lost, not left out.
                seconds = time.monotonic() - started
                run.results.append(Result(started, "lost", seconds, 0, "unfinished"))
                raise

        async def load() -> None:
            i = 0
            while time.monotonic() < end:
                task = asyncio.create_task(record())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(0.0, start + i / args.rps - time.monotonic()))

        async def bad() -> None:
            cases = bad_inputs(stack.model)
            async with httpx.AsyncClient(timeout=30, trust_env=False) as raw:
                while time.monotonic() < end:
                    name, content, headers = rng.choice(cases)
                    try:
                        response = await raw.post(f"{stack.url}/v1/completions", content=content,
                                                  headers=headers)  # fmt: skip
                        status = response.status_code
                    except httpx.HTTPError:
                        status = 0  # the gateway was down (a fault): nobody answered
                    except Exception as exc:  # the client refused to send it: not the server's
                        print(f"bad input {name}: not sent ({exc!r})", flush=True)
                        status = -1
                    run.bad.setdefault(name, {}).setdefault(status, 0)
                    run.bad[name][status] += 1
                    await asyncio.sleep(args.bad_every)

        async def faults() -> None:
            frng = random.Random(args.seed + 1)
            kinds = [k for k in args.faults.split(",") if k]
            if args.quick:  # each kind once, evenly spread
                plan = frng.sample(kinds, len(kinds))
                gap = args.duration / (len(plan) + 1)
                times = [start + gap * (i + 1) for i in range(len(plan))]
            else:
                plan, times, at = [], [], start
                while (at := at + args.fault_every * frng.uniform(0.6, 1.4)) < end - 10:
                    plan.append(frng.choice(kinds))
                    times.append(at)
            for kind, at in zip(plan, times, strict=True):
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                fault = Fault(kind, time.monotonic())
                run.faults.append(fault)
                print(f"[{fault.at - start:6.1f}s] fault: {kind}", flush=True)
                fault.note = await inject(stack, kind, frng)
                fault.restarted_at = time.monotonic()
                await probe_until_recovered(stack, fault, ref, frng, RECOVERY_LIMIT_S)
                took = (fault.recovered_at or float("nan")) - fault.at
                down = fault.restarted_at - fault.at
                print(f"[{time.monotonic() - start:6.1f}s]   recovered in {took:.1f}s from the "
                      f"kill (down {down:.1f}s)", flush=True)  # fmt: skip

        async def memory() -> None:
            while time.monotonic() < end:
                value = rss_mb(stack.gateway.pid)
                if value is not None:
                    run.rss.append(value)
                await asyncio.sleep(5.0)

        await asyncio.gather(load(), bad(), faults(), memory())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLIENT_TIMEOUT_S + 5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return run


def p99(values: list[float]) -> float | None:
    """As every benchmark here reports it (:func:`bench.percentiles.pct`); index
    int(0.99 n) was the maximum of 100 values."""
    if not values:
        return None
    return round(pct(sorted(values), 99), 3)


def report(args: argparse.Namespace, run: Run, start: float) -> dict[str, Any]:
    results = run.results
    kinds = {
        k: sum(r.kind == k for r in results) for k in ("complete", "mismatch", "error", "lost")
    }
    errors: dict[str, int] = {}
    for r in results:
        if r.kind == "error":
            errors[f"{r.status}:{r.code}"] = errors.get(f"{r.status}:{r.code}", 0) + 1
    done = [r.seconds for r in results if r.kind == "complete"]
    faults = []
    for f in run.faults:
        rec, restarted = f.recovered_at, f.restarted_at
        during = [r for r in results if overlaps(r, f.window())]
        after = [r for r in results if rec is not None and rec <= r.started < rec + 10]
        recovered_s = None if rec is None else round(rec - f.at, 2)
        faults.append({
            "kind": f.kind, "at_s": round(f.at - start, 1), "note": f.note,
            "down_s": None if restarted is None else round(restarted - f.at, 2),
            "recovered_s": recovered_s,
            "recovered_after_restart_s": None if rec is None or restarted is None
            else round(rec - restarted, 2),
            "target_s": TARGET_RECOVERY_S[f.kind],
            # From the kill, not the restart: the down time counts against the target.
            "survived": recovered_s is not None and recovered_s <= TARGET_RECOVERY_S[f.kind],
            "requests_during": len(during),
            "errors_during": sum(r.kind == "error" for r in during),
            "lost_during": sum(r.kind == "lost" for r in during),
            "p99_during_s": p99([r.seconds for r in during if r.kind == "complete"]),
            "p99_after_s": p99([r.seconds for r in after if r.kind == "complete"]),
        })  # fmt: skip
    # The load's errors no fault explains (run.bad, the bad-input probes, is not in results).
    windows = [f.window(ERROR_GRACE_S) for f in run.faults]
    outside = [r for r in results
               if r.kind == "error" and not any(overlaps(r, w) for w in windows)]  # fmt: skip
    bad_total = sum(sum(c.values()) for c in run.bad.values())
    bad_5xx = sum(n for c in run.bad.values() for s, n in c.items() if s >= 500)
    duplicated = sum(max(0, r.got_tokens - r.want_tokens) for r in results if r.kind != "error")
    missing = sum(max(0, r.want_tokens - r.got_tokens) for r in results
                  if r.kind in ("complete", "mismatch"))  # fmt: skip
    out: dict[str, Any] = {
        "command": " ".join(["python -m bench.chaos", *sys.argv[1:]]),
        "duration_s": args.duration,
        "stack": {"workers": args.workers, "step_ms": args.step_ms, "group": "short",
                  "max_batch": 8, "engine": "sim"},
        "load": {
            "target_rps": args.rps,
            "sent": len(results),
            "achieved_rps": round(len(results) / args.duration, 2),
            "completed_rps": round(kinds["complete"] / args.duration, 2),
            **kinds,
            "errors_by_status_code": errors,
            "p50_s": round(statistics.median(done), 3) if done else None,
            "p99_s": p99(done),
        },
        "faults_injected": len(faults),
        "faults_survived": sum(f["survived"] for f in faults),
        "faults": faults,
        "bad_inputs": {"sent": bad_total, "5xx": bad_5xx,
                       "by_case": {k: {str(s): n for s, n in v.items()} for k, v in run.bad.items()}},
        "requests_lost": kinds["lost"],
        "errors_outside_faults": len(outside),
        "answers_not_exact": kinds["mismatch"],
        "tokens_duplicated": duplicated,
        "tokens_missing": missing,
        "gateway_rss_mb": {"first": round(run.rss[0], 1) if run.rss else None,
                           "max": round(max(run.rss), 1) if run.rss else None,
                           "last": round(run.rss[-1], 1) if run.rss else None},
    }  # fmt: skip
    out["passed"] = (
        out["requests_lost"] == 0 and duplicated == 0 and kinds["mismatch"] == 0
        and out["errors_outside_faults"] == 0 and bad_5xx == 0
        and out["faults_survived"] == out["faults_injected"]
    )  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qosserve bench chaos", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    p.add_argument("--quick", action="store_true", help="60 s, each fault kind once")
    p.add_argument("--rps", type=float, default=8.0, help="streamed completions per second")
    p.add_argument("--workers", type=int, default=2, help="sim worker processes")
    p.add_argument("--step-ms", type=float, default=10.0, help="sim step cost")
    p.add_argument("--fault-every", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument("--faults", default=",".join(FAULTS), help="fault kinds to draw from")
    p.add_argument("--bad-every", type=float, default=1.0, help="seconds between bad inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", help="keep logs and stores here (default: a temp folder)")
    p.add_argument("--out", help="write the JSON report here too")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 60.0
    return args


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    state = Path(args.state_dir or tempfile.mkdtemp(prefix="qos-chaos-"))
    stack = ChaosStack(state, args.workers, args.step_ms)
    try:
        await stack.start()
        ref = Reference(load_tokenizer(str(stack.model_dir)))
        print(f"stack up (logs in {stack.logs}); soaking {args.duration:.0f}s at {args.rps}/s",
              flush=True)  # fmt: skip
        start = time.monotonic()
        run = await soak(args, stack, ref)
        result = report(args, run, start)
        result["logs"] = str(stack.logs)
        return result
    finally:
        stack.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(amain(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
