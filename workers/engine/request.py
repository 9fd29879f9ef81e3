"""One request's state inside the engine: tokens, status, KV blocks and bookkeeping.

Priority follows vLLM: a *lower* value is served first; the default is 0. The waiting
queue of the ``hybrid`` policy is ordered by ``(urgency, arrival_time)``, and preemption
picks the request with the largest: least urgent, then newest. Urgency is the priority,
aged when the batcher has ``priority_aging_s`` (see :attr:`Request.urgency`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.model_runner import PromptLogprobs

# Stands for a sampled token still on the device; never a real id (those are >= 0).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request from ``add_request`` until it finishes (identity-compared, not by value).

    ``token_ids`` holds prompt then output tokens; ``num_computed_tokens`` of them have their
    K/V in the cache (``block_table``). ``block_hashes`` is the hash chain of every full block
    of ``token_ids`` so far (see :mod:`workers.engine.block_pool`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    # Seconds of waiting worth one priority level (0: none); set by the batcher on arrival.
    aging_s: float = 0.0
    # What the batcher's timers (max wait, prefill delay) count from: the arrival, unless that
    # is later than the batcher's own clock (a caller's clock ahead of this host's).
    queued_since: float = 0.0
    prompt: str | None = None
    generator: torch.Generator | None = None
    # The prompt's distinct token ids on the sampler's device, made at its first step with a
    # repetition penalty (the sampler's): rebuilt from the list every step, they cost the
    # host ~0.5 ms per request at 2k tokens.
    prompt_ids_device: torch.Tensor | None = None
    # Its output as an int64 array, grown a step at a time (the sampler's, for penalties).
    output_ids_cache: Any = None
    detokenizer: Any = None
    stop_matcher: Any = None
    guide: Any = None  # guided decoding's matcher (workers.engine.guided.Guide)
    eos_token_ids: frozenset[int] = frozenset()

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # Mixed into every block name: requests with different salts never share a prefix.
    cache_salt: bytes = b""
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 = not admitted yet
    num_preemptions: int = 0
    # Decoding budget: min(prompt + max_tokens, max_seq_len), set by the engine.
    max_total_tokens: int = 0
    # Redelivered to this engine: the prompt ends with this many output tokens its caller
    # already has. They count as output for presence/frequency penalties and in the
    # output position that keys a seeded request's noise.
    resumed_tokens: int = 0

    # The output's text in the pieces steps added (joined once, by ``output_text``): an
    # attribute's ``+=`` copies the whole string every step.
    text_pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # Prompt logprobs (``params.prompt_logprobs``): positions 0 .. prompt_lp_done - 1 have
    # had their next-token logprobs computed, in ``prompt_lp_parts`` (host tensors, read only
    # once the step that samples the first token has synchronised); joined into the lists
    # at the first token. Kept through a preemption: recomputing never redoes them.
    prompt_lp_done: int = 0
    prompt_lp_parts: list[PromptLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    first_scheduled_time: float | None = None
    kv_load_start: float | None = None  # its first KV-tier load began (batcher clock)
    kv_load_s: float = 0.0  # spent reading KV-tier blocks, every admission's load summed
    # A KV-tier load of its failed to reach the cache: it computes its prefix from then on.
    skip_kv_tier: bool = False
    first_token_time: float | None = None
    finish_time: float | None = None

    # Asynchronous output (``LLMEngine.step``): the last token is a placeholder whose value
    # is row ``pending_row`` of the step still on the device.
    pending_row: int = -1
    # ``block_table`` as int64, grown in place as blocks are appended (block_table_array).
    _table: np.ndarray | None = field(default=None, init=False, repr=False)
    _table_of: list[int] | None = field(default=None, init=False, repr=False)
    _n_table: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if not self.max_total_tokens:
            self.max_total_tokens = len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while the prompt (or, after preemption, prompt + output) is not all computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def prompt_lp_pending(self) -> bool:
        """It asked for prompt logprobs and some prompt positions still lack them."""
        return (
            self.params.prompt_logprobs is not None
            and self.prompt_lp_done < self.num_prompt_tokens - 1
        )

    @property
    def max_hit_tokens(self) -> int:
        """Tokens a prefix hit (device cache or KV tier) may cover: positions skipped that
        way produce no logits, so a request owing prompt logprobs takes none past the ones
        it already has."""
        return self.prompt_lp_done if self.prompt_lp_pending else self.num_tokens

    @property
    def out_of_budget(self) -> bool:
        """The token still on its way back is the last one allowed: nothing to schedule."""
        return self.pending_row >= 0 and (
            self.num_output_tokens >= self.params.max_tokens
            or self.num_tokens >= self.max_total_tokens
        )

    @property
    def urgency(self) -> float:
        """Its priority, aged: one level more urgent per ``aging_s`` it has waited more than
        another. Linear aging orders two requests the same at any moment (p + t/s against
        q + u/s), so the key is fixed at arrival and a sorted queue stays sorted."""
        if self.aging_s <= 0:
            return float(self.priority)
        return self.priority + self.arrival_time / self.aging_s

    @property
    def sort_key(self) -> tuple[float, float]:
        """Queue order: most urgent first, then oldest."""
        return (self.urgency, self.arrival_time)

    @property
    def output_text(self) -> str:
        return "".join(self.text_pieces)

    def block_table_array(self) -> np.ndarray:
        """``block_table`` as an int64 array, for the model runner to lay out each step's
        tables from: made once per table and extended by the blocks appended since (copying
        every row's list each step cost ~1 ms at batch 256 with 2k-token contexts, 2.4 ms at
        8k). A table only grows by appending until ``BlockPool.free`` replaces the list."""
        table, n = self.block_table, len(self.block_table)
        array = self._table
        # Its own list (free() makes a new one) and never longer than it: else made afresh.
        have = self._n_table if array is not None and self._table_of is table else 0
        have = have if have <= n else 0
        if array is None or have == 0 or n > len(array):
            grown = np.empty(max(16, 2 * n), dtype=np.int64)
            if array is not None and have:
                grown[:have] = array[:have]
            array, self._table, self._table_of = grown, grown, table
        if n > have:
            array[have:n] = table[have:]
        self._n_table = n
        return array[:n]

    def append_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def drop_placeholder(self) -> None:
        """Forget a token not read back yet (the request was aborted meanwhile)."""
        if self.pending_row >= 0:
            self.token_ids.pop()
            self.output_token_ids.pop()
            self.pending_row = -1
