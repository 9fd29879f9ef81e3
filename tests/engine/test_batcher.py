"""Who runs when, per policy: the batcher alone, with a real block pool and no model."""

from __future__ import annotations

from workers.engine.batcher import TIER_LOADS_PER_STEP_S, Batcher, BatchPlan
from workers.engine.block_pool import BlockPool
from workers.engine.request import Request, RequestStatus
from workers.engine.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_batcher(
    policy: str,
    num_blocks: int = 64,
    max_batch_size: int = 4,
    budget: int = 64,
    max_wait_ms: float = 0.0,
    clock: Clock | None = None,
) -> Batcher:
    pool = BlockPool(num_blocks, BS, watermark=0.0)
    return Batcher(pool, policy, max_batch_size, budget, max_wait_ms, clock or Clock())


def req(
    rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0
) -> Request:
    return Request(
        request_id=rid,
        # Distinct per id, so prefix-cache hits happen only where a test wants them.
        prompt_token_ids=[(sum(map(ord, rid)) * 31 + i) % 97 + 1 for i in range(prompt_len)],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
    )


def run(b: Batcher) -> BatchPlan:
    """One step as the engine does it: schedule, compute, sample token 5, finish at max_tokens."""
    plan = b.schedule()
    b.commit(plan)
    for seq, r in zip(plan.seqs, plan.requests, strict=True):
        if seq.sample:
            r.append_token(5)
            if r.num_output_tokens >= r.params.max_tokens:
                b.finish(r, "length")
    return plan


def ids(plan: BatchPlan) -> list[str]:
    return [s.request_id for s in plan.seqs]


def test_static_runs_a_fixed_batch_to_completion_without_joins() -> None:
    b = make_batcher("static", max_batch_size=2)
    b.add(req("a", 5, max_tokens=2))
    b.add(req("b", 3, max_tokens=6))
    b.add(req("c", 3))
    assert sorted(ids(run(b))) == ["a", "b"]  # the batch: the two oldest, prefilled together
    b.add(req("d", 2))
    seen: set[str] = set()
    while "b" in {r.request_id for r in b.running}:
        seen |= set(ids(run(b)))
    # a finished early, yet c and d waited until b, the last member, was done.
    assert seen == {"a", "b"}
    assert sorted(ids(run(b))) == ["c", "d"]


def test_dynamic_waits_for_a_full_batch_or_the_deadline() -> None:
    clock = Clock()
    b = make_batcher("dynamic", max_batch_size=3, max_wait_ms=50, clock=clock)
    b.add(req("a", 4, arrival=clock.now))
    b.add(req("b", 4, arrival=clock.now))
    assert run(b).is_empty  # two of three, deadline not reached
    clock.now += 0.049
    assert run(b).is_empty
    clock.now += 0.002
    assert sorted(ids(run(b))) == ["a", "b"]
    # A full batch goes at once.
    b2 = make_batcher("dynamic", max_batch_size=2, max_wait_ms=1e6, clock=clock)
    b2.add(req("x", 4, arrival=clock.now))
    b2.add(req("y", 4, arrival=clock.now))
    assert sorted(ids(run(b2))) == ["x", "y"]


def test_an_arrival_stamped_by_a_clock_ahead_of_ours_waits_only_max_wait() -> None:
    """Arrival times come from the gateway's clock; one a minute ahead of the worker's must
    not hold a partial batch a minute longer."""
    clock = Clock()
    b = make_batcher("dynamic", max_batch_size=3, max_wait_ms=50, clock=clock)
    b.add(req("a", 4, arrival=clock.now + 60.0))
    assert run(b).is_empty
    clock.now += 0.051
    assert ids(run(b)) == ["a"]


def test_continuous_admits_arrivals_at_the_next_step_preferring_prefill() -> None:
    b = make_batcher("continuous")
    b.add(req("a", 5, max_tokens=10))
    assert ids(run(b)) == ["a"]
    assert ids(run(b)) == ["a"]  # decode
    b.add(req("b", 6, max_tokens=10))
    plan = run(b)
    assert ids(plan) == ["b"] and len(plan.seqs[0].token_ids) == 6  # prefill-only step
    plan = run(b)
    assert ids(plan) == ["a", "b"] and plan.is_decode


def test_continuous_admits_a_prompt_longer_than_the_token_budget() -> None:
    b = make_batcher("continuous", budget=8)
    b.add(req("long", 30))
    b.add(req("short", 3))
    plan = run(b)
    assert ids(plan) == ["long"] and plan.num_tokens == 30  # alone, but never stuck
    assert ids(run(b)) == ["short"]


