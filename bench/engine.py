"""Engine benchmark: the four batching policies side by side on one workload, JSON out.

Offline mode (nano-vllm's protocol): ``--num-seqs`` random prompts, input and output lengths
uniform in ``[--min-len, --max-len]``, ``ignore_eos``, fixed seed. Every policy runs the same
requests; reported: output tok/s, req/s, in-engine mean TTFT and TPOT, and ratios against
``static``. ``--hf-baseline`` adds ``transformers.generate`` static batching on the same
prompts. The roofline divides the bytes a decode step must read (weights + KV) by the
measured device copy bandwidth.

Online mode (``--arrival-rate R``): the same requests arrive as a Poisson process of R per
second and each policy serves them as they come (TTFT and E2E p50/p99 are then serving
latencies): the regime of a worker behind the gateway, without the message plane, to tell
the engine's share of a serving result from the rest.

Fixed-shape mode (``--fixed-batch B --input-len I --output-len O``): B identical-length
requests decoded together; reports the decode step time against its roofline.

    python -m bench.engine                      # CPU defaults: dummy:tiny, 32 seqs, 16..128
    python -m bench.engine --model dummy:llama-8b --dtype bf16 \\
        --fixed-batch 256 --input-len 512 --output-len 128   # the H200 comparison
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.arrivals import arrival_offsets
from bench.engine_phases import PhaseTimer
from bench.engine_profile import KernelProfile
from bench.engine_schedule import count_steps
from bench.percentiles import pct
from bench.policy_spec import POLICIES, split_spec
from bench.provenance import git_state
from workers.engine import EngineArgs, LLMEngine, SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass
class StepLog:
    """Per-step figures, to split prefill from decode and compare decode with its roofline."""

    seconds: list[float] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    context_tokens: list[int] = field(default_factory=list)  # KV tokens read by the step


def make_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)
    ]
    return Workload(prompts, [rng.randint(min_len, max_len) for _ in range(n)])


def engine_args(ns: argparse.Namespace, policy: str, **over: Any) -> EngineArgs:
    kw: dict[str, Any] = dict(
        model=ns.model,
        policy=policy,
        device=ns.device,
        dtype=ns.dtype,
        max_batch_size=ns.max_batch_size,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        enforce_eager=ns.enforce_eager,
        seed=ns.seed,
    )
    if ns.kv_cache_gib is not None:
        kw["kv_cache_gib"] = ns.kv_cache_gib
    if ns.num_kv_blocks is not None:
        kw["num_kv_blocks"] = ns.num_kv_blocks
    kw.update(over)
    return EngineArgs(**kw)


def drive(
    engine: LLMEngine,
    work: Workload,
    temperature: float,
    seeded: bool = True,
    step: Callable[[], list[Any]] | None = None,
    arrivals: list[float] | None = None,
) -> tuple[float, list[Any], StepLog]:
    """Submit the requests, step to the end; (wall seconds, outputs, step log).

    ``step`` replaces ``engine.step`` (a timed wrapper, say). ``arrivals``: seconds from
    the start at which each request arrives (online serving); None: all at once."""
    log = StepLog()
    step = step or engine.step
    outputs: dict[str, Any] = {}
    total = len(work.prompts)
    due = arrivals if arrivals is not None else [0.0] * total
    added = 0
    start = time.perf_counter()
    start_wall = time.time()
    while added < total or engine.has_unfinished():
        now = time.perf_counter() - start
        while added < total and due[added] <= now:
            seed = added if seeded else None
            params = SamplingParams(
                temperature=temperature,
                max_tokens=work.output_lens[added],
                ignore_eos=True,
                seed=seed,
            )
            # Online: its scheduled arrival, not now (one due during a step waited for it).
            # Offline: stamped as added, distinct, so "newest" still picks preemption victims.
            engine.add_request(
                str(added),
                prompt_token_ids=work.prompts[added],
                params=params,
                arrival_time=None if arrivals is None else start_wall + due[added],
            )
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[added] - now))  # idle until the next arrival
            continue
        t0 = time.perf_counter()
        deltas = step()
        dt = time.perf_counter() - t0
        for d in deltas:
            if d.output is not None:
                outputs[d.request_id] = d.output
        if engine.last_step_num_tokens == 0:
            time.sleep(0.0005)  # a dynamic batch still collecting
            continue
        log.seconds.append(dt)
        log.is_decode.append(engine.last_step_num_tokens == engine.last_step_num_seqs)
        log.batch.append(engine.last_step_num_seqs)
        log.context_tokens.append(sum(r.num_computed_tokens for r in engine.batcher.running))
    wall = time.perf_counter() - start
    return wall, [outputs[str(i)] for i in range(len(work.prompts))], log


def warm_up(engine: LLMEngine) -> None:
    engine.add_request("warm", prompt_token_ids=[1] * 8, params=SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()


def copy_bandwidth(device: torch.device | str) -> float:
    """Device memory bandwidth in bytes/s (read + write counted): the median of 20 copies of
    1 GiB (64 MiB on a CPU), each timed alone (CUDA events on a GPU). The one ceiling both
    the roofline here and ``bench.kernels``' percentages divide by."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = (1024 if cuda else 64) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(20 if cuda else 5):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(seconds)


