"""Priority preemption under ``hybrid``: an urgent arrival makes way for itself.

The batcher alone, with a real block pool and no model (as ``test_batcher``); a state
machine over random arrivals, priorities and aborts for the block invariants; and the
engine with a real model, whose victim's tokens must still be transformers'.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.engine.stepping import drain_all
from tests.engine.test_batcher import BS, Clock, ids, req, run
from tests.engine.tiny_checkpoints import checkpoint, hf_greedy, prompts
from workers.engine import EngineArgs, LLMEngine, SamplingParams
from workers.engine.batcher import Batcher
from workers.engine.block_pool import BlockPool
from workers.engine.request import RequestStatus


def make_batcher(
    num_blocks: int = 64, max_batch_size: int = 4, budget: int = 64, on: bool = True
) -> Batcher:
    pool = BlockPool(num_blocks, BS, watermark=0.0)
    return Batcher(pool, "hybrid", max_batch_size, budget, 0.0, Clock(), priority_preemption=on)


def test_an_urgent_arrival_takes_the_slot_of_the_least_urgent_then_newest() -> None:
    b = make_batcher(max_batch_size=2)
    b.add(req("low-old", 3, max_tokens=20, priority=5, arrival=1.0))
    b.add(req("low-new", 3, max_tokens=20, priority=5, arrival=2.0))
    run(b)
    run(b)
    b.add(req("urgent", 3, max_tokens=2, priority=0, arrival=3.0))
    plan = run(b)
    assert [r.request_id for r in plan.preempted] == ["low-new"]
    assert sorted(ids(plan)) == ["low-old", "urgent"]  # admitted in the same step
    assert b.num_priority_preemptions == b.num_preemptions == 1
    victim = plan.preempted[0]
    assert victim.status == RequestStatus.PREEMPTED and victim.block_table == []
    # It comes back once the urgent one is done, and finishes; nothing is leaked.
    while b.has_unfinished():
        run(b)
    assert victim.status == RequestStatus.FINISHED and victim.num_output_tokens == 20
    assert b.pool.num_free_blocks == b.pool.num_blocks
    assert b.num_preemptions == 1  # the victim never preempted anyone in turn


def test_equal_priorities_never_preempt_each_other() -> None:
    b = make_batcher(max_batch_size=2)
    b.add(req("a", 3, max_tokens=6, arrival=1.0))
    b.add(req("b", 3, max_tokens=6, arrival=2.0))
    run(b)
    b.add(req("c", 3, max_tokens=6, arrival=3.0))
    while "c" not in ids(plan := run(b)):
        assert not plan.preempted
    assert b.num_preemptions == 0


def test_switched_off_an_urgent_arrival_waits_for_a_free_slot() -> None:
    b = make_batcher(max_batch_size=1, on=False)
    b.add(req("low", 3, max_tokens=5, priority=5))
    run(b)
    b.add(req("urgent", 3, max_tokens=5, priority=0))
    for _ in range(3):
        assert ids(run(b)) == ["low"]
    assert b.num_preemptions == 0


def test_with_aging_an_urgent_stream_cannot_hold_a_less_urgent_request_back_for_ever() -> None:
    """Strict priority: while urgent requests kept arriving, a priority-5 one waited for as
    long as they did. Aged at 10 s a level, it goes ahead of urgent arrivals 50 s younger,
    and once running no younger urgent arrival takes its slot."""
    strict, aged = make_batcher(max_batch_size=1), make_batcher(max_batch_size=1)
    aged.priority_aging_s = 10.0
    for b in (strict, aged):
        b.add(req("busy", 3, max_tokens=2, priority=0, arrival=0.0))
        run(b)
        b.add(req("low", 3, max_tokens=3, priority=5, arrival=1.0))
        for t in (20.0, 52.0):  # 19 s, then 51 s after it (one level: 10 s)
            b.add(req(f"urgent@{t:g}", 3, max_tokens=3, priority=0, arrival=t))
    order = {"strict": [], "aged": []}  # type: dict[str, list[str]]
    for name, b in (("strict", strict), ("aged", aged)):
        while b.has_unfinished():
            for r in run(b).requests:
                if r.request_id not in order[name]:
                    order[name].append(r.request_id)
    assert order["strict"] == ["busy", "urgent@20", "urgent@52", "low"]
    assert order["aged"] == ["busy", "urgent@20", "low", "urgent@52"]
    # Running, it is not the victim of a younger urgent arrival it was aged past.
    b = make_batcher(max_batch_size=1)
    b.priority_aging_s = 10.0
    b.add(req("low", 3, max_tokens=6, priority=5, arrival=1.0))
    run(b)
    b.add(req("urgent", 3, max_tokens=2, priority=0, arrival=60.0))
    assert not run(b).preempted and b.num_preemptions == 0
    b.add(req("urgent-early", 3, max_tokens=2, priority=0, arrival=30.0))  # 29 s: not past it
    assert [r.request_id for r in run(b).preempted] == ["low"]


def test_only_as_many_go_as_the_blocks_need_least_urgent_first() -> None:
    # 12 blocks of 4. Three low-priority requests hold 4 blocks each (13 + 2 tokens).
    b = make_batcher(num_blocks=12, max_batch_size=8)
    for i, prio in enumerate((3, 4, 4)):
        b.add(req(f"low{i}", 13, max_tokens=30, priority=prio, arrival=float(i)))
    run(b)
    run(b)
    run(b)
    assert b.pool.num_free_blocks == 0
    # The urgent prompt needs 6 blocks: the two priority-4 ones go (newest first), not the
    # priority-3 one, which keeps its blocks.
    b.add(req("urgent", 22, max_tokens=2, priority=0, arrival=9.0))
    plan = run(b)
    assert [r.request_id for r in plan.preempted] == ["low2", "low1"]
    assert "urgent" in ids(plan) and "low0" in ids(plan)
    assert b.num_priority_preemptions == 2


def test_nobody_goes_when_the_less_urgent_cannot_make_the_room() -> None:
    # The urgent prompt needs 10 blocks; a more urgent request holds 8 of the 12 and the
    # less urgent one only 4: preempting it would waste its work and still not fit.
    b = make_batcher(num_blocks=12, max_batch_size=8)
    b.add(req("vip", 29, max_tokens=30, priority=-5, arrival=1.0))
    b.add(req("low", 13, max_tokens=30, priority=5, arrival=2.0))
    run(b)
    run(b)
    b.add(req("urgent", 38, max_tokens=2, priority=0, arrival=3.0))
    for _ in range(3):
        plan = run(b)
        assert "urgent" not in ids(plan)
    assert b.num_priority_preemptions == 0


def test_blocks_shared_with_a_more_urgent_request_are_not_counted_as_room() -> None:
    # low shares its first 2 blocks (a common prefix) with vip: freeing low gives back only
    # its own blocks, too few for the urgent prompt, though low holds enough in all.
    b = make_batcher(num_blocks=6, max_batch_size=8)
    vip = req("vip", 10, max_tokens=30, priority=-5, arrival=1.0)
    b.add(vip)
    run(b)
    low = req("low", 9, max_tokens=30, priority=5, arrival=2.0)
    low.prompt_token_ids[:] = low.token_ids[:] = vip.prompt_token_ids[:9]
    b.add(low)
    run(b)
    while b.pool.num_free_blocks:
        run(b)
    refs = Counter(b.pool.blocks[x].ref_count for x in low.block_table)
    assert refs[2] == 2 and refs[1] >= 1
    # Needs one block more than low's own, and no more than all low holds.
    b.add(req("urgent", (refs[1] + 1) * BS - 1, max_tokens=2, priority=0, arrival=3.0))
    plan = run(b)
    assert not plan.preempted and "urgent" not in ids(plan)


def test_a_prefill_chunk_that_takes_the_budget_gives_the_head_what_it_lacks() -> None:
    """The head lacked only the step's tokens, which a less urgent prompt's chunk had
    taken: that request was preempted (its progress lost) and still the head did not get
    in, since the running ones were planned after the preemption. Now the chunk gives up
    the tokens the head lacks, no more, and keeps its blocks and progress."""
    b = make_batcher(max_batch_size=4, budget=8)
    b.add(req("mid", 3, max_tokens=20, priority=0, arrival=1.0))
    run(b)
    b.add(req("low", 40, max_tokens=4, priority=5, arrival=2.0))
    run(b)  # mid decodes, low's first chunk: 7 tokens
    low = next(r for r in b.running if r.request_id == "low")
    done = low.num_computed_tokens
    b.add(req("urgent", 6, max_tokens=2, priority=-1, arrival=3.0))
    b.add(req("later", 5, max_tokens=2, priority=9, arrival=4.0))
    plan = run(b)
    chunks = {s.request_id: len(s.token_ids) for s in plan.seqs}
    # 8 tokens: mid's decode, urgent's 6, low's 1 (of its 7); "later", less urgent than low,
    # takes nothing the head was given room for.
    assert chunks == {"mid": 1, "urgent": 6, "low": 1} and not plan.preempted
    assert low.status == RequestStatus.RUNNING and low.num_computed_tokens == done + 1
    assert b.num_priority_preemptions == b.num_preemptions == 0
    assert "low" in ids(run(b))  # and carries on where it was


def test_decodes_sit_out_only_when_the_head_would_get_no_token_at_all() -> None:
    """A decode skipped stalls its stream for a step: worth it only to let the head in."""
    b = make_batcher(max_batch_size=8, budget=8)
    for i in range(3):
        b.add(req(f"low{i}", 3, max_tokens=20, priority=5, arrival=float(i)))
    run(b)
    b.add(req("urgent", 10, max_tokens=2, priority=0, arrival=9.0))
    plan = run(b)  # 3 decodes leave 5 tokens: the head's first chunk
    assert sorted(ids(plan)) == ["low0", "low1", "low2", "urgent"]
    assert [len(s.token_ids) for s in plan.seqs if s.request_id == "urgent"] == [5]
    full = make_batcher(max_batch_size=8, budget=3)
    for i in range(3):
        full.add(req(f"low{i}", 1, max_tokens=20, priority=5, arrival=float(i)))
    run(full)
    full.add(req("urgent", 10, max_tokens=2, priority=0, arrival=9.0))
    plan = run(full)  # the decodes took every token: the least urgent, newest sits out
    assert sorted(ids(plan)) == ["low0", "low1", "urgent"] and not plan.preempted


def test_nobody_goes_when_a_lowered_cap_leaves_no_slot_even_without_them() -> None:
    """The worker's cap fell below the running count (a breaker opened): preempting the
    less urgent ones cannot free a slot, so none of them goes."""
    b = make_batcher(max_batch_size=4)
    for i, prio in enumerate((0, 0, 5)):
        b.add(req(f"r{i}", 3, max_tokens=20, priority=prio, arrival=float(i)))
    run(b)
    b.max_batch_size = 2  # apply_batch_cap
    b.add(req("urgent", 3, max_tokens=2, priority=0, arrival=9.0))
    plan = run(b)
    assert not plan.preempted and "urgent" not in ids(plan)
    # All less urgent: preempting down to a slot under the cap would take three for one
    # arrival, in a group its breaker is degrading. The cap is reached as they end.
    crowd = make_batcher(max_batch_size=4)
    for i in range(4):
        crowd.add(req(f"low{i}", 3, max_tokens=20, priority=5, arrival=float(i)))
    run(crowd)
    crowd.max_batch_size = 2
    crowd.add(req("urgent", 3, max_tokens=2, priority=0, arrival=9.0))
    assert not run(crowd).preempted and crowd.num_preemptions == 0


def test_a_request_whose_last_token_is_on_its_way_back_is_no_victim() -> None:
    """Finishing anyway, it was preempted and counted (a preemption in its trace and the
    engine's counters) for a request that lost nothing."""
    b = make_batcher(max_batch_size=2)
    b.add(req("low-old", 3, max_tokens=20, priority=5, arrival=1.0))
    b.add(req("low-new", 3, max_tokens=2, priority=5, arrival=2.0))
    run(b)
    ending = next(r for r in b.running if r.request_id == "low-new")
    ending.append_token(-1)  # its last token, still on the device (asynchronous output)
    ending.pending_row = 0
    assert ending.out_of_budget
    b.add(req("urgent", 3, max_tokens=2, priority=0, arrival=3.0))
    plan = b.schedule()
    assert [r.request_id for r in plan.preempted] == ["low-old"]
    assert b.num_preemptions == 1


class PriorityMachine(RuleBasedStateMachine):
    """Random arrivals of mixed priority, steps and aborts against a tight pool."""

    def __init__(self) -> None:
        super().__init__()
        self.b = make_batcher(num_blocks=10, max_batch_size=3, budget=8)
        self.n = 0
        self.live: dict[str, object] = {}

    @rule(
        length=st.integers(1, 14),
        max_tokens=st.integers(1, 6),
        priority=st.integers(-2, 2),
        shared=st.booleans(),
    )
    def add(self, length: int, max_tokens: int, priority: int, shared: bool) -> None:
        self.n += 1
        r = req(f"r{self.n}", length, max_tokens=max_tokens, priority=priority,
                arrival=float(self.n))  # fmt: skip
        if shared:  # a common prefix: blocks held by several requests
            r.prompt_token_ids[:] = r.token_ids[:] = [1 + i % 3 for i in range(length)]
        self.b.add(r)
        self.live[r.request_id] = r

    @rule()
    def step(self) -> None:
        plan = self.b.schedule()
        for victim in plan.preempted:
            assert victim.block_table == [] and victim in self.b.waiting
        self.b.commit(plan)
        for seq, r in zip(plan.seqs, plan.requests, strict=True):
            if seq.sample:
                r.append_token(5)
                if r.num_output_tokens >= r.params.max_tokens:
                    self.b.finish(r, "length")

    @precondition(lambda self: self.b.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        queued = self.b.running + self.b.waiting
        self.b.finish(data.draw(st.sampled_from(queued)), "abort")

    @invariant()
    def blocks_are_held_exactly_by_running_requests(self) -> None:
        pool = self.b.pool
        held = Counter(x for r in self.b.running for x in r.block_table)
        for block_id, block in enumerate(pool.blocks):
            assert block.ref_count == held.get(block_id, 0)
        assert all(not r.block_table for r in self.b.waiting)
        assert len(self.b.running) <= self.b.max_batch_size

    def teardown(self) -> None:
        for _ in range(500):  # everything left finishes: no request is stuck
            if not self.b.has_unfinished():
                break
            self.step()
        assert not self.b.has_unfinished()
        assert self.b.pool.num_free_blocks == self.b.pool.num_blocks


TestPriorityMachine = PriorityMachine.TestCase
TestPriorityMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_request_preempted_for_an_urgent_one_still_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    """Through the engine and a real model: the victim recomputes and continues exactly."""
    path = checkpoint("llama", str(tmp_path))
    args = EngineArgs(str(path), block_size=4, num_kv_blocks=64, dtype="float32")
    args.max_batch_size, args.max_num_batched_tokens = 2, 64
    engine = LLMEngine(args)
    batch = prompts(4, seed=5)[2:]  # 4, 5 and 14 tokens
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("low-a", prompt_token_ids=batch[0], params=params, priority=3)
    engine.add_request("low-b", prompt_token_ids=batch[1], params=params, priority=3)
    outs: dict[str, list[int]] = {}
    for _ in range(4):
        for delta in engine.step():
            outs.setdefault(delta.request_id, []).extend(delta.token_ids)
    engine.add_request("urgent", prompt_token_ids=batch[2], params=params, priority=0)
    for rid, tokens in drain_all(engine).items():
        outs.setdefault(rid, []).extend(tokens)
    stats = engine.stats()
    assert stats.num_priority_preemptions == stats.num_preemptions == 1
    for rid, prompt in zip(("low-a", "low-b", "urgent"), batch, strict=True):
        assert outs[rid] == hf_greedy(path, prompt, 10), rid
    assert engine.pool.num_used_blocks == 0


def test_no_one_is_preempted_for_a_head_whose_tier_hit_will_not_fit() -> None:
    """The head's KV-tier hit needs blocks too, and its lookup came only at admission: the
    estimate without it preempted a victim, then the head with its tier prefix did not fit,
    and the victim waited behind it having lost its cache for nothing."""
    from tests.engine.test_batcher import SlowLoadingTier

    clock = Clock()
    pool = BlockPool(14, BS, watermark=0.0)
    b = Batcher(pool, "hybrid", 4, 8, 0.0, clock, priority_preemption=True,
                kv_tier=SlowLoadingTier(clock, load_s=0.0))  # fmt: skip
    b.add(req("a", 32, max_tokens=50, priority=0, arrival=1.0))
    b.add(req("v", 12, max_tokens=50, priority=5, arrival=2.0))
    while len([r for r in b.running if r.num_output_tokens > 0]) < 2:
        run(b)
    run(b)  # both decoding, for a few steps more without a new block
    assert pool.num_free_blocks == 1  # too few for a 6-token chunk without preemption
    # 41 tokens, 40 of them in the tier: 11 blocks, more than the victim's would free.
    b.add(req("head", 41, max_tokens=4, priority=1, arrival=3.0))
    run(b)
    assert b.num_priority_preemptions == 0
    assert {r.request_id for r in b.running} == {"a", "v"}
