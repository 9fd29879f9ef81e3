"""One KV block as bytes: a 64-byte versioned header, then the raw K/V of every layer.

Layout (little-endian)::

    0  magic "QKVB"   4  version u8   5  dtype u8   6  quant u8   7  checksum kind u8
    8  model + layout fingerprint (8 bytes, ``KVIdentity.value_fp``)   16 block hash (16 bytes)
    32 num_layers u16  34 block_size u16  36 num_kv_heads u16  38 head_dim u16
    40 scale bytes u32 44 payload bytes u32
    48 checksum over bytes 0..47, the scales and the payload: blake2b-128 (kind 0), crc32
       in the first 4 bytes, the rest zero (kind 1), or blake2b-128 keyed with the
       deployment's secret (kind 2, ``redis.kv_mac_secret``)
    64 scales (quantised formats only: fp32 [2, layers, block, heads]), then the payload:
       [2, layers, block, heads, dim]

No pickle: decoding only slices bytes and compares numbers, so a value written by anyone
(a bug, another version, an attacker with Redis access) is at worst a miss. The block hash
in the header ties a value to its key: a value copied under another key does not load.
The checksum covers everything, so garbage, truncation and torn writes are all
:class:`CorruptBlock`. Kinds 0 and 1 guard against accidents, not attackers (anyone who can
write to Redis can write a valid checksum, and plant the KV of another text under a common
prompt's key), so the fast crc32 (4 GB/s a core here, against 0.8 for blake2b) is the
default where Redis is private to the workers. With a secret set, every value is
authenticated (kind 2, a keyed blake2b): a reader that has the secret takes no other kind. Writers send the header
(:func:`block_header`) and the engine's row as one value without joining them, and
decoding returns a zero-copy view into the value.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from kvstore.identity import KVLayout

MAGIC = b"QKVB"
VERSION = 2  # 2: the fingerprint field covers the model too (1: the layout alone)
HEADER_BYTES = 64
_FIXED = struct.Struct("<4sBBBB8s16sHHHHII")  # bytes 0..47; the checksum follows
CHECKSUM_BYTES = 16
assert _FIXED.size + CHECKSUM_BYTES == HEADER_BYTES

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "int8": 5}
QUANT_CODES = {"none": 0, "per_token_head": 1}  # int8/fp8 with fp32 scales per token per head
CHECKSUMS = {"blake2b": 0, "crc32": 1, "blake2b_mac": 2}
MAC = CHECKSUMS["blake2b_mac"]


def mac_key(secret: str) -> bytes:
    """The keyed checksum's key, from the deployment's secret (any length)."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"qos-kv-mac").digest()


def mac_id(key: bytes) -> str:
    """A public name of a :func:`mac_key` (for key namespaces): says nothing of the key."""
    return hashlib.blake2b(key, digest_size=4, person=b"qos-kv-mac-id").hexdigest()


class CorruptBlock(ValueError):
    """A stored value that is not a valid block of this layout: treat it as a miss."""


def _checksum(
    kind: int,
    head: bytes | memoryview,
    scales: memoryview,
    payload: memoryview,
    key: bytes = b"",
) -> bytes:
    # Both drop the GIL on large buffers: codec threads run next to the socket work.
    if kind == CHECKSUMS["crc32"]:
        crc = zlib.crc32(payload, zlib.crc32(scales, zlib.crc32(head)))
        return crc.to_bytes(4, "little") + bytes(CHECKSUM_BYTES - 4)
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES, key=key if kind == MAC else b"")
    h.update(head)
    h.update(scales)
    h.update(payload)
    return h.digest()


def _fixed_header(
    layout: KVLayout,
    layout_fp: bytes,
    block_hash: bytes,
    scale_len: int,
    payload_len: int,
    kind: int,
) -> bytes:
    return _FIXED.pack(
        MAGIC,
        VERSION,
        DTYPE_CODES[layout.dtype],
        QUANT_CODES[layout.quant],
        kind,
        layout_fp,
        block_hash,
        layout.num_layers,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        scale_len,
        payload_len,
    )


def block_header(
    layout: KVLayout,
    layout_fp: bytes,
    block_hash: bytes,
    row: np.ndarray,
    checksum: str = "crc32",
    key: bytes = b"",
) -> bytes:
    """The 64-byte header of one block whose row (scales, then payload: ``layout.block_bytes``
    of uint8) stays where it is: a writer sends the header and then the row as one value,
    without joining them (``kvstore.bulk_io``). ``key`` (:func:`mac_key`): authenticated,
    whatever ``checksum`` says."""
    kind = MAC if key else CHECKSUMS[checksum]
    view = row.data.cast("B")
    if len(view) != layout.block_bytes:
        raise ValueError(f"row of {len(view)} bytes, the layout's blocks have {layout.block_bytes}")
    split = layout.scale_bytes
    head = _fixed_header(layout, layout_fp, block_hash, split, len(view) - split, kind)
    return head + _checksum(kind, head, view[:split], view[split:], key)


