"""Block pool: hash chain, prefix reuse, LRU eviction, watermark, and invariants under any
sequence of allocate / append / finish / preempt / abort / re-request (hypothesis)."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.engine.block_pool import BlockPool, hash_block, hash_chain
from workers.engine.request import PLACEHOLDER, Request
from workers.engine.sampling_params import SamplingParams

BS = 4


def make_request(tokens: list[int], rid: str = "r") -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams())


def admit(pool: BlockPool, req: Request) -> bool:
    """What the batcher does for a new request: prefix hit, room for the rest, compute."""
    hit_blocks, hit_tokens = pool.get_computed_blocks(req)
    if not pool.allocate_slots(req, req.num_tokens - hit_tokens, hit_blocks, admission=True):
        return False
    req.num_computed_tokens = req.num_tokens
    pool.cache_full_blocks(req, hit_tokens)
    return True


def test_hash_chain_names_a_block_by_its_whole_prefix() -> None:
    a = hash_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = hash_chain([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2  # only full blocks are named
    assert a[1] != b[1]  # same second block, different parents
    assert a[0] == hash_block(None, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    assert hash_chain([1, 2, 3, 4], BS, salt=b"model-a") != hash_chain(
        [1, 2, 3, 4], BS, salt=b"model-b"
    )
    # Stable across processes: a fixed value, not Python's salted hash().
    assert hash_block(None, [1, 2, 3, 4]).hex() == hash_block(None, (1, 2, 3, 4)).hex()
    assert len(a[0]) == 16


def test_freed_named_blocks_stay_reusable_until_their_slot_is_taken() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, watermark=0.0)
    first = make_request(list(range(10)), "a")  # 2 full blocks + 2 tokens
    assert admit(pool, first)
    pool.free(first)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    again = make_request(list(range(10)), "b")
    assert admit(pool, again)
    assert again.block_table[:2] == first_blocks(pool, list(range(8)))
    assert pool.prefix_hits == 8
    pool.free(again)
    # A different request needing every block evicts the names.
    other = make_request([99] * 16, "c")
    assert admit(pool, other)
    assert pool.num_cached_blocks == 4  # its own 4 blocks; the old names are gone
    pool.free(other)
    third = make_request(list(range(10)), "d")
    hit_blocks, hit_tokens = pool.get_computed_blocks(third)
    assert hit_tokens == 0 and hit_blocks == []


def first_blocks(pool: BlockPool, tokens: list[int]) -> list[int]:
    return [pool._by_hash[h] for h in hash_chain(tokens, BS)]


def test_unnamed_blocks_are_handed_out_before_named_ones() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, watermark=0.0)
    named = make_request(list(range(8)), "a")  # 2 full blocks, both named
    assert admit(pool, named)
    partial = make_request([50, 51], "b")  # 1 partial block, unnamed
    assert admit(pool, partial)
    pool.free(named)
    pool.free(partial)
    newcomer = make_request([70, 71, 72], "c")
    assert admit(pool, newcomer)
    assert pool.num_cached_blocks == 2  # took an unnamed block, the prefix survives


def test_a_hit_never_covers_the_last_token() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS, watermark=0.0)
    assert admit(pool, make_request(list(range(8)), "a"))
    twin = make_request(list(range(8)), "b")
    hit_blocks, hit_tokens = pool.get_computed_blocks(twin)
    assert hit_tokens == 4 and len(hit_blocks) == 1  # one token must be computed for logits


def test_a_hash_collision_is_caught_by_comparing_tokens() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS, watermark=0.0)
    a = make_request([1, 2, 3, 4, 5], "a")
    assert admit(pool, a)
    block = pool.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # pretend another prefix produced the same name
    hit_blocks, hit_tokens = pool.get_computed_blocks(make_request([1, 2, 3, 4, 5], "b"))
    assert hit_tokens == 0 and hit_blocks == []


def test_admission_keeps_the_watermark_free_but_running_requests_may_use_it() -> None:
    pool = BlockPool(num_blocks=10, block_size=BS, watermark=0.2)  # 2 blocks reserved
    big = make_request(list(range(32)), "a")  # 8 blocks: leaves exactly the reserve
    assert admit(pool, big)
    assert not admit(pool, make_request([1], "b"))  # would eat into the reserve
    big.append_token(5)
    assert pool.allocate_slots(big, 1)  # a running decode may
    assert pool.num_free_blocks == 1


def test_fragmentation_counts_empty_slots_of_allocated_blocks() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS, watermark=0.0)
    a, b = make_request(list(range(5)), "a"), make_request(list(range(20, 24)), "b")
    assert admit(pool, a) and admit(pool, b)
    # a: 2 blocks, 5 tokens; b: 1 block, 4 tokens -> 3 unused of 12 slots.
    assert pool.fragmentation([a, b]) == pytest.approx(3 / 12)


def test_a_twin_block_takes_over_the_name_when_the_named_one_was_evicted() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, watermark=0.0)
    a, b = make_request([1, 2, 3, 4, 5], "a"), make_request([1, 2, 3, 4, 6], "b")
    # Both compute the same first block in one step: only a's copy gets the name.
    for req in (a, b):
        assert pool.allocate_slots(req, 5, admission=True)
        req.num_computed_tokens = 5
    for req in (a, b):
        pool.cache_full_blocks(req, 0)
    named = pool._by_hash[hash_block(None, [1, 2, 3, 4])]
    assert named == a.block_table[0]
    pool.free(a)
    assert admit(pool, make_request([9] * 8, "c"))  # takes a's two blocks, evicting the name
    twin = b.block_table[0]
    pool.free(b)
    assert pool._by_hash[hash_block(None, [1, 2, 3, 4])] == twin
    _, hit_tokens = pool.get_computed_blocks(make_request([1, 2, 3, 4, 7], "d"))
    assert hit_tokens == 4


def test_double_free_is_an_error() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = make_request([1, 2], "a")
    assert admit(pool, a)
    table = list(a.block_table)
    pool.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random request life cycles against the pool, with the batcher's calling pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=BS, watermark=0.1)
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}  # preempted, blocks freed
        self.finished: list[list[int]] = []  # token lists of finished requests
        self.n = 0

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    # A small alphabet so prefixes are shared often.
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def add(self, tokens: list[int]) -> None:
        req = make_request(tokens, self._new_id())
        if admit(self.pool, req):
            self.running[req.request_id] = req
        else:
            assert req.block_table == []
            self.waiting[req.request_id] = req

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def re_request_finished(self, data: st.DataObject) -> None:
        """A repeat of a finished request hits every full block still named in the cache."""
        tokens = data.draw(st.sampled_from(self.finished))
        req = make_request(tokens, self._new_id())
        hashes = self.pool.update_hashes(req)
        limit = (req.num_tokens - 1) // BS
        cached = 0
        while cached < limit and hashes[cached] in self.pool._by_hash:
            cached += 1
        hit_blocks, hit_tokens = self.pool.get_computed_blocks(req)
        assert hit_tokens == cached * BS
        if self.pool.allocate_slots(req, req.num_tokens - hit_tokens, hit_blocks, admission=True):
            req.num_computed_tokens = req.num_tokens
            self.pool.cache_full_blocks(req, hit_tokens)
            self.running[req.request_id] = req
        else:
            self.waiting[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        req.append_token(token)
        if self.pool.allocate_slots(req, 1):
            start = req.num_computed_tokens
            req.num_computed_tokens += 1
            self.pool.cache_full_blocks(req, start)
        else:
            self._preempt(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.pool.free(req)
        self.finished.append(list(req.token_ids))
        # Right after a finish its full computed blocks are all findable by name.
        for i, h in enumerate(self.pool.update_hashes(req)[: req.num_computed_tokens // BS]):
            assert h in self.pool._by_hash, f"block {i} of a finished request lost its name"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        req = self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting))))
        if admit(self.pool, req):
            self.running[req.request_id] = req
        else:
            self.waiting[req.request_id] = req

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        req = self.running.pop(rid, None) or self.waiting.pop(rid)
        self.pool.free(req)  # a waiting request has no blocks: a no-op
        assert req.block_table == []

    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.pool.free(req)
        req.num_computed_tokens = 0
        self.waiting[req.request_id] = req

    @invariant()
    def free_plus_used_is_total(self) -> None:
        used = sum(1 for b in self.pool.blocks if b.ref_count > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks

    @invariant()
    def ref_counts_equal_the_holders(self) -> None:
        holders = Counter(b for r in self.running.values() for b in r.block_table)
        for block in self.pool.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.pool._free)
        for req in self.waiting.values():
            assert req.block_table == []

    @invariant()
    def tables_cover_their_tokens_without_duplicates(self) -> None:
        for req in self.running.values():
            assert len(set(req.block_table)) == len(req.block_table)
            assert len(req.block_table) == self.pool.blocks_needed(req.num_computed_tokens)

    @invariant()
    def names_map_to_blocks_holding_them(self) -> None:
        for h, block_id in self.pool._by_hash.items():
            assert self.pool.blocks[block_id].block_hash == h
        named = [b for b in self.pool.blocks if b.block_hash is not None]
        assert len(named) == len(self.pool._by_hash)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_token_still_on_the_device_is_not_hashed_into_a_block_name() -> None:
    """Async output appends a placeholder for a sampled token until it is read back; a
    preemption in between frees (and names) the request's blocks. The block that the
    placeholder ends must be named after the real token, or the request and every later
    turn miss their own prefix (and a tier could serve another request's KV under it)."""
    pool = BlockPool(num_blocks=8, block_size=BS, watermark=0.0)
    req = make_request([1, 2, 3, 4, 5, 6], "a")
    assert admit(pool, req)
    req.append_token(7)
    req.num_computed_tokens = 7
    req.append_token(PLACEHOLDER)  # sampled at position 7, ends block 1, not read back
    req.pending_row = 0
    pool.free(req)  # preempted before the read-back
    req.token_ids[-1] = req.output_token_ids[-1] = 8  # the read-back
    req.pending_row = -1
    assert pool.update_hashes(req) == hash_chain([1, 2, 3, 4, 5, 6, 7, 8], BS)


def test_a_free_block_unnamed_after_a_failed_load_is_handed_out_before_named_ones() -> None:
    """forget() unnamed a free block but left it among the named ones in LRU order: older
    named prefixes were evicted first while a block worth nothing stayed."""
    pool = BlockPool(num_blocks=3, block_size=BS, watermark=0.0)
    older = make_request(list(range(8)), "b")
    newer = make_request([50, 51, 52, 53], "a")
    assert admit(pool, older) and admit(pool, newer)
    pool.free(older)
    pool.free(newer)
    (unnamed,) = first_blocks(pool, [50, 51, 52, 53])
    pool.forget([unnamed])
    taker = make_request([90, 91, 92], "c")
    assert admit(pool, taker)
    assert taker.block_table == [unnamed]
    assert len(first_blocks(pool, list(range(8)))) == 2  # the older prefix kept its names
    assert pool.num_cached_blocks == 2


def test_only_a_requests_first_admission_counts_as_a_prefix_query() -> None:
    """A preempted request comes back to its own freed blocks: counting that as a hit
    inflated the cache's hit rate with every preemption."""
    pool = BlockPool(num_blocks=8, block_size=BS, watermark=0.0)
    req = make_request(list(range(10)))
    assert admit(pool, req)
    req.num_cached_tokens = 0  # what the batcher records at a first admission
    assert (pool.prefix_queries, pool.prefix_hits) == (10, 0)
    pool.free(req)  # preempted
    req.num_computed_tokens = 0
    assert admit(pool, req)
    assert (pool.prefix_queries, pool.prefix_hits) == (10, 0)


def test_a_requests_block_table_array_follows_its_list_and_a_new_list_starts_afresh() -> None:
    """The model runner lays out each step's tables from these arrays (copying every row's
    list each step cost ~1 ms at batch 256 with 2k-token contexts); a stale entry would
    read another request's KV, so the array must follow the list exactly."""
    from workers.engine.request import Request
    from workers.engine.sampling_params import SamplingParams

    req = Request("r", [1, 2, 3], SamplingParams())
    seen = []
    for block in range(40):  # past the first capacity: grown, earlier views intact
        req.block_table.append(100 + block)
        array = req.block_table_array()
        assert array.tolist() == req.block_table
        seen.append(array)
    assert all(v.tolist() == list(range(100, 101 + i)) for i, v in enumerate(seen))
    req.block_table = []  # as BlockPool.free leaves it
    req.block_table += [7, 8]
    fresh = req.block_table_array()
    assert fresh.tolist() == [7, 8] and seen[-1].tolist() == list(range(100, 140))
    req.block_table = [5]  # shorter, as a preempted request readmitted with fewer blocks
    assert req.block_table_array().tolist() == [5]


def test_only_the_block_pool_appends_to_or_replaces_a_block_table() -> None:
    """block_table_array relies on a table list only growing by append until BlockPool
    replaces it: no code may shrink or rewrite one in place."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    mutation = re.compile(
        r"block_table\.(pop|insert|remove|extend|clear|sort|reverse)\b"
        r"|block_table\[[^\]]*\]\s*=(?!=)|del\s+\S*block_table|block_table\s*\+="
    )
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for folder in ("workers", "kvstore", "bench", "common")
        for path in (root / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if mutation.search(line)
    ]
    assert offenders == []