class Roofline:
    """Decode step time if it only had to stream its bytes at copy bandwidth."""

    def __init__(self, engine: LLMEngine) -> None:
        model = engine.runner.model
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if model.lm_head is not None:  # a step reads only B rows of an untied embedding
            emb = model.model.embed_tokens
            self.weight_bytes -= emb.numel() * emb.element_size()
        cfg = engine.model_config
        elem = torch.empty((), dtype=engine.dtype).element_size()
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        self.bandwidth = copy_bandwidth(engine.device)

    def step_seconds(self, context_tokens: int) -> float:
        return (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.bandwidth

    def summary(self, batch: int, context_per_seq: int) -> dict[str, Any]:
        t = self.step_seconds(batch * context_per_seq)
        return {
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "copy_bandwidth_gb_s": round(self.bandwidth / 1e9, 2),
            "example_step": {
                "batch": batch,
                "context_per_seq": context_per_seq,
                "predicted_step_ms": round(t * 1e3, 3),
                "predicted_tok_s": round(batch / t, 1),
            },
        }


def summarize(wall: float, outputs: list[Any], log: StepLog, roof: Roofline) -> dict[str, Any]:
    n_out = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [
        (o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    e2e = sorted(o.metrics.finish_time - o.metrics.arrival_time for o in outputs)
    ttft_sorted = sorted(ttft)
    decode = [i for i, d in enumerate(log.is_decode) if d]
    decode_s = sum(log.seconds[i] for i in decode)
    roof_s = sum(roof.step_seconds(log.context_tokens[i]) for i in decode)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": n_out,
        "output_tok_s": round(n_out / wall, 2),
        "req_s": round(len(outputs) / wall, 3),
        "mean_ttft_ms": round(1e3 * statistics.fmean(ttft), 2),
        "mean_tpot_ms": round(1e3 * statistics.fmean(tpot), 2) if tpot else None,
        "ttft_p50_ms": round(1e3 * pct(ttft_sorted, 50), 2),
        "ttft_p99_ms": round(1e3 * pct(ttft_sorted, 99), 2),
        "e2e_p50_ms": round(1e3 * pct(e2e, 50), 2),
        "e2e_p99_ms": round(1e3 * pct(e2e, 99), 2),
        "steps": len(log.seconds),
        "decode_steps": len(decode),
        "mean_decode_batch": round(statistics.fmean(log.batch[i] for i in decode), 2)
        if decode
        else 0,
        "decode_s": round(decode_s, 3),
        "mean_decode_step_ms": round(1e3 * decode_s / len(decode), 3) if decode else None,
        "roofline_decode_s": round(roof_s, 4),
        "decode_vs_roofline": round(decode_s / roof_s, 2) if roof_s else None,
        "preemptions": sum(o.metrics.num_preemptions for o in outputs),
    }


def run_policies(ns: argparse.Namespace) -> dict[str, Any]:
    online = ns.arrival_rate is not None
    result: dict[str, Any] = {"mode": "online" if online else "offline", "policies": {}}
    arrivals = arrival_offsets(ns.num_seqs, ns.arrival_rate, 1.0, ns.seed) if online else None
    work: Workload | None = None
    roof: Roofline | None = None
    rounds: dict[str, list[dict[str, Any]]] = {spec: [] for spec in ns.policies}
    # Each round starts one policy later: run once in a fixed order, a ratio measured the
    # host's drift and each policy's place in the order (static's own rate moved 12.4k ->
    # 18.5k tok/s across runs of one code on the H200; continuous/static read 1.33x, 0.87x
    # and 0.78x).
    order = [ns.policies[(i + r) % len(ns.policies)] for r in range(ns.repeats)
             for i in range(len(ns.policies))]  # fmt: skip
    for spec in order:
        policy, delay = split_spec(spec)
        engine = LLMEngine(
            engine_args(ns, policy, max_wait_ms=ns.max_wait_ms, prefill_delay_factor=delay)
        )
        if work is None:
            vocab = min(engine.model_config.vocab_size, 32000)
            work = make_workload(ns.num_seqs, ns.min_len, ns.max_len, vocab, ns.seed)
            roof = Roofline(engine)
            result["workload"] = {
                "num_seqs": ns.num_seqs,
                "min_len": ns.min_len,
                "max_len": ns.max_len,
                "input_tokens": sum(map(len, work.prompts)),
                "output_tokens": sum(work.output_lens),
                "seed": ns.seed,
                "temperature": ns.temperature,
                "ignore_eos": True,
                "arrival_rate": ns.arrival_rate,  # Poisson req/s; None: all at once
            }
            result["engine"] = {
                "num_kv_blocks": engine.pool.num_blocks,
                "max_seq_len": engine.max_seq_len,
                "backend": engine.backend,
                "dtype": str(engine.dtype),
                "device": str(engine.device),
            }
        assert roof is not None
        warm_up(engine)
        timer = PhaseTimer(engine) if ns.phases else None
        step = timer.step if timer is not None else None
        wall, outputs, log = drive(engine, work, ns.temperature, step=step, arrivals=arrivals)
        summary = summarize(wall, outputs, log, roof)
        if timer is not None:
            summary["phases_ms"] = {
                "decode": timer.summary(),
                "prefill": timer.summary(decode=False),
            }
        rounds[spec].append(summary)
        print(f"{spec} (round {len(rounds[spec])}): {summary}", file=sys.stderr)
        # The timer's wrappers hold the engine too: drop both before the next engine sizes
        # its KV cache from the free device memory.
        del engine, timer, step
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    assert work is not None and roof is not None
    if not online:  # the bound assumes every request is there from the start
        result["schedule_bound"] = schedule_bound(ns, work, result["engine"])
    batch = min(ns.max_batch_size, ns.num_seqs)
    result["roofline"] = roof.summary(batch, (ns.min_len + ns.max_len) * 3 // 4)
    for spec, runs in rounds.items():  # the round of median throughput stands for it
        median_run = sorted(runs, key=lambda s: s["output_tok_s"])[(len(runs) - 1) // 2]
        result["policies"][spec] = median_run
        if len(runs) > 1:
            median_run["rounds_output_tok_s"] = [s["output_tok_s"] for s in runs]
    if "static" in rounds:
        result["ratios_vs_static"] = {
            p: paired_ratios(runs, rounds["static"]) for p, runs in rounds.items()
        }
    if ns.hf_baseline:
        result["hf_baseline"] = hf_baseline(ns, work)
        hf = result["hf_baseline"].get("output_tok_s")
        if hf:
            result["ratios_vs_hf"] = {
                p: round(r["output_tok_s"] / hf, 3) for p, r in result["policies"].items()
            }
    return result


def paired_ratios(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's figures over the same round's ``base``, the median over rounds (and,
    with several rounds, their range): rounds pair runs made close together in time."""

    def median_ratio(key: str) -> tuple[float, float, float]:
        ratios = [r[key] / b[key] for r, b in zip(runs, base, strict=True)]
        return statistics.median(ratios), min(ratios), max(ratios)

    out: dict[str, Any] = {}
    for name, key in (("output_tok_s", "output_tok_s"), ("req_s", "req_s"),
                      ("mean_ttft", "mean_ttft_ms")):  # fmt: skip
        mid, low, high = median_ratio(key)
        out[name] = round(mid, 3)
        if len(runs) > 1:
            out[f"{name}_range"] = [round(low, 3), round(high, 3)]
    return out


def schedule_bound(
    ns: argparse.Namespace, work: Workload, engine: dict[str, Any]
) -> dict[str, Any]:
    """Each policy's step count with no model (``bench/engine_schedule.py``) and the gain over
    ``static`` that step count allows if every step cost the same."""
    counts = {
        policy: count_steps(
            split_spec(policy)[0],
            work.prompts,
            work.output_lens,
            max_batch_size=ns.max_batch_size,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            num_blocks=engine["num_kv_blocks"],
            block_size=ns.block_size,
            max_seq_len=engine["max_seq_len"],
        )
        for policy in ns.policies
    }
    static = counts.get("static")
    if static:
        for c in counts.values():
            c["step_ratio_vs_static"] = round(static["steps"] / c["steps"], 3)
    return counts


def hf_model(ns: argparse.Namespace) -> tuple[Any, torch.device] | None:
    """``transformers``' model of ``--model`` on the engine's device and dtype, warmed up
    and set to ignore EOS as the engine runs do; None without transformers."""
    try:
        import transformers as tf
    except ImportError:
        return None
    from workers.engine.args import resolve_device, resolve_dtype
    from workers.engine.loader import DUMMY_SHAPES, is_dummy, load_model_config

    device = resolve_device(ns.device)
    # The engine's own resolution, so both sides run the same dtype.
    dtype = resolve_dtype(ns.dtype, device, load_model_config(ns.model).checkpoint_dtype)
    if is_dummy(ns.model):
        shape = dict(DUMMY_SHAPES[ns.model.split(":", 1)[1]])
        kind = shape.pop("model_type")
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[kind]
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(cls(**shape), dtype=dtype)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(ns.model, dtype=dtype).to(device)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as in the engine runs
    with torch.no_grad():  # warm-up, as the engine runs have (CUDA context, kernels)
        warm = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=device)
        model.generate(warm, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    return model, device


def hf_baseline(ns: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """``transformers.generate`` in static batches of ``--max-batch-size`` (left padded)."""
    built = hf_model(ns)
    if built is None:
        return {"skipped": "transformers is not installed"}
    model, device = built
    bs = ns.max_batch_size
    n_out = 0
    start = time.perf_counter()
    for i in range(0, len(work.prompts), bs):
        batch = work.prompts[i : i + bs]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        new = max(work.output_lens[i : i + bs])
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        n_out += sum(work.output_lens[i : i + bs])  # useful tokens only
    wall = time.perf_counter() - start
    return {
        "wall_s": round(wall, 3),
        "output_tok_s": round(n_out / wall, 2),
        "req_s": round(len(work.prompts) / wall, 3),
        "batch": bs,
    }


def hf_decode_step(ns: argparse.Namespace, prompts: list[list[int]], o_len: int) -> dict[str, Any]:
    """``transformers.generate``'s decode step on the fixed shape, measured as the engine's
    is: the batch generating ``o_len`` tokens less the batch generating 1 (its prefill and
    first token), over the ``o_len - 1`` decode steps between. Its rate is B / that step,
    the same definition as the engine's ``decode_tok_s``."""
    built = hf_model(ns)
    if built is None:
        return {"skipped": "transformers is not installed"}
    model, device = built
    ids = torch.tensor(prompts, device=device)
    # Every position real: without a mask, transformers infers one from pad_token_id, and
    # a prompt token 0 (random prompts hold some) would be masked, the batch then sent
    # down SDPA's masked path: other prompts, and a slower baseline, than the engine's.
    mask = torch.ones_like(ids)

    def timed(new: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    first, whole = timed(1), timed(o_len)
    step = (whole - first) / max(1, o_len - 1)
    return {
        "decode_step_ms": round(step * 1e3, 3),
        "decode_tok_s": round(len(prompts) / step, 1) if step > 0 else None,
        "prefill_and_first_token_s": round(first, 3),
        "whole_s": round(whole, 3),
    }


def run_fixed(ns: argparse.Namespace) -> dict[str, Any]:
    """B requests of I prompt tokens, O output tokens each, decoded as one batch."""
    b, i_len, o_len = ns.fixed_batch, ns.input_len, ns.output_len
    over: dict[str, Any] = {"max_batch_size": b, "max_seq_len": i_len + o_len + ns.block_size}
    on_cpu = ns.device == "cpu" or (ns.device == "auto" and not torch.cuda.is_available())
    if on_cpu and ns.kv_cache_gib is None and ns.num_kv_blocks is None:
        over["num_kv_blocks"] = b * (-(-(i_len + o_len) // ns.block_size) + 1)
    engine = LLMEngine(engine_args(ns, "continuous", **over))
    roof = Roofline(engine)
    warm_up(engine)
    vocab = min(engine.model_config.vocab_size, 32000)
    rng = random.Random(ns.seed)
    work = Workload([[rng.randrange(vocab) for _ in range(i_len)] for _ in range(b)], [o_len] * b)
    timer = PhaseTimer(engine) if ns.phases else None
    step = timer.step if timer is not None else None
    kernels = None
    if ns.profile_kernels and engine.device.type == "cuda":
        kernels = KernelProfile(engine, b, inner=step)
        step = kernels.step
    wall, outputs, log = drive(engine, work, ns.temperature, seeded=not ns.unseeded, step=step)
    summary = summarize(wall, outputs, log, roof)
    decode = [k for k, d in enumerate(log.is_decode) if d and log.batch[k] == b]
    step_s = statistics.median(log.seconds[k] for k in decode) if decode else float("nan")
    mid_ctx = b * (i_len + o_len // 2)
    predicted = roof.step_seconds(mid_ctx)
    engine_info = {
        "model": ns.model,
        "dtype": str(engine.dtype),
        "device": str(engine.device),
        "backend": engine.backend,
        "cuda_graphs": bool(engine.runner._graphs),
    }
    phases = {"phases_ms": timer.summary(b)} if timer is not None else {}
    kernel_figures = {"kernels": kernels.result} if kernels is not None else {}
    baseline: dict[str, Any] = {}
    if ns.hf_baseline:  # the same prompts, once the engine and its KV cache are gone
        del engine, timer, kernels, step  # step is timer's or kernels' bound method
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        hf = hf_decode_step(ns, work.prompts, o_len)
        if hf.get("decode_tok_s"):
            hf["engine_speedup"] = round((b / step_s) / hf["decode_tok_s"], 2)
        baseline = {"transformers": hf}
    return {
        "mode": "fixed",
        "shape": {"batch": b, "input_len": i_len, "output_len": o_len},
        "engine": engine_info,
        "decode_step_ms_median": round(step_s * 1e3, 3),
        "roofline_step_ms": round(predicted * 1e3, 3),
        "decode_vs_roofline": round(step_s / predicted, 2),
        "decode_tok_s": round(b / step_s, 1),
        "roofline_tok_s": round(b / predicted, 1),
        "run": summary,
        "roofline": roof.summary(b, i_len + o_len // 2),
        **phases,
        **kernel_figures,
        **baseline,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; continuous@F / hybrid@F run with prefill_delay_factor F",
    )
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        help="online mode: requests arrive as a Poisson process of this many per second "
        "(default: all at once, offline)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--hf-baseline", action="store_true")
    p.add_argument("--fixed-batch", type=int, default=None)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--unseeded", action="store_true", help="requests carry no seed")
    p.add_argument(
        "--phases",
        action="store_true",
        help="host/device ms per step phase (offline mode: per policy, decode and prefill)",
    )
    p.add_argument(
        "--profile-kernels",
        action="store_true",
        help="fixed mode, CUDA: device ms per step by kernel kind (torch.profiler)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every policy, each round starting one policy later; ratios are the "
        "median of each round's (default 1)",
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    ns = p.parse_args(argv)
    if ns.repeats < 1:
        p.error("--repeats must be at least 1")
    ns.policies = [s.strip() for s in ns.policies.split(",") if s.strip()]
    for spec in ns.policies:
        try:
            split_spec(spec)
        except ValueError as exc:
            p.error(str(exc))
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    result = run_fixed(ns) if ns.fixed_batch else run_policies(ns)
    args = list(sys.argv[1:] if argv is None else argv)
    result = {
        "benchmark": "engine",
        "command": shlex.join(["python", "-m", "bench.engine", *args]),
        "git": git_state(),
        **result,
    }
    result["config"] = {
        **{k: v for k, v in vars(ns).items() if k != "out"},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
