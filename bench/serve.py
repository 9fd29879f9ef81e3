"""Serving benchmark, like ``vllm bench serve``: drive the gateway over HTTP, print JSON.

Requests are streamed completions (``--client httpx``, async, or ``raw``: see
:mod:`bench.serve_http`) whose prompts are random token ids, so input lengths are exact: ``--input-len`` / ``--output-len`` with ``--range-ratio`` r draw
each length uniformly from ``[len·(1−r), len·(1+r)]``; ``ignore_eos`` makes every request
produce its whole output. Arrivals are Poisson at ``--request-rate`` (gamma with shape
``--burstiness`` when it is not 1; ``inf`` sends everything at once), optionally capped at
``--max-concurrency`` requests in flight. The target is an existing deployment
(``--base-url``) or a stack this process starts on loopback (``--launch sim|real``:
nats-server, ``--replicas`` worker processes of ``--group``, a gateway process).

Reported: completed / failed, req/s, output tok/s, TTFT, TPOT, ITL and E2E (mean, p50,
p90, p99, in ms), goodput under ``--slo-ttft-ms`` / ``--slo-e2e-ms``, throughput per
second, and the machine (cores, load average: the load generator shares them).

Modes (``--mode``):

- ``serve`` (default): one run as configured.
- ``overhead``: the sim engine at zero step time, at ``--request-rate`` (350: the field
  study's throughput). The same requests, at the same arrival times, go three ways: over
  HTTP through the gateway; NATS-natively (:class:`~common.client.QosClient`: JetStream →
  worker → core NATS back, what the gateway does per request); and to a sim engine in
  this process through the worker's engine bridge. The message plane adds the NATS-native
  latency less the in-process one (targets: p50 < 2 ms, p99 < 10 ms); HTTP adds the rest.
- ``max-rps``: steps the offered rate of short streamed requests up (×``--ramp-factor``)
  until the p99 E2E passes ``--max-p99-ms`` (50) or the achieved rate falls behind, in
  ``--step-retries`` + 1 tries of the step; the answer is the most req/s one gateway
  process sustained (target ≥ 1000), with each process's CPU per request when this
  process launched the stack.

    python -m bench.serve --launch sim --quick
    python -m bench.serve --launch sim --mode overhead --num-prompts 7000 --plot out/
    python -m bench.serve --launch sim --mode max-rps --replicas 2
    # issue #4's figure: 6 % steps around the target (1.25x steps jump from 954 to 1,192)
    python -m bench.serve --launch sim --mode max-rps --request-rate 850 --ramp-factor 1.06
    python -m bench.serve --base-url http://127.0.0.1:8000 --request-rate 20 --num-prompts 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.arrivals import arrival_offsets
from bench.percentiles import pct
from bench.serve_http import CLIENTS, Result
from bench.serve_load import (
    Req,
    make_workload,
    run_in_process,
    run_load,
    run_nats,
)
from bench.serve_stack import LocalStack, machine_info
from bench.slo_rate import LAG_SHARE

# mode -> (num_prompts, request_rate, input_len, output_len), and with --quick.
MODE_DEFAULTS = {
    "serve": (200, 10.0, 128, 64),
    "overhead": (7000, 350.0, 32, 16),
    "max-rps": (0, 200.0, 16, 4),  # prompts per step: rate × --step-s
}
QUICK_DEFAULTS = {"serve": (40, 20.0), "overhead": (700, 350.0), "max-rps": (0, 200.0)}
Series = dict[str, list[Result]]  # what the plots draw, by name


# --- figures ------------------------------------------------------------------------------


def dist_ms(values: list[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds, of durations in seconds."""
    v = sorted(x * 1e3 for x in values)
    mean = sum(v) / len(v) if v else float("nan")
    return {"mean": round(mean, 3), **{f"p{q}": round(pct(v, q), 3) for q in (50, 90, 99)}}


