"""Key namespaces: one per model and cache layout, so incompatible workers share no keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvstore.identity import KVIdentity, KVLayout, model_fingerprint

LAYOUT = KVLayout(block_size=16, dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128)


def test_key_is_namespace_model_layout_and_block_hash_in_hex() -> None:
    ident = KVIdentity(model_fingerprint("dummy:tiny"), LAYOUT)
    key = ident.key(b"\xab" * 16)
    ns, kind, model_fp, layout_fp, block = key.decode().split(":")
    assert (ns, kind) == ("qos", "kv")
    assert bytes.fromhex(model_fp) == ident.model_fp
    assert bytes.fromhex(layout_fp) == LAYOUT.fingerprint()
    assert block == "ab" * 16
    assert LAYOUT.block_bytes == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB, Llama-8B in bf16


def test_every_layout_field_changes_the_prefix() -> None:
    model_fp = model_fingerprint("dummy:tiny")
    base = KVIdentity(model_fp, LAYOUT).key_prefix
    others = [
        dataclasses.replace(LAYOUT, block_size=32),
        dataclasses.replace(LAYOUT, dtype="float16"),
        dataclasses.replace(LAYOUT, num_layers=16),
        dataclasses.replace(LAYOUT, num_kv_heads=4),
        dataclasses.replace(LAYOUT, head_dim=64),
        dataclasses.replace(LAYOUT, quant="fp8"),
        dataclasses.replace(LAYOUT, tp_rank=1, tp_size=2),
    ]
    for other in others:
        assert KVIdentity(model_fp, other).key_prefix != base, other


def test_model_fingerprint_follows_config_and_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_fingerprint(str(tmp_path))
    assert model_fingerprint(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(str(tmp_path)) != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 65}))
    assert model_fingerprint(str(tmp_path)) != first


def test_dummy_weights_depend_on_the_seed() -> None:
    assert model_fingerprint("dummy:tiny", 0) != model_fingerprint("dummy:tiny", 1)
    assert model_fingerprint("dummy:tiny", 0) != model_fingerprint("dummy:llama-1b", 0)
