"""Capacity by replica count: one group served by 1, 2, 4 … workers, the offered rate
ramped until the SLO gives, side by side in one run.

Each worker is a sim engine whose steps cost device time (``time.sleep``: a GPU's step
leaves the host's CPU free, so on two cores a replica adds capacity as a GPU would, and
the host path stays shared): ``--sim-base-ms`` + ``--sim-prefill-us-per-token`` ×
prompt tokens + ``--sim-decode-us-per-seq`` × running sequences, at most the group's
``max_batch`` running. For each replica count a fresh stack (nats-server, the workers, one
gateway; :class:`bench.serve_stack.LocalStack`) gets ``bench.serve``'s max-rps ramp:
Poisson arrivals of short streamed completions, ×``--ramp-factor`` per step from
``--start-rps-per-replica`` × replicas, until p99 E2E passes ``--max-p99-ms`` or the
stack serves less than 90 % of the offered rate. Reported per count: the most req/s
sustained, its ratio to one replica, the scaling efficiency (ratio ÷ replicas) and each
process's CPU per request; and the device bound of one replica from the cost model (the
rate at which a full batch finishes requests). Capacity scales by replica count until the
one gateway process or the machine's two cores bind: the report says which processes
were busiest at the top step.

    python -m bench.replicas                                  # ~4 minutes on two cores
    python -m bench.replicas --replicas 1 2 4 --out bench/results/cpu/replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from bench.serve import Target, mode_max_rps
from bench.serve import parse_args as serve_args
from bench.serve_stack import LocalStack, machine_info


def device_bound_rps(args: argparse.Namespace, max_batch: int) -> float:
    """Requests per second one replica finishes with a full batch, from the cost model: a
    step runs ``max_batch`` sequences, each emits a token, and a request leaves after
    ``--output-len`` of them; the step also prefills the prompts that replace them."""
    finishing_per_step = max_batch / args.output_len
    step_ms = (
        args.sim_base_ms
        + args.sim_decode_us_per_seq * max_batch / 1e3
        + args.sim_prefill_us_per_token * args.input_len * finishing_per_step / 1e3
    )
    return finishing_per_step / (step_ms / 1e3)


def stack_args(args: argparse.Namespace, replicas: int) -> argparse.Namespace:
    """``bench.serve``'s arguments for one ramp; its max-rps mode zeroes the sim's step
    cost (it measures the host path), so the cost model is put back after parsing."""
    argv = [
        "--launch", "sim", "--mode", "max-rps", "--replicas", str(replicas),
        "--group", args.group, "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--request-rate", str(args.start_rps_per_replica * replicas),
        "--step-s", str(args.step_s), "--ramp-factor", str(args.ramp_factor),
        "--max-p99-ms", str(args.max_p99_ms), "--seed", str(args.seed),
    ]  # fmt: skip
    parsed = serve_args(argv)
    parsed.sim_base_ms = args.sim_base_ms
    parsed.sim_prefill_us_per_token = args.sim_prefill_us_per_token
    parsed.sim_decode_us_per_seq = args.sim_decode_us_per_seq
    return parsed


async def one_count(args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    """The max-rps ramp against a fresh stack of ``replicas`` workers."""
    parsed = stack_args(args, replicas)
    stack = LocalStack(parsed)
    try:
        await stack.start()
        target = Target(
            stack.url, stack.model_name, path=f"/v1/{stack.group}/completions",
            max_batch=stack.max_batch, stack=stack, client=parsed.client,
        )  # fmt: skip
        result, _ = await mode_max_rps(parsed, target)
    finally:
        await stack.stop()
    sustained = [s for s in result["steps"] if s["achieved_rps"] <= result["max_sustained_rps"]]
    top = max(sustained, key=lambda s: s["achieved_rps"]) if sustained else None
    return {
        "replicas": replicas,
        "max_batch_per_replica": stack.max_batch,
        "max_sustained_rps": result["max_sustained_rps"],
        "top_step": top,
        "steps": result["steps"],
    }


def step_passed(step: dict[str, Any], max_p99_ms: float) -> bool:
    """The ramp's rule for one step (``bench.serve.mode_max_rps``): p99 within the bound,
    90 % of the offered rate served, nothing failed, the load sent on time."""
    return (
        step["p99_ms"] <= max_p99_ms
        and step["achieved_rps"] >= 0.9 * step["offered_rps"]
        and step["failed"] == 0
        and step.get("send_lag_p99_ms", 0.0) <= max_p99_ms
    )


def without_retries(steps: list[dict[str, Any]], max_p99_ms: float) -> float:
    """The ramp's figure had it never retried a step: it ends at its first miss once it
    has held a rate (a retry that passes holds a rate once of twice)."""
    best, failed_rate = 0.0, None
    for step in steps:
        if not step_passed(step, max_p99_ms):
            if best > 0:
                break
            failed_rate = step["offered_rps"]
        elif step["offered_rps"] != failed_rate:  # a retry of the miss does not count
            best = max(best, step["achieved_rps"])
    return best


def top_step_was_a_retry(steps: list[dict[str, Any]], max_p99_ms: float) -> bool:
    """Whether the step the ramp's figure comes from passed right after missing."""
    passing = [i for i, step in enumerate(steps) if step_passed(step, max_p99_ms)]
    if not passing:
        return False
    top = max(passing, key=lambda i: steps[i]["achieved_rps"])
    before = steps[top - 1] if top > 0 else None
    return (
        before is not None
        and before["offered_rps"] == steps[top]["offered_rps"]
        and not step_passed(before, max_p99_ms)
    )


