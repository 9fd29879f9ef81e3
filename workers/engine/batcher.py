"""The in-engine scheduler: which requests compute which tokens in the next step.

Four policies (``EngineArgs.policy``):

- ``static``: form a batch of up to ``max_batch_size`` waiting requests (as many as the KV
  cache holds), prefill them, decode them together until the last one finishes. Nobody
  joins a batch in flight.
- ``dynamic``: like ``static``, but a batch forms only once ``max_batch_size`` requests
  wait or the oldest has waited ``max_wait_ms``.
- ``continuous``: iteration-level join/leave. Every step admits waiting requests while
  blocks and ``max_batch_size`` allow; a step is either whole-prompt prefills (preferred,
  as in vLLM v0) or one decode token for every running request.
- ``hybrid``: continuous + chunked prefill under the token budget
  ``max_num_batched_tokens``: decodes first, then running prefill chunks, then new
  requests in (priority, arrival) order; one step may mix decodes and prefill chunks.

When blocks run out, the least urgent then newest running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to recompute its prompt and
output later (the prefix cache usually still holds most of it).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.block_pool import BlockPool
from workers.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """The tokens of one sequence to compute in a step: what the model runner needs."""

    request_id: str
    token_ids: list[int]  # the new tokens, positions start_pos .. start_pos + len - 1
    start_pos: int  # tokens already in the KV cache
    block_table: list[int]
    sample: bool  # this chunk ends at the last known token: sample the next one


@dataclass
class BatchPlan:
    """One step's work. ``seqs[i]`` belongs to ``requests[i]``; the runner reads ``seqs``."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_wait_s = max_wait_ms / 1000.0
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        # static/dynamic: ids of the batch in flight; empty = a new batch may form.
        self._members: set[str] = set()

    # --- queue changes -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a new request."""
        req.status = RequestStatus.WAITING
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
        self.pool.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def commit(self, plan: BatchPlan) -> None:
        """After the step ran: its tokens are in the cache, and full blocks get names."""
        for seq, req in zip(plan.seqs, plan.requests, strict=True):
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            self.pool.cache_full_blocks(req, seq.start_pos)

    # --- scheduling ----------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        """Decide the next step. An empty plan means nothing can run now."""
        plan = BatchPlan()
        if self.policy == "hybrid":
            self._schedule_running(plan, budget=self.max_num_batched_tokens)
            if not plan.preempted:
                self._admit(plan, self.waiting, self.max_num_batched_tokens - plan.num_tokens)
            return plan
        candidates = self._admission_candidates()
        if candidates:
            self._admit(plan, candidates, self.max_num_batched_tokens, whole=True)
        if plan.is_empty:
            self._schedule_running(plan, budget=None)
        return plan

    def _admission_candidates(self) -> list[Request]:
        """Who may join now, in order, under the whole-prompt policies."""
        if not self.waiting:
            return []
        if self.policy == "continuous":
            return self.waiting
        if self._members:  # a fixed batch is in flight: only its preempted members return
            return [r for r in self.waiting if r.request_id in self._members]
        if self.running:
            return []
        if self.policy == "dynamic" and not (
            len(self.waiting) >= self.max_batch_size
            or self.clock() - self.waiting[0].arrival_time >= self.max_wait_s
        ):
            return []
        # Form the batch: the oldest requests whose prompts fit in the free blocks together.
        free = self.pool.num_free_blocks - self.pool.watermark_blocks
        batch: list[Request] = []
        for req in self.waiting[: self.max_batch_size]:
            need = self.pool.blocks_needed(req.num_tokens)
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
            remaining = req.num_tokens - hit_tokens
            if whole and remaining > budget and not plan.is_empty:
                break
            num_new = remaining if whole else min(remaining, budget)
            if not self.pool.allocate_slots(req, num_new, hit_blocks, admission=True):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_seq(plan, req, num_new)
            budget -= num_new

    def _schedule_running(self, plan: BatchPlan, budget: int | None) -> None:
        """Give running requests their next tokens: decodes first, then unfinished prefill
        chunks (``budget`` bounds the total; None = one token each, the whole-prompt
        policies' decode step). Preempts from the back of the queue when blocks run out."""
        if budget is None:
            queue = sorted(self.running, key=lambda r: r.sort_key)
        else:
            queue = sorted(self.running, key=lambda r: (r.is_prefilling, r.sort_key))
        while queue:
            req = queue.pop(0)
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = 1 if budget is None else min(remaining, budget)
            if num_new <= 0:
                break
            while not self.pool.allocate_slots(req, num_new):
                victim = max(queue, key=lambda r: r.sort_key) if queue else req
                if victim is not req:
                    queue.remove(victim)
                self._preempt(victim, plan)
                if victim is req:
                    break
            else:
                self._add_seq(plan, req, num_new)
                if budget is not None:
                    budget -= num_new

    def _preempt(self, req: Request, plan: BatchPlan) -> None:
        self.running.remove(req)
        self.pool.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
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
                block_table=req.block_table,
                sample=start + num_new == req.num_tokens,
            )
        )
        plan.requests.append(req)
