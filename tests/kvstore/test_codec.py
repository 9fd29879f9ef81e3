"""The block codec: round trips, and whatever bytes a key holds, decoding either returns
this block's payload or raises CorruptBlock, nothing else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codec import (
    HEADER_BYTES,
    CorruptBlock,
    block_header,
    decode_block,
    encode_block,
    encode_blocks,
)
from kvstore.identity import KVLayout

LAYOUT = KVLayout(block_size=4, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8)
FP = LAYOUT.fingerprint()
HASH = bytes(range(16))


def payload(seed: int = 0, layout: KVLayout = LAYOUT) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, layout.block_bytes, np.uint8).tobytes()


def test_round_trip_returns_the_payload_as_a_view_of_the_value() -> None:
    data = payload()
    value = encode_block(LAYOUT, FP, HASH, data)
    assert len(value) == HEADER_BYTES + LAYOUT.block_bytes
    out = decode_block(value, LAYOUT, FP, HASH)
    assert bytes(out) == data
    assert out.obj is value  # no copy on the load path


def test_crc32_values_decode_and_catch_flips_too() -> None:
    value = bytearray(encode_block(LAYOUT, FP, HASH, payload(), checksum="crc32"))
    assert bytes(decode_block(bytes(value), LAYOUT, FP, HASH)) == payload()
    value[-1] ^= 0x80
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(value), LAYOUT, FP, HASH)


def test_batch_encoding_gives_each_block_its_own_header() -> None:
    rows = np.stack([np.frombuffer(payload(i), np.uint8) for i in range(3)])
    hashes = [bytes([i]) * 16 for i in range(3)]
    values = encode_blocks(LAYOUT, FP, hashes, rows)
    for i, v in enumerate(values):
        assert bytes(decode_block(v, LAYOUT, FP, hashes[i])) == payload(i)
    with pytest.raises(CorruptBlock, match="another block"):
        decode_block(values[0], LAYOUT, FP, hashes[1])


def test_truncated_or_flipped_values_are_corrupt() -> None:
    value = encode_block(LAYOUT, FP, HASH, payload())
    with pytest.raises(CorruptBlock):
        decode_block(value[:-1], LAYOUT, FP, HASH)
    with pytest.raises(CorruptBlock):
        decode_block(value[:10], LAYOUT, FP, HASH)
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 100] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(flipped), LAYOUT, FP, HASH)


@pytest.mark.parametrize(
    "other",
    [
        KVLayout(block_size=8, dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8),
        KVLayout(block_size=4, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8),
    ],
)
def test_a_value_of_another_layout_is_never_read(other: KVLayout) -> None:
    value = encode_block(other, other.fingerprint(), HASH, payload(layout=other))
    with pytest.raises(CorruptBlock, match="layout"):
        decode_block(value, LAYOUT, FP, HASH)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * HEADER_BYTES + LAYOUT.block_bytes))
def test_decoding_arbitrary_bytes_only_ever_raises_corrupt_block(value: bytes) -> None:
    with pytest.raises(CorruptBlock):
        decode_block(value, LAYOUT, FP, HASH)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decoding_a_mutated_valid_value_is_the_payload_or_corrupt(data: st.DataObject) -> None:
    value = bytearray(encode_block(LAYOUT, FP, HASH, payload()))
    cut = data.draw(st.integers(0, len(value)))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(value) - 1), st.integers(0, 255))))
    for pos, byte in edits:
        value[pos] = byte
    value = value[:cut] + data.draw(st.binary(max_size=8))
    try:
        out = decode_block(bytes(value), LAYOUT, FP, HASH)
    except CorruptBlock:
        return
    assert bytes(out) == payload()  # only an unchanged value decodes


def test_a_header_sent_before_the_row_makes_the_same_value_as_encoding() -> None:
    row = np.frombuffer(payload(5), np.uint8)
    for kind in ("crc32", "blake2b"):
        value = block_header(LAYOUT, FP, HASH, row, kind) + row.tobytes()
        assert value == encode_block(LAYOUT, FP, HASH, row.tobytes(), checksum=kind)
        assert bytes(decode_block(value, LAYOUT, FP, HASH)) == payload(5)


def test_with_a_secret_only_values_authenticated_with_it_decode() -> None:
    """Anyone who can write to Redis could write a value with a valid checksum, planting
    the KV of another text under a common prompt's key. A deployment's secret keys the
    checksum: a forged value, an unkeyed one or one keyed otherwise is a miss."""
    from kvstore.codec import mac_key

    key, other = mac_key("s3cret"), mac_key("another")
    data = payload(3)
    good = encode_block(LAYOUT, FP, HASH, data, key=key)
    assert bytes(decode_block(good, LAYOUT, FP, HASH, key)) == data
    forged = {
        "unkeyed crc32": encode_block(LAYOUT, FP, HASH, payload(4), checksum="crc32"),
        "unkeyed blake2b": encode_block(LAYOUT, FP, HASH, payload(4), checksum="blake2b"),
        "another key": encode_block(LAYOUT, FP, HASH, payload(4), key=other),
    }
    for what, value in forged.items():
        with pytest.raises(CorruptBlock):
            decode_block(value, LAYOUT, FP, HASH, key)
        assert what
    flipped = bytearray(good)
    flipped[-1] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block(bytes(flipped), LAYOUT, FP, HASH, key)
    with pytest.raises(CorruptBlock, match="no key"):  # a reader without it cannot check
        decode_block(good, LAYOUT, FP, HASH)