def test_max_batch_size_caps_running_requests() -> None:
    for policy in ("continuous", "hybrid", "static", "dynamic"):
        b = make_batcher(policy, max_batch_size=2)
        for i in range(5):
            b.add(req(str(i), 3, max_tokens=3))
        peak = 0
        for _ in range(6):
            run(b)
            assert len(b.running) <= 2
            peak = max(peak, len(b.running))
        assert peak == 2, policy  # the cap, reached: not a policy that admits fewer


def test_hybrid_decodes_first_then_prefill_chunks_within_the_token_budget() -> None:
    b = make_batcher("hybrid", budget=8)
    b.add(req("a", 3, max_tokens=20))
    run(b)
    b.add(req("b", 20, max_tokens=20))
    plans = [run(b) for _ in range(4)]
    for plan in plans:
        assert plan.num_tokens <= 8
    # Step 1: a's decode, then 7 tokens of b's prompt; b's chunks continue until done.
    assert ids(plans[0]) == ["a", "b"]
    assert [len(s.token_ids) for s in plans[0].seqs] == [1, 7]
    assert not plans[0].seqs[1].sample  # an unfinished chunk needs no logits
    assert [s.start_pos for s in plans[1].seqs] == [4, 7]
    assert [len(s.token_ids) for s in plans[2].seqs] == [1, 6]  # 7 + 7 + 6 = 20
    assert plans[2].seqs[1].sample
    assert plans[3].is_decode


def test_hybrid_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    b = make_batcher("hybrid", max_batch_size=1)
    b.add(req("late-low", 3, priority=5, arrival=1.0))
    b.add(req("early-normal", 3, priority=0, arrival=2.0))
    b.add(req("urgent", 3, priority=-1, arrival=3.0))
    b.add(req("later-normal", 3, priority=0, arrival=4.0))
    order = []
    while b.has_unfinished():
        order += [i for i in ids(run(b)) if i not in order]
    assert order == ["urgent", "early-normal", "later-normal", "late-low"]


def test_preemption_takes_the_least_urgent_then_newest_and_requeues_it_in_front() -> None:
    # 6 blocks of 4: three requests of 8 tokens (2 full blocks each) fill the pool.
    b = make_batcher("continuous", num_blocks=6, budget=64)
    b.add(req("old-low", 8, max_tokens=8, priority=1, arrival=1.0))
    b.add(req("new-low", 8, max_tokens=8, priority=1, arrival=2.0))
    b.add(req("newest-high", 8, max_tokens=8, priority=0, arrival=3.0))
    b.add(req("queued", 3, priority=0, arrival=4.0))
    run(b)
    assert b.pool.num_free_blocks == 0
    plan = run(b)  # every decode needs a third block: someone must go
    assert [r.request_id for r in plan.preempted] == ["new-low"]
    victim = plan.preempted[0]
    assert victim.status == RequestStatus.PREEMPTED and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens == 1
    assert b.waiting[0] is victim  # back in front of the queue, ahead of "queued"
    assert b.num_preemptions == 1


def test_a_preempted_request_recomputes_its_prompt_and_output() -> None:
    b = make_batcher("hybrid", num_blocks=4, budget=64)
    b.add(req("a", 8, max_tokens=8, arrival=1.0))
    b.add(req("b", 8, max_tokens=8, arrival=2.0))
    run(b)
    plan = run(b)
    assert [r.request_id for r in plan.preempted] == ["b"]
    while not any(r.request_id == "b" for r in b.running):
        plan = run(b)
    seq = next(s for s in plan.seqs if s.request_id == "b")
    # Its 8 prompt tokens and its 1 generated token are computed again (a's growth took
    # the freed blocks, so nothing is left in the prefix cache), then it samples again.
    assert seq.start_pos == 0 and len(seq.token_ids) == 9 and seq.sample
    assert seq.token_ids[-1] == 5


def test_abort_frees_blocks_at_once() -> None:
    b = make_batcher("hybrid")
    r = req("a", 9, max_tokens=50)
    b.add(r)
    run(b)
    assert b.pool.num_free_blocks < b.pool.num_blocks
    b.finish(r, "abort")
    assert b.pool.num_free_blocks == b.pool.num_blocks
    assert r.status == RequestStatus.FINISHED and r.finish_reason == "abort"
    assert not b.has_unfinished()
    waiting = req("w", 3)
    b.add(waiting)
    b.finish(waiting, "abort")
    assert not b.waiting


