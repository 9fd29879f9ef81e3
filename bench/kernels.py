"""Kernel microbenchmark: paged decode and prefill attention next to torch SDPA and a copy.

Decode is bound by reading the cache, so it is reported in GB/s (K/V read plus q and out)
next to SDPA on the same K/V laid out contiguously and next to a device-to-device copy of
the same number of bytes, the bandwidth ceiling. Prefill is reported in TFLOP/s (visible
query-key pairs only) next to SDPA. A few launch configs are swept per shape; the JSON says
which won and what the engine's default choice reaches.

    python -m bench.kernels [--quick] [--out FILE]

GPU times come from CUDA events around CUDA-graph replays (warm-up, median of N). Without
CUDA the Triton kernels are skipped (the interpreter says nothing about speed) and the
``torch`` backend runs a scaled-down shape set, so the script is exercised anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workers.engine.kernels import torch_paged


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context_len: int
    n_heads: int = 32
    n_kv: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    q_len: int
    prefix: int = 0
    n_heads: int = 32
    n_kv: int = 8
    head_dim: int = 128
    block_size: int = 16


# Llama-8B-like heads: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16.
GPU_DECODE = [DecodeShape(64, 2048), DecodeShape(64, 8192), DecodeShape(8, 32768)]
GPU_PREFILL = [PrefillShape(4, 4096), PrefillShape(1, 16384), PrefillShape(8, 512, prefix=8192)]
GPU_DECODE_QUICK = [DecodeShape(8, 2048)]
GPU_PREFILL_QUICK = [PrefillShape(1, 2048)]
CPU_DECODE = [
    DecodeShape(4, 256, 8, 2, 64),
    DecodeShape(2, 1024, 8, 2, 64),
    DecodeShape(16, 2048, 8, 2, 32),  # the demo model's heads, a CPU worker's long batch
]
CPU_PREFILL = [PrefillShape(2, 128, 0, 8, 2, 64), PrefillShape(2, 64, 192, 8, 2, 64)]


# ---- timing -------------------------------------------------------------------------------


def _time_gpu(fn: Callable[[], Any], iters: int, warmup: int) -> tuple[float, str]:
    """Median milliseconds of ``fn`` on the GPU, replayed as a CUDA graph when it captures."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run, mode = fn, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, mode = graph.replay, "cuda_graph"
    except Exception:  # not capturable here: time it eagerly
        torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy while the host enqueues, so no launch gap lands inside the timing.
        torch.cuda._sleep(200_000)
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs), mode


def _time_cpu(fn: Callable[[], Any], iters: int, warmup: int) -> tuple[float, str]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), "host_clock"


def _time_copy(
    nbytes: int, device: str, timer: Callable[..., tuple[float, str]], iters: int, warmup: int
) -> tuple[float, str]:
    """Milliseconds of a device-to-device copy of ``nbytes``: the bandwidth ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), iters, warmup)


def _timer(
    device: str, quick: bool, full: tuple[int, int]
) -> tuple[Callable[..., tuple[float, str]], tuple[int, int]]:
    """The clock for ``device`` and its (iterations, warm-up): few on a CPU or when quick."""
    if device == "cuda":
        return _time_gpu, ((10, 2) if quick else full)
    return _time_cpu, (15, 2)  # milliseconds each: three were noise on a shared host


# ---- inputs -------------------------------------------------------------------------------


def _shuffled_tables(
    batch: int, length: int, block_size: int, gen: torch.Generator, device: str
) -> torch.Tensor:
    """Block tables of a fragmented pool: every sequence's blocks scattered at random."""
    per_seq = length // block_size
    ids = torch.randperm(batch * per_seq, generator=gen, device=device)
    return ids.view(batch, per_seq).to(torch.int32)


