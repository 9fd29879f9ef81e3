"""The in-engine scheduler: which requests compute which tokens in the next step.

Four policies (``EngineArgs.policy``):

- ``static``: form a batch of up to ``max_batch_size`` waiting requests (as many as the KV
  cache holds at their worst case, prompt + ``max_tokens``), prefill them, decode them
  together until the last one finishes. Nobody joins a batch in flight.
- ``dynamic``: like ``static``, but a batch forms only once ``max_batch_size`` requests
  wait or the oldest has waited ``max_wait_ms``.
- ``continuous``: iteration-level join/leave. Every step admits waiting requests while
  blocks and ``max_batch_size`` allow; a step is either whole-prompt prefills (preferred,
  as in vLLM v0) or one decode token for every running request.
- ``hybrid``: continuous + chunked prefill under the token budget
  ``max_num_batched_tokens``: decodes first, then running prefill chunks, then new
  requests in (priority, arrival) order; one step may mix decodes and prefill chunks.

Prefill delay (``continuous`` and ``hybrid``, ``prefill_delay_factor`` > 0, as vLLM's
``scheduler_delay_factor``): under online traffic requests arrive one by one, and admitting
each at the next step makes a prefill step (a whole-prompt step stalls every decode; a mixed
step cannot replay the decode CUDA graph) for every trickle of arrivals. With a factor,
while requests are running, new ones wait until the oldest has waited ``factor`` times the
duration of the last step that admitted (never more than ``max_wait_ms``: a long prompt's
prefill must not hold the next arrival for as long), or until their prompts fill the token
budget, and are then prefilled together. A preempted request never waits for it.

When blocks run out, the least urgent then newest running request is preempted: its blocks
are freed and it goes back to the waiting queue (at its front under the whole-prompt
policies, in (priority, arrival) order under ``hybrid``), to recompute its prompt and
output later (the prefix cache usually still holds most of it).

Priority preemption (``hybrid``, ``priority_preemption``): a queue head more urgent than
some running request, kept out by the batch size, the step's token budget or the blocks
once the running requests are scheduled, preempts the fewest running requests strictly
less urgent than itself (least urgent, then newest, first; their tokens leave the step)
that make it fit. Only a head that would then fit makes anyone go, and equal priorities
never preempt each other, so nothing thrashes: a victim comes back when room frees, and
its full blocks are usually still in the prefix cache.

Priority aging (``hybrid``, ``priority_aging_s`` > 0): a waiting request gains one level
of urgency for each ``priority_aging_s`` seconds it arrived before another, so a steady
stream of urgent arrivals cannot hold less urgent ones back for ever: the queue is
ordered by ``priority + arrival / priority_aging_s`` (the same order at any moment, see
``Request.urgency``), and a victim must be less urgent by class and once aged.

With a KV tier (host memory, Redis), admission extends the device cache's prefix hit with
the tier's: those blocks are allocated like computed ones and their bytes ride in the plan
(``kv_loads``) for the engine to copy in before the step runs.

A request that asked for prompt logprobs takes no hit, from either cache, over the prompt
positions whose logits it has not had yet (``Request.max_hit_tokens``): it computes them.
Once it has them all (a preempted one), its hits are anyone's.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from workers.engine.block_pool import BlockPool, KVTier
from workers.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledSeq:
    """The tokens of one sequence to compute in a step: what the model runner needs."""

    request_id: str
    token_ids: list[int]  # the new tokens, positions start_pos .. start_pos + len - 1
    start_pos: int  # tokens already in the KV cache
    block_table: Sequence[int] | np.ndarray  # an array from the batcher (a fast copy)
    sample: bool  # this chunk ends at the last known token: sample the next one


@dataclass
class BatchPlan:
    """One step's work. ``seqs[i]`` belongs to ``requests[i]``; the runner reads ``seqs``."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (block id, bytes) loaded from a KV tier: copied into the cache before the step runs.
    kv_loads: list[tuple[int, memoryview]] = field(default_factory=list)
    # (name, block id) of blocks the step filled, prompt or generated: written through to
    # the KV tier (a next turn resends the answer; a resumed request continues after it).
    kv_stores: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token (the decode attention path)."""
        return bool(self.seqs) and all(len(s.token_ids) == 1 for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


# How long a waiting request's KV-tier lookup answer is reused (Batcher._tier_seen).
TIER_LOOKUP_REUSE_S = 1.0
# The longest one step's KV-tier loads may take together: each load is bounded by the
# tier, but seven 20k-token prefixes at 0.3 GB/s in one step held every decode for a
# minute, past the worker's stuck-engine limit (60 s). Once spent (less than
# TIER_LOAD_MIN_LEFT_S left: too little for a load to bring anything), the next request
# with a tier hit waits for the next step, first in line.
TIER_LOADS_PER_STEP_S = 10.0
TIER_LOAD_MIN_LEFT_S = 0.5


class Batcher:
    """Waiting and running queues of one engine, and the policy that moves between them."""

    def __init__(
        self,
        pool: BlockPool,
        policy: str,
        max_batch_size: int,
        max_num_batched_tokens: int,
        max_wait_ms: float = 0.0,
        clock: Callable[[], float] = time.time,
        kv_tier: KVTier | None = None,
        prefill_delay_factor: float = 0.0,
        timer: Callable[[], float] | None = None,
        priority_preemption: bool = False,
        priority_aging_s: float = 0.0,
    ) -> None:
        self.pool = pool
        self.kv_tier = kv_tier
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_wait_s = max_wait_ms / 1000.0
        # Wall time for what requests report (their scheduling and load times); intervals on
        # ``timer``, monotonic: a wall clock stepped back (NTP, a VM resumed) held dynamic
        # batches and delayed prefills for as long as the step. A test's clock drives both.
        self.clock = clock
        self.timer = timer or (time.monotonic if clock is time.time else clock)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.priority_preemption = priority_preemption
        self.priority_aging_s = priority_aging_s  # for arrivals from now on (Request.urgency)
        self.num_priority_preemptions = 0  # of num_preemptions, those to let an urgent one in
        self.tier_query_tokens = 0  # tokens asked of the KV tier at admission
        self.tier_hit_tokens = 0  # of which loaded from it
        # request id -> (tokens, device hit, tier hit, when) of its last KV-tier lookup, kept
        # while it waits for blocks, hit or miss: a queue head that waits must not cost a
        # Redis round trip (and count its tokens as queried again) every step. Asked again
        # after TIER_LOOKUP_REUSE_S, in case another node has stored the prefix meanwhile;
        # at once (when -inf) after a load that came back short sent it back to wait.
        self._tier_seen: dict[str, tuple[int, int, int, float]] = {}
        # static/dynamic: ids of the batch in flight; empty = a new batch may form.
        self._members: set[str] = set()
        self.prefill_delay_factor = prefill_delay_factor
        self._admitted = False  # the plan being formed admitted a request
        self._step_load_s = 0.0  # time the plan being formed spent on KV-tier loads
        self._admitted_at: float | None = None  # when the last plan that admitted was formed
        self._admit_step_s = 0.0  # from that plan to the next scheduling decision

    # --- queue changes -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a new request."""
        req.status = RequestStatus.WAITING
        req.queued_since = self.timer() - max(0.0, self.clock() - req.arrival_time)
        req.aging_s = self.priority_aging_s
        if self.policy == "hybrid":
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
        else:
            self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of the queues for good and free its blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._members.discard(req.request_id)
        self._tier_seen.pop(req.request_id, None)
        self.pool.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def commit(self, plan: BatchPlan, store_budget: int | None = None) -> None:
        """After the step ran: its tokens are in the cache, and full blocks get names.
        ``store_budget``: at most this many blocks offered for write-through (the tier's
        room less what is on its way to it), each request's leading ones first; the rest
        are counted as skipped rather than copied off the device to be dropped."""
        tier = self.kv_tier
        write_through = tier is not None and self.pool.enable_prefix_caching
        stores = write_through and tier is not None and tier.accepts_stores
        budget = store_budget
        skipped = 0
        bs = self.pool.block_size
        for seq, req in zip(plan.seqs, plan.requests, strict=True):
            if req.is_finished:  # stopped while the step ran (asynchronous output)
                continue
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            self.pool.cache_full_blocks(req, seq.start_pos)
            first, last = seq.start_pos // bs, req.num_computed_tokens // bs
            if stores and first < last:
                hashes = self.pool.update_hashes(req)
                # Only the blocks that took their names: another block named the same was
                # offered by whoever computed it first (a request that computes its whole
                # prompt for its logprobs wrote a shared prefix again, using up the budget).
                blocks = self.pool.blocks
                named = [
                    i for i in range(first, last)
                    if blocks[req.block_table[i]].block_hash == hashes[i]
                ]  # fmt: skip
                n = len(named) if budget is None else min(len(named), budget)
                plan.kv_stores += [(hashes[i], req.block_table[i]) for i in named[:n]]
                if budget is not None:
                    budget -= n
                skipped += len(named) - n
            elif write_through and first < last:
                skipped += last - first
        if skipped and tier is not None:
            tier.skipped(skipped)

    # --- scheduling ----------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        """Decide the next step. An empty plan means nothing can run now."""
        self._step_load_s = 0.0
        if self.prefill_delay_factor > 0:
            self._time_admitting_step()
        plan = BatchPlan()
        if self.policy == "hybrid":
            self._schedule_running(plan, budget=self.max_num_batched_tokens)
            if not plan.preempted:  # else blocks ran short for the running ones: admit nobody
                made_way = self._make_way(plan) if self.priority_preemption else 0
                left = self.max_num_batched_tokens - plan.num_tokens
                if made_way:
                    # The room was made for the head alone, and it waits out no prefill
                    # delay: what is left of it is no less urgent request's to take.
                    self._admit(plan, self.waiting[:1], left)
                elif not self._delaying_prefills():
                    self._admit(plan, self.waiting, left)
            return self._formed(plan)
        candidates = self._admission_candidates()
        if candidates:
            self._admit(plan, candidates, self.max_num_batched_tokens, whole=True)
        if plan.is_empty:
            self._schedule_running(plan, budget=None)
        return self._formed(plan)

    def _formed(self, plan: BatchPlan) -> BatchPlan:
        if self._admitted:
            self._admitted = False
            self._admitted_at = self.timer()
        return plan

    def _time_admitting_step(self) -> None:
        """The last plan admitted: how long until this decision is what its step took."""
        if self._admitted_at is not None:
            self._admit_step_s = self.timer() - self._admitted_at
            self._admitted_at = None

    def _delaying_prefills(self) -> bool:
        """Hold new admissions back (module docstring, "Prefill delay")?"""
        if self.prefill_delay_factor <= 0 or not self.running or not self.waiting:
            return False
        # One pass that stops early: under load the queue is long and its head fills a step.
        tokens, oldest = 0, float("inf")
        for r in self.waiting:
            tokens += r.num_tokens
            if tokens >= self.max_num_batched_tokens or r.num_preemptions:
                return False  # a full prefill step, or one that was running: admit now
            oldest = min(oldest, r.queued_since)
        hold = min(self.prefill_delay_factor * self._admit_step_s, self.max_wait_s)
        return self.timer() - oldest < hold

    def _make_way(self, plan: BatchPlan) -> int:
        """Make room in this step for the queue head, once the running requests are
        scheduled (module docstring, "Priority preemption"): tokens of less urgent
        requests' chunks first (trimmed, or sat out, keeping their blocks), then, for a
        batch slot or blocks, the fewest of them preempted. Nothing moves unless the head
        then fits: a slot, a token of the budget, and the blocks of the chunk it gets.
        Returns how many made way (trimmed or preempted)."""
        if not self.waiting or not self.running or len(self.running) > self.max_batch_size:
            return 0  # over a lowered cap, slots come back as requests end, not by preemption
        head = self.waiting[0]
        victims = sorted(
            # One whose last token is on its way back is finishing anyway.
            # Strictly less urgent, by class and once aged: an old request aged past new
            # urgent ones is not taken out by each of them in turn.
            (
                r
                for r in self.running
                if r.priority > head.priority and r.urgency > head.urgency and not r.out_of_budget
            ),
            key=lambda r: r.sort_key,
            reverse=True,  # least urgent, then newest, first
        )
        if not victims:
            return 0
        pool = self.pool
        hit_blocks, hit_tokens = pool.get_computed_blocks(head)
        hits = set(hit_blocks)
        # Its KV-tier hit needs blocks too. Asked here when not known yet (a fresh arrival):
        # counted as none, a victim went for a head that then did not fit with its tier
        # prefix. The answer is kept a second, so the admission below asks nothing again.
        tier = self._tier_lookup(head, len(hit_blocks))
        todo = head.num_tokens - hit_tokens - tier
        # A hit on a free named block takes it off the free list too.
        revived = sum(1 for b in hit_blocks if pool.blocks[b].ref_count == 0)
        base_tokens, base_blocks = hit_tokens + tier, len(hit_blocks) - revived
        scheduled = {id(r): len(s.token_ids) for s, r in zip(plan.seqs, plan.requests, strict=True)}
        slots = self.max_batch_size - len(self.running)
        budget = self.max_num_batched_tokens - plan.num_tokens
        free = pool.num_free_blocks - pool.watermark_blocks

        def fits() -> bool:
            if slots <= 0 or budget <= 0:
                return False
            return free >= pool.blocks_needed(base_tokens + min(todo, budget)) - base_blocks

        # The step's tokens, least urgent first: from prefill chunks as many as the head's
        # prompt lacks; decodes (one skipped stalls a stream) only while the head would get
        # no token at all.
        taken: dict[int, int] = {}  # id(victim) -> tokens taken from its chunk
        for victim in sorted(victims, key=lambda r: not r.is_prefilling):
            chunk = scheduled.get(id(victim), 0)
            want = todo - budget if victim.is_prefilling else 1 - budget
            if chunk and want > 0:
                taken[id(victim)] = min(chunk, want)
                budget += taken[id(victim)]
        # Slots and blocks: the fewest victims that make them. A block comes free only when
        # every holder goes (a prefix shared with one that stays does not), and a hit block
        # freed is the head's again, not room.
        went: list[Request] = []
        holders: dict[int, int] = {}
        for victim in victims:
            if fits():
                break
            went.append(victim)
            slots += 1
            budget += scheduled.get(id(victim), 0) - taken.get(id(victim), 0)
            for b in victim.block_table:
                holders[b] = holders.get(b, 0) + 1
                if holders[b] == pool.blocks[b].ref_count and b not in hits:
                    free += 1
        if not fits():
            return 0
        gone = {id(v) for v in went}
        for victim in victims:
            if id(victim) in gone:
                if id(victim) in scheduled:
                    self._unschedule(plan, victim)
                self._preempt(victim, plan)
            elif id(victim) in taken:
                self._trim(plan, victim, scheduled[id(victim)] - taken[id(victim)])
        self.num_priority_preemptions += len(went)
        return len(gone | taken.keys())

    def _admission_candidates(self) -> list[Request]:
        """Who may join now, in order, under the whole-prompt policies."""
        if not self.waiting:
            return []
        if self.policy == "continuous":
            return [] if self._delaying_prefills() else self.waiting
        if self._members:  # a fixed batch is in flight: only its preempted members return
            # All of them running (the usual case): no scan of a queue of thousands a step.
            if len(self.running) == len(self._members):
                return []
            return [r for r in self.waiting if r.request_id in self._members]
        if self.running:
            return []
        if self.policy == "dynamic" and not (
            len(self.waiting) >= self.max_batch_size
            or self.timer() - self.waiting[0].queued_since >= self.max_wait_s
        ):
            return []
        # Form the batch: the oldest requests whose whole runs (prompt + max_tokens) fit in
        # the free blocks together. A run-to-completion batch reserves its worst case, as a
        # static batcher without paging must: nobody joins to use what is left, nobody is
        # preempted as the batch grows (the first member goes alone if it needs more).
        free = self.pool.num_free_blocks - self.pool.watermark_blocks
        batch: list[Request] = []
        for req in self.waiting[: self.max_batch_size]:
            need = self.pool.blocks_needed(req.max_total_tokens)
            if batch and need > free:
                break
            batch.append(req)
            free -= need
        self._members = {r.request_id for r in batch}
        return batch

    def _admit(
        self, plan: BatchPlan, candidates: list[Request], budget: int, whole: bool = False
    ) -> None:
        """Move waiting requests to running in queue order while blocks, batch size and the
        token budget allow. Stops at the first that does not fit, so nobody is overtaken.
        ``whole``: never split a prompt (but the first one of a step may exceed the budget,
        so a long prompt cannot get stuck)."""
        for req in list(candidates):
            if len(self.running) >= self.max_batch_size or budget <= 0:
                break
            hit_blocks, hit_tokens = self.pool.get_computed_blocks(req)
            tier_tokens = self._tier_lookup(req, len(hit_blocks))
            if tier_tokens and self._step_load_s > TIER_LOADS_PER_STEP_S - TIER_LOAD_MIN_LEFT_S:
                # The step's loads took their time: this one waits for the next step,
                # first in line (its lookup kept in _tier_seen), not recomputed.
                break
            remaining = req.num_tokens - hit_tokens - tier_tokens
            if whole and remaining > budget and not plan.is_empty:
                break
            num_new = remaining if whole else min(remaining, budget)
            if not self.pool.allocate_slots(req, tier_tokens + num_new, hit_blocks, admission=True):
                break  # its tier lookup stays in _tier_seen for the next try
            self._tier_seen.pop(req.request_id, None)
            self.waiting.remove(req)
            req.num_computed_tokens = hit_tokens
            if tier_tokens:
                hit_tokens += self._tier_load(req, plan, len(hit_blocks), tier_tokens)
                if whole:  # blocks that failed to load are computed in this step after all
                    num_new = req.num_tokens - hit_tokens
                    if num_new > budget and not plan.is_empty:
                        # ...unless that takes the step past its budget (by up to a whole
                        # prompt): it waits, first in line, and the blocks that did load
                        # (named, freed, copied in before this step) are a device hit next.
                        # Nothing else is allocated this step, so none is handed out.
                        self.pool.free(req)
                        req.num_computed_tokens = 0
                        self.waiting.insert(0, req)
                        # This admission's counts stand, once: counted again when it came
                        # back, the blocks that loaded were a tier hit and then a device
                        # hit, and its tokens were queried of the tier twice.
                        if req.num_cached_tokens < 0:  # the device cache counts no more
                            req.num_cached_tokens = hit_tokens
                        # The tier is asked again (its answer came back short), uncounted.
                        self._tier_seen[req.request_id] = (
                            req.num_tokens, len(hit_blocks), tier_tokens, -math.inf
                        )  # fmt: skip
                        break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_seq(plan, req, num_new)
            self._admitted = True
            budget -= num_new

    def _tier_lookup(self, req: Request, first: int) -> int:
        """Tokens of the full blocks after the device-cache hit that the KV tier holds (one
        token is always left to compute, as for the device cache)."""
        if self.kv_tier is None or not self.pool.enable_prefix_caching or req.skip_kv_tier:
            return 0
        bs = self.pool.block_size
        # Nothing past what a request owing prompt logprobs has: those positions need logits.
        limit = min(req.num_tokens - 1, req.max_hit_tokens) // bs
        if first >= limit:
            return 0
        seen = self._tier_seen.get(req.request_id)
        if (
            seen is not None
            and seen[0] == req.num_tokens
            and self.timer() - seen[3] < TIER_LOOKUP_REUSE_S
        ):
            # The last answer still says it, from a device hit that grew into the tier's
            # prefix as well (another request named the blocks they share): those blocks
            # are on the device now, and the tier's prefix from there is what was left.
            grown = (first - seen[1]) * bs
            if 0 <= grown <= seen[2]:
                return seen[2] - grown
        # Asked again unless its tokens changed: a device hit that grew meanwhile (another
        # request's prefill named the shared blocks) only narrows what was counted already.
        fresh = seen is None or seen[0] != req.num_tokens
        if fresh:
            self.tier_query_tokens += (limit - first) * bs
        hashes = self.pool.update_hashes(req)[first:limit]
        try:
            tokens = self.kv_tier.lookup(hashes, count=fresh) * bs
        except Exception:  # a tier that breaks its promise not to raise: a miss, not a stall
            log.warning("KV tier lookup failed; computing the prefix", exc_info=True)
            return 0
        self._tier_seen[req.request_id] = (req.num_tokens, first, tokens, self.timer())
        return tokens

    def _tier_load(self, req: Request, plan: BatchPlan, first: int, tokens: int) -> int:
        """Fetch the tier's blocks into the request's freshly allocated ones; name them in
        the device cache. Returns the tokens that arrived (a value may have vanished)."""
        assert self.kv_tier is not None
        bs = self.pool.block_size
        started, t0 = self.clock(), self.timer()
        want = tokens // bs
        try:
            # The request is out of the waiting queue and holds its blocks by now: a load
            # that raised here left it in neither queue, its blocks held for good.
            left_s = TIER_LOADS_PER_STEP_S - self._step_load_s
            data = self.kv_tier.load(req.block_hashes[first : first + want], left_s)[:want]
        except Exception:
            log.warning("KV tier load failed; computing the prefix", exc_info=True)
            data = []
        self._step_load_s += self.timer() - t0
        # The request's "kv load" phase in its trace (a preempted request may load again).
        if req.kv_load_start is None:
            req.kv_load_start = started
        req.kv_load_s += self.timer() - t0
        block_ids = req.block_table[first : first + len(data)]
        plan.kv_loads.extend(zip(block_ids, data, strict=True))
        loaded = len(data) * bs
        start = req.num_computed_tokens
        req.num_computed_tokens += loaded
        self.pool.cache_full_blocks(req, start)
        self.tier_hit_tokens += loaded
        return loaded

    def _schedule_running(self, plan: BatchPlan, budget: int | None) -> None:
        """Give running requests their next tokens: decodes first, then unfinished prefill
        chunks (``budget`` bounds the total; None = all each has left, the whole-prompt
        policies' step: one token for a decode). When blocks run out, the least urgent
        running request goes, the asker included; one already scheduled this step leaves
        the plan (its tokens go back to the budget), as in vLLM: hybrid schedules decodes
        first, and sparing them made an urgent prompt preempt itself while less urgent
        decodes ran on."""
        if budget is None:
            queue = sorted(self.running, key=lambda r: r.sort_key)
        else:
            queue = sorted(self.running, key=lambda r: (r.is_prefilling, r.sort_key))
        while queue:
            req = queue.pop(0)
            if req.out_of_budget:  # its last token is on the way back: nothing to compute
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0:
                # A step that failed after its KV was written (a sampler error) gave it no
                # token: compute the last position again (same token, same KV) to sample.
                req.num_computed_tokens = req.num_tokens - 1
                remaining = 1
            # Whole-prompt policies compute what is left at once: a prompt whose step failed
            # (no commit) is still running with it all to do, and one token a step made its
            # first token wait prompt-length steps. A decode has one left.
            num_new = remaining if budget is None else min(remaining, budget)
            if num_new <= 0:
                break
            while not self.pool.allocate_slots(req, num_new):
                victim = max([*queue, req, *plan.requests], key=lambda r: r.sort_key)
                if victim is req and budget is not None and req.is_prefilling:
                    # A smaller chunk first: preempting itself threw its prompt's progress
                    # away, to be admitted again next step (one chunk fits) and again
                    # preempt itself, step after step, while a more urgent decode shared
                    # each of those steps with it.
                    room = self._room(req)
                    if 0 < room < num_new:
                        num_new = room
                        continue
                    if room <= 0:
                        # No room at all: it waits in its blocks, this step. Preempting
                        # itself freed blocks nobody had asked for; it came back with one
                        # chunk's room and went again, recomputing from its first token,
                        # every few steps. One that needs them takes them (it is a victim).
                        break
                if victim in queue:
                    queue.remove(victim)
                elif victim is not req:
                    freed = self._unschedule(plan, victim)
                    if budget is not None:
                        budget += freed
                self._preempt(victim, plan)
                if victim is req:
                    break
            else:
                self._add_seq(plan, req, num_new)
                if budget is not None:
                    budget -= num_new

    def recompute(self, req: Request, plan: BatchPlan) -> None:
        """Take ``req`` out of this step and queue it to compute from its first token (its
        tier load never reached the cache): a preemption by recompute."""
        self._unschedule(plan, req)
        self._preempt(req, plan)

    def _room(self, req: Request) -> int:
        """Tokens ``req`` could compute now in its blocks and the free ones."""
        blocks = len(req.block_table) + self.pool.num_free_blocks
        return blocks * self.pool.block_size - req.num_computed_tokens

    @staticmethod
    def _trim(plan: BatchPlan, req: Request, keep: int) -> None:
        """Cut ``req``'s chunk in this step to its first ``keep`` tokens (0: out of the
        step); it keeps its blocks and goes on from there next step."""
        if keep <= 0:
            Batcher._unschedule(plan, req)
            return
        i = next(i for i, r in enumerate(plan.requests) if r is req)
        seq = plan.seqs[i]
        # Shorter, it no longer reaches the last known token: nothing to sample.
        plan.seqs[i] = replace(seq, token_ids=seq.token_ids[:keep], sample=False)

    @staticmethod
    def _unschedule(plan: BatchPlan, req: Request) -> int:
        """Take ``req`` out of this step's plan; returns the tokens it had there."""
        i = next(i for i, r in enumerate(plan.requests) if r is req)
        del plan.requests[i]
        return len(plan.seqs.pop(i).token_ids)

    def _preempt(self, req: Request, plan: BatchPlan) -> None:
        self.running.remove(req)
        self.pool.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if not req.out_of_budget:  # one whose last token is on its way back loses nothing
            req.num_preemptions += 1
            self.num_preemptions += 1
        plan.preempted.append(req)
        if self.policy == "hybrid":
            bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
        else:
            # Victims leave least urgent first, so the last one out ends up in front.
            self.waiting.insert(0, req)

    @staticmethod
    def _add_seq(plan: BatchPlan, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        plan.seqs.append(
            ScheduledSeq(
                request_id=req.request_id,
                token_ids=req.token_ids[start : start + num_new],
                start_pos=start,
                block_table=req.block_table_array(),
                sample=start + num_new == req.num_tokens,
            )
        )
        plan.requests.append(req)
