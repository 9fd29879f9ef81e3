"""Clear errors: bad model folders, bad EngineArgs, bad requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ConfigError, ContextLengthExceededError, InvalidRequestError
from tests.engine.tiny_checkpoints import checkpoint
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.loader import ModelLoadError


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint("llama", str(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=32, block_size=4, max_seq_len=24))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_architecture_is_named(llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(llama, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLMEngine(EngineArgs(str(folder), num_kv_blocks=8))
    cfg.update(architectures=["LlamaForCausalLM"], model_type="falcon")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="falcon"):
        LLMEngine(EngineArgs(str(folder), num_kv_blocks=8))


def test_missing_files_are_named(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineArgs(str(tmp_path / "nowhere")))
    folder = copy_checkpoint(llama, tmp_path / "no-config")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLMEngine(EngineArgs(str(folder)))
    folder = copy_checkpoint(llama, tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLMEngine(EngineArgs(str(folder), num_kv_blocks=8))
    folder = copy_checkpoint(llama, tmp_path / "bad-index")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        LLMEngine(EngineArgs(str(folder), num_kv_blocks=8))


def test_a_missing_tensor_is_named(llama: Path, tmp_path: Path) -> None:
    folder = copy_checkpoint(llama, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.gate_up_proj"):
        LLMEngine(EngineArgs(str(folder), num_kv_blocks=8))


def test_unknown_dummy_spec_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="dummy:llama-8b"):
        LLMEngine(EngineArgs("dummy:gpt-5"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policy", "fifo"),
        ("block_size", 0),
        ("max_batch_size", 0),
        ("max_batch_size", 65536),  # past the prefill kernel's grid axis
        ("num_kv_blocks", 0),
        ("kv_cache_gib", -1.0),
        ("gpu_memory_utilization", 1.5),
        ("max_seq_len", 1),
        ("max_num_batched_tokens", 0),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("backend", "flash"),
        ("max_wait_ms", -1),
        ("prefill_delay_factor", -0.5),
    ],
)
def test_bad_engine_args_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"EngineArgs.{field}") as info:
        EngineArgs("dummy:tiny", **{field: value})  # type: ignore[arg-type]
    assert info.value.param == field


def test_engine_args_that_do_not_fit_the_model_or_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else triton runs on CPU
    with pytest.raises(ConfigError, match=r"max_seq_len.*do not fit in the KV cache"):
        LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=4, block_size=4, max_seq_len=64))
    with pytest.raises(ConfigError, match=r"max_seq_len.*context length 4096"):
        LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=1024, max_seq_len=8192))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineArgs("dummy:tiny", policy="hybrid", max_batch_size=64, max_num_batched_tokens=16)
    with pytest.raises(ConfigError, match="triton"):
        LLMEngine(EngineArgs("dummy:tiny", device="cpu", backend="triton"))


def test_a_prompt_too_long_is_rejected_up_front(tiny: LLMEngine) -> None:
    with pytest.raises(ContextLengthExceededError, match=r"24 tokens.*max_seq_len is 24") as info:
        tiny.add_request("long", prompt_token_ids=[3] * 24)
    assert info.value.http_status == 400
    tiny.add_request("fits", prompt_token_ids=[3] * 23, params=SamplingParams(max_tokens=50))
    deltas = tiny.step()
    # No room beyond max_seq_len: one token, then "length", whatever max_tokens says.
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("fits", "length")]
    assert not tiny.has_unfinished()


def test_bad_requests_are_rejected(tiny: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.add_request("e", prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match=r"\[0, 512\)"):
        tiny.add_request("v", prompt_token_ids=[1, 512])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        tiny.add_request("b", "hi", prompt_token_ids=[1])
    tiny.add_request("dup", prompt_token_ids=[1, 2])
    with pytest.raises(InvalidRequestError, match="already exists"):
        tiny.add_request("dup", prompt_token_ids=[1, 2])
    assert tiny.abort("dup")
    assert not tiny.abort("dup")


def test_text_needs_a_tokenizer(llama: Path) -> None:
    engine = LLMEngine(EngineArgs(str(llama), num_kv_blocks=8))
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("t", "hello")
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        engine.add_request("s", prompt_token_ids=[1, 2], params=SamplingParams(stop=["x"]))


def test_a_step_that_raises_keeps_the_reports_it_had_gathered(monkeypatch: pytest.MonkeyPatch):
    """An abort's report waits for the next step; if that step raises (a device error), the
    report must come with the step after, not vanish."""
    engine = LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=32, block_size=4, max_seq_len=24))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", None, params, prompt_token_ids=[1, 2, 3])
    engine.add_request("b", None, params, prompt_token_ids=[4, 5, 6])
    engine.step()
    assert engine.abort("a")
    execute = engine.runner.execute

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("device error")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    monkeypatch.setattr(engine.runner, "execute", execute)
    deltas = {d.request_id: d for d in engine.step()}
    assert deltas["a"].finished and deltas["a"].finish_reason == "abort"
    assert "b" in deltas  # b goes on


def test_a_block_size_the_triton_kernels_cannot_tile_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU it passed the checks and failed in the first kernel with a bare
    ValueError; the torch backend (the CPU's) serves any size."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend on this CPU
    with pytest.raises(ConfigError, match="block_size: 24 must be a power of two"):
        LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=8, block_size=24, backend="triton"))
    LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=8, block_size=24, backend="torch"))


def test_an_fp8_cache_on_a_gpu_without_fp8_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton has no fp8 e4m3 below compute capability 8.9: the engine died in its warm-up
    profile with "type fp8e4nv not supported in this architecture"."""
    from workers.engine.args import check_fp8_support

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"fp8_e4m3 needs compute capability 8\.9.*8\.0") as info:
        check_fp8_support("triton", "fp8_e4m3", cuda)
    assert info.value.param == "kv_cache_dtype"
    check_fp8_support("triton", "int8", cuda)  # int8 runs anywhere
    check_fp8_support("torch", "fp8_e4m3", torch.device("cpu"))  # the torch path casts itself
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_support("triton", "fp8_e4m3", cuda)


def test_an_engine_on_a_gpu_makes_that_gpu_current_before_it_builds_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The current device is per thread and Triton launches on the current device's stream:
    a worker builds its engine on a pool thread, still on cuda:0, so an engine for cuda:1
    ran its profile and warm-up kernels on cuda:0's stream with cuda:1's pointers."""
    import workers.engine.engine as engine_module

    made_current: list[torch.device] = []

    class Built(Exception):
        pass

    def set_device(device: torch.device) -> None:
        made_current.append(device)
        raise Built  # nothing else to build here: no GPU

    monkeypatch.setattr(engine_module, "resolve_device", lambda name: torch.device("cuda:1"))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Built):
        LLMEngine(EngineArgs("dummy:tiny", device="cuda:1"))
    assert made_current == [torch.device("cuda:1")]
