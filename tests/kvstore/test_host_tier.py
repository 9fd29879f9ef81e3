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