def summarize(
    results: list[Result], duration: float, slo_ttft_ms: float | None, slo_e2e_ms: float | None
) -> dict[str, Any]:
    """vLLM's figures for one run: counts, throughputs, latency distributions, goodput."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    decoding = [r for r in ok if r.ttft is not None and r.output_tokens > 1]
    tpot = [(r.e2e - (r.ttft or 0.0)) / (r.output_tokens - 1) for r in decoding]
    slo_given = slo_ttft_ms is not None or slo_e2e_ms is not None

    def good(r: Result) -> bool:
        ttft_ok = slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms)
        return ttft_ok and (slo_e2e_ms is None or r.e2e * 1e3 <= slo_e2e_ms)

    errors: dict[str, int] = {}
    for r in failed:
        key = f"{r.status} {r.error}".strip()[:80]
        errors[key] = errors.get(key, 0) + 1
    return {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 2) if duration else 0.0,
        "output_throughput": round(out_tokens / duration, 1) if duration else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_ms": dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": dist_ms(tpot),
        "itl_ms": dist_ms([x for r in ok for x in r.itl]),
        "e2e_ms": dist_ms([r.e2e for r in ok]),
        # The load generator's lag behind its arrival process (it shares the cores): a
        # latency measured from the send hides it, so it is reported beside them.
        "send_lag_ms": dist_ms([max(0.0, r.start - r.scheduled) for r in results]),
        "goodput": round(sum(map(good, ok)) / duration, 2) if duration and slo_given else None,
        "slo": {"ttft_ms": slo_ttft_ms, "e2e_ms": slo_e2e_ms},
    }


def per_second(results: list[Result]) -> list[dict[str, float]]:
    """Completions and output tokens finished in each second of the run."""
    bins: dict[int, list[int]] = {}
    for r in results:
        if r.ok:
            b = bins.setdefault(int(r.start + r.e2e), [0, 0])
            b[0] += 1
            b[1] += r.output_tokens
    return [{"t": t, "requests": c, "tokens": n} for t, (c, n) in sorted(bins.items())]


# --- modes --------------------------------------------------------------------------------


def workload(args: argparse.Namespace, n: int, rate: float) -> tuple[list[Req], list[float]]:
    """``n`` requests as the flags describe them, and their send times at ``rate``."""
    work = make_workload(n, args.input_len, args.output_len, args.range_ratio, args.seed)
    return work, arrival_offsets(n, rate, args.burstiness, args.seed)


async def mode_serve(args: argparse.Namespace, target: Target) -> tuple[dict[str, Any], Series]:
    """One run as the flags describe it."""
    work, offsets = workload(args, args.num_prompts, args.request_rate)
    results, duration = await target.load(work, offsets, args.max_concurrency)
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_e2e_ms)
    return {**summary, "per_second": per_second(results)}, {"served": results}


def stack_tokenizer(model: str) -> Any | None:
    """The tokenizer the stack's sim workers detokenize with (a folder's), else None."""
    if not Path(model).is_dir():
        return None
    from common.tokenizer import load_tokenizer

    return load_tokenizer(model)


async def mode_overhead(args: argparse.Namespace, target: Target) -> tuple[dict[str, Any], Series]:
    """The same requests over HTTP, NATS-natively and in-process (see the module docstring)."""
    work, offsets = workload(args, args.num_prompts, args.request_rate)
    await target.load(work[:50], offsets[:50], None)  # warm-up: connections, caches
    cpu0 = target.cpu_seconds()
    http, http_s = await target.load(work, offsets, args.max_concurrency)
    cpu = cpu_used(cpu0, target.cpu_seconds(), http_s, len(http))
    assert target.stack is not None
    nats, nats_s = await run_nats(target.stack.nats_config, target.stack.group, work, offsets)
    inproc, inproc_s = await run_in_process(
        work, offsets, target.max_batch, stack_tokenizer(target.stack.model)
    )
    runs = {"http": (http, http_s), "nats": (nats, nats_s), "in_process": (inproc, inproc_s)}
    s = {name: summarize(res, took, None, None) for name, (res, took) in runs.items()}

    def minus(a: str, b: str) -> dict[str, float]:
        return {q: round(s[a]["e2e_ms"][q] - s[b]["e2e_ms"][q], 3) for q in ("p50", "p99")}

    plane = minus("nats", "in_process")
    report = {
        "request_rate": args.request_rate,
        **s,
        "added_e2e_ms": {
            "message_plane": plane,  # JetStream -> worker -> core NATS, vs in-process
            "http_and_message_plane": minus("http", "in_process"),
        },
        "targets_ms": {"p50": 2.0, "p99": 10.0},
        "met": plane["p50"] < 2.0 and plane["p99"] < 10.0,
        "cpu_during_http_run": cpu,
        "per_second": per_second(http),
    }
    series = {"HTTP (gateway)": http, "NATS (QosClient)": nats, "in-process": inproc}
    return report, series


# max-rps: a start that fails is halved down to this before the run reports nothing sustained.
MIN_START_RPS = 10.0
# max-rps: a step keeps up when it completes at least this share of its arrivals' own rate.
KEPT_UP = 0.97


async def mode_max_rps(args: argparse.Namespace, target: Target) -> tuple[dict[str, Any], Series]:
    """Ramp the offered rate until the p99 or the achieved rate gives (the module docstring).

    A first step that fails (and its retries) halves the rate and starts again from there,
    so a start set too high, or a burst of other work at the wrong moment, costs steps
    rather than reporting 0."""
    steps: list[dict[str, Any]] = []
    rate, best = args.request_rate, 0.0
    await target.load(*workload(args, 50, math.inf), None)  # warm-up: connections, caches
    last: list[Result] = []
    tries = 0
    while rate <= args.max_rate:
        work, offsets = workload(args, max(20, int(rate * args.step_s)), rate)
        cpu0 = target.cpu_seconds()
        results, duration = await target.load(work, offsets, args.max_concurrency)
        summary = summarize(results, duration, None, None)
        cpu = cpu_used(cpu0, target.cpu_seconds(), duration, summary["completed"])
        p99 = summary["e2e_ms"]["p99"]
        achieved = summary["request_throughput"]
        # A generator that fell behind its arrivals did not offer the rate: not kept up
        # (latencies are timed from the sends; a tenth of the bound, as bench.slo_rate).
        lagged = summary["send_lag_ms"]["p99"] > LAG_SHARE * args.max_p99_ms
        # Kept up: completed about as fast as this step's arrivals came (their own rate,
        # not the nominal one). At 0.9 of the nominal rate a step offered up to 10 % over
        # capacity passed on a 6 s queue that had no time to show in its p99, and its
        # achieved rate, the stack's capacity, was reported as held.
        arrivals = (len(offsets) - 1) / offsets[-1] if offsets and offsets[-1] > 0 else rate
        kept_up = achieved >= KEPT_UP * arrivals and summary["failed"] == 0 and not lagged
        step = {
            "offered_rps": round(rate, 1),
            "achieved_rps": achieved,
            "p50_ms": summary["e2e_ms"]["p50"],
            "p99_ms": p99,
            "send_lag_p99_ms": summary["send_lag_ms"]["p99"],
            "held": p99 <= args.max_p99_ms and kept_up,
            "failed": summary["failed"],
            "errors": summary["errors"],
            "cpu": cpu,
        }
        steps.append(step)
        print(json.dumps(step), file=sys.stderr, flush=True)
        if p99 > args.max_p99_ms or not kept_up:
            tries += 1
            if tries <= args.step_retries:
                continue  # once more: on a shared machine one burst of other work can do this
            if best == 0 and rate / 2 >= MIN_START_RPS:
                rate, tries = rate / 2, 0  # nothing sustained yet: the start was too high
                continue
            break
        best, last, tries = max(best, achieved), results, 0
        rate *= args.ramp_factor
    gateway = [s["cpu"]["gateway"]["ms_per_request"] for s in steps if "gateway" in s["cpu"]]
    report = {
        "max_p99_ms": args.max_p99_ms,
        "steps": steps,
        "max_sustained_rps": best,
        "target_rps": 1000,
        "met": best >= 1000,
        # One event loop: a gateway process never uses more than one core.
        "gateway_rps_per_core_estimate": round(1e3 / min(gateway), 1) if gateway else None,
    }
    return report, {"last sustained step": last}


# --- plumbing -----------------------------------------------------------------------------


@dataclass
class Target:
    """The gateway under test: where to send, as which model, and the stack if launched."""

    url: str
    model: str = ""
    path: str = "/v1/completions"
    max_batch: int = 16
    stack: LocalStack | None = None
    client: str = "httpx"

    async def load(
        self, work: list[Req], offsets: list[float], max_concurrency: int | None
    ) -> tuple[list[Result], float]:
        return await run_load(
            self.url, self.path, self.model, work, offsets, max_concurrency, self.client
        )

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far: this process (the load generator) and a launched stack."""
        own = {"load-generator": time.process_time()}
        return {**own, **self.stack.cpu_seconds()} if self.stack is not None else own