def _paged_copy(kv: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Scatter contiguous ``[B, n_kv, L, d]`` into the blocks that ``tables`` names."""
    n_kv, head_dim = kv.shape[1], kv.shape[3]
    blocks = kv.permute(0, 2, 1, 3).reshape(-1, block_size, n_kv, head_dim)
    cache = torch.empty_like(blocks)
    cache[tables.flatten().long()] = blocks
    return cache


def _randn(gen: torch.Generator, *shape: int, like: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=like)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA over ``[B, h, n, d]`` q and ``[B, h_kv, L, d]`` K/V, GQA without expanding K/V."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: expand (SDPA then reads more bytes)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _decode_configs(quick: bool) -> list[Any]:
    from workers.engine.kernels.decode_attention import DecodeConfig

    if quick:
        return [DecodeConfig(64, 4, 2), DecodeConfig(128, 4, 2)]
    return [
        DecodeConfig(32, 4, 2),
        DecodeConfig(64, 4, 2),
        DecodeConfig(64, 4, 3),
        DecodeConfig(128, 4, 2),
        DecodeConfig(128, 8, 2),
    ]


def _prefill_configs(quick: bool) -> list[Any]:
    from workers.engine.kernels.prefill_attention import PrefillConfig

    if quick:
        return [PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 64, 4, 3)]
    return [
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 64, 4, 3),
        PrefillConfig(128, 128, 8, 2),
        PrefillConfig(64, 64, 4, 3),
        PrefillConfig(128, 32, 4, 4),
    ]


# ---- decode -------------------------------------------------------------------------------


def bench_decode(
    shape: DecodeShape,
    dtype: torch.dtype,
    device: str,
    use_triton: bool,
    quick: bool,
    ceiling_gbps: float,
) -> dict:
    """Time one decode step of ``shape``: SDPA, a copy, and Triton or the torch backend;
    ``ceiling_gbps`` is the device's copy bandwidth (``bench.engine.copy_bandwidth``)."""
    timer, (iters, warmup) = _timer(device, quick, full=(50, 5))
    gen = torch.Generator(device=device).manual_seed(0)
    B, L, d = shape.batch, shape.context_len, shape.head_dim
    q = _randn(gen, B, shape.n_heads, d, like=dtype, device=device)
    k = _randn(gen, B, shape.n_kv, L, d, like=dtype, device=device)
    v = _randn(gen, B, shape.n_kv, L, d, like=dtype, device=device)
    tables = _shuffled_tables(B, L, shape.block_size, gen, device)
    k_cache = _paged_copy(k, tables, shape.block_size)
    v_cache = _paged_copy(v, tables, shape.block_size)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    scale = d**-0.5
    elem = torch.finfo(dtype).bits // 8
    nbytes = (2 * B * L * shape.n_kv * d + 2 * B * shape.n_heads * d) * elem
    gbps = lambda ms: nbytes / ms / 1e6  # noqa: E731

    result: dict[str, Any] = {**asdict(shape), "dtype": str(dtype), "bytes": nbytes}
    q4 = q.unsqueeze(2)
    sdpa_out = _sdpa(q4, k, v, causal=False).squeeze(2)
    ms, mode = timer(lambda: _sdpa(q4, k, v, causal=False), iters, warmup)
    result["sdpa_contiguous"] = {"ms": ms, "gbps": gbps(ms), "timing": mode}

    ms, mode = _time_copy(nbytes, device, timer, iters, warmup)
    # The ceiling for reading `bytes`: a copy reads them and writes them again.
    result["copy_same_bytes"] = {"ms": ms, "gbps_moved": 2 * nbytes / ms / 1e6, "timing": mode}

    if not use_triton:

        def torch_backend() -> torch.Tensor:  # what a CPU worker serves with
            return torch_paged.paged_decode_attention_torch(
                q, k_cache, v_cache, tables, lens, scale, L
            )

        ms, mode = timer(torch_backend, iters, warmup)
        err = (torch_backend().float() - sdpa_out.float()).abs().max().item()
        result["torch_backend"] = {"ms": ms, "gbps": gbps(ms), "max_abs_err_vs_sdpa": err}
        return result

    from workers.engine.kernels.decode_attention import (
        choose_num_splits,
        decode_plan,
        paged_decode_attention,
    )

    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    default_cfg, default_splits = decode_plan(B, shape.n_kv, L, d, k_cache.element_size(), sms)
    out = torch.empty_like(q)

    def run(cfg: Any, splits: int) -> dict:
        def step() -> torch.Tensor:
            return paged_decode_attention(
                q, k_cache, v_cache, tables, lens, scale, L,
                num_splits=splits, config=cfg, out=out,
            )  # fmt: skip

        step()
        err = (out.float() - sdpa_out.float()).abs().max().item()
        ms, mode = timer(step, iters, warmup)
        return {"config": asdict(cfg), "num_splits": splits, "ms": ms, "gbps": gbps(ms),
                "timing": mode, "max_abs_err_vs_sdpa": err}  # fmt: skip

    def attempt(cfg: Any, splits: int) -> dict:
        try:
            return run(cfg, splits)
        except Exception as exc:  # a config may not fit (shared memory): note it, go on
            return {"config": asdict(cfg), "num_splits": splits, "error": repr(exc)[:200]}

    tried = [run(default_cfg, default_splits)]
    result["triton_default"] = tried[0]
    for cfg in _decode_configs(quick):
        splits = choose_num_splits(B, shape.n_kv, L, cfg.block_n, sms)
        if (cfg, splits) != (default_cfg, default_splits):
            tried.append(attempt(cfg, splits))
    best = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    best_cfg = type(default_cfg)(**best["config"])
    # Then split counts around the heuristic's, with the best config.
    for splits in sorted({max(1, best["num_splits"] // 2), best["num_splits"] * 2}):
        if splits != best["num_splits"] and splits <= 128:
            tried.append(attempt(best_cfg, splits))
    result["triton_best"] = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    result["triton_tried"] = tried
    # Against the device's one copy ceiling: a copy of just these bytes read slower at the
    # larger shapes on the H200 (2.8 vs 4.2 TB/s), which made the kernel "beat" its ceiling.
    result["triton_best_vs_copy"] = result["triton_best"]["gbps"] / ceiling_gbps
    result["triton_best_vs_sdpa"] = result["sdpa_contiguous"]["ms"] / result["triton_best"]["ms"]
    return result


# ---- prefill ------------------------------------------------------------------------------


def bench_prefill(
    shape: PrefillShape, dtype: torch.dtype, device: str, use_triton: bool, quick: bool
) -> dict:
    """Time causal prefill of ``shape`` after ``prefix`` cached tokens: SDPA and one backend."""
    timer, (iters, warmup) = _timer(device, quick, full=(20, 3))
    gen = torch.Generator(device=device).manual_seed(0)
    B, n, p, d = shape.batch, shape.q_len, shape.prefix, shape.head_dim
    L = p + n
    q = _randn(gen, B * n, shape.n_heads, d, like=dtype, device=device)
    k = _randn(gen, B, shape.n_kv, L, d, like=dtype, device=device)
    v = _randn(gen, B, shape.n_kv, L, d, like=dtype, device=device)
    tables = _shuffled_tables(B, L, shape.block_size, gen, device)
    k_cache = _paged_copy(k, tables, shape.block_size)
    v_cache = _paged_copy(v, tables, shape.block_size)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    cu = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)
    scale = d**-0.5
    # Each query sees the prefix and the queries up to itself: two products of 2*d flops each.
    flops = 4 * B * shape.n_heads * d * (n * p + n * (n + 1) // 2)
    tflops = lambda ms: flops / ms / 1e9  # noqa: E731
    result: dict[str, Any] = {**asdict(shape), "dtype": str(dtype), "flops": flops}

    if p == 0:
        q4 = q.view(B, n, shape.n_heads, d).transpose(1, 2)
        sdpa_out = _sdpa(q4, k, v, causal=True).transpose(1, 2).reshape(B * n, shape.n_heads, d)
        ms, mode = timer(lambda: _sdpa(q4, k, v, causal=True), iters, warmup)
        result["sdpa_contiguous"] = {"ms": ms, "tflops": tflops(ms), "timing": mode}
    else:
        sdpa_out = None  # SDPA's causal mask is top-left aligned: no match for a cached prefix
        result["sdpa_contiguous"] = {"skipped": "is_causal cannot place queries after a prefix"}
    args = (q, k_cache, v_cache, cu, lens, tables, scale)

    if not use_triton:  # what a CPU worker serves with
        serve = torch_paged.paged_prefill_attention_torch
        ms, mode = timer(lambda: serve(*args), iters, warmup)
        result["torch_backend"] = {"ms": ms, "tflops": tflops(ms), "timing": mode}
        if sdpa_out is not None:
            got = serve(*args)
            result["torch_backend"]["max_abs_err_vs_sdpa"] = (
                (got.float() - sdpa_out.float()).abs().max().item()
            )
        return result

    from workers.engine.kernels.prefill_attention import (
        default_prefill_config,
        paged_prefill_attention,
    )

    default_cfg = default_prefill_config(d, shape.n_heads // shape.n_kv, n, dtype)
    out = torch.empty_like(q)

    def run(cfg: Any) -> dict:
        def step() -> torch.Tensor:
            return paged_prefill_attention(*args, max_seqlen_q=n, config=cfg, out=out)

        step()
        row: dict[str, Any] = {"config": asdict(cfg)}
        if sdpa_out is not None:
            row["max_abs_err_vs_sdpa"] = (out.float() - sdpa_out.float()).abs().max().item()
        ms, mode = timer(step, iters, warmup)
        return {**row, "ms": ms, "tflops": tflops(ms), "timing": mode}

    tried = [run(default_cfg)]
    result["triton_default"] = tried[0]
    for cfg in _prefill_configs(quick):
        if cfg != default_cfg:
            try:
                tried.append(run(cfg))
            except Exception as exc:  # a config may not fit (shared memory): note it, go on
                tried.append({"config": asdict(cfg), "error": repr(exc)[:200]})
    timed = [r for r in tried if "ms" in r]
    result["triton_best"] = min(timed, key=lambda r: r["ms"])
    result["triton_tried"] = tried
    if "ms" in result["sdpa_contiguous"]:
        result["triton_best_vs_sdpa"] = (
            result["sdpa_contiguous"]["ms"] / result["triton_best"]["ms"]
        )
    return result


# ---- main ---------------------------------------------------------------------------------


def _summarise(report: dict) -> None:
    """One line per shape on stderr, for a reader skimming a log; stdout stays pure JSON."""
    for r in report["decode"]:
        ours = r.get("triton_best") or r["torch_backend"]
        line = (
            f"decode B={r['batch']} L={r['context_len']}: {ours['gbps']:.0f} GB/s"
            f" (config {ours.get('config', 'torch')}, splits {ours.get('num_splits', '-')}),"
            f" sdpa {r['sdpa_contiguous']['gbps']:.0f} GB/s,"
            f" copy {r['copy_same_bytes']['gbps_moved']:.0f} GB/s moved"
        )
        if "triton_default" in r:
            line += f", default {r['triton_default']['gbps']:.0f} GB/s"
        print(line, file=sys.stderr)
    for r in report["prefill"]:
        ours = r.get("triton_best") or r["torch_backend"]
        sdpa = r["sdpa_contiguous"].get("tflops")
        print(
            f"prefill B={r['batch']} q={r['q_len']} prefix={r['prefix']}: "
            f"{ours['tflops']:.1f} TFLOP/s (config {ours.get('config', 'torch')}), "
            f"sdpa {'-' if sdpa is None else f'{sdpa:.1f}'} TFLOP/s",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print its JSON to stdout (and to ``--out``), and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, configs, iterations")
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    # A CPU worker serves in fp32 (worker.dtype auto), a GPU one in the checkpoint's 16 bits.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "quick": args.quick or not on_gpu,
    }
    if on_gpu:
        import triton

        report["triton"] = triton.__version__
        report["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        decode = GPU_DECODE_QUICK if args.quick else GPU_DECODE
        prefill = GPU_PREFILL_QUICK if args.quick else GPU_PREFILL
    else:
        report["triton_skipped"] = (
            "no CUDA device: the Triton interpreter measures nothing about kernel speed; "
            "timed the torch backend on scaled-down shapes instead"
        )
        decode, prefill = CPU_DECODE, CPU_PREFILL
    quick = bool(report["quick"])
    device = "cuda" if on_gpu else "cpu"
    from bench.engine import copy_bandwidth

    ceiling = copy_bandwidth(device) / 1e9
    report["copy_ceiling_gbps"] = round(ceiling, 1)
    report["decode"] = [bench_decode(s, dtype, device, on_gpu, quick, ceiling) for s in decode]
    if on_gpu:
        torch.cuda.empty_cache()
    report["prefill"] = [bench_prefill(s, dtype, device, on_gpu, quick) for s in prefill]

    text = json.dumps(report, indent=2)
    print(text)
    _summarise(report)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
