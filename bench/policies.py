"""Batching policies side by side: the same field-mix workload through the full stack.

For each of ``static``, ``dynamic``, ``continuous`` and ``hybrid`` this starts a stack on
loopback (``qosserve up``: nats-server, redis-server, a real-engine worker for ``short`` and
one for ``long``, both on that policy, and the gateway; no scheduler, so no breaker caps a
batch mid-run), then runs, with the same seeds for every policy:

1. a fixed arrival rate (``--rate`` sessions/s for ``--duration-s``): req/s, output tok/s,
   TTFT and E2E p50/p99 per group, goodput under each group's SLOs (``common.config``),
   the engine thread's busy fraction and mean running batch (worker telemetry);
2. a saturation sweep: the rate times each ``--sweep`` factor for ``--step-s`` each; the
   most req/s any step sustained is the policy's saturation throughput.

Sessions are the field mix (``bench/policies_load.py``): 19 % long-document questions on the
``long`` group, 28 % three-turn conversations resending their history, 48 % short
generations (the locust file's 5 % invalid requests are left out: they measure robustness).
Ratios are against ``dynamic``; the field study reports 2.9x req/s for continuous batching
plus instance groups over dynamic batching. Whatever ours are, they are printed as measured.

    python -m bench.policies                 # the demo model on CPU, ~5 min
    python -m bench.policies --quick         # ~2 min (stack start-up is most of it)
    python -m bench.policies --policies dynamic,continuous --rate 3 --out policies.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.policies_load import Sent, TelemetryLog, make_sessions, run_sessions
from bench.serve import summarize
from bench.serve_load import arrival_offsets
from bench.serve_stack import machine_info
from bench.up_stack import UpStack
from common.config import default_groups

POLICIES = ("static", "dynamic", "continuous", "hybrid")
BASELINE = "dynamic"
FIELD_STUDY_RATIO = 2.9


def group_figures(sent: list[Sent], duration: float) -> dict[str, Any]:
    """Per group (and all together): summarize() under that group's SLOs."""
    slos = default_groups()
    out: dict[str, Any] = {}
    for group in sorted({s.group for s in sent}):
        slo = slos[group]
        results = [s.result for s in sent if s.group == group]
        out[group] = summarize(results, duration, slo.slo_ttft_ms, slo.slo_e2e_p99_ms)
    every = summarize([s.result for s in sent], duration, None, None)
    every["goodput"] = round(sum(out[g]["goodput"] or 0 for g in out), 2)
    out["all"] = every
    return out


