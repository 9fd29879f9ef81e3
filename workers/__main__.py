"""``python -m workers`` / ``qosserve-worker``: run one worker replica of an instance group.

Examples::

    qosserve-worker --group short --model demo                  # the demo model
    qosserve-worker --group realtime --model /models/Llama-3.2-1B --device cuda
    qosserve-worker --group short --engine sim --sim-base-ms 0  # message plane only

Configuration comes from ``--config`` / ``QOS_CONFIG`` and ``QOS_*`` variables
(:mod:`common.config`); flags override the ``worker.*`` keys they name. SIGTERM or SIGINT
drains gracefully (``--grace-s``) and exits 0. ``/metrics`` is served on
``--metrics-port`` (default ``worker.metrics_port``, 0 = a free port, logged and put in the
heartbeat); traces follow the ``OTEL_*`` variables (:mod:`common.tracing`), off when unset.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import runtime
from common.config import Config, load_config, with_settings
from common.errors import ConfigError
from common.lifecycle import run_until_signalled
from common.logging import add_log_flags, log_config_from, setup_logging
from common.models import configured_served_name
from common.tracing import init_tracing
from workers.service import WorkerOptions, WorkerService

log = logging.getLogger("workers")

# `--model demo`: the model bench/train_tiny.py trains (bench/models/pystd-tiny).
DEMO_MODEL = Path(__file__).resolve().parents[1] / "bench" / "models" / "pystd-tiny"


def default_worker_id() -> str:
    """``<hostname>-<pid>``, made a valid subject token."""
    raw = f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:128]


def resolve_model(model: str) -> str:
    """``demo`` → the demo model's folder; anything else unchanged."""
    if model != "demo":
        return model
    if not (DEMO_MODEL / "config.json").is_file():
        raise ConfigError(
            f"the demo model is not at {DEMO_MODEL}; train it with `python -m bench.train_tiny` "
            "or pass --model PATH (or dummy:tiny)"
        )
    return str(DEMO_MODEL)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qosserve worker", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config file (else $QOS_CONFIG, else defaults)")
    p.add_argument("--group", required=True, help="instance group to serve (e.g. short)")
    p.add_argument("--model", help="model folder, dummy:<shape> or demo (default worker.model)")
    p.add_argument("--engine", choices=("real", "sim"), default="real",
                   help="engine kind (default real; sim: a timed simulation, no model run)")  # fmt: skip
    p.add_argument("--worker-id", default=None, help="default <hostname>-<pid>")
    p.add_argument("--nats-url", help="overrides nats.url")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (default worker.device)")
    p.add_argument("--dtype", help="auto | float32 | float16 | bfloat16 (default worker.dtype)")
    p.add_argument("--kv-cache-gib", type=float, help="KV cache size (default worker.kv_cache_gib)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="this worker's share of its GPU (default worker.gpu_memory_utilization)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3"),
                   help="KV cache storage (default worker.kv_cache_dtype)")  # fmt: skip
    p.add_argument("--policy", choices=("static", "dynamic", "continuous", "hybrid"),
                   help="batching policy (default: the group's)")  # fmt: skip
    p.add_argument("--max-batch", type=_positive_int,
                   help="engine batch size (default: the largest group's); a group's max_batch "
                        "still caps what runs: raise groups.<group>.max_batch to run more")  # fmt: skip
    p.add_argument("--max-seq-len", type=_positive_int,
                   help="context length (default: the longest group's, within the model's); a "
                        "group's max_seq_len still caps its requests")  # fmt: skip
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="seconds to drain on SIGTERM before requests are handed back (default 30)")  # fmt: skip
    p.add_argument("--engine-stuck-s", type=float, default=60.0,
                   help="seconds one engine step may take before the device counts as hung: "
                        "requests handed back, exit 1 (default 60)")  # fmt: skip
    p.add_argument(
        "--coalesce-ms", type=float, help="chunk coalescing (default worker.coalesce_ms)"
    )
    sim = p.add_argument_group("simulated engine (--engine sim)")
    from workers.sim import SimCost

    fitted = SimCost()  # an H200 running a 1B model (workers/sim.py)
    sim.add_argument("--sim-base-ms", type=float, default=fitted.base_s * 1e3,
                     help="fixed cost of a step, ms (default %(default).3g: an H200, 1B model)")  # fmt: skip
    sim.add_argument("--sim-prefill-us-per-token", type=float,
                     default=fitted.prefill_s_per_token * 1e6,
                     help="cost of a prompt token, µs (default %(default).3g)")  # fmt: skip
    sim.add_argument("--sim-decode-us-per-seq", type=float, default=fitted.decode_s_per_seq * 1e6,
                     help="cost of a running sequence a step, µs (default %(default).3g)")  # fmt: skip
    sim.add_argument("--sim-slowdown-ms", type=float, default=0.0, help="extra time per step")
    sim.add_argument("--tokenizer", help="tokenizer folder for sim text (default: the model's)")
    p.add_argument("--metrics-port", type=int,
                   help="/metrics port, 0 = a free one (default worker.metrics_port)")  # fmt: skip
    add_log_flags(p)
    return p


