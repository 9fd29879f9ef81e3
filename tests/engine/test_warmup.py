"""The engine's warm-up: it meets every prefill tile, and leaves a fresh engine behind.

On CUDA it compiles the Triton variants of the first steps before the replica serves;
here (CPU, torch kernels) what can fail is the choice of shapes and what the warm-up
leaves in the engine: blocks, names, counters, the KV tier, or different outputs after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.tiers import KVTiers
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.warmup import WARMUP_SAMPLING, prompt_lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("longest", [1, 5, 40, 300, 2048])
def test_prompt_lengths_meet_every_prefill_tile(
    dtype: torch.dtype, head_dim: int, group: int, longest: int
) -> None:
    # Here, not at the top: importing Triton while tests are collected, before
    # tests/kernels/conftest.py turns its interpreter on, breaks the kernel tests.
    from workers.engine.kernels.prefill_attention import default_prefill_config

    lengths = prompt_lengths(head_dim, group, dtype, longest)
    assert lengths and all(1 <= n <= longest for n in lengths)

    def tile(n: int) -> object:
        return default_prefill_config(head_dim, group, n, dtype)

    every = {tile(n) for n in range(1, longest + 1)}
    assert {tile(n) for n in lengths} == every
    for config in every:
        seen = [n for n in range(1, longest + 1) if tile(n) == config]
        warmed = [n for n in lengths if tile(n) == config]
        # Triton specialises an integer argument on == 1 and % 16 == 0: each class the
        # tile's range holds is warmed.
        for cls in (lambda n: n == 1, lambda n: n % 16 == 0, lambda n: n != 1 and n % 16):
            if any(cls(n) for n in seen):
                assert any(cls(n) for n in warmed), (config, warmed)


def _engine(warmup: bool | None, policy: str = "hybrid", **kw: object) -> LLMEngine:
    args = EngineArgs(
        model="dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
        max_num_batched_tokens=64, policy=policy, warmup=warmup, max_wait_ms=1,
    )  # fmt: skip
    return LLMEngine(args, **kw)  # type: ignore[arg-type]


def _outputs(engine: LLMEngine) -> list[list[int]]:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11, 12, 13, 20], [3] * 17, [4] * 9]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=6, ignore_eos=True),
        # Unseeded: torch's global generator, seeded by EngineArgs.seed, which the
        # warm-up's own draws must not have moved.
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
    ]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt_token_ids=p, params=sp)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", ["hybrid", "static", "dynamic"])
def test_a_warmed_engine_starts_as_a_fresh_one(policy: str) -> None:
    # Each engine serves right after it is built: unseeded requests draw from torch's
    # global generator, which building an engine seeds (EngineArgs.seed) and both share.
    cold = _engine(False, policy)
    cold_stats, cold_out = cold.stats(), _outputs(cold)
    warm = _engine(True, policy)
    assert cold.warmup is None
    report = warm.warmup
    assert report is not None and report.steps > 0 and report.prompt_lengths
    # Each prompt computed whole, the mixed wave's (the first few lengths again) too: none
    # reused another's blocks, which would have shortened the query it was there to warm.
    lengths = report.prompt_lengths
    mixed = [lengths[min(i, len(lengths) - 1)] for i in range(len(WARMUP_SAMPLING))]
    assert report.prompt_tokens == sum(lengths) + sum(mixed)
    # Nothing held, nothing named, nothing counted.
    assert warm.pool.num_free_blocks == warm.pool.num_blocks
    assert warm.pool.num_cached_blocks == 0
    assert not warm.requests and not warm.has_unfinished()
    assert warm.stats() == cold_stats
    # The same tokens as an engine that never warmed up, seeded and unseeded ones, and the
    # prefix cache starts empty: the same prefix queries and hits afterwards.
    assert _outputs(warm) == cold_out
    assert (warm.pool.prefix_queries, warm.pool.prefix_hits) == (
        cold.pool.prefix_queries,
        cold.pool.prefix_hits,
    )


def test_warm_up_is_on_by_default_only_where_kernels_compile() -> None:
    engine = _engine(None)
    assert engine.device.type == "cpu" and engine.warmup is None


def test_warm_up_writes_nothing_to_the_kv_tier() -> None:
    # A cache of 12 blocks: the warm-up's prompts overflow it, so named blocks are evicted,
    # which with the tier attached would be offloaded to it.
    args = EngineArgs(
        model="dummy:tiny", device="cpu", dtype="float32", num_kv_blocks=12, block_size=4,
        max_num_batched_tokens=64, warmup=True,
    )  # fmt: skip
    with KVTiers(None, host_capacity_bytes=1 << 20, pin_host=False) as tiers:
        engine = LLMEngine(args, kv_tier=tiers)
        assert engine.warmup is not None
        assert tiers.host is not None and tiers.host.num_puts == 0
        assert tiers.host_counters.query_tokens == 0
        # Still attached: a request's blocks do reach it.
        for i in range(3):
            prompt = [i + 1] * 30
            engine.add_request(str(i), prompt_token_ids=prompt, params=SamplingParams(max_tokens=2))
            while engine.has_unfinished():
                engine.step()
        engine.flush_exports()
        assert engine.kv_tier is tiers and engine.batcher.kv_tier is tiers
        assert tiers.host.num_puts > 0


TRITON_SCRIPT = """
import torch
from workers.engine import EngineArgs, LLMEngine
from workers.engine.warmup import prompt_lengths

args = dict(model="dummy:tiny", device="cpu", dtype="float32", backend="triton",
            num_kv_blocks=64, block_size=16, max_num_batched_tokens=256)
warm = LLMEngine(EngineArgs(**args, warmup=True))
cfg = warm.model_config
assert warm.warmup.prompt_lengths == prompt_lengths(
    cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, torch.float32, 256), warm.warmup
assert warm.pool.num_free_blocks == warm.pool.num_blocks and warm.pool.num_cached_blocks == 0
cold = LLMEngine(EngineArgs(**args, warmup=False))
assert warm.stats() == cold.stats()
print("OK")
"""


def test_warm_up_runs_the_triton_kernels_in_the_interpreter() -> None:
    """The Triton backend's warm-up (its own prompt lengths, one per prefill tile) runs its
    kernels, here in the interpreter, which must be on before Triton is first imported."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_the_prefill_kernel_does_not_specialise_on_the_block_table_width() -> None:
    """The widest block table changes every step; Triton specialises an integer argument
    on == 1 and % 16 == 0, so each tile compiled up to three times while serving, and the
    warm-up (narrow tables) could not meet those variants. Read off the compiled kernel's
    parameters, in a process without the interpreter (which keeps none)."""
    script = (
        "from workers.engine.kernels.prefill_attention import _prefill_kernel as k\n"
        "params = {p.name: p for p in k.params}\n"
        "assert params['stride_bt'].do_not_specialize\n"
        "assert not params['stride_qt'].do_not_specialize  # the others keep theirs\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]
