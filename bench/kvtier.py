"""KV-tier benchmark, JSON out. Starts its own redis-server on loopback.

- ``redis``: load/store GB/s and ms per block vs connections x sub-batch bytes x value size
  (redis.asyncio with pre-encoded values, no codec), the tier as the engine sees it
  (its own connections reading into numpy rows, checksums, I/O threads) at its defaults, and plain redis-py SET/MGET of 2 MB values as the
  reference, all in the same run. Values of 1/2/4/8 MiB are Llama-8B bf16 blocks of
  8/16/32/64 tokens; 32 KiB is a dummy:tiny block.
- ``fragmentation``: allocated-but-unused KV slots for block sizes 8/16/32/64 on the field
  study's mix (20% long, 30% multi-turn, 50% short; lengths scaled down for a CPU).
- ``multi_turn``: two engines sharing Redis, conversations resending their history; the
  share of history tokens that came from G1/G2/G3 on turns >= 2, with sticky and with
  round-robin routing.
- ``break_even``: time to first token with the prefix loaded from Redis vs computed, by
  prompt length, per model; the formula to evaluate it for another model and device.

    python -m bench.kvtier --quick --out kvtier.json     # CI scale (a few minutes on 2 cores)
    python -m bench.kvtier --out kvtier.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from common.config import RedisConfig
from common.services import RedisServer
from kvstore.identity import KVIdentity, KVLayout
from kvstore.redis_tier import RedisTier, new_event_loop
from kvstore.tiers import KVTiers
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.block_pool import hash_chain
from workers.engine.loader import load_model_config
from workers.engine.model_runner import kv_bytes_per_block

MiB = 1 << 20
DEMO_MODEL = Path(__file__).parent / "models" / "pystd-tiny"


def llama8b_layout(block_size: int) -> KVLayout:
    return KVLayout(block_size, "bfloat16", num_layers=32, num_kv_heads=8, head_dim=128)


# --- Redis throughput ---------------------------------------------------------------------


def _server_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    ops: dict[str, Callable[[], object]], nbytes: int, blocks: int, pid: int | None, reps: int = 3
) -> dict[str, Any]:
    """Per op, medians over ``reps``: wall GB/s and ms per block, and CPU seconds per GB in
    this process (all threads) and in redis-server. On a shared machine wall time says what
    the other jobs left; CPU per GB says what a core buys (what a worker with free cores
    gets)."""
    out: dict[str, Any] = {}
    gb = nbytes / 1e9
    for name, op in ops.items():
        wall, client, server = [], [], []
        for _ in range(reps):
            c0, s0, w0 = time.process_time(), _server_cpu_s(pid), time.perf_counter()
            op()
            wall.append(time.perf_counter() - w0)
            client.append(time.process_time() - c0)
            server.append(_server_cpu_s(pid) - s0)
        out[name] = dict(
            gbps=gb / statistics.median(wall),
            ms_per_block=1000 * statistics.median(wall) / blocks,
            client_cpu_s_per_gb=statistics.median(client) / gb,
            server_cpu_s_per_gb=statistics.median(server) / gb,
        )
    return out


def reference_redis_py(url: str, pid: int | None, value_bytes: int, n: int, reps: int) -> dict:
    """Plain redis-py, the way most code does it: one connection, SET one value at a time,
    MGET four at a time."""
    client = redis.Redis.from_url(url)
    value = os.urandom(value_bytes)
    keys = [f"ref:{i}" for i in range(n)]

    def store() -> None:
        for k in keys:
            client.set(k, value)

    def load() -> None:
        for i in range(0, n, 4):
            client.mget(keys[i : i + 4])

    out = {
        "value_bytes": value_bytes,
        **measure({"store": store, "load": load}, n * value_bytes, n, pid, reps),
    }
    client.flushdb()
    client.close()
    return out


def transport_point(
    url: str, pid: int | None, layout: KVLayout, conns: int, batch: int, total: int, **kw: Any
) -> dict:
    """RedisTier set/get of pre-encoded values: the network path without the codec.
    ``loop="asyncio"`` swaps uvloop for the standard loop."""
    config = RedisConfig(url=url, max_connections=conns, socket_timeout_s=10.0)
    ident = KVIdentity(b"bench\0\0\0", layout)
    n = max(4, total // layout.block_bytes)
    value = os.urandom(layout.block_bytes + 64)
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    loop = asyncio.new_event_loop() if kw.get("loop") == "asyncio" else new_event_loop()
    tier = RedisTier(config, ident, batch_bytes=batch)
    loop.run_until_complete(tier.prefix([bytes(16)]))  # connect outside the timing

    def store() -> None:
        assert loop.run_until_complete(tier.set(hashes, [value] * n)) == n

    def load() -> None:
        assert None not in loop.run_until_complete(tier.get(hashes)), "transport lost values"

    point: dict[str, Any] = dict(
        value_bytes=len(value), connections=conns, batch_bytes=batch, blocks=n, **kw
    )
    point |= measure({"store": store, "load": load}, n * len(value), n, pid)
    loop.run_until_complete(tier.close())
    loop.close()
    return point


def tier_point(url: str, pid: int | None, layout: KVLayout, checksum: str, total: int) -> dict:
    """KVTiers as the engine uses it: checksums and sub-batches on its I/O threads, the
    default RedisConfig; load includes the lookup round trip, as at admission."""
    n = max(4, total // layout.block_bytes)
    data = np.random.default_rng(0).integers(0, 256, (n, layout.block_bytes), dtype=np.uint8)
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    config = RedisConfig(url=url)
    with KVTiers(config, store_queue_bytes=2 * data.nbytes, checksum=checksum) as t:
        t.bind("dummy:bench", 0, layout)

        def store() -> None:
            t.store_async(hashes, data)
            assert t.flush(120)

        def load() -> None:
            assert t.lookup(hashes) == n and len(t.load(hashes)) == n, "tier lost values"

        point: dict[str, Any] = dict(
            checksum=checksum, value_bytes=layout.block_bytes + 64, blocks=n
        )
        point |= measure({"store": store, "load": load}, data.nbytes, n, pid)
        assert t.stats().redis.drops == 0
    return point


def bench_redis(url: str, pid: int | None, quick: bool) -> dict:
    total = (64 if quick else 256) * MiB
    block_sizes = (16, 64) if quick else (8, 16, 32, 64)
    tiny = KVLayout(16, "float32", num_layers=4, num_kv_heads=2, head_dim=32)
    layouts = [tiny] + [llama8b_layout(bs) for bs in block_sizes]
    grid = [(1, 8 * MiB), (4, 8 * MiB), (16, 8 * MiB)]
    if not quick:
        grid += [(4, 2 * MiB), (4, 32 * MiB), (16, 2 * MiB), (16, 32 * MiB)]
    curve = [transport_point(url, pid, lay, c, b, total) for lay in layouts for c, b in grid]
    two_mib = llama8b_layout(16)
    loops = [
        transport_point(url, pid, two_mib, 4, 8 * MiB, total, loop=name)
        for name in ("asyncio", "uvloop")
    ]
    tier = [tier_point(url, pid, two_mib, ck, total) for ck in ("blake2b", "crc32")]
    ref = reference_redis_py(url, pid, 2 * MiB, 32 if quick else 64, 3)
    return dict(reference_redis_py=ref, transport=curve, event_loop=loops, tier_2MiB_blocks=tier)


# --- engine workloads -----------------------------------------------------------------------


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def drain(engines: list[LLMEngine], on_step: Any = None) -> dict[str, list[int]]:
    """Step every engine until all finish; generated tokens by request id."""
    out: dict[str, list[int]] = {}
    while any(e.has_unfinished() for e in engines):
        for e in engines:
            if e.has_unfinished():
                for d in e.step():
                    out.setdefault(d.request_id, []).extend(d.token_ids)
                if on_step is not None:
                    on_step(e)
    return out


def bench_fragmentation(model: str, quick: bool) -> list[dict]:
    """Field-study mix in rounds: shorts and longs arrive each round, multi-turn
    conversations send their next turn (history + answer + a new message)."""
    rng0 = random.Random(7)
    n_rounds = 3
    per_round = 10 if quick else 20
    results = []
    for bs in (8, 16, 32, 64):
        rng = random.Random(rng0.random())
        engine = LLMEngine(
            EngineArgs(model, block_size=bs, num_kv_blocks=16384 // bs, max_batch_size=16)
        )
        vocab = engine.model_config.vocab_size
        convs = [tokens(rng, 64, vocab) for _ in range(int(0.3 * per_round))]
        fr: list[float] = []

        def sample(e: LLMEngine, fr: list[float] = fr) -> None:
            stats = e.stats()
            if stats.num_running:
                fr.append(stats.fragmentation)

        for r in range(n_rounds):
            for i in range(per_round - len(convs)):
                kind_long = i < int(0.2 * per_round)
                p = tokens(rng, rng.randint(384, 768) if kind_long else rng.randint(32, 128), vocab)
                params = SamplingParams(max_tokens=rng.randint(16, 48), ignore_eos=True, seed=i)
                engine.add_request(f"s{r}-{i}", prompt_token_ids=p, params=params)
            for c, hist in enumerate(convs):
                hist += tokens(rng, rng.randint(16, 48), vocab)
                engine.add_request(
                    f"c{c}-{r}",
                    prompt_token_ids=list(hist),
                    params=SamplingParams(max_tokens=32, ignore_eos=True, seed=c),
                )
            outs = drain([engine], sample)
            for c, hist in enumerate(convs):
                hist += outs[f"c{c}-{r}"]
        frag = dict(mean=statistics.fmean(fr), p90=sorted(fr)[int(0.9 * len(fr))])
        hit = engine.stats().prefix_cache_hit_rate
        value = llama8b_layout(bs).block_bytes
        results.append(
            dict(block_size=bs, fragmentation=frag, g1_hit_rate=hit, llama8b_value=value)
        )
    return results


def bench_multi_turn(model: str, url: str, quick: bool) -> dict:
    """Two nodes share Redis; each has a small G1 and G2. Per routing, shares of the resent
    history served by each tier on turns >= 2. A preempted request's hits count again when
    it is readmitted, so the shares are exact only where ``preemptions`` (reported) is 0."""
    out = {}
    n_conv, n_turns = (8, 4) if quick else (16, 6)
    for routing in ("sticky", "round_robin"):
        redis.Redis.from_url(url).flushdb()
        rng = random.Random(11)
        block_bytes = kv_bytes_per_block(load_model_config(model), 16, torch.float32)
        # G1 holds two or three conversations, G2 a few more: all three tiers get work.
        host = 64 * block_bytes
        tiers = [KVTiers(RedisConfig(url=url), host, pin_host=False) for _ in range(2)]
        args = EngineArgs(model, block_size=16, num_kv_blocks=40, max_batch_size=4, watermark=0.1)
        nodes = [LLMEngine(args, kv_tier=t) for t in tiers]
        vocab = nodes[0].model_config.vocab_size
        system = tokens(rng, 64, vocab)
        hist = [list(system) for _ in range(n_conv)]
        got = dict(history=0, block_aligned_max=0, g1=0, g2=0, g3=0)
        for turn in range(n_turns):
            before = [
                (n.stats().prefix_cache_hits, t.stats()) for n, t in zip(nodes, tiers, strict=True)
            ]
            for c in range(n_conv):
                if turn:
                    got["history"] += len(hist[c])
                    # The last generated token never had its K/V computed: full blocks of
                    # the rest are all a cache can hold of this history.
                    got["block_aligned_max"] += ((len(hist[c]) - 1) // 16) * 16
                hist[c] += tokens(rng, 32, vocab)
                node = nodes[c % 2 if routing == "sticky" else (c + turn) % 2]
                node.add_request(
                    f"{c}-{turn}",
                    prompt_token_ids=list(hist[c]),
                    params=SamplingParams(max_tokens=24, ignore_eos=True, seed=c),
                )
            outs = drain(nodes)
            for c in range(n_conv):
                hist[c] += outs[f"{c}-{turn}"]
            if turn:
                for (g1, ts), n, t in zip(before, nodes, tiers, strict=True):
                    now = t.stats()
                    got["g1"] += n.stats().prefix_cache_hits - g1
                    got["g2"] += now.host.hit_tokens - ts.host.hit_tokens
                    got["g3"] += now.redis.hit_tokens - ts.redis.hit_tokens
        for t in tiers:
            t.close()
        h = got.pop("history")
        shares = {f"{k}_share": v / h for k, v in got.items()}
        shares["served_share"] = sum(got[k] for k in ("g1", "g2", "g3")) / h
        preempted = sum(n.stats().num_preemptions for n in nodes)
        out[routing] = dict(history_tokens=h, **shares, preemptions=preempted)
    return out


# --- break-even ---------------------------------------------------------------------------


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    engine.pool.reset_prefix_cache()  # nothing in G1: compute, or load from the tier
    rid = f"t{engine.num_steps}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def bench_break_even(model: str, url: str, quick: bool) -> dict:
    lengths = [32, 128, 512, 1024] if quick else [32, 64, 128, 256, 512, 1024, 1536]
    args = EngineArgs(model, block_size=16, num_kv_blocks=256)
    with KVTiers(RedisConfig(url=url)) as tier:
        plain = LLMEngine(args)
        tiered = LLMEngine(args, kv_tier=tier)
        layout = tiered.runner.kv_layout()
        rng = random.Random(3)
        rows = []
        for n in lengths:
            prompt = tokens(rng, n, plain.model_config.vocab_size)
            ttft(tiered, prompt)  # computes and writes it through
            assert tier.flush(60)
            reps = 3 if quick else 5
            comp = statistics.median(ttft(plain, prompt) for _ in range(reps))
            load = statistics.median(ttft(tiered, prompt) for _ in range(reps))
            ms = dict(compute_ms=1000 * comp, load_ms=1000 * load)
            rows.append(dict(prompt_tokens=n, **ms, prefill_tok_s=n / comp, speedup=comp / load))
        # The fixed cost of asking the tier at all: a lookup and a load of one block.
        one = hash_chain(prompt[:16], 16)
        fixed = statistics.median(_round_trip(tier, one) for _ in range(20))
        s = tier.stats().redis
    bpt = tiered.runner.bytes_per_block() // layout.block_size
    pays = [r["prompt_tokens"] for r in rows if r["speedup"] > 1.0]
    return dict(
        model=model,
        kv_bytes_per_token=bpt,
        rows=rows,
        measured_break_even_tokens=min(pays) if pays else None,
        tier_load_gbps=s.load_gbps,
        tier_fixed_ms=1000 * fixed,
    )


def _round_trip(tier: KVTiers, hashes: list[bytes]) -> float:
    t0 = time.perf_counter()
    assert tier.lookup(hashes) == len(hashes) and len(tier.load(hashes)) == len(hashes)
    return time.perf_counter() - t0


def break_even_formula(bandwidths: dict[str, float], fixed_ms: float) -> dict:
    """Loading L tokens costs t_fixed + L*B/bw, computing them L/tps (more, with attention's
    quadratic term). Loading pays for L > t_fixed / (1/tps - B/bw), never if bw <= B*tps."""
    bpt = 2 * 32 * 8 * 128 * 2  # dummy:llama-8b in bf16: 128 KiB of K/V per token
    out: dict[str, Any] = dict(
        formula="load pays for L > t_fixed / (1/prefill_tok_s - kv_bytes_per_token/bw); "
        "never when bw <= kv_bytes_per_token * prefill_tok_s",
        llama8b_kv_bytes_per_token=bpt,
        t_fixed_ms=fixed_ms,
    )
    for name, bw in bandwidths.items():
        table = {}
        for tps in (2_000, 5_000, 10_000, 20_000, 40_000):
            gap = 1 / tps - bpt / (bw * 1e9)
            table[str(tps)] = None if gap <= 0 else round(fixed_ms / 1000 / gap, 1)
        out[name] = dict(
            bw_gbps=bw,
            pays_below_prefill_tok_s=bw * 1e9 / bpt,
            break_even_tokens_by_prefill_tok_s=table,
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="CI scale")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--only", nargs="*", default=["redis", "fragmentation", "multi_turn", "break_even"]
    )
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    result: dict[str, Any] = {
        "config": {**vars(ns), "cpus": os.cpu_count(), "torch": torch.__version__}
    }
    with RedisServer() as server:
        url = server.url
        if "redis" in ns.only:
            result["redis"] = bench_redis(url, server.pid, ns.quick)
        if "fragmentation" in ns.only:
            result["fragmentation"] = bench_fragmentation(ns.model, ns.quick)
        if "multi_turn" in ns.only:
            result["multi_turn"] = bench_multi_turn(ns.model, url, ns.quick)
        if "break_even" in ns.only:
            models = [ns.model] + ([str(DEMO_MODEL)] if DEMO_MODEL.is_dir() else [])
            result["break_even"] = [bench_break_even(m, url, ns.quick) for m in models]
            bws = {"target_1_gbps": 1.0}
            for point in result.get("redis", {}).get("tier_2MiB_blocks", []):
                load = point["load"]
                bws[f"measured_{point['checksum']}"] = load["gbps"]
                bws[f"one_free_core_{point['checksum']}"] = 1 / load["client_cpu_s_per_gb"]
            fixed = result["break_even"][0]["tier_fixed_ms"]
            result["break_even_llama8b"] = break_even_formula(bws, fixed)
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
