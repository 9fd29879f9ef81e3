"""Loading: sharded checkpoints, fused projections, dummy shapes of real models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.tiny_checkpoints import checkpoint, hf_greedy, prompts
from workers.engine import LLM, SamplingParams
from workers.engine.args import resolve_dtype
from workers.engine.loader import (
    ModelLoadError,
    generation_config_eos,
    load_model,
    load_model_config,
)
from workers.engine.models.llama import ModelConfig, rope_inv_freq


def served_greedy(path: Path, batch: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    """Greedy tokens of ``batch`` from our engine on the checkpoint at ``path``."""
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(prompt_token_ids=batch, sampling_params=params)]


def test_sharded_checkpoint_loads_through_its_index(tmp_path: Path) -> None:
    import transformers as tf

    src = checkpoint("llama", str(tmp_path))
    model = tf.AutoModelForCausalLM.from_pretrained(src)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    batch = prompts(4, seed=9)
    assert served_greedy(sharded, batch) == [hf_greedy(src, p, 6) for p in batch]


def test_qkv_and_gate_up_are_fused_in_checkpoint_order(tmp_path: Path) -> None:
    path = checkpoint("qwen2", str(tmp_path))
    cfg = load_model_config(str(path))
    net = load_model(str(path), cfg, torch.device("cpu"), torch.float32, "torch")
    hf = load_file(path / "model.safetensors")
    attn = net.model.layers[1].self_attn
    want = torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, want)
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None  # Qwen2: q/k/v bias only
    mlp = net.model.layers[1].mlp
    want = torch.cat([hf[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)
    assert net.lm_head is None  # tied: the head is the embedding


@pytest.mark.parametrize(
    ("spec", "billions"),
    [("dummy:qwen2-0.5b", 0.494), ("dummy:llama-1b", 1.236), ("dummy:llama-8b", 8.03)],
)
def test_dummy_specs_have_the_real_models_shapes(spec: str, billions: float) -> None:
    assert load_model_config(spec).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_dummy_weights_give_finite_logits() -> None:
    llm = LLM("dummy:tiny", num_kv_blocks=16)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0]
    assert out.logprobs is not None and all(torch.isfinite(torch.tensor(out.logprobs)))


def _hf(**kw: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32768,
    )  # fmt: skip
    return {**base, **kw}


def test_sliding_windows_follow_transformers_defaults_and_cap_the_context() -> None:
    # Mistral windows at 4096 when its config names no window, and at none when it says null.
    assert ModelConfig.from_hf(_hf(model_type="mistral")).context_len == 4096
    assert ModelConfig.from_hf(_hf(model_type="mistral", sliding_window=None)).context_len == 32768
    # Qwen2/3: only with use_sliding_window, and only if some layer is past max_window_layers.
    qwen = _hf(model_type="qwen2", sliding_window=1024, num_hidden_layers=4)
    assert ModelConfig.from_hf(qwen).context_len == 32768
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).context_len == 32768
    windowed = {**qwen, "use_sliding_window": True, "max_window_layers": 2}
    assert ModelConfig.from_hf(windowed).context_len == 1024
    # An explicit layer_types wins over max_window_layers, as in Qwen2Config.
    listed = {**qwen, "use_sliding_window": True, "max_window_layers": 4}
    sliding = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    assert ModelConfig.from_hf({**listed, "layer_types": sliding}).context_len == 1024
    full = {**windowed, "layer_types": ["full_attention"] * 4}
    assert ModelConfig.from_hf(full).context_len == 32768
    # Llama's attention never reads the key (a Mistral converted to Llama keeps it).
    assert ModelConfig.from_hf(_hf(sliding_window=4096)).context_len == 32768


def _their_window(given: dict[str, object]) -> int | None:
    """The attention window transformers gives some layer of ``given``, or None."""
    import transformers as tf

    theirs = tf.AutoConfig.for_model(**given)
    window = getattr(theirs, "sliding_window", None)
    layer_types = getattr(theirs, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def test_sliding_windows_cap_the_context_exactly_where_transformers_windows() -> None:
    """The cases above, read from transformers itself rather than from memory: a release
    that changes a default must show here."""
    qwen = _hf(model_type="qwen2", sliding_window=1024, num_hidden_layers=4)
    sliding = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    cases = [
        _hf(model_type="mistral"),
        _hf(model_type="mistral", sliding_window=None),
        qwen,
        {**qwen, "use_sliding_window": True},
        {**qwen, "use_sliding_window": True, "max_window_layers": 2},
        {**qwen, "use_sliding_window": True, "max_window_layers": 4, "layer_types": sliding},
        {**qwen, "use_sliding_window": True, "max_window_layers": 2,
         "layer_types": ["full_attention"] * 4},
    ]  # fmt: skip
    for given in cases:
        window = _their_window(given)
        want = 32768 if window is None else min(window, 32768)
        assert ModelConfig.from_hf(given).context_len == want, given


def test_config_mistakes_are_named() -> None:
    incomplete = _hf()
    del incomplete["intermediate_size"]
    with pytest.raises(ValueError, match="lacks the required key 'intermediate_size'"):
        ModelConfig.from_hf(incomplete)


def test_a_malformed_generation_config_is_a_load_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{eos_token_id: 2")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        generation_config_eos(str(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_llama3_rope_takes_its_original_length_as_transformers_does(model_type: str) -> None:
    """Read from transformers itself: a top-level original_max_position_embeddings was
    taken first here (4096 below) where transformers reads the rope parameters' (8192)."""
    import transformers as tf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}  # fmt: skip
    cases = [
        {"rope_scaling": scaling},
        {"rope_scaling": scaling, "original_max_position_embeddings": 4096},
        {"rope_scaling": {**scaling, "original_max_position_embeddings": 8192},
         "original_max_position_embeddings": 4096},
    ]  # fmt: skip
    for case in cases:
        given = _hf(model_type=model_type, **case)
        theirs = tf.AutoConfig.for_model(**given)
        ours = ModelConfig.from_hf(given)
        assert ours.rope_scaling is not None, case
        want = theirs.rope_parameters["original_max_position_embeddings"]
        assert ours.rope_scaling["original_max_position_embeddings"] == want, case
    assert rope_inv_freq(ours).shape == (ours.head_dim // 2,)
    # transformers 4.x rope_scaling wins over a 5.x rope_parameters naming only the theta.
    both = ModelConfig.from_hf(_hf(rope_scaling=scaling, rope_parameters={"rope_theta": 5e5}))
    assert both.rope_scaling is not None and both.rope_scaling["rope_type"] == "llama3"


def test_auto_dtype_serves_a_16_bit_checkpoint_in_its_own_dtype_on_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp16 = ModelConfig.from_hf(_hf(torch_dtype="float16")).checkpoint_dtype
    assert resolve_dtype("auto", cuda, fp16) == torch.float16
    assert (
        resolve_dtype("auto", cuda, ModelConfig.from_hf(_hf(dtype="bfloat16")).checkpoint_dtype)
        == torch.bfloat16
    )
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("auto", cpu, fp16) == torch.float32
    assert resolve_dtype("float16", cpu, "bfloat16") == torch.float16


def _rewrite(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of checkpoint ``src`` whose tensors ``edit`` (dict -> dict) changed."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file(edit(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_tied_config_whose_checkpoint_has_its_own_head_serves_that_head(
    tmp_path: Path,
) -> None:
    """A fine-tune trained untied with its config left tied: transformers 5 keeps the
    checkpoint's lm_head (and warns); tying it away gave other tokens from the first."""
    src = checkpoint("qwen2", str(tmp_path))  # tied
    torch.manual_seed(5)

    def own_head(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t["lm_head.weight"] = torch.randn_like(t["model.embed_tokens.weight"]) * 3
        return t

    path = _rewrite(src, tmp_path / "own-head", own_head)
    batch = prompts(4, seed=3)[:3]
    assert served_greedy(path, batch) == [hf_greedy(path, p, 6) for p in batch]


def test_a_tied_checkpoint_with_only_the_head_and_bare_names_loads_as_transformers(
    tmp_path: Path,
) -> None:
    """The head stored instead of the embedding, and tensors saved from the bare model
    (no "model." prefix): transformers loads both; we refused them."""
    src = checkpoint("qwen2", str(tmp_path))

    def head_only_bare(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k.removeprefix("model."): v for k, v in t.items() if k != "lm_head.weight"}
        out["lm_head.weight"] = out.pop("embed_tokens.weight")
        return out

    path = _rewrite(src, tmp_path / "head-only", head_only_bare)
    batch = prompts(4, seed=4)[:3]
    assert served_greedy(path, batch) == [hf_greedy(src, p, 6) for p in batch]


def test_quantized_and_half_specified_configs_are_refused_by_name(tmp_path: Path) -> None:
    import json
    import shutil

    from workers.engine.loader import ModelLoadError

    src = checkpoint("llama", str(tmp_path))
    for name, change, message in [
        ("awq", {"quantization_config": {"quant_method": "awq"}}, "quantized.*'awq'"),
        (
            "rope",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "needs low_freq_factor, high_freq_factor",
        ),
    ]:
        path = tmp_path / name
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        cfg.update(change)
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=message):
            load_model_config(str(path))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_keys_a_config_leaves_out_take_transformers_defaults_for_that_architecture(
    model_type: str,
) -> None:
    """A Qwen3 config.json without head_dim has 128-wide heads in transformers (ours were
    hidden_size / heads: a shape error at load), a Mistral one 128k positions (ours 2048)."""
    import transformers as tf

    given = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=32)  # fmt: skip
    theirs = tf.AutoConfig.for_model(model_type, **given)
    ours = ModelConfig.from_hf({"model_type": model_type, **given})
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 256 // 32)
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.max_position_embeddings == theirs.max_position_embeddings