def cpu_used(
    before: dict[str, float], after: dict[str, float], duration: float, completed: int
) -> dict[str, dict[str, float]]:
    """Per process: the share of a core it used over ``duration``, and ms per request."""
    return {
        name: {
            "util": round((after[name] - before[name]) / duration, 3),
            "ms_per_request": round((after[name] - before[name]) * 1e3 / max(1, completed), 3),
        }
        for name in after
        if name in before and before[name] >= 0 and after[name] >= 0
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.serve", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--base-url", help="an existing gateway, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", choices=("sim", "real"), help="start a stack on loopback")
    p.add_argument("--mode", choices=sorted(MODE_DEFAULTS), default="serve")
    p.add_argument("--group", default="short", help="route by path /v1/<group>/ ('' = by length)")
    p.add_argument("--model", help="launch: model folder or demo (real); tokenizer folder (sim)")
    p.add_argument("--replicas", type=int, default=1, help="launch: worker processes")
    p.add_argument("--device", default="cpu", help="launch real: worker device")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--request-rate", type=float, help="req/s (inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument(
        "--client",
        choices=CLIENTS,
        help="HTTP client (httpx; overhead and max-rps: raw, a tenth of httpx's CPU)",
    )
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    sim = p.add_argument_group("launch sim: step cost (overhead and max-rps force 0)")
    sim.add_argument("--sim-base-ms", type=float, default=5.0)
    sim.add_argument("--sim-prefill-us-per-token", type=float, default=10.0)
    sim.add_argument("--sim-decode-us-per-seq", type=float, default=100.0)
    ramp = p.add_argument_group("max-rps")
    ramp.add_argument("--step-s", type=float, default=8.0, help="seconds per offered rate")
    ramp.add_argument("--ramp-factor", type=float, default=1.25)
    ramp.add_argument("--max-rate", type=float, default=4000.0)
    ramp.add_argument("--max-p99-ms", type=float, default=50.0)
    ramp.add_argument("--step-retries", type=int, default=1, help="reruns of a failed step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small run (seconds)")
    p.add_argument("--out", help="write the JSON here too")
    p.add_argument("--plot", help="write PNG plots into this folder (needs matplotlib)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    n, rate, inp, out = MODE_DEFAULTS[args.mode]
    if args.quick:
        (n, rate), args.step_s = QUICK_DEFAULTS[args.mode], 2.0
    args.num_prompts = args.num_prompts or n
    args.request_rate = args.request_rate if args.request_rate is not None else rate
    args.input_len, args.output_len = args.input_len or inp, args.output_len or out
    args.client = args.client or ("httpx" if args.mode == "serve" else "raw")
    if args.mode == "overhead" and args.base_url:
        p.error("--mode overhead compares against a zero-cost sim stack: use --launch sim")
    if args.mode != "serve":
        if args.launch == "real":
            p.error(f"--mode {args.mode} measures the serving path: use --launch sim")
        args.sim_base_ms = args.sim_prefill_us_per_token = args.sim_decode_us_per_seq = 0.0
    if not args.base_url and not args.launch:
        args.launch = "sim"
    return args


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start (or find) the target, run the mode, and build the report."""
    machine_before = machine_info()
    async with contextlib.AsyncExitStack() as exits:
        if args.launch:
            stack = LocalStack(args)
            exits.push_async_callback(stack.stop)
            await stack.start()
            target = Target(stack.url, stack.model_name, max_batch=stack.max_batch, stack=stack)
        else:
            target = Target(args.base_url.rstrip("/"))
            async with httpx.AsyncClient(base_url=target.url, timeout=10) as client:
                target.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if args.group:
            target.path = f"/v1/{args.group}/completions"
        target.client = args.client
        runner = {"serve": mode_serve, "overhead": mode_overhead, "max-rps": mode_max_rps}
        result, series = await runner[args.mode](args, target)
        gateway_pid = target.stack.gateway_pid if target.stack else None
    report = {
        "benchmark": "serve",
        "mode": args.mode,
        "command": " ".join(["python -m bench.serve", *args.argv]),
        "target": args.base_url or f"launch {args.launch} (replicas {args.replicas})",
        "machine": {
            **machine_before,
            "load_avg_after": machine_info()["load_avg"],
            "load_generator": f"pid {os.getpid()}, a separate process from the gateway"
            + (f" (pid {gateway_pid})" if gateway_pid else ""),
        },
        "config": {k: v for k, v in vars(args).items() if k not in ("argv", "out", "plot")},
        "result": result,
    }
    if args.plot:
        from bench.serve_plots import draw

        report["plots"] = draw(Path(args.plot), args.mode, series, result)
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; JSON on stdout; exit 1 when a request failed."""
    args = parse_args(argv)
    try:
        import uvloop

        uvloop.install()  # the load generator's own overhead counts against the measurement
    except ImportError:
        pass
    report = asyncio.run(bench(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    result = report["result"]
    runs = [result, *(result.get(k, {}) for k in ("http", "nats", "in_process"))]
    return 1 if any(run.get("failed") for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