def test_static_batch_reserves_each_members_whole_run_so_nobody_is_preempted() -> None:
    # 8 blocks of 4 tokens. a and b need 8 + 6 = 14 tokens (4 blocks) each at their worst;
    # c's prompt would fit beside their prompts (5 blocks in all) but not beside their runs.
    b = make_batcher("static", num_blocks=8, max_batch_size=4)
    b.add(req("a", 8, max_tokens=6, arrival=1.0))
    b.add(req("b", 8, max_tokens=6, arrival=2.0))
    b.add(req("c", 2, arrival=3.0))
    assert sorted(ids(run(b))) == ["a", "b"]
    preempted = 0
    while b.running:
        plan = run(b)
        assert "c" not in ids(plan)
        preempted += len(plan.preempted)
    assert preempted == 0
    assert ids(run(b)) == ["c"]


def test_continuous_uses_the_blocks_a_static_batch_would_reserve() -> None:
    b = make_batcher("continuous", num_blocks=8, max_batch_size=4)
    for rid, n in (("a", 8), ("b", 8), ("c", 2)):
        b.add(req(rid, n, max_tokens=6))
    assert sorted(ids(run(b))) == ["a", "b", "c"]  # prompts fit now; growth preempts later


def test_prefill_delay_holds_arrivals_while_others_decode_then_prefills_them_together() -> None:
    for policy in ("continuous", "hybrid"):
        clock = Clock()
        b = make_batcher(policy, max_batch_size=8, max_wait_ms=1000, clock=clock)
        b.prefill_delay_factor = 2.0
        b.add(req("a", 5, max_tokens=50, arrival=clock.now))
        assert ids(run(b)) == ["a"]  # nothing runs: no delay
        clock.now += 0.010  # that admitting step took 10 ms: hold arrivals up to 20 ms
        b.add(req("b", 6, max_tokens=50, arrival=clock.now))
        assert ids(run(b)) == ["a"], policy  # a decodes; b waits
        clock.now += 0.010
        b.add(req("c", 6, max_tokens=50, arrival=clock.now))
        assert ids(run(b)) == ["a"], policy
        clock.now += 0.0101  # b has waited 20.1 ms
        plan = run(b)
        prefilled = [s.request_id for s in plan.seqs if len(s.token_ids) > 1]
        assert prefilled == ["b", "c"], policy  # together, in one step


def test_prefill_delay_ends_when_the_waiting_prompts_fill_the_budget_or_one_was_preempted() -> None:
    clock = Clock()
    b = make_batcher("continuous", max_batch_size=8, budget=12, max_wait_ms=1000, clock=clock)
    b.prefill_delay_factor = 100.0
    b.add(req("a", 5, max_tokens=50, arrival=clock.now))
    run(b)
    clock.now += 0.010
    b.add(req("b", 6, arrival=clock.now))
    assert ids(run(b)) == ["a"]
    b.add(req("c", 6, arrival=clock.now))  # 12 prompt tokens waiting: a full prefill step
    assert ids(run(b)) == ["b", "c"]
    # A request that was running and got preempted goes back at once.
    d = req("d", 3, arrival=clock.now)
    d.num_preemptions = 1
    b.add(d)
    assert ids(run(b)) == ["d"]


def test_no_prefill_delay_by_default() -> None:
    clock = Clock()
    b = make_batcher("continuous", clock=clock)
    b.add(req("a", 5, max_tokens=10, arrival=clock.now))
    run(b)
    clock.now += 1.0
    b.add(req("b", 6, arrival=clock.now))
    assert ids(run(b)) == ["b"]


def test_prefill_delay_never_holds_an_arrival_longer_than_max_wait_ms() -> None:
    clock = Clock()
    b = make_batcher("continuous", max_batch_size=8, max_wait_ms=5, clock=clock)
    b.prefill_delay_factor = 1.0
    b.add(req("long", 40, max_tokens=50, arrival=clock.now))
    run(b)
    clock.now += 2.0  # a 2-second prefill would allow a 2-second hold
    b.add(req("b", 3, arrival=clock.now))
    assert ids(run(b)) == ["long"]
    clock.now += 0.0051
    assert ids(run(b)) == ["b"]  # past 5 ms, the cap


def test_hybrid_preempts_the_least_urgent_even_when_it_is_the_decode_asking() -> None:
    """Hybrid schedules decodes before prefill chunks. A low-priority decode that needs a
    block when the pool is full must give way itself, not evict the urgent prompt whose
    chunks are still queued behind it."""
    b = make_batcher("hybrid", num_blocks=4, budget=8)
    b.add(req("low", 7, max_tokens=20, priority=5, arrival=1.0))
    run(b)  # low's prompt: two blocks
    b.add(req("urgent", 20, max_tokens=4, priority=0, arrival=2.0))
    run(b)  # low decodes into its second block; urgent's first chunk of 7 takes the others
    assert b.pool.num_free_blocks == 0
    plan = run(b)  # low's next token needs a block
    assert [r.request_id for r in plan.preempted] == ["low"]
    assert ids(plan) == ["urgent"]


