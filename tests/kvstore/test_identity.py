"""Block identity: who may read whose KV bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstore.identity import KVLayout, model_fingerprint


def _folder(root: Path, seed: int) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.w": torch.randn(64, 64, generator=gen) for i in range(3)}
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_retrained_weights_of_the_same_shapes_get_another_fingerprint(tmp_path: Path) -> None:
    """A retrain (or a fine-tune) keeps config.json and the file sizes: its KV must not be
    read by the old model's workers, nor theirs by it."""
    old, new = _folder(tmp_path / "old", 0), _folder(tmp_path / "new", 1)
    assert (old / "model.safetensors").stat().st_size == (new / "model.safetensors").stat().st_size
    assert model_fingerprint(str(old)) != model_fingerprint(str(new))
    copy = tmp_path / "copy"
    shutil.copytree(old, copy)  # the same weights on another node: shared
    assert model_fingerprint(str(copy)) == model_fingerprint(str(old))
    # Changing only the end of one tensor changes it too.
    tensors = {f"layers.{i}.w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
               for i in range(3)}  # fmt: skip
    tensors["layers.2.w"][-1, -1] += 1.0
    save_file(tensors, str(copy / "model.safetensors"))
    assert model_fingerprint(str(copy)) != model_fingerprint(str(old))


def test_a_quantised_cache_is_namespaced_by_the_model_dtype_too() -> None:
    fp32 = KVLayout(4, "int8", 2, 2, 16, quant="per_token_head", compute_dtype="float32")
    bf16 = KVLayout(4, "int8", 2, 2, 16, quant="per_token_head", compute_dtype="bfloat16")
    assert fp32.fingerprint() != bf16.fingerprint()
    from workers.engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs("dummy:tiny", num_kv_blocks=8, kv_cache_dtype="int8"))
    layout = engine.runner.kv_layout()
    assert (layout.dtype, layout.compute_dtype) == ("int8", "float32")


def test_a_git_lfs_pointer_in_place_of_the_weights_is_fingerprinted_not_read_whole(
    tmp_path: Path,
) -> None:
    """Cloned without LFS, a .safetensors file is a 130-byte text whose first 8 bytes read
    as a header length of exabytes: it must be sampled as the text it is."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 123\n"
    (folder / "model.safetensors").write_text(pointer)
    first = model_fingerprint(str(folder))
    (folder / "model.safetensors").write_text(pointer.replace("ab", "cd"))
    assert model_fingerprint(str(folder)) != first


def test_dummy_weights_drawn_on_other_devices_have_other_fingerprints() -> None:
    """CPU and CUDA generators (and CUDA on GPUs with other SM counts) draw other weights
    for one seed: two such workers loaded each other's KV from Redis as hits."""
    cpu = model_fingerprint("dummy:tiny", 0, "cpu")
    assert cpu == model_fingerprint("dummy:tiny", 0, "cpu")
    assert cpu != model_fingerprint("dummy:tiny", 0, "cuda:NVIDIA H200:132")
    assert model_fingerprint("dummy:tiny", 0, "cuda:NVIDIA A100:108") != model_fingerprint(
        "dummy:tiny", 0, "cuda:NVIDIA H200:132"
    )


def test_a_value_copied_under_another_models_key_is_no_hit() -> None:
    """Block names do not depend on the model, and the header carried the layout alone: a
    value copied from one fine-tune's key to another's (same shape) loaded there."""
    import pytest

    from kvstore.codec import CorruptBlock, decode_block, encode_block
    from kvstore.identity import KVIdentity, KVLayout

    layout = KVLayout(block_size=4, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8)
    a, b = KVIdentity(b"a" * 16, layout), KVIdentity(b"b" * 16, layout)
    assert a.layout_fp == b.layout_fp and a.value_fp != b.value_fp
    block_hash, data = bytes(16), bytes(layout.block_bytes)
    value = encode_block(layout, a.value_fp, block_hash, data)
    assert bytes(decode_block(value, layout, a.value_fp, block_hash)) == data
    with pytest.raises(CorruptBlock, match="another layout"):
        decode_block(value, layout, b.value_fp, block_hash)


def test_a_dummy_models_fingerprint_covers_what_draws_its_weights() -> None:
    """Only the spec, the seed and the device were hashed: two releases whose shapes or
    init (or torch, whose generators) differ shared KV of differently drawn weights."""
    import torch

    from workers.engine.engine import weights_device

    cpu = torch.device("cpu")
    tiny = weights_device(cpu, "dummy:tiny")
    assert torch.__version__ in tiny and "init" in tiny
    assert tiny != weights_device(cpu, "dummy:llama-1b")
    assert weights_device(cpu, "/models/llama") == "cpu"  # a folder: its files say it all
