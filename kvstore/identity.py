"""Who may read whose KV bytes: the model and layout fingerprints behind every key.

A block's K/V depend on the weights (model fingerprint) and on how they are laid out in
memory (layout fingerprint: block size, KV dtype and quantisation, layers, KV heads, head
dim, tensor-parallel rank). Both go into the key prefix ``qos:kv2:<model_fp>:<layout_fp>:``,
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
# "2": the value format's version (kvstore.codec.VERSION), so values of another format,
# which a reader would count as corrupt and the next write-through overwrite, live apart.
KEY_NAMESPACE = "qos:kv2"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=FP_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def model_fingerprint(model: str, seed: int = 0, weights_device: str = "") -> bytes:
    """Fingerprint of the weights a worker serves.

    A folder: its ``config.json`` bytes plus, per weight file, its name, size and a sample
    of its contents (see :func:`_weights_sample`): a retrained or fine-tuned checkpoint
    keeps its config and its file sizes, and must not read the KV its predecessor wrote.
    A ``dummy:<shape>`` spec: the spec, the seed and ``weights_device`` (what drew the
    random weights: CPU and CUDA generators, and CUDA on GPUs of different SM counts, give
    other numbers for one seed, so two such workers must not share KV).
    """
    if model.startswith("dummy:"):
        return _digest(b"dummy", model.encode(), str(seed).encode(), weights_device.encode())
    folder = Path(model)
    config = (folder / "config.json").read_bytes()
    files = sorted(
        p
        for pattern in ("*.safetensors", "*.bin", "*.safetensors.index.json")
        for p in folder.glob(pattern)
    )
    weights = [(p.name, p.stat().st_size) for p in files]
    samples = [_weights_sample(p) for p in files]
    return _digest(b"folder", config, json.dumps(weights).encode(), *samples)


SAMPLE_BYTES = 4096  # per tensor end (safetensors) or per window (other files)


def _weights_sample(path: Path) -> bytes:
    """A digest of what a file holds, read in kilobytes, not gigabytes: for a safetensors
    file its header and the first and last 4 KiB of every tensor (training changes them
    all); for any other file five 4 KiB windows spread over it."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        # A real header fits the file (and safetensors' 100 MB cap); a Git LFS pointer named
        # .safetensors does not, and is sampled as the small text file it is.
        if path.name.endswith(".safetensors") and 0 < header_len <= min(size - 8, 100 << 20):
            header = f.read(header_len)
            h.update(header)
            try:
                tensors = json.loads(header)
            except ValueError:
                tensors = {}
            base = 8 + header_len
            for name in sorted(tensors) if isinstance(tensors, dict) else ():
                span = _tensor_span(tensors[name], size - base)
                if span is None:
                    continue
                start, end = base + span[0], base + span[1]
                for at in sorted({start, max(start, end - SAMPLE_BYTES)}):
                    f.seek(at)
                    h.update(f.read(min(SAMPLE_BYTES, end - at)))
        else:
            for i in range(5):
                f.seek(max(0, (size - SAMPLE_BYTES) * i // 4))
                h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def _tensor_span(spec: object, data_bytes: int) -> tuple[int, int] | None:
    """A header entry's ``data_offsets`` when they are two ints inside the data, else None."""
    offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2):
        return None
    start, end = offsets
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_bytes):
        return None
    return start, end


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
    # The model's own dtype: with a quantised cache the bytes depend on it too (the K/V
    # quantised were computed in it), so an fp32 and a bf16 worker must not share them.
    compute_dtype: str = ""

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
    # With values authenticated (redis.kv_mac_secret): an id of the key, so workers with
    # another secret (or none) keep their own keys instead of rejecting, recomputing and
    # overwriting each other's values block for block.
    mac_id: str = ""

    @cached_property
    def layout_fp(self) -> bytes:
        return self.layout.fingerprint()

    @cached_property
    def value_fp(self) -> bytes:
        """What a value's header carries (8 bytes): the model and the layout together, so a
        value copied under another model's key (two fine-tunes of one shape) is no hit."""
        return hashlib.blake2b(self.model_fp + self.layout_fp, digest_size=8).digest()

    @cached_property
    def key_prefix(self) -> bytes:
        """``qos:kv2:<model_fp>:<layout_fp>:`` (hex fingerprints), then ``m<mac id>:`` when
        values are authenticated."""
        mac = f"m{self.mac_id}:" if self.mac_id else ""
        return f"{KEY_NAMESPACE}:{self.model_fp.hex()}:{self.layout_fp.hex()}:{mac}".encode()

    def key(self, block_hash: bytes) -> bytes:
        """The Redis key of one block: the prefix and the block hash in hex."""
        return self.key_prefix + block_hash.hex().encode()
