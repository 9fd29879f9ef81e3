"""Where a decode step's device time goes, kernel by kernel (CUDA only).

Wraps an engine's step function: a window of ``steps`` consecutive decode steps of one
batch size runs under ``torch.profiler`` (CUPTI sees the kernels a CUDA graph replays), and
the kernels' device time is summed per kind — GEMM (cuBLAS / CUTLASS), paged attention
(our Triton decode/prefill kernels), KV store, fused elementwise (Triton RMSNorm/RoPE/SiLU),
sampling, copies, other — as ms per step, with the costliest kernels by name. That is the
figure to hold against the roofline: which part of the step is over its bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from workers.engine.engine import LLMEngine

# Kernel name fragment -> kind, first match wins (names are lower-cased first).
KINDS: tuple[tuple[str, str], ...] = (
    ("decode_stage1", "attention"),
    ("decode_stage2", "attention"),
    ("prefill_kernel", "attention"),
    ("attention", "attention"),
    ("store_kv", "kv_store"),
    ("gumbel", "sampling"),
    ("sample", "sampling"),
    ("rms", "elementwise"),
    ("rope", "elementwise"),
    ("silu", "elementwise"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("nvjet", "gemm"),
    ("xmma", "gemm"),
    ("memcpy", "copy"),
    ("memset", "copy"),
    ("copy", "copy"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for frag, kind in KINDS if frag in low), "other")


class KernelProfile:
    """``step`` runs ``engine.step`` (or ``inner``) and profiles one window of decode steps:
    after ``skip`` decode steps of ``batch`` sequences, the next ``steps`` ones."""

    def __init__(
        self,
        engine: LLMEngine,
        batch: int,
        skip: int = 16,
        steps: int = 8,
        inner: Callable[[], list[Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.batch = batch
        self.skip = skip
        self.window = steps
        self.inner = inner or engine.step
        self.seen = 0
        self.profiled = 0
        self._prof: Any = None
        self.result: dict[str, Any] = {}

    def _decoding_full_batch(self) -> bool:
        running = self.engine.batcher.running
        return len(running) == self.batch and not any(r.is_prefilling for r in running)

    def step(self) -> list[Any]:
        if self._prof is None and not self.result and self._decoding_full_batch():
            self.seen += 1
            if self.seen > self.skip:
                torch.cuda.synchronize()
                self._prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]
                )
                self._prof.__enter__()
        out = self.inner()
        if self._prof is not None:
            self.profiled += 1
            if self.profiled == self.window or not self._decoding_full_batch():
                torch.cuda.synchronize()
                prof, self._prof = self._prof, None
                try:  # a profiler failure must not cost the benchmark's own figures
                    prof.__exit__(None, None, None)
                    self.result = summarize_kernels(prof, self.profiled)
                except Exception as exc:  # reported in the JSON instead
                    self.result = {"error": f"{type(exc).__name__}: {exc}"}
        return out


def summarize_kernels(prof: Any, steps: int, top: int = 12) -> dict[str, Any]:
    """ms per step per kind and the ``top`` kernels, from a finished profiler."""
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, tuple[float, int]] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.time_range.elapsed_us()
        by_kind[kind_of(evt.name)] += us
        total, count = by_name.get(evt.name, (0.0, 0))
        by_name[evt.name] = (total + us, count + 1)
    per_step = {k: round(v / 1e3 / steps, 3) for k, v in sorted(by_kind.items())}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "device_ms_per_step": round(sum(by_kind.values()) / 1e3 / steps, 3),
        "ms_per_step_by_kind": per_step,
        "top_kernels": [
            {"name": name[:120], "ms_per_step": round(t / 1e3 / steps, 3), "calls": n // steps}
            for name, (t, n) in ranked
        ],
    }
