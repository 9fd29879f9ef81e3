"""Batching policies side by side: the same field-mix workload through the full stack.

For each of ``static``, ``dynamic``, ``continuous`` and ``hybrid`` this starts a stack on
loopback (``qosserve up``: nats-server, redis-server, a real-engine worker for ``short`` and
one for ``long``, both on that policy, and the gateway; no scheduler, so no breaker caps a
batch mid-run), then runs, with the same seeds for every policy:

1. a fixed arrival rate (``--rate`` sessions/s for ``--duration-s``): req/s, output tok/s,
   TTFT and E2E p50/p99 per group, goodput under each group's SLOs (``common.config``),
   the engine thread's busy fraction and mean running batch (worker telemetry);
2. a sweep: the rate times each ``--sweep`` factor (geometric by default, each step
   ``--step-s`` long but at least ``--min-sessions`` sessions), lowest first. From it come
   the **rate at SLO** (``bench/slo_rate.py``: the highest offered rate below the first step
   where realtime's or short's E2E p99 exceeds its group SLO, long's TTFT p99 its
   ``slo_ttft_ms``, or under 99 % of requests complete) and the saturation throughput (the
   most req/s any step sustained).

Sessions are the field mix by request (``bench/policies_load.py``): of the valid requests,
20 % long-document questions on the ``long`` group, 30 % turns of three-turn conversations
resending their history, 50 % short generations (the locust file's 5 % invalid requests are
left out: they measure robustness). Runs before 2026-12-01 drew sessions in those
proportions instead: 13 / 56 / 31 % by request.
Ratios are against two baselines. The field study reports 2.9x req/s at the same SLO from
leaving traditional dynamic batching *for continuous batching with instance groups*: its
baseline is ``dynamic/pool``, dynamic batching on one undivided pool of the same workers
(the same two processes, every request on one queue, a long document in the same batch as
short questions). ``dynamic`` -- dynamic batching inside the instance groups -- isolates
what the batching policy alone is worth. Whatever the ratios are, they are printed as
measured. The JSON is rewritten after each policy, so a run cut short by a time limit keeps
the policies it finished.

    python -m bench.policies                 # the demo model on CPU, ~10 min
    python -m bench.policies --quick         # ~3 min (stack start-up is much of it)
    python -m bench.policies --policies dynamic/pool,continuous --rate 3 --out policies.json
    python -m bench.policies --device cuda --model dummy:llama-1b --rate 16   # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.arrivals import arrival_offsets
from bench.output import write_json
from bench.policies_load import UNSENT, Sent, TelemetryLog, make_sessions, run_sessions
from bench.policies_table import table
from bench.policy_spec import POLICIES, POOL_SUFFIX, split_stack_spec
from bench.serve import summarize
from bench.serve_http import CLIENTS
from bench.serve_stack import machine_info
from bench.slo_rate import (
    JUDGED_GROUPS,
    MIN_COMPLETED,
    RateAtSlo,
    StepFigures,
    rate_at_slo,
    ratio_at_slo,
)
from bench.up_stack import UpStack
from common.config import default_groups
from common.models import served_name

BASELINE = "dynamic"
FIELD_BASELINE = "dynamic" + POOL_SUFFIX  # the field study's: no instance groups
DEFAULT_POLICIES = (FIELD_BASELINE, *POLICIES)
FIELD_STUDY_RATIO = 2.9
FIELD_POLICIES = ("continuous", "hybrid")  # what the field study moved to, with groups
POOL_GROUP = "short"  # the one group a pooled stack serves everything on
POOL_REPLICAS = {"realtime": 0, "short": 2, "long": 0}  # the grouped stack's short + long
GROUPED_REPLICAS = {"realtime": 0}  # short and long: one replica each
# Admission sheds (429) are the stack working as designed under overload: they count against
# the SLO (fewer than 99 % completed) but do not make the run a failure.
SHED_STATUS = "429"


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
        # How late the load generator sent (it shares the cores with the stack): latencies
        # are timed from the send, so lag would hide in them unjudged.
        "send_lag_p99_ms": figures["send_lag_ms"]["p99"],
    }


async def phase(
    stack: UpStack,
    tel: TelemetryLog,
    args: argparse.Namespace,
    n: int,
    rate: float,
    seed: int,
    pool: str | None = None,
) -> dict[str, Any]:
    """``n`` sessions at ``rate``/s; figures per group, with the telemetry of the window.

    ``pool``: every request goes to that group; figures stay per kind of session (a long
    document is still reported, and judged, as ``long``)."""
    sessions = make_sessions(n, seed, args.long_tokens, doc_pool=args.long_doc_pool)
    t0 = time.monotonic()
    sent, duration = await run_sessions(
        stack.url,
        served_name(args.model),
        sessions,
        arrival_offsets(n, rate, 1.0, seed),
        args.client,
        pool=pool,
    )
    figures = group_figures(sent, duration)
    return {
        "offered_sessions_s": round(rate, 4),
        "sessions": n,
        "requests": len(sent),
        "groups": {g: brief(f) for g, f in figures.items()},
        "errors": figures["all"]["errors"],
        "engine": tel.window(t0, time.monotonic()),
    }


def step_figures(step: dict[str, Any]) -> StepFigures:
    """A phase's figures as the SLO check reads them (groups with no completion have no p99)."""
    every = step["groups"]["all"]
    groups = {g: f for g, f in step["groups"].items() if g != "all"}
    done = {g: f for g, f in groups.items() if f["completed"] > 0}
    sent = every["completed"] + every["failed"]
    return StepFigures(
        step["offered_sessions_s"], every["req_s"], sent, every["completed"],
        {g: f["e2e_p99_ms"] for g, f in done.items()},
        {g: f["ttft_p99_ms"] for g, f in done.items()},
        {g: f["completed"] + f["failed"] for g, f in groups.items()},
        {g: f["completed"] for g, f in groups.items()},
        every.get("send_lag_p99_ms"),  # absent from results written before it was kept
    )  # fmt: skip