def encode_blocks(
    layout: KVLayout,
    layout_fp: bytes,
    hashes: Sequence[bytes],
    payload: np.ndarray,
    checksum: str = "crc32",
    key: bytes = b"",
) -> list[memoryview]:
    """Values for ``len(hashes)`` blocks; ``payload`` is uint8 ``[n, layout.block_bytes]``
    (a quantised layout's rows start with its ``layout.scale_bytes`` of scales).

    The values are rows of one new buffer (one copy of the payload in all); each is a
    ``memoryview`` that redis-py sends without copying it again.
    """
    n, size = payload.shape
    if n != len(hashes) or size != layout.block_bytes or payload.dtype != np.uint8:
        raise ValueError(
            f"payload {payload.shape} {payload.dtype} does not hold {len(hashes)} blocks of "
            f"{layout.block_bytes} bytes"
        )
    out = np.empty((n, HEADER_BYTES + size), dtype=np.uint8)
    out[:, HEADER_BYTES:] = payload
    values = []
    for i, block_hash in enumerate(hashes):
        row = out[i]
        head = block_header(layout, layout_fp, block_hash, row[HEADER_BYTES:], checksum, key)
        row[:HEADER_BYTES] = np.frombuffer(head, dtype=np.uint8)
        values.append(memoryview(row))
    return values


def encode_block(
    layout: KVLayout,
    layout_fp: bytes,
    block_hash: bytes,
    payload: bytes | memoryview,
    checksum: str = "crc32",
    key: bytes = b"",
) -> bytes:
    """One block's value as ``bytes`` (tests, tools; the hot path uses :func:`encode_blocks`)."""
    data = np.frombuffer(payload, dtype=np.uint8).reshape(1, -1)
    return bytes(encode_blocks(layout, layout_fp, [block_hash], data, checksum, key)[0])


def decode_block(
    value: bytes | memoryview,
    layout: KVLayout,
    layout_fp: bytes,
    block_hash: bytes,
    key: bytes = b"",
) -> memoryview:
    """The block's row (scales, if any, then the payload: a view into ``value``) in the
    format :func:`encode_blocks` took, or :class:`CorruptBlock`.

    Checks, in order: length, magic, version, the layout (fingerprint, dtype, quant,
    shape), that it is this block, the sizes, and the checksum. With a ``key``, only an
    authenticated value (kind 2, that key) is one; without, a keyed value cannot be checked.
    """
    view = memoryview(value).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptBlock(f"value of {len(view)} bytes is shorter than a header")
    (
        magic,
        version,
        dtype,
        quant,
        kind,
        got_layout,
        got_hash,
        layers,
        block_size,
        heads,
        head_dim,
        scale_len,
        payload_len,
    ) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != VERSION:
        raise CorruptBlock(f"unknown version {version}")
    if got_layout != layout_fp or (dtype, quant) != (
        DTYPE_CODES[layout.dtype],
        QUANT_CODES[layout.quant],
    ):
        raise CorruptBlock("value of another layout")
    if kind not in CHECKSUMS.values():
        raise CorruptBlock(f"unknown checksum kind {kind}")
    if (kind == MAC) != bool(key):
        raise CorruptBlock("unauthenticated value" if key else "authenticated value, no key")
    if (layers, block_size, heads, head_dim) != (
        layout.num_layers,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
    ):
        raise CorruptBlock("shape does not match the layout")
    if got_hash != block_hash:
        raise CorruptBlock("value of another block")
    if payload_len != layout.block_bytes - layout.scale_bytes or scale_len != layout.scale_bytes:
        raise CorruptBlock(f"payload of {payload_len} bytes, scales {scale_len}")
    if len(view) != HEADER_BYTES + scale_len + payload_len:
        raise CorruptBlock(f"value of {len(view)} bytes, header says {scale_len + payload_len}")
    scales = view[HEADER_BYTES : HEADER_BYTES + scale_len]
    payload = view[HEADER_BYTES + scale_len :]
    if not hmac.compare_digest(
        _checksum(kind, view[: _FIXED.size], scales, payload, key), view[_FIXED.size : HEADER_BYTES]
    ):
        raise CorruptBlock("checksum mismatch")
    return view[HEADER_BYTES:]