def brief(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures the comparison table shows, from one summarize() result."""
    return {
        "req_s": figures["request_throughput"],
        "out_tok_s": figures["output_throughput"],
        "goodput_req_s": figures["goodput"],
        "ttft_p50_ms": figures["ttft_ms"]["p50"],
        "ttft_p99_ms": figures["ttft_ms"]["p99"],
        "e2e_p50_ms": figures["e2e_ms"]["p50"],
        "e2e_p99_ms": figures["e2e_ms"]["p99"],
        "completed": figures["completed"],
        "failed": figures["failed"],
    }


async def phase(
    stack: UpStack, tel: TelemetryLog, model: str, n: int, rate: float, seed: int, long_tokens: int
) -> dict[str, Any]:
    """``n`` sessions at ``rate``/s; figures per group, with the telemetry of the window."""
    sessions = make_sessions(n, seed, long_tokens)
    t0 = time.monotonic()
    sent, duration = await run_sessions(
        stack.url, model, sessions, arrival_offsets(n, rate, 1.0, seed)
    )
    figures = group_figures(sent, duration)
    return {
        "offered_sessions_s": rate,
        "requests": len(sent),
        "groups": {g: brief(f) for g, f in figures.items()},
        "errors": figures["all"]["errors"],
        "engine": tel.window(t0, time.monotonic()),
    }


async def measure(stack: UpStack, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Warm-up, the fixed-rate phase, the sweep; against a started stack."""
    async with TelemetryLog(stack.nats_url) as tel:
        model = "pystd-tiny" if args.model == "demo" else Path(args.model).name
        await run_sessions(stack.url, model, make_sessions(4, 999, args.long_tokens), [0.0] * 4)
        n_fixed = max(4, round(args.rate * args.duration_s))
        fixed = await phase(stack, tel, model, n_fixed, args.rate, args.seed, args.long_tokens)
        print(f"  {policy}: fixed {fixed['groups']['all']}", file=sys.stderr, flush=True)
        sweep = []
        for i, factor in enumerate(args.sweep):
            rate = args.rate * factor
            n = max(4, round(rate * args.step_s))
            step = await phase(stack, tel, model, n, rate, args.seed + 100 + i, args.long_tokens)
            sweep.append(step)
            print(f"  {policy}: x{factor} {step['groups']['all']}", file=sys.stderr, flush=True)
    best = max([*sweep, fixed], key=lambda s: s["groups"]["all"]["req_s"])
    return {
        "fixed_rate": fixed,
        "sweep": sweep,
        "saturation_req_s": best["groups"]["all"]["req_s"],
        "saturation_out_tok_s": best["groups"]["all"]["out_tok_s"],
    }


def run_policy(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """A fresh stack on ``policy`` for both groups; measured, then stopped."""
    config = {
        "groups": {"short": {"policy": policy}, "long": {"policy": policy}},
        "worker": {"telemetry_interval_s": 0.5},
    }
    started = time.perf_counter()
    stack = UpStack(engine="real", model=args.model, config=config, replicas={"realtime": 0})
    with stack:
        ready_s = time.perf_counter() - started
        result = asyncio.run(measure(stack, args, policy))
    result["stack_start_s"] = round(ready_s, 1)
    return result


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each policy against ``dynamic``: throughputs up is better, latencies down is better."""
    if BASELINE not in results:
        return {}
    base = results[BASELINE]
    out: dict[str, Any] = {}
    for policy, r in results.items():
        row: dict[str, Any] = {}
        for key in ("req_s", "out_tok_s", "goodput_req_s", "ttft_p99_ms", "e2e_p99_ms"):
            a = r["fixed_rate"]["groups"]["all"][key]
            b = base["fixed_rate"]["groups"]["all"][key]
            row[f"fixed_{key}"] = round(a / b, 3) if a is not None and b else None
        sat, sat_base = r["saturation_req_s"], base["saturation_req_s"]
        row["saturation_req_s"] = round(sat / sat_base, 3) if sat_base else None
        out[policy] = row
    return out


def table(results: dict[str, Any], rel: dict[str, Any]) -> str:
    """A plain-text table of the fixed-rate phase and the saturation throughput."""
    head = f"{'policy':<11}{'group':<7}{'req/s':>7}{'tok/s':>8}{'good/s':>8}"
    head += f"{'TTFT p50':>10}{'p99':>8}{'E2E p50':>9}{'p99':>8}{'busy':>6}{'sat req/s':>11}{'x dyn':>7}"
    lines = [head]
    for policy, r in results.items():
        fixed = r["fixed_rate"]
        for group, g in fixed["groups"].items():
            busy = fixed["engine"].get(group, {}).get("busy_fraction", "")
            sat = f"{r['saturation_req_s']:.2f}" if group == "all" else ""
            x = rel.get(policy, {}).get("saturation_req_s") if group == "all" else None
            lines.append(
                f"{policy:<11}{group:<7}{g['req_s']:>7.2f}{g['out_tok_s']:>8.1f}"
                f"{g['goodput_req_s'] or 0:>8.2f}{g['ttft_p50_ms']:>10.0f}{g['ttft_p99_ms']:>8.0f}"
                f"{g['e2e_p50_ms']:>9.0f}{g['e2e_p99_ms']:>8.0f}{busy!s:>6}{sat:>11}"
                f"{'' if x is None else f'{x:.2f}':>7}"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.policies", description=__doc__.split("\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model", default="demo", help="checkpoint folder or demo")
    p.add_argument("--rate", type=float, default=2.0, help="fixed phase: sessions per second")
    p.add_argument("--duration-s", type=float, default=20.0, help="fixed phase length")
    p.add_argument("--sweep", default="2,4", help="saturation sweep: factors of --rate")
    p.add_argument("--step-s", type=float, default=10.0, help="seconds per sweep step")
    p.add_argument("--long-tokens", type=int, default=1024, help="long-document prompt tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="short phases (~2 min in all)")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.duration_s, args.step_s, args.long_tokens = 6.0, 5.0, 512
        args.sweep = "4" if args.sweep == "2,4" else args.sweep
    args.sweep = [float(x) for x in args.sweep.split(",") if x]
    args.policy_list = [x for x in args.policies.split(",") if x]
    unknown = set(args.policy_list) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every policy; JSON on stdout, the table on stderr; exit 1 when a request failed."""
    args = parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()
    results = {policy: run_policy(args, policy) for policy in args.policy_list}
    rel = ratios(results)
    report = {
        "benchmark": "policies",
        "command": " ".join(["python -m bench.policies", *args.argv]),
        "machine": {**machine, "load_avg_after": machine_info()["load_avg"]},
        "workload": {
            "mix": "19% long-document QA (long group), 28% 3-turn conversations, 48% short",
            "rate_sessions_s": args.rate,
            "duration_s": args.duration_s,
            "sweep_factors": args.sweep,
            "step_s": args.step_s,
            "long_tokens": args.long_tokens,
            "slos_ms": {g: [c.slo_ttft_ms, c.slo_e2e_p99_ms] for g, c in default_groups().items()},
        },
        "results": results,
        "ratios_vs_dynamic": rel,
        "field_study_ratio": FIELD_STUDY_RATIO,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(table(results, rel), file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    failed = any(
        r["fixed_rate"]["errors"] or any(s["errors"] for s in r["sweep"]) for r in results.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