def test_hybrid_takes_blocks_from_a_less_urgent_decode_already_scheduled_this_step() -> None:
    """The decodes go first into the plan; an urgent prompt's chunk that then found no
    block preempted itself while the less urgent decodes ran on (vLLM takes the victim
    from every running request and un-schedules it): the urgent request finished last."""
    b = make_batcher("hybrid", num_blocks=12, budget=8, max_batch_size=4)
    b.add(req("low1", 8, max_tokens=14, priority=5, arrival=1.0))
    b.add(req("low2", 8, max_tokens=14, priority=5, arrival=1.5))
    for _ in range(3):
        run(b)
    b.add(req("high", 22, max_tokens=4, priority=0, arrival=2.0))
    finished: list[str] = []
    for _ in range(200):
        running = {r.request_id for r in b.running}
        plan = run(b)
        assert "high" not in [r.request_id for r in plan.preempted]
        finished += sorted(running - {r.request_id for r in b.running} - set(
            r.request_id for r in plan.preempted))  # fmt: skip
        if not b.running and not b.waiting:
            break
    assert finished[0] == "high", finished
    assert b.pool.num_free_blocks == 12  # the un-scheduled victims left nothing behind


def test_a_wall_clock_stepped_back_does_not_hold_a_dynamic_batch() -> None:
    """Intervals were measured on the wall clock: stepped back 30 s (NTP, a VM resumed)
    after a request queued, a dynamic batch short of its size waited those 30 s instead
    of max_wait. They are measured on a monotonic timer now."""
    wall, mono = [1000.0], [50.0]
    pool = BlockPool(64, 4)
    b = Batcher(pool, "dynamic", 4, 64, 20, clock=lambda: wall[0], timer=lambda: mono[0])
    b.add(req("a", 5, arrival=wall[0]))
    assert b.schedule().is_empty  # one of four, 0 ms waited
    wall[0] -= 30.0  # the wall clock steps back; 25 ms pass
    mono[0] += 0.025
    assert [r.request_id for r in b.schedule().requests] == ["a"]


def test_a_prefill_short_of_blocks_takes_a_smaller_chunk_before_preempting_itself() -> None:
    """Hybrid: a less urgent prompt whose next chunk did not fit preempted itself, all its
    chunks thrown away, though the free blocks held part of that chunk."""
    pool = BlockPool(12, 4, enable_prefix_caching=False, watermark=0.0)
    b = Batcher(pool, "hybrid", 4, 8, clock=Clock())
    decode = req("D", 30, max_tokens=200, priority=0)
    b.add(decode)
    for _ in range(6):
        run(b)
    prompt = req("R", 40, max_tokens=5, priority=1)
    b.add(prompt)
    first = run(b)  # R admitted with the room one chunk needs
    assert "R" in ids(first) and prompt.num_computed_tokens == 7
    second = run(b)  # 8 more do not fit; the 5 the free block holds do
    chunk = [len(s.token_ids) for s, r in zip(second.seqs, second.requests, strict=True)
             if r is prompt]  # fmt: skip
    assert chunk == [5] and not second.preempted and prompt.num_computed_tokens == 12


def test_a_prefill_out_of_room_waits_in_its_blocks_instead_of_preempting_itself() -> None:
    """Hybrid, no prefix cache: a less urgent prompt with no room left preempted itself in
    a step where nobody needed its blocks, came back with one chunk's room, and went again,
    recomputing from its first token each time. It waits in its blocks now, and goes only
    when a request that needs them takes them (here: the decode's next block)."""
    pool = BlockPool(12, 4, enable_prefix_caching=False, watermark=0.0)
    b = Batcher(pool, "hybrid", 4, 8, clock=Clock())
    decode = req("D", 30, max_tokens=14, priority=0)  # 11 of the 12 blocks at its end
    b.add(decode)
    for _ in range(6):
        run(b)
    prompt = req("R", 40, max_tokens=5, priority=1)
    b.add(prompt)
    for _ in range(60):
        if not b.has_unfinished():
            break
        before = len(decode.block_table)
        plan = run(b)
        if plan.preempted:
            assert ids(plan) == ["D"] and len(decode.block_table) == before + 1, (
                "preempted in a step where the decode took no block of its"
            )
    assert not b.has_unfinished()  # both finished: waiting never blocks for good
    assert decode.num_preemptions == 0 and pool.num_free_blocks == 12


