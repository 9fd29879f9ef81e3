"""A scripted incident: one group's workers slow down under steady load, then heal.

The whole stack runs locally: a nats-server, sim workers for every group (in one child
process that can slow a group's engines on command), the scheduler (``python -m
scheduler``, default breaker settings: 10 samples, wait 10 s open, 3 healthy to close) and
a load generator that routes each request the way the gateway does (its
:class:`~gateway.admission.Admission` over the breaker state in the bucket: an open group's
traffic goes to its fallback, a half-open one lets a share through) and sends it with
:class:`~common.client.QosClient`.

Timeline: ``--warmup-s`` of steady load, then ``--group``'s steps take ``--slowdown-ms``
longer for ``--slow-s`` seconds (60; ``--quick``: 15), then the load goes on until the
breaker has closed (at most ``--max-recovery-s``) and a few seconds more.

Output (JSON on stdout): p99 per group per second (by the group that served the request),
breaker transitions as the gateways saw them, time to open, time to close after healing,
requests sent / completed / rejected / lost (lost must be 0), whether the unaffected groups
stayed within their SLO every second; ``--png FILE`` draws the timeline (matplotlib).

    python -m bench.incident --quick --png incident.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import common.nats as qnats
from common.client import QosClient
from common.config import Config, NatsConfig, SchedulerConfig, default_groups
from common.errors import QosError
from common.protocol import Control, RequestParams
from common.services import NatsServer
from common.subjects import Subjects
from gateway.admission import Admission
from gateway.workers_view import WorkersView

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = {"realtime": 1, "short": 2, "long": 1}
# (requests/s, prompt tokens, max_tokens): e2e well inside each SLO when healthy.
LOAD = {"realtime": (4.0, 16, 8), "short": (10.0, 64, 32), "long": (0.5, 2000, 64)}
STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.incident", description=__doc__.split("\n")[0])
    p.add_argument("--group", default="short", help="the group whose workers slow down")
    p.add_argument("--slow-s", type=float, default=None, help="how long (60; --quick 15)")
    p.add_argument("--slowdown-ms", type=float, default=100.0, help="added to every step")
    p.add_argument("--warmup-s", type=float, default=None, help="steady load first (10; quick 5)")
    p.add_argument("--max-recovery-s", type=float, default=60.0)
    p.add_argument("--quick", action="store_true", help="a 15 s incident")
    p.add_argument("--png", help="write the timeline plot here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-host", help=argparse.SUPPRESS)  # internal: run the workers
    args = p.parse_args(argv)
    args.slow_s = args.slow_s if args.slow_s is not None else (15.0 if args.quick else 60.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (5.0 if args.quick else 10.0)
    return args


def bench_config(nats_url: str) -> Config:
    """The field study's groups and the scheduler's defaults; no metrics ports to clash."""
    return Config(
        nats=NatsConfig(url=nats_url, reconnect_wait_s=0.2),
        groups=default_groups(),
        scheduler=SchedulerConfig(metrics_port=0),
    )


# --- the worker host (a child process) ----------------------------------------------------


async def host_workers(config: Config) -> None:
    """Every group's sim replicas; ``<prefix>.bench.slowdown`` sets a group's slowdown."""
    from workers.service import WorkerOptions, WorkerService
    from workers.sim import SimEngine

    services: list[tuple[WorkerService, SimEngine]] = []
    for group, count in REPLICAS.items():
        gc = config.groups[group]
        for i in range(count):
            engine = SimEngine(max_batch_size=gc.max_batch, max_seq_len=gc.max_seq_len)
            service = WorkerService(config, engine, WorkerOptions(group, f"{group}-{i}"))
            await service.start()
            services.append((service, engine))
    nc = await qnats.connect(config.nats, "bench-worker-host")

    async def on_slowdown(msg: Any) -> None:
        order = json.loads(msg.data)
        for service, engine in services:
            if service.group == order["group"]:
                engine.set_slowdown(order["seconds"])
        await msg.respond(b"ok")

    await nc.subscribe(f"{config.nats.subject_prefix}.bench.slowdown", cb=on_slowdown)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await asyncio.gather(*(service.stop(grace_s=2) for service, _ in services))
    await nc.close()


# --- the load and what it saw -------------------------------------------------------------


@dataclass
class Outcome:
    requested: str
    served: str | None
    start: float
    end: float | None = None
    status: str = "pending"  # ok | rejected | error | lost


class Bench:
    def __init__(self, config: Config, args: argparse.Namespace) -> None:
        self.config, self.args = config, args
        self.outcomes: list[Outcome] = []
        self.breaker_log: list[tuple[float, dict[str, str]]] = []
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)
        self.tasks: set[asyncio.Task[None]] = set()
        self.controls: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, client: QosClient, admission: Admission, group: str) -> None:
        _, prompt_len, max_tokens = LOAD[group]
        out = Outcome(group, None, self.now())
        self.outcomes.append(out)
        try:
            route = await admission.admit(group, prompt_len + max_tokens, 30.0)
        except QosError:
            out.status, out.end = "rejected", self.now()
            return
        out.served = route.group
        try:
            ids, _, _ = await client.collect(
                group=route.group,
                prompt_token_ids=[self.rng.randrange(1, 30000) for _ in range(prompt_len)],
                params=RequestParams(max_tokens=max_tokens, ignore_eos=True),
                timeout_s=120,
            )
            out.status = "ok" if len(ids) == max_tokens else "error"
        except QosError:
            out.status = "error"
        finally:
            out.end = self.now()
            admission.release(route)

    async def drive(self, client: QosClient, admission: Admission, stop: asyncio.Event) -> None:
        async def arrivals(group: str) -> None:
            rate = LOAD[group][0]
            while not stop.is_set():
                task = asyncio.create_task(self.one(client, admission, group))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                await asyncio.sleep(self.rng.expovariate(rate))

        await asyncio.gather(*(arrivals(g) for g in LOAD))

    async def watch(self, view: WorkersView, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.breaker_log.append((self.now(), dict(view.breakers())))
            await asyncio.sleep(0.25)


async def slow(nc: Any, prefix: str, group: str, seconds: float) -> None:
    payload = json.dumps({"group": group, "seconds": seconds}).encode()
    await nc.request(f"{prefix}.bench.slowdown", payload, timeout=5)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with NatsServer(store_dir=workdir / "nats") as server:
        config = bench_config(server.url)
        data = config.model_dump(mode="json") | {"groups_replace_defaults": True}
        (workdir / "qos.yaml").write_text(yaml.safe_dump(data))
        py, cfg = sys.executable, str(workdir / "qos.yaml")
        env = {k: v for k, v in os.environ.items() if not k.startswith("QOS_")}
        children = [
            subprocess.Popen([py, "-m", "bench.incident", "--worker-host", cfg], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=(workdir / "workers.log").open("wb")),
            subprocess.Popen([py, "-m", "scheduler", "--config", cfg], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=(workdir / "scheduler.log").open("wb")),
        ]  # fmt: skip
        try:
            assert children[0].stdout is not None
            await asyncio.to_thread(children[0].stdout.readline)  # "ready"
            return await incident(config, args)
        finally:
            for child in children:
                child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(15)
                except subprocess.TimeoutExpired:
                    child.kill()


async def incident(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(config, args)
    client = await QosClient.connect(config, "bench-load")
    kv = await qnats.ensure_kv(client.js, config.nats)
    view = WorkersView(config.groups)
    await view.start(client.nc, Subjects(config.nats.subject_prefix), kv)
    admission = Admission(config, view)

    async def on_control(msg: Any) -> None:
        c = Control.from_bytes(msg.data)
        bench.controls.append({"t": round(bench.now(), 2), "subject": msg.subject,
                               "action": c.action, "group": c.group, "batch_cap": c.batch_cap})  # fmt: skip

    await client.nc.subscribe(f"{config.nats.subject_prefix}.ctl.>", cb=on_control)
    await view.wait_live(list(config.groups), 10)
    await asyncio.sleep(2.0)  # every replica reported at least once
    stop = asyncio.Event()
    bench.t0 = time.monotonic()
    loops = [asyncio.create_task(bench.drive(client, admission, stop)),
             asyncio.create_task(bench.watch(view, stop))]  # fmt: skip
    prefix, group = config.nats.subject_prefix, args.group
    await asyncio.sleep(args.warmup_s)
    slow_at = bench.now()
    await slow(client.nc, prefix, group, args.slowdown_ms / 1000)
    await asyncio.sleep(args.slow_s)
    healed_at = bench.now()
    await slow(client.nc, prefix, group, 0.0)
    deadline = healed_at + args.max_recovery_s
    while bench.now() < deadline and view.breaker(group) != "closed":
        await asyncio.sleep(0.25)
    await asyncio.sleep(5.0)
    stop.set()
    await asyncio.gather(*loops)
    pending = list(bench.tasks)
    if pending:
        await asyncio.wait(pending, timeout=150)
    for out in bench.outcomes:
        if out.status == "pending":
            out.status = "lost"
    await view.stop()
    await client.close()
    return summarise(bench, config, args, slow_at, healed_at)


# --- results ------------------------------------------------------------------------------


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarise(
    bench: Bench, config: Config, args: argparse.Namespace, slow_at: float, healed_at: float
) -> dict[str, Any]:
    groups = list(config.groups)
    seconds = math.ceil(max((o.end or 0.0) for o in bench.outcomes)) + 1
    per_second: dict[str, list[list[float]]] = {g: [[] for _ in range(seconds)] for g in groups}
    for o in bench.outcomes:
        if o.status == "ok" and o.served and o.end is not None:
            per_second[o.served][int(o.end)].append((o.end - o.start) * 1000)
    p99_series = {g: [round(_p99(v), 1) if v else None for v in per_second[g]] for g in groups}
    transitions: list[dict[str, Any]] = []
    last: dict[str, str] = dict.fromkeys(groups, "closed")
    for t, states in bench.breaker_log:
        for g, s in states.items():
            if s != last[g]:
                transitions.append({"t": round(t, 2), "group": g, "from": last[g], "to": s})
                last[g] = s
    ours = [x for x in transitions if x["group"] == args.group]
    opened = next((x["t"] for x in ours if x["to"] == "open" and x["t"] >= slow_at), None)
    closed = next((x["t"] for x in reversed(ours) if x["to"] == "closed"), None)
    closed = closed if closed is not None and closed >= healed_at else None
    status: defaultdict[str, int] = defaultdict(int)
    for o in bench.outcomes:
        status[o.status] += 1
    per_group = {}
    for g in groups:
        slo = config.groups[g].slo_e2e_p99_ms
        every = [v for v in p99_series[g] if v is not None]
        all_ok = [(o.end - o.start) * 1000 for o in bench.outcomes
                  if o.served == g and o.status == "ok" and o.end is not None]  # fmt: skip
        mine_ok = [(o.end - o.start) * 1000 for o in bench.outcomes
                   if o.requested == g and o.status == "ok" and o.end is not None]  # fmt: skip
        per_group[g] = {
            "slo_ms": slo,
            "p99_ms_overall": round(_p99(all_ok), 1) if all_ok else None,
            "worst_second_p99_ms": max(every, default=None),
            "seconds_over_slo": sum(1 for v in every if v > slo),
            "within_slo_throughout": all(v <= slo for v in every),
            "served": len(all_ok),
            "diverted_here": sum(1 for o in bench.outcomes if o.served == g and o.requested != g),
            # What this group's callers saw, wherever they were served.
            "requested": sum(1 for o in bench.outcomes if o.requested == g),
            "requested_p99_ms": round(_p99(mine_ok), 1) if mine_ok else None,
            "diverted_away": sum(1 for o in bench.outcomes if o.requested == g and o.served
                                 and o.served != g),
            "rejected": sum(1 for o in bench.outcomes if o.requested == g
                            and o.status == "rejected"),
        }  # fmt: skip
    return {
        "bench": "incident",
        "group": args.group,
        "slowdown_ms_per_step": args.slowdown_ms,
        "slow_from_s": round(slow_at, 2),
        "healed_at_s": round(healed_at, 2),
        "time_to_open_s": None if opened is None else round(opened - slow_at, 2),
        "time_to_close_after_heal_s": None if closed is None else round(closed - healed_at, 2),
        "recovered_within_30s": closed is not None and closed - healed_at < 30,
        "requests": {"sent": len(bench.outcomes), **dict(status), "lost": status["lost"]},
        "unaffected_within_slo": all(
            per_group[g]["within_slo_throughout"] for g in groups if g != args.group
        ),
        "per_group": per_group,
        "breaker_transitions": transitions,
        # Scheduler orders seen on <prefix>.ctl.> (aborts from clients left out).
        "controls": [c for c in bench.controls if c["action"] != "abort"],
        "timeline": {
            "p99_ms_per_second": p99_series,
            "breaker": [{"t": round(t, 2), **s} for t, s in bench.breaker_log[::4]],
        },
    }


def plot(result: dict[str, Any], path: str) -> None:
    """p99 per group per second (log scale, SLOs dashed) over the breaker states."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})  # fmt: skip
    colors = {"realtime": "tab:green", "short": "tab:blue", "long": "tab:orange"}
    for g, series in result["timeline"]["p99_ms_per_second"].items():
        xs = [i + 0.5 for i in range(len(series))]
        ys = [math.nan if v is None else v for v in series]  # a second with no answers: a gap
        color = colors.get(g)
        top.plot(xs, ys, marker=".", lw=1.2, color=color, label=f"{g} p99")
        top.axhline(result["per_group"][g]["slo_ms"], ls="--", lw=0.8, color=color)
    for ax in (top, bottom):
        ax.axvspan(result["slow_from_s"], result["healed_at_s"], color="red", alpha=0.08)
    top.set_yscale("log")
    top.set_ylabel("E2E p99 per second (ms)")
    top.set_title(f"incident: {result['group']} +{result['slowdown_ms_per_step']:g} ms/step "
                  f"(shaded); open after {result['time_to_open_s']} s, closed "
                  f"{result['time_to_close_after_heal_s']} s after healing")  # fmt: skip
    top.legend(loc="upper right", fontsize=8)
    end = len(next(iter(result["timeline"]["p99_ms_per_second"].values())))
    for k, g in enumerate(result["per_group"]):
        moves = [x for x in result["breaker_transitions"] if x["group"] == g]
        ts = [0.0] + [x["t"] for x in moves] + [end]
        states = ["closed"] + [x["to"] for x in moves]
        ys = [STATE_VALUE[st] + k * 0.08 for st in [*states, states[-1]]]  # offset: no overlap
        bottom.step(ts, ys, where="post", color=colors.get(g), label=g)
    bottom.set_yticks([0, 1, 2], ["closed", "half-open", "open"])
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_host:
        from common.config import load_config

        asyncio.run(host_workers(load_config(args.worker_host, env={})))
        return 0
    with tempfile.TemporaryDirectory(prefix="qos-incident-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    if args.png:
        plot(result, args.png)
        result["png"] = args.png
    print(json.dumps(result, indent=1))
    return 0 if result["requests"]["lost"] == 0 else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
