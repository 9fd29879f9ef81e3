"""G2: a host-memory pool of KV blocks with an LRU, sized in bytes.

Fixed-size slots allocated once, in a few slabs (page-locked when CUDA is there, so copies
to and from the GPU run at full PCIe speed without a staging copy; plain memory on CPU).
Blocks evicted from the device cache land here; a request that finds its prefix here
copies it back instead of recomputing or fetching it from Redis. Used by the engine
thread only, so nothing here locks.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class _Slabs:
    """``num_slots`` rows of ``slot_bytes``, in slabs of at most a power of two bytes each.

    Pinned memory comes from torch's caching host allocator, which rounds every request up
    to a power of two: one 40 GiB slab locked 64 GiB (65 GiB asked for 128, and failed or
    starved the host). Slabs whose sizes are powers of two lock what they hold.
    """

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool) -> None:
        self.rows: list[np.ndarray] = []
        self._starts: list[int] = []
        pinned = False
        if pin:
            import torch  # local: only a CUDA worker pins; kvstore imports without torch

            pinned = torch.cuda.is_available()
        left = num_slots
        while left > 0:
            size = 1 << ((left * slot_bytes).bit_length() - 1)  # the largest power <= left
            rows = min(left, max(1, size // slot_bytes))
            self._starts.append(num_slots - left)
            self.rows.append(_allocate(rows, slot_bytes, pinned))
            left -= rows

    def __getitem__(self, slot: int) -> np.ndarray:
        i = bisect.bisect_right(self._starts, slot) - 1
        return self.rows[i][slot - self._starts[i]]

    def __setitem__(self, slot: int, row: np.ndarray) -> None:
        i = bisect.bisect_right(self._starts, slot) - 1
        self.rows[i][slot - self._starts[i]] = row


def _allocate(rows: int, slot_bytes: int, pinned: bool) -> np.ndarray:
    if pinned:
        import torch

        return torch.empty((rows, slot_bytes), dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty((rows, slot_bytes), dtype=np.uint8)


class HostTier:
    """Up to ``capacity_bytes // block_bytes`` blocks, least recently used out first.

    ``get`` returns a view into the slab: it stays valid until the next :meth:`put`, which
    may reuse that slot. The engine consumes loads before it offloads, so that is enough.
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool = True) -> None:
        if block_bytes < 1:
            raise ValueError("block_bytes must be >= 1")
        self.block_bytes = block_bytes
        self.num_slots = max(0, capacity_bytes // block_bytes)
        self.capacity_bytes = self.num_slots * block_bytes
        self._slab = _Slabs(self.num_slots, block_bytes, pin) if self.num_slots else None
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, LRU first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.num_evictions = 0
        self.num_puts = 0

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.block_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, are here; those are made the most
        recently used, head last (as :meth:`get_prefix`): a request that found them waits
        for device blocks before it loads, and other requests' offloads evicted them
        meanwhile, to be recomputed."""
        n = 0
        for h in hashes:
            if h not in self._slots:
                break
            n += 1
        for h in reversed(hashes[:n]):
            self._slots.move_to_end(h)
        return n

    def get(self, block_hash: bytes) -> memoryview | None:
        """The block's bytes (a view, see the class docstring), marked most recently used."""
        slot = self._slots.get(block_hash)
        if slot is None or self._slab is None:
            return None
        self._slots.move_to_end(block_hash)
        return self._slab[slot].data

    def get_prefix(self, hashes: Sequence[bytes]) -> list[memoryview]:
        """The bytes of the longest prefix of ``hashes`` held here, its head made the most
        recently used: a prefix's first blocks must outlive its continuation, as in the
        device cache (getting them one by one left the head the oldest of them, the next
        to go, and the rest unreachable behind it)."""
        n = self.prefix(hashes)
        if n == 0 or self._slab is None:
            return []
        return [self._slab[self._slots[h]].data for h in hashes[:n]]

    def put(self, block_hash: bytes, data: np.ndarray | bytes | memoryview) -> bool:
        """Copy one block in (evicting the least recently used one if full); False when the
        tier has no room at all or the data is not one block."""
        if self._slab is None:
            return False
        row = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if row.nbytes != self.block_bytes:
            return False
        slot = self._slots.get(block_hash)
        if slot is not None:  # same name, same tokens, same bytes: only refresh its age
            self._slots.move_to_end(block_hash)
            return True
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            self.num_evictions += 1
        self._slab[slot] = row.reshape(-1).view(np.uint8)
        self._slots[block_hash] = slot
        self.num_puts += 1
        return True

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