def test_swish_is_silu_as_in_transformers() -> None:
    assert ModelConfig.from_hf(_hf(hidden_act="swish")).model_type == "llama"
    with pytest.raises(ValueError, match="gelu"):
        ModelConfig.from_hf(_hf(hidden_act="gelu"))


def test_weights_that_are_not_the_models_own_are_not_loaded(tmp_path: Path) -> None:
    """Mistral repositories ship consolidated.safetensors (the same tensors, Mistral's
    names) beside model.safetensors; a PEFT adapter may sit there too. Without an index
    every *.safetensors was read, and the first unknown name failed the load."""
    from workers.engine.loader import safetensors_files

    for name in ("model.safetensors", "consolidated.safetensors", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert safetensors_files(tmp_path) == [tmp_path / "model-00001-of-00002.safetensors"]


def test_a_cpu_engine_never_imports_triton() -> None:
    """Built on the meta device, the rope frequencies ran torch's reference ops, which
    import torch._dynamo and with it Triton: every CPU worker then printed 54 nanobind
    "leaked function" lines at exit, which were all a failed start's log tail showed."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from workers.engine import LLMEngine, EngineArgs, SamplingParams\n"
        "e = LLMEngine(EngineArgs('dummy:tiny', device='cpu'))\n"
        "e.add_request('a', prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))\n"
        "while e.has_unfinished(): e.step()\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_context_capped_by_the_sliding_window_says_so(tmp_path: Path) -> None:
    """Mistral-7B-v0.1 reads 32768 positions in its config.json; asking for 8192 was refused
    with "context length 4096" and no word of where 4096 came from."""
    import json
    import shutil

    from common.errors import ConfigError
    from workers.engine import EngineArgs, LLMEngine

    path = tmp_path / "windowed"
    shutil.copytree(checkpoint("mistral", str(tmp_path / "ckpt")), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    with pytest.raises(ConfigError, match=r"context length 64 \(its sliding window: .* 512"):
        LLMEngine(EngineArgs(str(path), num_kv_blocks=64, max_seq_len=128))


def test_an_unreadable_shard_or_index_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    """A folder cloned without git-lfs holds pointer files where the shards should be; a
    download cut short holds a truncated shard; a broken index is not JSON. Each used to
    surface as safetensors' or json's bare error, naming no file."""
    src = checkpoint("llama", str(tmp_path))
    cfg = load_model_config(str(src))
    shard = src / "model.safetensors"
    whole = shard.read_bytes()

    def load() -> None:
        load_model(str(src), cfg, torch.device("cpu"), torch.float32, "torch")

    shard.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable.*git-lfs"):
        load()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable"):
        load()
    shard.write_bytes(whole)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelLoadError, match=r"index\.json: unreadable.*weight_map"):
        load()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_bias_keys_count_only_where_transformers_reads_them(model_type: str) -> None:
    """Mistral never has biases and Qwen2/3's MLPs none, whatever attention_bias/mlp_bias
    say: a config carrying them was refused here ("checkpoint lacks tensors for ...bias")
    where transformers loads it."""
    import transformers as tf

    given = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 attention_bias=True, mlp_bias=True)  # fmt: skip
    theirs = tf.AutoConfig.for_model(model_type, **given)
    names = set(tf.AutoModelForCausalLM.from_config(theirs).state_dict())
    ours = ModelConfig.from_hf({"model_type": model_type, **given})
    layer = "model.layers.0"
    assert ours.qkv_bias == (f"{layer}.self_attn.q_proj.bias" in names)
    assert ours.o_bias == (f"{layer}.self_attn.o_proj.bias" in names)
    assert ours.mlp_bias == (f"{layer}.mlp.gate_proj.bias" in names)