def _positive_int(text: str) -> int:
    """An argparse type: 0 read as "unset" here (the group's limit) and was taken silently."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _apply_flags(config: Config, args: argparse.Namespace) -> Config:
    worker: dict[str, Any] = {}
    for flag, key in (("model", "model"), ("device", "device"), ("dtype", "dtype"),
                      ("kv_cache_gib", "kv_cache_gib"), ("coalesce_ms", "coalesce_ms"),
                      ("kv_cache_dtype", "kv_cache_dtype"),
                      ("gpu_memory_utilization", "gpu_memory_utilization"),
                      ("metrics_port", "metrics_port")):  # fmt: skip
        if getattr(args, flag) is not None:
            worker[key] = getattr(args, flag)
    nats = {"url": args.nats_url} if args.nats_url else {}
    return with_settings(config, "flags", worker=worker, nats=nats)


def build_engine(config: Config, args: argparse.Namespace) -> Any:
    """The engine the flags ask for (slow for a real model: loads weights)."""
    group = config.groups[args.group]
    # Built for every group, not only the first: the scheduler may move this replica, and
    # the service then applies the new group's limits within these (see _apply_group_limits).
    max_batch = args.max_batch or max(g.max_batch for g in config.groups.values())
    widest = max(g.max_seq_len for g in config.groups.values())
    if args.engine == "sim":
        from workers.sim import SimCost, SimEngine

        engine = SimEngine(
            max_batch_size=max_batch,
            max_seq_len=args.max_seq_len or widest,
            cost=SimCost(
                base_s=args.sim_base_ms / 1e3,
                prefill_s_per_token=args.sim_prefill_us_per_token / 1e6,
                decode_s_per_seq=args.sim_decode_us_per_seq / 1e6,
            ),
            tokenizer=_sim_tokenizer(args.tokenizer or config.worker.model),
        )
        engine.set_slowdown(args.sim_slowdown_ms / 1e3)
        return engine
    from workers.engine import EngineArgs, LLMEngine
    from workers.engine.loader import load_model_config

    model = resolve_model(config.worker.model)
    model_max = load_model_config(model).context_len  # a sliding window caps it
    engine_args = EngineArgs(
        model=model,
        policy=args.policy or group.policy,
        prefill_delay_factor=group.prefill_delay_factor,
        priority_preemption=group.priority_preemption,
        priority_aging_s=group.priority_aging_s,
        max_batch_size=max_batch,
        max_num_batched_tokens=max(2048, max_batch),
        # The longest group's limit within the model's context and, unless the flag asked
        # for it, within what the KV cache holds: the worker serves what it can and says so
        # in its telemetry (the gateway limits the group to it).
        max_seq_len=args.max_seq_len or min(widest, model_max),
        fit_max_seq_len=args.max_seq_len is None,
        kv_cache_gib=config.worker.kv_cache_gib,
        gpu_memory_utilization=config.worker.gpu_memory_utilization,
        kv_cache_dtype=config.worker.kv_cache_dtype,
        device=config.worker.device,
        dtype=config.worker.dtype,
    )
    return LLMEngine(engine_args, kv_tier=build_kv_tier(config))


def build_kv_tier(config: Config) -> Any | None:
    """The host/Redis KV tiers the config asks for, or None when both are off."""
    worker = config.worker
    if not worker.kv_redis and worker.kv_host_cache_gib <= 0:
        return None
    from kvstore.tiers import KVTiers

    return KVTiers(
        config.redis if worker.kv_redis else None,
        host_capacity_bytes=int(worker.kv_host_cache_gib * (1 << 30)),
        checksum=worker.kv_checksum,
    )


def _sim_tokenizer(source: str) -> Any | None:
    """A folder's tokenizer for the sim's text; None (ids only) for anything else."""
    if source == "demo":
        source = str(DEMO_MODEL)
    if not Path(source).is_dir():
        return None
    from common.tokenizer import load_tokenizer

    return load_tokenizer(source)


def exit_while_loading(sig: int) -> None:
    """SIGTERM/SIGINT before the service starts: nothing is held yet (no connection, no
    request), so exit now. Without a handler the signal was lost on a container's PID 1
    (which ignores what it does not handle), and a pod stopped during a minutes-long load
    went on to fetch requests, then was killed holding them."""
    log.info("signal %d while loading the model: exiting", sig)
    os._exit(128 + sig)


async def serve(config: Config, args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # run_until_signalled replaces them
        loop.add_signal_handler(sig, exit_while_loading, sig)
    engine = await asyncio.to_thread(build_engine, config, args)
    runtime.settle_heap()  # the engine (and its model, if real) is loaded: freeze it
    runtime.share_gil_quickly()  # the engine thread steps while this loop moves messages
    model_name = configured_served_name(config.gateway.served_model_name, config.worker.model)
    options = WorkerOptions(
        group=args.group,
        worker_id=args.worker_id or default_worker_id(),
        model=model_name,
        grace_s=args.grace_s,
        engine_stuck_s=args.engine_stuck_s,
    )
    service = WorkerService(config, engine, options)
    return await run_until_signalled(service)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qosserve-worker`` and ``python -m workers``."""
    args = build_parser().parse_args(argv)
    try:
        config = _apply_flags(load_config(args.config), args)
        config.log = log_config_from(config.log, args)
        setup_logging("worker", config.log)
        args.worker_id = args.worker_id or default_worker_id()
        init_tracing("qosserve-worker", instance_id=args.worker_id)
        if args.group not in config.groups:
            raise ConfigError(f"--group {args.group!r}: not one of {sorted(config.groups)}")
        if args.worker_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", args.worker_id):
            raise ConfigError(f"--worker-id {args.worker_id!r}: use [A-Za-z0-9_-]{{1,128}}")
        group = config.groups[args.group]
        if args.max_batch is not None and args.max_batch > group.max_batch:
            # Said, not silently capped: the group's limit applies to every replica in it.
            log.warning("--max-batch %d: group %s runs at most %d at a time "
                        "(groups.%s.max_batch)", args.max_batch, args.group, group.max_batch,
                        args.group)  # fmt: skip
        return runtime.run(serve(config, args))
    except ConfigError as exc:
        print(f"qosserve-worker: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad OTEL_* value
        print(f"qosserve-worker: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"qosserve-worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