def completed_all(step: dict[str, Any]) -> bool:
    """Whether a phase completed its requests (``MIN_COMPLETED`` of them, overall and in
    every group sent any), as the rate at SLO asks."""
    f = step_figures(step)
    if f.sent == 0 or f.completed < MIN_COMPLETED * f.sent:
        return False
    return all(
        f.completed_by_group.get(g, 0) >= MIN_COMPLETED * sent
        for g, sent in f.sent_by_group.items()
    )


def sweep_slo(sweep: list[dict[str, Any]]) -> RateAtSlo:
    """The rate at SLO of a sweep, under the groups' SLOs of ``common.config`` (E2E p99
    for the interactive groups, TTFT p99 for long: see ``bench/slo_rate.py``)."""
    groups = default_groups()
    e2e = {g: c.slo_e2e_p99_ms for g, c in groups.items()}
    ttft = {g: c.slo_ttft_ms for g, c in groups.items()}
    return rate_at_slo([step_figures(s) for s in sweep], e2e, slo_ttft_ms=ttft)


def slo_summary(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """The rate at SLO over the sweep; each step is marked met or not, and why."""
    found = sweep_slo(sweep)
    verdicts = {v.offered: v for v in found.steps}
    for step in sweep:
        verdict = verdicts[step["offered_sessions_s"]]
        step["slo_met"], step["slo_miss"] = verdict.met, verdict.why
    return {
        "rate_sessions_s": found.rate,
        "req_s": found.req_s,
        "first_miss_sessions_s": found.first_miss,
    }


async def measure(stack: UpStack, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Warm-up, the fixed-rate phase, the sweep; against a started stack."""
    pool = POOL_GROUP if split_stack_spec(policy).pooled else None
    async with TelemetryLog(stack.nats_url) as tel:
        warm = make_sessions(4, 999, args.long_tokens, doc_pool=args.long_doc_pool)
        await run_sessions(
            stack.url, served_name(args.model), warm, [0.0] * 4, args.client, pool=pool
        )
        n_fixed = max(4, round(args.rate * args.duration_s))
        fixed = await phase(stack, tel, args, n_fixed, args.rate, args.seed, pool)
        print(f"  {policy}: fixed {fixed['groups']['all']}", file=sys.stderr, flush=True)
        sweep = []
        for i, factor in enumerate(args.sweep):
            rate = args.rate * factor
            n = max(args.min_sessions, round(rate * args.step_s))
            step = await phase(stack, tel, args, n, rate, args.seed + 100 + i, pool)
            sweep.append(step)
            g = step["groups"]
            short = g.get("short", {}).get("e2e_p99_ms")
            print(
                f"  {policy}: {rate:.3g}/s short E2E p99 {short} ms, all {g['all']}",
                file=sys.stderr,
                flush=True,
            )
    return {"fixed_rate": fixed, "sweep": sweep, "slo": slo_summary(sweep),
            **saturation(sweep, fixed)}  # fmt: skip


def saturation(sweep: list[dict[str, Any]], fixed: dict[str, Any]) -> dict[str, Any]:
    """The most completed req/s (and its output tok/s) of a phase that completed its
    requests: a step that refused the expensive long documents with 429s read up to 1.8x
    higher on the grouped stacks, which refused, than on the pool, which queued. The fixed
    phase when none did."""
    whole = [s for s in [*sweep, fixed] if completed_all(s)] or [fixed]
    best = max(whole, key=lambda s: s["groups"]["all"]["req_s"])
    return {
        "saturation_req_s": best["groups"]["all"]["req_s"],
        "saturation_out_tok_s": best["groups"]["all"]["out_tok_s"],
        "saturation_offered_sessions_s": best.get("offered_sessions_s"),
    }


def stack_config(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """The stack's config overrides for ``spec`` (a policy, ``@F`` its prefill delay
    factor, ``/pool`` one undivided pool): both serving groups on it."""
    policy, delay, pooled = split_stack_spec(spec)
    both: dict[str, Any] = {"policy": policy, "prefill_delay_factor": delay}
    if args.max_batch:  # the groups' own (short 16, long 2) suit two CPU cores, not a GPU
        both["max_batch"] = args.max_batch
    # The longest session is a long-document prompt plus its answer; the long group's own
    # limit (128k) would ask a model without that context, or a small KV cache, for it.
    fits_long = max(4096, 2 * args.long_tokens)
    return {
        "groups": {
            # Pooled: short's batch and SLOs, long enough for every request.
            "short": {**both, "max_seq_len": fits_long} if pooled else both,
            "long": {**both, "max_seq_len": fits_long},
        },
        "worker": {"telemetry_interval_s": 0.5},
    }


def replicas_for(spec: str) -> dict[str, int]:
    """Two workers either way: short + long, or both on the pool."""
    return POOL_REPLICAS if split_stack_spec(spec).pooled else GROUPED_REPLICAS


def run_policy(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    """A fresh stack on ``spec`` (:func:`stack_config`); measured, then stopped."""
    config = stack_config(args, spec)
    started = time.perf_counter()
    stack = UpStack(
        engine="real",
        model=args.model,
        device=args.device,
        config=config,
        replicas=replicas_for(spec),
    )
    with stack:
        ready_s = time.perf_counter() - started
        result = asyncio.run(measure(stack, args, spec))
    result["stack_start_s"] = round(ready_s, 1)
    return result


def ratios(results: dict[str, Any], baseline: str = BASELINE) -> dict[str, Any]:
    """Each policy against ``baseline``: throughputs up is better, latencies down is better."""
    if baseline not in results:
        return {}
    base = results[baseline]
    out: dict[str, Any] = {}
    for policy, r in results.items():
        row: dict[str, Any] = {}
        for key in ("req_s", "out_tok_s", "goodput_req_s", "ttft_p99_ms", "e2e_p99_ms"):
            a = r["fixed_rate"]["groups"]["all"][key]
            b = base["fixed_rate"]["groups"]["all"][key]
            row[f"fixed_{key}"] = round(a / b, 3) if a is not None and b else None
        sat, sat_base = r["saturation_req_s"], base["saturation_req_s"]
        row["saturation_req_s"] = round(sat / sat_base, 3) if sat_base else None
        at_slo = ratio_at_slo(sweep_slo(r["sweep"]), sweep_slo(base["sweep"]))
        row["slo_rate"] = at_slo["ratio"]
        row["slo_rate_low"], row["slo_rate_high"] = at_slo["low"], at_slo["high"]
        out[policy] = row
    return out


def sweep_factors(text: str) -> list[float]:
    """``a,b,c`` as given, or ``LO:HI:N``: N factors from LO to HI, evenly spaced in log."""
    if ":" in text:
        lo, hi, n = text.split(":")
        low, high, steps = float(lo), float(hi), int(n)
        if steps < 2 or low <= 0 or high <= low:
            raise ValueError(f"sweep {text!r}: want 0 < LO < HI and N >= 2")
        return [round(low * (high / low) ** (i / (steps - 1)), 4) for i in range(steps)]
    factors = sorted(float(x) for x in text.split(",") if x)
    if not factors or factors[0] <= 0:
        raise ValueError(f"sweep {text!r}: want positive factors")
    return factors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.policies", description=__doc__.split("\n")[0])
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="run in this order; continuous@F / hybrid@F with prefill delay factor F; "
        "POLICY/pool on one undivided pool of the same workers (no instance groups)",
    )
    p.add_argument("--model", default="demo", help="checkpoint folder, dummy:<shape> or demo")
    p.add_argument("--device", default="cpu", help="the workers' device: cpu (default) or cuda")
    p.add_argument("--rate", type=float, default=2.0, help="fixed phase: sessions per second")
    p.add_argument("--duration-s", type=float, default=15.0, help="fixed phase length")
    p.add_argument(
        "--sweep",
        default="0.25:4:9",
        help="factors of --rate: a,b,c or LO:HI:N (N factors, geometric); default 0.25:4:9",
    )
    p.add_argument("--step-s", type=float, default=7.0, help="seconds per sweep step")
    p.add_argument("--min-sessions", type=int, default=8, help="sessions per sweep step, at least")
    p.add_argument("--long-tokens", type=int, default=1024, help="long-document prompt tokens")
    p.add_argument(
        "--long-doc-pool",
        type=int,
        default=0,
        help="0: a new document per long-document question (default); N: N shared ones "
        "(their prefixes are cache hits; results before 2026-12-02 shared 4)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="short's and long's max batch (default: the groups', 16 and 2)",
    )
    p.add_argument("--client", default="raw", choices=CLIENTS, help="load generator's client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="short phases (~3 min in all)")
    p.add_argument("--out", help="write the JSON here too (after each policy)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.duration_s, args.step_s, args.long_tokens = 6.0, 4.0, 512
        args.min_sessions = min(args.min_sessions, 6)
        args.sweep = "0.5:4:4" if args.sweep == "0.25:4:9" else args.sweep
    try:
        args.sweep = sweep_factors(args.sweep)
    except ValueError as exc:
        p.error(str(exc))
    if args.long_doc_pool < 0:
        p.error("--long-doc-pool must be 0 (a new document each question) or more")
    args.policy_list = [x for x in args.policies.split(",") if x]
    for spec in args.policy_list:
        try:
            split_stack_spec(spec)
        except ValueError as exc:
            p.error(str(exc))
    return args


def report(args: argparse.Namespace, machine: dict[str, Any], results: dict[str, Any],
           started: float) -> dict[str, Any]:  # fmt: skip
    """The JSON document for the policies measured so far."""
    groups = default_groups()
    return {
        "benchmark": "policies",
        "command": " ".join(["python -m bench.policies", *args.argv]),
        "machine": {**machine, "load_avg_after": machine_info()["load_avg"]},
        "model": args.model,
        "device": args.device,
        "workload": {
            "mix": "by request: 20 % long-document QA (long group), 30 % turns of 3-turn "
            "conversations, 50 % short (before 2026-12-01: sessions in those proportions)",
            "rate_sessions_s": args.rate,
            "duration_s": args.duration_s,
            "sweep_factors": args.sweep,
            "step_s": args.step_s,
            "min_sessions": args.min_sessions,
            "long_tokens": args.long_tokens,
            "long_doc_pool": args.long_doc_pool,
            "max_batch": {g: args.max_batch or groups[g].max_batch for g in ("short", "long")},
            "client": args.client,
            "slos_ms": {g: [c.slo_ttft_ms, c.slo_e2e_p99_ms] for g, c in groups.items()},
        },
        "slo_definition": {
            "judged_groups": list(JUDGED_GROUPS),
            "metric": "E2E p99 within the group's slo_e2e_p99_ms; long's TTFT p99 within its "
            "slo_ttft_ms",
            "min_completed": MIN_COMPLETED,
            "rate": "highest offered sessions/s below the first sweep step that misses",
        },
        "results": results,
        "ratios_vs_dynamic": ratios(results),
        "ratios_vs_pooled_dynamic": ratios(results, FIELD_BASELINE),
        "field_study_ratio": FIELD_STUDY_RATIO,
        "field_study_comparison": field_comparison(results),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def field_comparison(results: dict[str, Any]) -> dict[str, Any] | None:
    """The field study's comparison: the best grouped continuous/hybrid run against
    ``dynamic/pool``, by rate at SLO (None until both have run)."""
    if FIELD_BASELINE not in results:
        return None
    rel = ratios(results, FIELD_BASELINE)
    specs = {p: split_stack_spec(p) for p in results}
    candidates = [p for p, s in specs.items() if not s.pooled and s.policy in FIELD_POLICIES]
    if not candidates:
        return None

    def bounds(p: str) -> tuple[float, float]:
        # What the sweep proves first (the ratio's low bound), then the point ratio.
        r = rel[p]
        return (r["slo_rate_low"] or 0.0, r["slo_rate"] or 0.0)

    best = max(candidates, key=bounds)
    ratio, low, high = (rel[best][k] for k in ("slo_rate", "slo_rate_low", "slo_rate_high"))
    # Judged by the bracket, not the point ratio: a geometric sweep's ratios are powers of
    # its step, so the point ratio met or missed a target between two of them by the grid.
    if low is not None and low >= FIELD_STUDY_RATIO:
        met: bool | None = True
    elif high is not None and high < FIELD_STUDY_RATIO:
        met = False
    else:
        met = None  # the bracket straddles the target: a finer sweep decides
    return {
        "baseline": FIELD_BASELINE,
        "policy": best,
        "slo_rate_ratio": ratio,
        "slo_rate_ratio_low": low,
        "slo_rate_ratio_high": high,
        "saturation_req_s_ratio": rel[best]["saturation_req_s"],
        "target": FIELD_STUDY_RATIO,
        "met": met,
    }


def unexpected_errors(result: dict[str, Any]) -> int:
    """Failed requests other than admission sheds (and the later turns a failed one left
    unsent), in every phase of one policy."""
    phases = [result["fixed_rate"], *result["sweep"]]
    return sum(
        n
        for ph in phases
        for key, n in ph["errors"].items()
        if not key.startswith(SHED_STATUS) and UNSENT not in key
    )


def main(argv: list[str] | None = None) -> int:
    """Run every policy; JSON on stdout, the tables on stderr; exit 1 when a request failed
    for a reason other than an admission shed."""
    args = parse_args(argv)
    started = time.perf_counter()
    machine = machine_info()
    results: dict[str, Any] = {}
    for policy in args.policy_list:
        results[policy] = run_policy(args, policy)
        if args.out:  # a run cut short by a time limit keeps what it finished
            write_json(Path(args.out), report(args, machine, results, started))
    doc = report(args, machine, results, started)
    print(
        table(results, doc["ratios_vs_dynamic"], doc["ratios_vs_pooled_dynamic"]), file=sys.stderr
    )
    print(json.dumps(doc, indent=2))
    if args.out:
        write_json(Path(args.out), doc)
    return 1 if any(unexpected_errors(r) for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
