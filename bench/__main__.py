"""``qosserve bench NAME [ARGS]``: run one benchmark module of this package by name."""

from __future__ import annotations

import runpy
import sys

# The runnable benchmarks and tools of bench/ (the other modules are their parts).
COMMANDS: dict[str, str] = {
    "engine": "offline throughput per batching policy vs transformers, roofline",
    "kernels": "paged decode/prefill attention vs torch SDPA and a device copy",
    "eager_step": "a prefill step that is no graph replay: host vs device time, kernels",
    "warmup": "a fresh replica's first requests with and without the engine's warm-up",
    "host_step": "host work per step from kept arrays vs lists rebuilt (block tables, penalties)",
    "guided": "guided decoding's cost: output tok/s guided vs not, a row's mask time",
    "tool_calls": "reading streamed tool calls: each format fed a character at a time",
    "priority": "urgent requests into a full engine with and without priority preemption",
    "aging": "less urgent requests under a steady urgent stream: strict priority vs aging",
    "serve": "serving benchmark through the gateway (like vllm bench serve)",
    "replicas": "capacity by worker replica count: the most req/s within the SLO for 1, 2, 4 …",
    "policies": "the four batching policies side by side through the full stack",
    "golden": "golden set scored with EM and ROUGE-L through the served stack",
    "kvtier": "KV tiers: Redis GB/s, hit rates, fragmentation, break-even",
    "kvquant": "KV quantisation quality: fp32 vs int8 vs fp8 KV",
    "incident": "scripted incident: breaker opens, falls back, recovers",
    "chaos": "soak under random faults (worker, NATS, Redis, scheduler, gateway) and bad input",
    "tracing_overhead": "tracing on vs off through the gateway",
    "tracing_hooks": "CPU per request tracing adds in-process: request-path hooks, encoding",
    "locust_run": "locust headless with the field mix against a stack it starts",
    "report": "one Markdown report with plots from every result in bench/results",
    "make_golden": "rebuild bench/data/golden.jsonl and its references",
    "train_tiny": "train the demo model pystd-tiny",
}


def available() -> list[str]:
    """Names ``qosserve bench`` accepts."""
    return sorted(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not args or args[0] in ("-h", "--help"):
        print("usage: qosserve bench NAME [ARGS]   (NAME --help for its options)")
        for name in names:
            print(f"  {name:<17} {COMMANDS[name]}")
        return 0 if args else 2
    name = args[0]
    if name not in names:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [f"qosserve bench {name}", *args[1:]]
    from common.errors import QosError

    try:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except QosError as exc:  # a bad flag or model, in one line, as the services say it
        print(f"qosserve bench {name}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
