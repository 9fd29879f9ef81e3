"""Who may read whose KV bytes: the model and layout fingerprints behind every key.

A block's K/V depend on the weights (model fingerprint) and on how they are laid out in
memory (layout fingerprint: block size, KV dtype and quantisation, layers, KV heads, head
dim, tensor-parallel rank). Both go into the key prefix ``qos:kv:<model_fp>:<layout_fp>:``,
so two workers that could not use each other's bytes never even see each other's keys.
The block hash itself (see ``workers.engine.block_pool.hash_block``) names the tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

SCALE_BYTES = 4  # fp32 scales of quantised layouts
FP_BYTES = 8  # 64-bit fingerprints: collisions between deployed models are not a concern
KEY_NAMESPACE = "qos:kv"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=FP_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def model_fingerprint(model: str, seed: int = 0) -> bytes:
    """Fingerprint of the weights a worker serves.

    A folder: its ``config.json`` bytes plus the name and size of every weight file (the
    weights are not read: hashing gigabytes at start-up would cost more than it catches).
    A ``dummy:<shape>`` spec: the spec and the seed, since the random weights come from it.
    """
    if model.startswith("dummy:"):
        return _digest(b"dummy", model.encode(), str(seed).encode())
    folder = Path(model)
    config = (folder / "config.json").read_bytes()
    weights = sorted(
        (p.name, p.stat().st_size)
        for pattern in ("*.safetensors", "*.bin", "*.safetensors.index.json")
        for p in folder.glob(pattern)
    )
    return _digest(b"folder", config, json.dumps(weights).encode())


class CacheLayout(Protocol):
    """What an engine says about its cache (``workers.engine.block_pool.KVCacheLayout``)."""

    @property
    def block_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class KVLayout:
    """How one block's K/V sit in memory: ``[2, num_layers, block_size, num_kv_heads,
    head_dim]`` elements of ``dtype``. ``quant`` names a quantised format: "none", or
    "per_token_head" (int8/fp8 values, preceded by ``[2, num_layers, block_size,
    num_kv_heads]`` fp32 scales)."""

    block_size: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quant: str = "none"
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block's scales (0 unless quantised)."""
        if self.quant == "none":
            return 0
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * SCALE_BYTES

    @property
    def block_bytes(self) -> int:
        """Bytes of one block as the engine exports it: its scales, then all layers' K and V."""
        n = 1
        for d in self.shape:
            n *= d
        return self.scale_bytes + n * self.elem_bytes

    def fingerprint(self) -> bytes:
        return _digest(b"layout", json.dumps(asdict(self), sort_keys=True).encode())


# Element sizes of the KV dtypes the codec knows; fp8/int8 blocks are quantised and carry
# fp32 scales, which travel in the codec's scale field.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KVIdentity:
    """A worker's key namespace: model + layout fingerprints."""

    model_fp: bytes
    layout: KVLayout

    @cached_property
    def layout_fp(self) -> bytes:
        return self.layout.fingerprint()

    @cached_property
    def key_prefix(self) -> bytes:
        """``qos:kv:<model_fp>:<layout_fp>:`` (hex fingerprints)."""
        return f"{KEY_NAMESPACE}:{self.model_fp.hex()}:{self.layout_fp.hex()}:".encode()

    def key(self, block_hash: bytes) -> bytes:
        """The Redis key of one block: the prefix and the block hash in hex."""
        return self.key_prefix + block_hash.hex().encode()
