"""G2, the host-memory pool: capacity in bytes, least recently used out first."""

from __future__ import annotations

import numpy as np

from kvstore.host_tier import HostTier

BLOCK = 64


def block(i: int) -> np.ndarray:
    return np.full(BLOCK, i, dtype=np.uint8)


def name(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_capacity_in_bytes_rounds_down_to_whole_blocks() -> None:
    tier = HostTier(3 * BLOCK + BLOCK // 2, BLOCK, pin=False)
    assert tier.num_slots == 3 and tier.capacity_bytes == 3 * BLOCK
    for i in range(5):
        assert tier.put(name(i), block(i))
    assert tier.num_blocks == 3 and tier.used_bytes <= tier.capacity_bytes
    assert tier.num_evictions == 2


def test_least_recently_used_goes_first_and_a_get_refreshes() -> None:
    tier = HostTier(3 * BLOCK, BLOCK, pin=False)
    for i in range(3):
        tier.put(name(i), block(i))
    assert tier.get(name(0)) is not None  # 0 is now the most recent; 1 is the oldest
    tier.put(name(3), block(3))
    assert name(1) not in tier and name(0) in tier
    assert bytes(tier.get(name(3)) or b"") == bytes(block(3))
    assert tier.prefix([name(0), name(2), name(1), name(3)]) == 2


def test_wrong_sized_data_and_a_zero_capacity_store_nothing() -> None:
    assert not HostTier(BLOCK, BLOCK, pin=False).put(name(0), np.zeros(BLOCK - 1, np.uint8))
    empty = HostTier(BLOCK - 1, BLOCK, pin=False)
    assert not empty.put(name(0), block(0)) and empty.get(name(0)) is None


def test_a_prefix_read_keeps_its_head_the_most_recent() -> None:
    """Blocks read one by one left the prefix's first block the oldest of them: the next
    put evicted it, and the rest of the prefix sat unreachable behind it."""
    tier = HostTier(4 * BLOCK, BLOCK, pin=False)
    for i in reversed(range(4)):  # offloads arrive tail first, as the device cache evicts
        tier.put(name(i), block(i))
    views = tier.get_prefix([name(i) for i in range(4)])
    assert [bytes(v) for v in views] == [bytes(block(i)) for i in range(4)]
    tier.put(name(9), block(9))
    assert tier.prefix([name(i) for i in range(4)]) == 3  # the tail went, not the head
    assert tier.get_prefix([name(5)]) == []


def test_a_prefix_found_by_a_lookup_outlives_offloads_until_it_is_loaded() -> None:
    """A request that found its prefix here waits for device blocks before it loads; the
    lookup did not touch it, so other requests' offloads evicted it in the meantime."""
    tier = HostTier(4 * BLOCK, BLOCK, pin=False)
    for i in range(4):
        tier.put(name(i), block(i))  # 0 is the oldest
    assert tier.prefix([name(0), name(1)]) == 2  # the lookup
    tier.put(name(7), block(7))
    tier.put(name(8), block(8))  # two offloads: 2 and 3 go, not the prefix found
    assert tier.prefix([name(0), name(1)]) == 2 and name(2) not in tier


def test_the_pool_is_slabs_whose_sizes_pinned_memory_does_not_round_up() -> None:
    """torch's pinned allocator rounds a request up to a power of two: one 40 GiB slab
    locked 64 GiB. Slabs of at most a power of two each lock what they hold."""
    from kvstore.host_tier import _Slabs

    slabs = _Slabs(num_slots=11, slot_bytes=48, pin=False)
    sizes = [s.nbytes for s in slabs.rows]
    assert sum(s.shape[0] for s in slabs.rows) == 11
    locked = sum(1 << (size - 1).bit_length() for size in sizes)  # rounded up as torch does
    assert locked <= 11 * 48 + len(sizes) * 48  # one slab of 11 * 48 bytes would lock 1024
    tier = HostTier(11 * 48, 48, pin=False)
    for i in range(11):
        assert tier.put(name(i), np.full(48, i, np.uint8))
    assert [bytes(tier.get(name(i)) or b"") for i in range(11)] == [
        bytes([i]) * 48 for i in range(11)
    ]