class ShortLoadingTier:
    """A KV tier that says it holds every block and then loads none (its values vanished
    between the lookup and the load)."""

    accepts_stores = accepts_offloads = False

    def lookup(self, hashes: list[bytes], count: bool = True) -> int:
        return len(hashes)

    def load(self, hashes: list[bytes], budget_s: float | None = None) -> list[memoryview]:
        return []

    def skipped(self, blocks: int) -> None:
        pass


def test_a_tier_load_that_comes_back_short_does_not_take_the_step_past_its_budget() -> None:
    """Admission counted the tier's blocks as loaded; when none came, the whole prompt was
    computed in the step anyway, next to the step's first prompt: 110 tokens in a 16-token
    step, past the activation memory the engine planned for."""
    pool = BlockPool(64, BS, watermark=0.0)
    b = Batcher(pool, "continuous", 4, 16, 0.0, Clock(), kv_tier=ShortLoadingTier())
    b.add(req("a", 10))
    b.add(req("b", 100))
    first = run(b)
    assert ids(first) == ["a"] and first.num_tokens == 10
    assert [r.request_id for r in b.waiting] == ["b"] and pool.num_used_blocks == 3
    second = run(b)  # a step of its own: the first prompt of a step may exceed the budget
    assert ids(second) == ["b"] and second.num_tokens == 100


class SlowLoadingTier:
    """A KV tier that holds every block and whose loads take ``load_s`` of the batcher's
    clock each (less when the budget it is handed is less, as KVTiers keeps to it)."""

    accepts_stores = accepts_offloads = False

    def __init__(self, clock: Clock, load_s: float) -> None:
        self.clock, self.load_s = clock, load_s
        self.budgets: list[float | None] = []

    def lookup(self, hashes: list[bytes], count: bool = True) -> int:
        return len(hashes)

    def load(self, hashes: list[bytes], budget_s: float | None = None) -> list[memoryview]:
        self.budgets.append(budget_s)
        self.clock.now += min(self.load_s, budget_s if budget_s is not None else self.load_s)
        return [memoryview(b"\0")] * len(hashes)

    def skipped(self, blocks: int) -> None:
        pass


def test_one_steps_tier_loads_keep_to_a_budget_together() -> None:
    """Each load kept to its own budget, but seven in one step held every decode for a
    minute, past the worker's stuck-engine limit. A load gets what the step has left; once
    spent, the next request with a tier hit waits for the next step, first in line."""
    clock = Clock()
    tier = SlowLoadingTier(clock, load_s=6.0)
    b = Batcher(BlockPool(64, BS, watermark=0.0), "continuous", 4, 256, 0.0, clock,
                kv_tier=tier)  # fmt: skip
    for name in ("a", "b", "c"):
        b.add(req(name, 21))
    first = run(b)
    assert ids(first) == ["a", "b"] and [r.request_id for r in b.waiting] == ["c"]
    assert tier.budgets == [TIER_LOADS_PER_STEP_S, TIER_LOADS_PER_STEP_S - 6.0]
    assert all(s.start_pos == 20 for s in first.seqs)  # loaded, not recomputed
    second = run(b)
    assert "c" in ids(second) and tier.budgets[-1] == TIER_LOADS_PER_STEP_S
    # Too little left for a load to bring anything: the next waits, not loads in vain.
    clock2 = Clock()
    tier2 = SlowLoadingTier(clock2, load_s=TIER_LOADS_PER_STEP_S - 0.3)
    b2 = Batcher(BlockPool(64, BS, watermark=0.0), "continuous", 4, 256, 0.0, clock2,
                 kv_tier=tier2)  # fmt: skip
    b2.add(req("a", 21))
    b2.add(req("b", 21))
    assert ids(run(b2)) == ["a"] and len(tier2.budgets) == 1


def test_a_whole_prompt_whose_step_failed_is_computed_whole_at_the_next_step() -> None:
    """The engine survives a failed step (no commit): the prompt it admitted stays running
    with every token to compute, and whole-prompt policies gave it one token a step, its
    first token prompt-length steps late (2,000 steps for a 2,000-token prompt)."""
    for policy in ("continuous", "static", "dynamic"):
        b = make_batcher(policy, max_batch_size=1)
        b.add(req("a", 12))
        failed = b.schedule()  # admitted; the step raised before commit
        assert [len(s.token_ids) for s in failed.seqs] == [12]
        plan = b.schedule()
        assert [(len(s.token_ids), s.sample) for s in plan.seqs] == [(12, True)], policy
        b.commit(plan)
        plan.requests[0].append_token(5)
        assert [len(s.token_ids) for s in b.schedule().seqs] == [1]  # decodes stay at one
