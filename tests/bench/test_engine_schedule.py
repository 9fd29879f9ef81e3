"""The model-free step count matches the engine's, and kernels sort into the right kinds."""

from __future__ import annotations

import pytest

from bench.engine import drive, make_workload
from bench.engine_profile import kind_of
from bench.engine_schedule import count_steps
from workers.engine import EngineArgs, LLMEngine


@pytest.mark.parametrize("policy", ["static", "continuous", "hybrid"])
def test_step_count_without_a_model_equals_the_engines(policy: str) -> None:
    args = EngineArgs(
        model="dummy:tiny",
        policy=policy,
        max_batch_size=3,
        max_num_batched_tokens=64,
        num_kv_blocks=12,
        block_size=8,
        async_output=False,
    )
    engine = LLMEngine(args)
    work = make_workload(7, 4, 30, engine.model_config.vocab_size, seed=3)
    _, _, log = drive(engine, work, temperature=0.0)
    counted = count_steps(
        policy,
        work.prompts,
        work.output_lens,
        max_batch_size=3,
        max_num_batched_tokens=64,
        num_blocks=engine.pool.num_blocks,
        block_size=8,
        max_seq_len=engine.max_seq_len,
    )
    assert counted["steps"] == len(log.seconds)
    assert counted["decode_steps"] == sum(log.is_decode)


def test_static_needs_more_steps_than_continuous_when_lengths_vary() -> None:
    prompts = [[1] * 4] * 6
    outputs = [2, 40, 2, 40, 2, 40]
    kw = dict(max_batch_size=2, max_num_batched_tokens=64, num_blocks=64, block_size=8)
    static = count_steps("static", prompts, outputs, max_seq_len=512, **kw)  # type: ignore[arg-type]
    cont = count_steps("continuous", prompts, outputs, max_seq_len=512, **kw)  # type: ignore[arg-type]
    # static: three batches, each as long as its 40-token member; continuous refills the
    # short requests' slots, so the three long ones overlap.
    assert static["decode_steps"] >= 3 * 39
    assert cont["decode_steps"] < 2 * 40


def test_kernel_kinds() -> None:
    assert kind_of("_decode_stage1_kernel") == "attention"
    assert kind_of("_decode_stage2_kernel") == "attention"
    assert kind_of("_prefill_kernel") == "attention"
    assert kind_of("_gumbel_argmax_kernel") == "sampling"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert kind_of("_rms_norm_kernel") == "elementwise"
    assert kind_of("_store_kv_kernel") == "kv_store"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kind_of("void at::native::vectorized_elementwise_kernel") == "other"
