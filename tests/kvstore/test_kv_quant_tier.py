"""Quantised KV caches in the tiers: each kv dtype has its own key namespace, and a block's
values and scales survive the codec."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvstore.codec import CorruptBlock, decode_block, encode_blocks
from kvstore.identity import KVIdentity, KVLayout, model_fingerprint
from kvstore.tiers import KVTiers
from workers.engine import EngineArgs, LLMEngine

HASHES = [b"\x01" * 16, b"\x02" * 16]


def engine(kv_dtype: str) -> LLMEngine:
    args = EngineArgs("dummy:tiny", block_size=4, num_kv_blocks=8, kv_cache_dtype=kv_dtype)
    return LLMEngine(args)


def identity(eng: LLMEngine) -> KVIdentity:
    tier = KVTiers()
    tier.bind("dummy:tiny", 0, eng.runner.kv_layout())
    return tier.identity


def test_engines_with_different_kv_dtypes_never_share_keys() -> None:
    prefixes = {kv: identity(engine(kv)).key_prefix for kv in ("auto", "int8", "fp8_e4m3")}
    assert len(set(prefixes.values())) == 3, prefixes


def test_an_int8_block_does_not_decode_as_fp8_though_the_sizes_match() -> None:
    i8 = identity(engine("int8")).layout
    f8 = dataclasses.replace(i8, dtype="float8_e4m3fn")
    assert i8.block_bytes == f8.block_bytes
    rows = np.zeros((1, i8.block_bytes), np.uint8)
    value = encode_blocks(i8, i8.fingerprint(), HASHES[:1], rows)[0]
    with pytest.raises(CorruptBlock, match="another layout"):
        decode_block(value, f8, f8.fingerprint(), HASHES[0])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_blocks_round_trip_through_the_codec_into_another_engine(kv_dtype: str) -> None:
    src, dst = engine(kv_dtype), engine(kv_dtype)
    # Real quantised K/V: run a prompt so the cache holds written values and scales.
    src.add_request("r", prompt_token_ids=list(range(3, 12)))
    while src.has_unfinished():
        src.step()
    layout = identity(src).layout
    rows = src.runner.export_blocks([0, 1])
    assert layout.scale_bytes > 0 and rows.shape[1] == layout.block_bytes
    values = encode_blocks(layout, layout.fingerprint(), HASHES, rows, checksum="crc32")
    got = [
        decode_block(v, layout, layout.fingerprint(), h)
        for v, h in zip(values, HASHES, strict=True)
    ]
    dst.runner.import_blocks([5, 2], got)
    for a, b in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
        assert torch.equal(a.k[:2].view(torch.uint8), b.k[[5, 2]].view(torch.uint8))
        assert torch.equal(a.v_scale[:2], b.v_scale[[5, 2]])
        assert bool(a.k_scale[:2].ne(0).any())  # the prompt's tokens really wrote scales


def test_a_quantized_value_with_its_scales_cut_off_is_corrupt() -> None:
    layout = KVLayout(4, "int8", 2, 2, 16, quant="per_token_head")
    ident = KVIdentity(model_fingerprint("dummy:tiny"), layout)
    rows = np.random.default_rng(0).integers(0, 256, (1, layout.block_bytes), np.uint8)
    value = bytes(encode_blocks(layout, ident.layout_fp, HASHES[:1], rows)[0])
    assert bytes(decode_block(value, layout, ident.layout_fp, HASHES[0])) == rows.tobytes()
    with pytest.raises(CorruptBlock):
        decode_block(value[:-8], layout, ident.layout_fp, HASHES[0])
