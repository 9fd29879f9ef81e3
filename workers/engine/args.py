"""EngineArgs: every knob of one engine instance, validated in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.errors import ConfigError
from workers.engine.kernels.kv_quant import KV_QUANT_DTYPES

POLICIES = ("static", "dynamic", "continuous", "hybrid")
BACKEND_CHOICES = ("auto", "torch", "triton")
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16")
# "auto": the KV cache holds the model dtype; the others quantise (workers/engine/kernels/kv_quant.py).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3", "int8")
MAX_BATCH_SIZE = 65535  # CUDA grid axis z, where the prefill kernel puts the sequences

# Default KV budget on CPU, where there is no free-memory figure worth profiling.
DEFAULT_CPU_KV_CACHE_GIB = 0.5


@dataclass
class EngineArgs:
    """Configuration of one :class:`~workers.engine.engine.LLMEngine`.

    ``model`` is a local Hugging Face folder or a ``dummy:<shape>`` spec. The KV cache is sized
    by ``num_kv_blocks`` if given, else ``kv_cache_gib`` if given, else (CUDA) what a profile
    run leaves of this engine's share ``gpu_memory_utilization`` of the device's memory
    (vLLM's per-instance meaning: engines sharing a GPU each take a part; the cache never
    takes more than is free), or (CPU) ``DEFAULT_CPU_KV_CACHE_GIB``. ``max_seq_len=None`` means the model's context length,
    capped to what the KV cache can hold. ``kv_cache_dtype`` "int8" or "fp8_e4m3" stores
    K/V quantised with a scale per token per KV head (about half the bytes of bf16).
    ``async_output`` (default: on CUDA) launches step N+1 before reading step N's tokens
    back, so the host's bookkeeping overlaps the device's work (see ``LLMEngine.step``).
    """

    model: str
    tokenizer: str | None = None
    policy: str = "hybrid"
    block_size: int = 16
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_batch_size: int = 64
    max_seq_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_wait_ms: float = 10.0
    # continuous/hybrid: hold new arrivals back while others run, up to this many times the
    # last admitting step's duration and at most max_wait_ms, to prefill them together
    # (batcher.py, "Prefill delay").
    prefill_delay_factor: float = 0.0
    # hybrid: a waiting request more urgent than running ones that the batch size or the
    # blocks keep out preempts the least urgent of them (batcher.py, "Priority preemption").
    priority_preemption: bool = True
    # hybrid: seconds of waiting worth one priority level (0: strict priority, as vLLM).
    priority_aging_s: float = 0.0
    # A max_seq_len the KV cache cannot hold: refuse to start (an explicit choice), or, with
    # this, serve what the cache holds (a worker sized for every group's limit: the gateway
    # learns the real one from its telemetry).
    fit_max_seq_len: bool = False
    # Share of blocks kept free when admitting new requests, so running decodes can grow.
    watermark: float = 0.01
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_output: bool | None = None
    # Run the step shapes a replica meets first before serving, so Triton compiles their
    # kernels then, not inside users' first requests (workers/engine/warmup.py). None: on
    # where kernels compile (CUDA with the triton backend).
    warmup: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field."""

        def bad(param: str, message: str) -> ConfigError:
            return ConfigError(f"EngineArgs.{param}: {message}", param=param)

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a model folder or a 'dummy:<shape>' spec")
        if self.policy not in POLICIES:
            raise bad("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if not _is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise bad("block_size", f"must be an integer in [1, 1024], got {self.block_size!r}")
        if self.kv_cache_gib is not None and not (
            isinstance(self.kv_cache_gib, int | float) and self.kv_cache_gib > 0
        ):
            raise bad("kv_cache_gib", f"must be > 0, got {self.kv_cache_gib!r}")
        if self.num_kv_blocks is not None and (
            not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1
        ):
            raise bad("num_kv_blocks", f"must be an integer >= 1, got {self.num_kv_blocks!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        # The prefill kernel's grid has a step's sequences on CUDA's axis z (at most 65535).
        if not _is_int(self.max_batch_size) or not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise bad(
                "max_batch_size",
                f"must be an integer in [1, {MAX_BATCH_SIZE}], got {self.max_batch_size!r}",
            )
        if self.max_seq_len is not None and (not _is_int(self.max_seq_len) or self.max_seq_len < 2):
            raise bad("max_seq_len", f"must be an integer >= 2, got {self.max_seq_len!r}")
        if not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be an integer >= 1")
        if self.max_num_batched_tokens < self.max_batch_size and self.policy == "hybrid":
            raise bad(
                "max_num_batched_tokens",
                f"must be >= max_batch_size ({self.max_batch_size}) so every running "
                "request can decode in one step",
            )
        if not isinstance(self.max_wait_ms, int | float) or self.max_wait_ms < 0:
            raise bad("max_wait_ms", "must be >= 0")
        if not isinstance(self.priority_aging_s, int | float) or not (
            0 <= self.priority_aging_s <= 86400
        ):
            raise bad("priority_aging_s", "must be in [0, 86400] seconds")
        if not isinstance(self.prefill_delay_factor, int | float) or not (
            0 <= self.prefill_delay_factor <= 100
        ):
            raise bad("prefill_delay_factor", "must be in [0, 100]")
        if not 0.0 <= self.watermark < 0.5:
            raise bad("watermark", "must be in [0, 0.5)")
        if self.backend not in BACKEND_CHOICES:
            raise bad("backend", f"must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise bad("dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise bad(
                "kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}",
            )
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise bad("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not _is_int(self.seed):
            raise bad("seed", "must be an integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when there is one, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"EngineArgs.device: {name!r} asked but CUDA is not available", param="device"
        )
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """``auto``: on CUDA the checkpoint's own 16-bit dtype (``float16`` / ``bfloat16`` in its
    config), else bf16 (an fp32 checkpoint is served in bf16, as vLLM does); fp32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return (
        _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16
    )


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` is the model dtype; ``int8`` / ``fp8_e4m3`` are quantised storage dtypes."""
    if name == "auto":
        return model_dtype
    return KV_QUANT_DTYPES[name]


def check_fp8_support(backend: str, kv_cache_dtype: str, device: torch.device) -> None:
    """``ConfigError`` for an fp8 KV cache on a GPU whose Triton has no fp8 e4m3 (compute
    capability below 8.9: A100, A10, RTX 3090): said here, by name, rather than as Triton's
    bare "type fp8e4nv not supported" from the first kernel of the warm-up profile."""
    if backend != "triton" or kv_cache_dtype != "fp8_e4m3" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 9):
        raise ConfigError(
            f"EngineArgs.kv_cache_dtype: fp8_e4m3 needs compute capability 8.9 or newer "
            f"(Ada, Hopper); this GPU is {capability[0]}.{capability[1]}: use int8",
            param="kv_cache_dtype",
        )


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` is Triton on CUDA, torch elsewhere (Triton on CPU only in its interpreter)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "EngineArgs.backend: 'triton' needs CUDA (or TRITON_INTERPRET=1 for tests)",
            param="backend",
        )
    return name