def summarize(args: argparse.Namespace, counts: list[dict[str, Any]]) -> dict[str, Any]:
    """Each count against one replica (the smallest count run), and the device bound."""
    base = counts[0]
    per_replica = base["max_sustained_rps"] / base["replicas"] if base["replicas"] else 0.0
    bound = device_bound_rps(args, base["max_batch_per_replica"])
    rows = []
    for c in counts:
        ratio = c["max_sustained_rps"] / per_replica if per_replica else 0.0
        cpu = (c["top_step"] or {}).get("cpu", {})
        rows.append(
            {
                "replicas": c["replicas"],
                "max_sustained_rps": c["max_sustained_rps"],
                "vs_one_replica": round(ratio, 2),
                "scaling_efficiency": round(ratio / c["replicas"], 3),
                "device_bound_rps": round(bound * c["replicas"], 1),
                "share_of_device_bound": round(c["max_sustained_rps"] / (bound * c["replicas"]), 3),
                "top_step_was_a_retry": top_step_was_a_retry(c["steps"], args.max_p99_ms),
                "max_sustained_rps_without_retries": without_retries(c["steps"], args.max_p99_ms),
                # Who was busiest at the top step: a gateway near 1.0 is the single
                # process that binds first; the sum near the core count, the machine.
                "cpu_util_at_top_step": {n: v["util"] for n, v in cpu.items()},
            }
        )
    return {"per_count": rows, "device_bound_rps_per_replica": round(bound, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.replicas", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4],
                   help="worker counts to compare; the first is the baseline")  # fmt: skip
    p.add_argument("--group", default="short")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--sim-base-ms", type=float, default=5.0, help="device time per step")
    p.add_argument("--sim-prefill-us-per-token", type=float, default=10.0)
    p.add_argument("--sim-decode-us-per-seq", type=float, default=100.0)
    p.add_argument("--start-rps-per-replica", type=float, default=60.0,
                   help="the ramp's first offered rate, times the replica count")  # fmt: skip
    p.add_argument("--ramp-factor", type=float, default=1.12)
    p.add_argument("--step-s", type=float, default=6.0, help="seconds per offered rate")
    p.add_argument("--max-p99-ms", type=float, default=500.0,
                   help="the SLO: p99 E2E (short's field-study SLO)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    if sorted(args.replicas) != args.replicas or args.replicas[0] < 1:
        p.error("--replicas: positive counts in increasing order")
    return args


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()
    counts = []
    for n in args.replicas:
        print(f"# {n} replica(s)", file=sys.stderr, flush=True)
        counts.append(await one_count(args, n))
    return {
        "benchmark": "replicas",
        "command": " ".join(["python -m bench.replicas", *sys.argv[1:]]),
        "machine": {**machine, "load_avg_after": machine_info()["load_avg"]},
        "config": vars(args),
        "result": summarize(args, counts),
        "ramps": counts,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()  # as bench/serve.py: the load generator's own cost stays small
    report = asyncio.run(bench(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(c["max_sustained_rps"] > 0 for c in report["ramps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
