"""KV blocks: ref counts, the hash-chain prefix cache, an LRU free list and the watermark.

A full block of ``block_size`` tokens is named by ``h_i = H(h_{i-1}, salt, tokens_i)``
(:func:`hash_block`), so one name covers the whole prefix up to it: the KV tier can store
and look blocks up by that name. A block whose last user left keeps its name and its data
in the free list until the slot is handed out again; a new request whose prefix hashes
to it takes it back instead of recomputing. Free blocks without a name are handed out
first, named ones in least-recently-freed order.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from workers.engine.request import Request

HASH_BYTES = 16
_ROOT = bytes(HASH_BYTES)


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """Name of one full block: blake2b-128 over the parent's name, the salt, the tokens.

    Tokens are hashed as packed little-endian int32, the same bytes as on the wire, so any
    process (or language) can recompute a name. The first block's parent is all zeros.
    """
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


def hash_chain(
    token_ids: Sequence[int], block_size: int, salt: bytes = b"", parents: Sequence[bytes] = ()
) -> list[bytes]:
    """Names of every full block of ``token_ids``; ``parents`` are names already known."""
    chain = list(parents)
    for i in range(len(chain), len(token_ids) // block_size):
        chain.append(
            hash_block(
                chain[-1] if chain else None, token_ids[i * block_size : (i + 1) * block_size], salt
            )
        )
    return chain


@dataclass(frozen=True)
class KVCacheLayout:
    """One block of the device cache: ``[2, num_layers, block_size, num_kv_heads, head_dim]``
    elements of ``dtype`` (a torch dtype name such as "bfloat16"), K then V. ``quant`` is
    "per_token_head" for int8/fp8 caches, whose fp32 scales precede the values."""

    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quant: str = "none"
    compute_dtype: str = ""  # the model's dtype: quantised bytes depend on it too


class KVTier(Protocol):
    """Tiers below the device cache (host memory, a shared Redis), by block name.

    Synchronous and never raising: a tier that cannot answer answers "miss". Implemented by
    ``kvstore.tiers.KVTiers``; the engine only ever sees this interface. ``data`` rows are
    one block each: uint8 ``[n, kv_bytes_per_block]`` in the runner's layout.
    """

    @property
    def accepts_stores(self) -> bool:
        """``store_async`` is worth a copy of the blocks."""

    @property
    def accepts_offloads(self) -> bool:
        """``offload`` is worth a copy of the evicted blocks."""

    def bind(self, model: str, seed: int, layout: KVCacheLayout, weights_device: str = "") -> None:
        """Called once by the engine: which model and cache layout the blocks belong to."""

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> int:
        """How many of ``hashes``, from the first, the tiers hold; ``count`` False: the
        same question asked again (a waiting request), not counted as queried tokens."""
        ...

    def load(self, hashes: Sequence[bytes], budget_s: float | None = None) -> list[memoryview]:
        """The bytes of a prefix of ``hashes`` (maybe shorter than asked, never longer);
        ``budget_s``: how long it may take at most (the engine step's time for loads)."""
        ...

    def store_async(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Write computed blocks through; returns at once (the tier may drop them)."""

    def skipped(self, blocks: int) -> None:
        """``blocks`` filled blocks were not offered while ``accepts_stores`` was false:
        count them with the tier's drops."""

    def offload_wanted(self, hashes: Sequence[bytes]) -> list[int]:
        """Which of the blocks the device cache evicts (in eviction order) :meth:`offload`
        wants the bytes of: at most what it holds, and none it has already (those are
        only made recent)."""
        ...

    def offload(self, hashes: Sequence[bytes], data: np.ndarray) -> None:
        """Keep blocks that the device cache evicts."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # contents of a named block, compared on every hit


class BlockPool:
    """All KV blocks of one engine and the requests' claims on them.

    The batcher asks :meth:`get_computed_blocks` for a cached prefix, then
    :meth:`allocate_slots` for room for the tokens of a step, and :meth:`free` when a request
    finishes, is preempted or aborted. After a step it calls :meth:`cache_full_blocks` so
    the blocks that just filled become reusable by name.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_salt: bytes = b"",
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Head = next to hand out. Unnamed blocks go to the head, named ones to the tail.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of which found in the cache
        # (block id, name) of named blocks handed out again; None = nobody wants them.
        self.evictions: list[tuple[int, bytes]] | None = None

    # --- figures -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a named, reusable prefix (in use or free)."""
        return len(self._by_hash)

    def usage(self) -> float:
        """Share of blocks held by requests (named free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def fragmentation(self, requests: Iterable[Request]) -> float:
        """Allocated-but-unused slots / allocated slots, over the given (running) requests.

        Only a request's last block can be partly empty, and it is never shared, so summing
        per request counts every unused slot once.
        """
        allocated = self.num_used_blocks * self.block_size
        if allocated == 0:
            return 0.0
        unused = sum(
            max(0, len(r.block_table) * self.block_size - r.num_computed_tokens) for r in requests
        )
        return unused / allocated

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache --------------------------------------------------------------------

    def update_hashes(self, req: Request) -> list[bytes]:
        """Extend ``req.block_hashes`` to every full block of its known tokens; return it.

        A sampled token not read back yet (async output) is a placeholder: a block it ends
        is not named until it is real, since names only ever grow (a preemption frees the
        request's blocks, naming them, while its last token is still on the device).
        """
        known = req.num_tokens - (req.pending_row >= 0)
        if len(req.block_hashes) < known // self.block_size:
            tokens = req.token_ids if known == req.num_tokens else req.token_ids[:known]
            salt = self.hash_salt + req.cache_salt  # the pool's salt is fixed: still one-to-one
            req.block_hashes = hash_chain(tokens, self.block_size, salt, req.block_hashes)
        return req.block_hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that has nothing computed: (block ids, tokens).

        At least one token is always left to compute, since the step must produce logits;
        a request owing prompt logprobs hits none of the positions it still owes
        (``Request.max_hit_tokens``). Touches nothing: pass the ids to
        :meth:`allocate_slots` before any other allocation.
        """
        if not self.enable_prefix_caching or req.num_computed_tokens or req.block_table:
            return [], 0
        if req.max_hit_tokens < self.block_size:  # a fresh request owing prompt logprobs
            return [], 0
        hashes = self.update_hashes(req)
        limit = min(len(hashes), (req.num_tokens - 1) // self.block_size)
        limit = min(limit, req.max_hit_tokens // self.block_size)
        hits: list[int] = []
        for i in range(limit):
            block_id = self._by_hash.get(hashes[i])
            if block_id is None:
                break
            start = i * self.block_size
            # Equal names with different tokens would be a blake2b collision: never trust it.
            if self.blocks[block_id].token_ids != tuple(
                req.token_ids[start : start + self.block_size]
            ):
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cache_full_blocks(self, req: Request, start_token: int) -> None:
        """Name the blocks that became full and computed since ``start_token``."""
        if not self.enable_prefix_caching:
            return
        first = start_token // self.block_size
        last = req.num_computed_tokens // self.block_size
        if last <= first:
            return
        hashes = self.update_hashes(req)
        for i in range(first, last):
            block = self.blocks[req.block_table[i]]
            if block.block_hash is not None or hashes[i] in self._by_hash:
                continue  # already named, or another block holds the same prefix
            block.block_hash = hashes[i]
            block.token_ids = tuple(req.token_ids[i * self.block_size : (i + 1) * self.block_size])
            self._by_hash[hashes[i]] = block.block_id

    def forget(self, block_ids: Iterable[int]) -> None:
        """Unname these blocks: what they hold is not what their names say (a KV-tier load
        that failed after its blocks were named)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and self._by_hash.get(block.block_hash) == block_id:
                del self._by_hash[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            if block.ref_count == 0:  # free: now worthless, it goes first (as _release does)
                self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every name (blocks in use keep their data)."""
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self._by_hash.clear()

    # --- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        admission: bool = False,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and the
        ``computed_blocks`` prefix hit, which joins the block table first).

        Admissions must leave the watermark free so that running decodes can still grow.
        Returns False, changing nothing, when the blocks are not there.
        """
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(req.block_table) - len(computed_blocks)
        # A hit on a free named block takes it off the free list too.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        reserve = self.watermark_blocks if admission else 0
        if self.num_free_blocks - max(num_new_blocks, 0) - revived < reserve:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
            req.block_table.append(block_id)
        for _ in range(num_new_blocks):
            req.block_table.append(self._take_free())
        if (
            admission
            and self.enable_prefix_caching
            and req.num_cached_tokens < 0
            and not req.prompt_lp_pending
        ):
            # Its first admission only: one preempted comes back to its own freed blocks,
            # hits that said nothing about the cache's use and inflated its hit rate. One
            # owing prompt logprobs looked nothing up, nor does any with caching off (its
            # 0 % hit rate read as a useless cache).
            self.count_prefix_query(req.num_tokens, len(computed_blocks) * self.block_size)
        return True

    def count_prefix_query(self, tokens: int, hit_tokens: int) -> None:
        """Count one admission's prefix lookup (negative values take one back)."""
        self.prefix_queries += tokens
        self.prefix_hits += hit_tokens

    def free(self, req: Request) -> None:
        """Give back every block of ``req``. The tail goes first so that, once named blocks
        are evicted oldest-first, a prefix outlives its own continuation."""
        # A block computed alongside an identical one stayed unnamed; if that twin has been
        # evicted since, this copy takes over the name instead of being lost.
        self.cache_full_blocks(req, 0)
        for block_id in reversed(req.block_table):
            self._release(block_id)
        req.block_table = []

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if not self._free:
            raise RuntimeError("block pool exhausted (allocate_slots checks this first)")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: the slot is about to hold new data.
            if self._by_hash.get(block.block_hash) == block_id:
                del self._by_hash[block.block_hash]
                if self.evictions is not None:  # a lower tier keeps it (before the step runs)
                    self.evictions.append((block_id, block.block_hash))
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)
