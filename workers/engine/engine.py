"""LLMEngine: the step API that the worker service drives from its own thread.

``add_request`` queues, ``step`` runs one forward pass and returns what it added to each
request, ``abort`` frees a request's blocks at once. Not thread-safe: one thread owns it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.errors import ConfigError, InvalidRequestError
from common.guided import GuidedSpec, GuidedSpecError
from workers.engine.admission_checks import check_logit_bias, checked_prompt_ids
from workers.engine.args import (
    DEFAULT_CPU_KV_CACHE_GIB,
    EngineArgs,
    check_fp8_support,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from workers.engine.batcher import Batcher, BatchPlan
from workers.engine.block_pool import BlockPool, KVTier
from workers.engine.guided import Guide, Guides
from workers.engine.loader import (
    DUMMY_INIT_VERSION,
    DUMMY_SHAPES,
    generation_config_eos,
    is_dummy,
    load_model_config,
)
from workers.engine.model_runner import GiB, ModelRunner, PromptLogprobs, PromptRows, TokenFeed
from workers.engine.outputs import (
    ENGINE_FAILED,
    GUIDED_FAILED,
    EngineStats,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
)
from workers.engine.request import PLACEHOLDER, Request
from workers.engine.sampling_params import SamplingParams
from workers.engine.stopping import primary_eos, settle_token
from workers.engine.transfer import to_device, to_host

if TYPE_CHECKING:
    from workers.engine.warmup import WarmupReport

log = logging.getLogger(__name__)
GUIDES_RETRY_S = 60.0  # a failed build of guided decoding's tokenizer view is tried again

# Upper bound of the profile run on CUDA when whole prompts may exceed the token budget.
_MAX_PROFILE_TOKENS = 32768


def weights_device(device: torch.device, model: str = "") -> str:
    """What draws a dummy model's random weights, as far as it changes them: the device
    (CPU and CUDA generators, and GPUs of different SM counts, give other numbers for one
    seed), torch and CUDA versions, the shape as resolved and the init scheme. Workers of
    two releases in a rolling upgrade must not share KV of differently drawn weights."""
    where = device.type
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"cuda:{props.name}:{props.multi_processor_count}"
    if not is_dummy(model):
        return where
    shape = json.dumps(DUMMY_SHAPES.get(model.split(":", 1)[1], {}), sort_keys=True, default=str)
    return (f"{where}|torch {torch.__version__}|cuda {torch.version.cuda}|{shape}"
            f"|init {DUMMY_INIT_VERSION}")  # fmt: skip


class LLMEngine:
    """One model, one KV cache, one batching policy. See :class:`EngineArgs`.

    Priority: a lower value is served first (vLLM's convention); preemption takes the
    least urgent, then newest, running request. ``kv_tier`` (e.g. ``kvstore.KVTiers``)
    extends the prefix cache below the device: hits load, full blocks write through, evicted
    blocks go down a tier.
    """

    def __init__(
        self, args: EngineArgs, tokenizer: Any | None = None, kv_tier: KVTier | None = None
    ) -> None:
        args.validate()
        self.args = args
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            # The current device is per thread, and Triton launches on the current device's
            # stream whatever its tensors' device: built on cuda:1 from a thread still on
            # cuda:0 (a worker builds on a pool thread), the profile's and the warm-up's
            # kernels went to cuda:0's stream with cuda:1 pointers.
            torch.cuda.set_device(self.device)
        self.model_config = load_model_config(args.model)
        self.dtype = resolve_dtype(args.dtype, self.device, self.model_config.checkpoint_dtype)
        self.backend = resolve_backend(args.backend, self.device)
        if self.backend == "triton" and args.block_size & (args.block_size - 1):
            # The Triton kernels tile KV blocks by powers of two: said here, by name, not
            # as a bare ValueError from the first kernel of the warm-up profile.
            raise ConfigError(
                f"EngineArgs.block_size: {args.block_size} must be a power of two with the "
                "triton backend (8, 16, 32 ...)"
            )
        check_fp8_support(self.backend, args.kv_cache_dtype, self.device)
        torch.manual_seed(args.seed)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(args)
        self.runner = ModelRunner(
            args.model,
            self.model_config,
            self.device,
            self.dtype,
            self.backend,
            args.block_size,
            args.seed,
            kv_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype),
        )
        self._profiled_tokens: int | None = None  # the memory profile's forward, on CUDA
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.pool = BlockPool(
            num_blocks, args.block_size, args.enable_prefix_caching, args.watermark
        )
        self.kv_tier = kv_tier
        if kv_tier is not None:
            kv_tier.bind(
                args.model,
                args.seed,
                self.runner.kv_layout(),
                weights_device(self.device, args.model),
            )
            if kv_tier.accepts_offloads:
                self.pool.evictions = []
        self.max_seq_len = self._resolve_max_seq_len()
        self._warn_if_prefill_outgrows_profile()
        capture = self.device.type == "cuda" and not args.enforce_eager and self.backend == "triton"
        self.runner.prepare(self.max_seq_len, args.max_batch_size, capture=capture)
        self.batcher = Batcher(
            self.pool,
            args.policy,
            args.max_batch_size,
            args.max_num_batched_tokens,
            args.max_wait_ms,
            kv_tier=kv_tier,
            prefill_delay_factor=args.prefill_delay_factor,
            priority_preemption=args.priority_preemption,
            priority_aging_s=args.priority_aging_s,
        )
        from workers.engine.sampler import Sampler

        self.sampler = Sampler()
        self.eos_token_ids = frozenset(
            set(self.model_config.eos_token_ids)
            | (set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set())
            | generation_config_eos(args.model)
        )
        # vLLM's EOS (without a tokenizer, config.json's first): the others stop as stop
        # token ids do, reporting their id.
        self.primary_eos = primary_eos(self.tokenizer)
        if self.tokenizer is None and self.model_config.eos_token_ids:
            self.primary_eos = self.model_config.eos_token_ids[0]
        self.requests: dict[str, Request] = {}
        # Requests that still owe prompt logprobs: a step looks for prompt rows only while
        # there are any, so others pay nothing for the feature.
        self._prompt_lp_owed: set[Request] = set()
        self._pending: list[RequestDelta] = []
        self._guides: Guides | None = None  # built for the first guided request
        self._guides_failed_at: float | None = None  # its build failed then: not retried
        self._guides_lock = threading.Lock()  # worker threads compile side by side
        self.async_output = (
            self.device.type == "cuda" if args.async_output is None else args.async_output
        )
        self._inflight: _Inflight | None = None
        self._exports: list[_Export] = []  # write-through copies on their way to the host
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.num_tokens_computed = 0
        self.last_step_num_tokens = 0  # 0: the step ran nothing (e.g. a dynamic batch collecting)
        self.last_step_num_seqs = 0
        self.warmup: WarmupReport | None = None
        if args.warmup or (
            args.warmup is None and self.device.type == "cuda" and self.backend == "triton"
        ):
            from workers.engine.warmup import warm_up

            self.warmup = warm_up(self)
        log.info(
            "engine ready: %s on %s/%s (%s), %d KV blocks x %d, max_seq_len %d, policy %s",
            args.model,
            self.device,
            self.dtype,
            self.backend,
            num_blocks,
            args.block_size,
            self.max_seq_len,
            args.policy,
        )

    # --- set-up --------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        args = self.args
        per_block = self.runner.bytes_per_block()
        if args.num_kv_blocks is not None:
            n = args.num_kv_blocks
        elif args.kv_cache_gib is not None:
            n = int(args.kv_cache_gib * GiB // per_block)
        elif self.device.type == "cuda":
            max_tokens = args.max_num_batched_tokens
            if args.policy != "hybrid":  # a whole prompt may exceed the budget
                want = args.max_seq_len or self.model_config.max_position_embeddings
                max_tokens = max(max_tokens, min(want, _MAX_PROFILE_TOKENS))
            self._profiled_tokens = max_tokens
            n = self.runner.profile_num_blocks(
                args.gpu_memory_utilization, max_tokens, args.max_batch_size
            )
        else:
            n = int(DEFAULT_CPU_KV_CACHE_GIB * GiB // per_block)
        if n < 1:
            raise ConfigError(
                f"EngineArgs: the KV cache budget holds no block of {per_block} bytes; "
                "raise kv_cache_gib / gpu_memory_utilization or use a smaller model",
                param="kv_cache_gib",
            )
        return n

    def _warn_if_prefill_outgrows_profile(self) -> None:
        """A policy without chunked prefill runs a whole prompt in one forward; the memory
        profile (capped: a 128k-token profile run needs that much KV just to measure)
        reserved activations for fewer tokens, so a longer prompt may run out of memory."""
        profiled = self._profiled_tokens
        if profiled is None or self.args.policy == "hybrid" or self.max_seq_len <= profiled:
            return
        log.warning(
            "policy %s prefills a whole prompt in one step, but activation memory was "
            "reserved for %d tokens and max_seq_len is %d: a longer prompt may run out of "
            "GPU memory; use policy hybrid (chunked prefill) or max_seq_len <= %d",
            self.args.policy, profiled, self.max_seq_len, profiled,
        )  # fmt: skip

    def _resolve_max_seq_len(self) -> int:
        cfg, bs = self.model_config, self.args.block_size
        model_max = cfg.context_len
        # One request alone must be admissible (the watermark stays free) and able to grow.
        capacity = (self.pool.num_blocks - self.pool.watermark_blocks) * bs
        wanted = self.args.max_seq_len
        if wanted is None:
            return min(model_max, capacity)
        if wanted > model_max:
            why = ""
            if cfg.sliding_window and cfg.sliding_window < cfg.max_position_embeddings:
                why = (
                    f" (its sliding window: max_position_embeddings is "
                    f"{cfg.max_position_embeddings}, but sliding-window attention is not "
                    "implemented, so it is served up to the window, where full attention agrees)"
                )
            raise ConfigError(
                f"EngineArgs.max_seq_len: {wanted} exceeds the model's context length "
                f"{model_max}{why}",
                param="max_seq_len",
            )
        if wanted > capacity and self.args.fit_max_seq_len:
            log.warning("max_seq_len %d does not fit in the KV cache; serving up to %d tokens",
                        wanted, capacity)  # fmt: skip
            return capacity
        if wanted > capacity:
            raise ConfigError(
                f"EngineArgs.max_seq_len: {wanted} tokens do not fit in the KV cache "
                f"({capacity} tokens); raise kv_cache_gib/num_kv_blocks or lower max_seq_len",
                param="max_seq_len",
            )
        return wanted

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resumed_tokens: int = 0,
        delivered_text_len: int = 0,
        cache_salt: str = "",
        guide: Guide | None = None,
    ) -> None:
        """Queue a request (exactly one of ``prompt`` / ``prompt_token_ids``).

        Raises :class:`InvalidRequestError` for a duplicate id or a bad prompt and
        :class:`ContextLengthExceededError` when the prompt leaves no room for one token.
        Generation stops with ``finish_reason="length"`` at ``max_seq_len``.
        A redelivered request continues its output: its prompt ends with the
        ``resumed_tokens`` tokens its caller has, with ``delivered_text_len`` characters of
        their text (see :func:`~common.detokenizer.attach_text_state`).
        Requests share cached prefix blocks (here and in the KV tiers) only when their
        ``cache_salt`` is equal, as in vLLM: a tenant's own salt keeps others from reusing,
        and so from timing, its prompts.
        ``guide``: the matcher of ``params.guided`` from :meth:`guide`, made off this thread
        (compiling a grammar takes up to tens of milliseconds); else it is made here.
        """
        params = params if params is not None else SamplingParams()

        def encode(text: str) -> list[int]:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"model {self.args.model!r} has no tokenizer: pass prompt_token_ids",
                    param="prompt",
                )
            return list(self.tokenizer.encode(text))

        ids = checked_prompt_ids(
            request_id, self.requests, prompt, prompt_token_ids, encode,
            self.max_seq_len, self.model_config.vocab_size,
        )  # fmt: skip
        check_logit_bias(params.logit_bias, self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        if params.guided is not None and guide is None:
            guide = self.guide(params.guided, ids[len(ids) - resumed_tokens :], params.guided_after)
        elif params.guided is None:
            guide = None
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt,
            max_total_tokens=min(len(ids) + params.max_tokens, self.max_seq_len),
            cache_salt=cache_salt.encode(),
            eos_token_ids=self.eos_token_ids,
        )
        req.resumed_tokens = resumed_tokens
        req.guide = guide
        if params.seed is not None:
            # Reseeded per step from the seed and output position (see the sampler).
            req.generator = torch.Generator(device=self.device)
        if self.tokenizer is not None:
            from common.detokenizer import attach_text_state

            attach_text_state(
                req, self.tokenizer, ids, params,
                resumed_tokens=resumed_tokens, delivered_text_len=delivered_text_len,
            )  # fmt: skip
        if guide is not None and guide.done:
            # Redelivered after its match was complete (the final chunk lost): it ends
            # now, with nothing more to add.
            req.finish_time, req.finish_reason = time.time(), "stop"
            output = RequestOutput.of(req)
            self._pending.append(RequestDelta(request_id, [], "", finished=True,
                                              finish_reason="stop", output=output))  # fmt: skip
            return
        self.requests[request_id] = req
        if req.prompt_lp_pending:
            self._prompt_lp_owed.add(req)
        self.batcher.add(req)

    def guide(
        self, spec: GuidedSpec, resumed: Sequence[int] = (), after: int | None = None
    ) -> Guide:
        """A matcher for ``spec`` that has read a redelivered request's output so far
        (``resumed``), holding from the token after ``after`` (``SamplingParams.guided_after``),
        for :meth:`add_request`. Safe to call from another thread. Raises
        :class:`InvalidRequestError` for a spec that cannot compile or output it rejects."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"model {self.args.model!r} has no tokenizer: guided decoding needs one",
                param="guided",
            )
        guides = self._guides or self._build_guides()
        try:
            return guides.start(spec, list(resumed), after)
        except GuidedSpecError as exc:
            raise InvalidRequestError(f"guided: {exc}", param="guided") from None

    def _build_guides(self) -> Guides:
        """The tokenizer as llguidance reads it, built once (a 152k vocabulary takes a
        second); a build that fails is tried again only after ``GUIDES_RETRY_S``, not for
        every request meanwhile. Its details stay in the log (they can name paths)."""
        with self._guides_lock:
            failed_at = self._guides_failed_at
            if self._guides is None and (
                failed_at is None or time.monotonic() - failed_at >= GUIDES_RETRY_S
            ):
                vocab = self.model_config.vocab_size
                try:
                    self._guides = Guides(self.tokenizer, vocab, set(self.eos_token_ids))
                except Exception:
                    log.exception("guided decoding is unavailable for %s", self.args.model)
                    self._guides_failed_at = time.monotonic()
            if self._guides is None:
                raise InvalidRequestError(
                    "guided decoding is unavailable for this model's tokenizer (the worker "
                    "logs why)",
                    param="guided",
                )
            return self._guides

    def pending_finished_ids(self) -> set[str]:
        """Requests whose finished delta the next :meth:`step` returns (a step that raised
        keeps what it had gathered)."""
        return {d.request_id for d in self._pending if d.finished}

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; the next :meth:`step` reports it with
        ``finish_reason="abort"``. False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.drop_placeholder()
        self.batcher.finish(req, "abort")
        self._prompt_lp_owed.discard(req)
        req.finish_time = time.time()
        self._pending.append(
            RequestDelta(
                request_id,
                [],
                "",
                finished=True,
                finish_reason="abort",
                output=RequestOutput.of(req),
                num_output_tokens=req.num_output_tokens,
            )
        )
        return True

    def has_unfinished(self) -> bool:
        return (
            self.batcher.has_unfinished()
            or bool(self._pending)
            or self._inflight is not None
            or bool(self._exports)  # an idle step hands them to the tier
        )

    # --- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one forward pass; one delta per request that got a token or finished.

        With ``async_output`` the step's sampled tokens stay on the device: the next step
        is scheduled and launched first (taking those tokens as inputs on the device), and
        only then are they read back, checked for stops and returned, so the host's work
        overlaps the device's. Deltas then arrive one step later, and a request that stops
        on a token (EOS, stop string) computes one extra position that is thrown away.
        Every sampling step is deferred: logprobs are copied back with the tokens, and
        penalties count a request's token still on the device there.

        A step that raises keeps the deltas it had gathered (abort reports, tokens read
        back from the step before) for the next call: a request that goes on must not
        skip a token, nor an aborted one lose its report.
        """
        deltas, self._pending = self._pending, []
        try:
            self._run_step(deltas)
        except BaseException:
            self._pending = deltas + self._pending
            self._drop_exports()  # its copies may never land: nothing may wait on them
            raise
        return deltas

    def _run_step(self, deltas: list[RequestDelta]) -> None:
        """:meth:`step`'s work; appends its deltas to ``deltas``."""
        plan = self.batcher.schedule()
        self.last_step_num_tokens = plan.num_tokens
        self.last_step_num_seqs = len(plan.seqs)
        if self.kv_tier is not None and (plan.kv_loads or self.pool.evictions):
            self._swap_kv(plan)
        if plan.is_empty:
            self._read_back(deltas)
            self._hand_over_exports(wait=True)
            return
        wanted = self._prompt_rows(plan) if self._prompt_lp_owed else None
        if wanted:
            logits, parts = self.runner.execute_with_prompt_logprobs(
                plan, self._feed(plan), [w for w, _ in wanted]
            )
            self._record_prompt_logprobs(wanted, parts)
        else:
            logits = self.runner.execute(plan, self._feed(plan))
        sampling = [r for r, s in zip(plan.requests, plan.seqs, strict=True) if s.sample]
        defer = self._can_defer(sampling)
        if defer and any(r.guide is not None for r in sampling):
            # A guided row's mask needs its token in flight: wait for that step's sampling
            # only (this step's forward is queued behind it), then queue this one's.
            self._read_back(deltas)
        launched = self._launch(logits, sampling) if defer else None
        self._read_back(deltas)  # the previous step's tokens: on the host by now
        self._commit(plan)
        if launched is not None:
            self._defer(launched)
            return
        rows = [i for i, r in enumerate(sampling) if not r.is_finished]
        if not rows:
            return
        live = [sampling[i] for i in rows]
        if len(rows) < len(sampling):  # a device index: a list's blocking copy would wait
            logits = logits.index_select(0, to_device(rows, logits.device, torch.long))
        out = self.sampler.sample(logits, live)
        now = time.time()
        self.num_generation_tokens += len(live)
        for i, req in enumerate(live):
            req.append_token(out.token_ids[i])
            logprob = out.logprobs[i] if out.logprobs is not None else None
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            deltas.append(self._accept_or_fail(req, out.token_ids[i], logprob, top, now))

    def _prompt_rows(self, plan: BatchPlan) -> list[tuple[PromptRows, Request]]:
        """The prompt positions of this step whose logprobs their requests still owe: those
        of the chunk before the prompt's last token (whose logits sample the first output
        token) from the first one not computed yet (a chunk recomputed after a preemption
        computes no position twice)."""
        wanted = []
        for i, (seq, req) in enumerate(zip(plan.seqs, plan.requests, strict=True)):
            if not req.prompt_lp_pending:
                continue
            first = req.prompt_lp_done
            end = min(seq.start_pos + len(seq.token_ids), req.num_prompt_tokens - 1)
            # Request.max_hit_tokens: no hit skips a position the request still owes.
            assert seq.start_pos <= first, (req.request_id, seq.start_pos, first)
            if first < end:
                k = req.params.prompt_logprobs or 0
                targets = req.prompt_token_ids[first + 1 : end + 1]
                wanted.append((PromptRows(i, first - seq.start_pos, targets, k), req))
        return wanted

    def _record_prompt_logprobs(
        self, wanted: list[tuple[PromptRows, Request]], parts: list[PromptLogprobs]
    ) -> None:
        """Keep each request's new prompt logprobs (on their way to the host) in order."""
        for (rows, req), part in zip(wanted, parts, strict=True):
            req.prompt_lp_parts.append(part)
            req.prompt_lp_done += len(rows.targets)
            if not req.prompt_lp_pending:
                self._prompt_lp_owed.discard(req)

    @staticmethod
    def _join_prompt_logprobs(req: Request) -> None:
        """The prompt logprobs as lists, entry 0 None (nothing precedes the first token).
        Called at the first token: the step that sampled it has synchronised by then, and
        every part's copy to the host was queued before its tokens'."""
        k = req.params.prompt_logprobs or 0
        chosen: list[float | None] = [None]
        tops: list[list[tuple[int, float]] | None] = [None]
        for part in req.prompt_lp_parts:
            chosen += part.chosen.tolist()
            if k and part.top_ids is not None and part.top_values is not None:
                ids, values = part.top_ids[:, :k].tolist(), part.top_values[:, :k].tolist()
                tops += [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
            else:
                tops += [[] for _ in range(len(part.chosen))]
        req.prompt_logprobs, req.prompt_top_logprobs = chosen, tops
        req.prompt_lp_parts = []

    def _commit(self, plan: BatchPlan) -> None:
        """The step's tokens are in the cache: name full blocks, write them through, count."""
        # Exports that landed go to the tier first: the store queue's room, which the
        # batcher asks about next, then counts them.
        self._hand_over_exports(wait=False)
        self.batcher.commit(plan, self._store_budget())
        if plan.kv_stores and self.kv_tier is not None:
            hashes, ids = zip(*plan.kv_stores, strict=True)
            try:
                rows, copied = self.runner.export_blocks_async(ids)
            except Exception:  # best effort (out of memory for the copy): the step is done
                log.warning("kv write-through of %d blocks failed", len(ids), exc_info=True)
                self.kv_tier.skipped(len(ids))
            else:
                self._exports.append(_Export(hashes, rows, copied))
        self.num_steps += 1
        self.num_tokens_computed += plan.num_tokens
        for seq, req in zip(plan.seqs, plan.requests, strict=True):
            n_prompt = req.num_prompt_tokens
            if seq.start_pos < n_prompt:  # decodes (the common case) computed no prompt
                end = seq.start_pos + len(seq.token_ids)
                self.num_prompt_tokens_computed += min(end, n_prompt) - seq.start_pos

    def _hand_over_exports(self, *, wait: bool) -> None:
        """Give the tier the write-through blocks whose copy to the host has finished
        (all of them with ``wait``). The copy is queued behind the step that filled the
        blocks; reading it at once (``.cpu()``) made the host wait for that whole step on
        every step that filled a block, which with a batch decoding is nearly every step:
        the overlap of asynchronous output was lost whenever the Redis tier was on."""
        assert self.kv_tier is not None or not self._exports
        while self._exports:
            # Out of the list before the device is asked: a device that fails every call
            # (a sticky CUDA error) must not leave it there, the engine "unfinished" for good.
            export = self._exports.pop(0)
            if export.copied is not None:
                try:
                    if wait:
                        export.copied.synchronize()
                    elif not export.copied.query():
                        self._exports.insert(0, export)
                        return  # later ones were queued behind it
                except BaseException:
                    self._drop_exports(export)
                    raise
            assert self.kv_tier is not None
            if export.offload:
                self.kv_tier.offload(export.hashes, export.rows.numpy())
            else:
                self.kv_tier.store_async(export.hashes, export.rows.numpy())

    def _store_budget(self) -> int | None:
        """Blocks the tier's store queue can still take, less the write-through copies on
        their way to it (None: the tier does not say). Those copies are not in its queue
        yet, so its own room check let several steps' blocks be copied off the device, and
        then dropped on arrival."""
        room = getattr(self.kv_tier, "store_room_blocks", None)
        if room is None:
            return None
        pending = sum(len(e.hashes) for e in self._exports if not e.offload)
        return max(0, room - pending)

    def flush_exports(self) -> None:
        """Hand every pending write-through and offload to the tier now, waiting for their
        copies (a stopping worker: the engine takes no further step to do it)."""
        try:
            self._hand_over_exports(wait=True)
        except Exception:
            log.warning("pending KV copies lost at stop", exc_info=True)
            self._drop_exports()

    def _drop_exports(self, *more: _Export) -> None:
        """Give up pending write-through (a failed step): counted with the tier's drops."""
        lost = [e for e in (*more, *self._exports) if not e.offload]  # offloads: a cache
        self._exports.clear()
        if lost and self.kv_tier is not None:
            self.kv_tier.skipped(sum(len(e.hashes) for e in lost))

    # --- asynchronous output -------------------------------------------------------------

    def _can_defer(self, sampling: list[Request]) -> bool:
        return self.async_output and bool(sampling)

    def _launch(self, logits: torch.Tensor, sampling: list[Request]) -> _Inflight:
        """Queue the sampling and the copy of its tokens (and of their logprobs, when a
        request asked) to the host; nothing waits. Logprobs used to make the whole batch's
        step synchronous: read back at once, four times."""
        cuda = logits.is_cuda
        pending = self._pending_tokens(sampling)
        extras: list[torch.Tensor | None] = []
        if any(r.params.logprobs is not None for r in sampling):
            tokens, *extras = self.sampler.choose_with_logprobs(logits, sampling, pending)
        else:
            tokens = self.sampler.choose(logits, sampling, pending)
        host = to_host(tokens)
        on_host = [to_host(t) if t is not None else None for t in extras]
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tokens.device))
        return _Inflight(sampling, tokens, host, ready, *on_host)

    def _pending_tokens(self, sampling: list[Request]) -> torch.Tensor | None:
        """Per row, the request's last token while it is still on the device (the step in
        flight's; -1 for none), for penalties, which count output tokens: their host list
        holds a placeholder for it. Penalties used to make every step of their batch
        synchronous."""
        step = self._inflight
        if step is None or not any(r.params.has_penalties for r in sampling):
            return None
        rows = [r.pending_row for r in sampling]
        if all(row < 0 for row in rows):
            return None
        index = to_device(rows, step.tokens.device, torch.long)
        return torch.where(index >= 0, step.tokens[index.clamp(min=0)], -1)

    def _defer(self, step: _Inflight) -> None:
        """Give each request a placeholder for its token (one whose placeholder is its last
        allowed token is not scheduled again: ``Request.out_of_budget``)."""
        for row, req in enumerate(step.requests):
            if req.is_finished:  # stopped on the previous token: this row is thrown away
                continue
            req.append_token(PLACEHOLDER)
            req.pending_row = row
        self._inflight = step

    def _read_back(self, deltas: list[RequestDelta]) -> None:
        """Wait for the step in flight's tokens; put them in place of the placeholders and
        append their deltas to ``deltas``. Every placeholder is replaced before any token is
        accepted: an accept that raises (a tokenizer's decode) must not leave a -1 behind
        for a later step to embed, nor lose the deltas already made."""
        step = self._inflight
        if step is None:
            return
        if step.ready is not None:
            step.ready.synchronize()  # raising (a device error), the step stays in flight
        self._inflight = None
        tokens = step.host.tolist()
        chosen = step.logprobs.tolist() if step.logprobs is not None else None
        top_values = step.top_values.tolist() if step.top_values is not None else None
        top_ids = step.top_ids.tolist() if step.top_ids is not None else None
        now = time.time()
        landed = []
        for row, req in enumerate(step.requests):
            if req.pending_row != row:  # aborted meanwhile, or it had already stopped
                continue
            req.pending_row = -1
            req.token_ids[-1] = req.output_token_ids[-1] = tokens[row]
            landed.append((row, req))
        for row, req in landed:
            self.num_generation_tokens += 1
            logprob: float | None = None
            top: list[tuple[int, float]] | None = None
            if chosen is not None and req.params.logprobs is not None:
                k = req.params.logprobs
                logprob = chosen[row]
                if top_ids is not None and top_values is not None:
                    top = list(zip(top_ids[row][:k], top_values[row][:k], strict=True))
            deltas.append(self._accept_or_fail(req, req.output_token_ids[-1], logprob, top, now))

    def _feed(self, plan: BatchPlan) -> TokenFeed | None:
        """Which sequences take their last input token from the step still in flight."""
        step = self._inflight
        if step is None:
            return None
        # Only into a sequence that samples: a chunk that holds the placeholder ends on it
        # and samples; one that does not (a request preempted with its token in flight by a
        # step that then failed, re-admitted in chunks) had its real last token overwritten.
        rows = np.fromiter(
            (
                r.pending_row if s.sample else -1
                for s, r in zip(plan.seqs, plan.requests, strict=True)
            ),
            np.int64,
            len(plan.requests),
        )
        return TokenFeed(step.tokens, rows) if (rows >= 0).any() else None

    def _swap_kv(self, plan: BatchPlan) -> None:
        """Before the step overwrites them, evicted named blocks the host tier wants are
        copied out, to go down to it once their bytes land (the copy used to make the host
        wait for the step in flight: with the prefix cache full, nearly every step evicts);
        then tier hits come in (a block may be both: the copies run in that order on one
        stream). Loads may be views of host-tier slots: offload goes last. Each side fails
        on its own: a failed copy out only loses the offloads (it cost the step's loads,
        perhaps a long prefix just fetched from Redis)."""
        assert self.kv_tier is not None
        evicted = self.pool.evictions or []
        wanted = (
            [evicted[i] for i in self.kv_tier.offload_wanted([h for _, h in evicted])]
            if evicted
            else []
        )
        evicted.clear()
        export: _Export | None = None
        try:
            if wanted:
                try:
                    rows, copied = self.runner.export_blocks_async([b for b, _ in wanted])
                    export = _Export([h for _, h in wanted], rows, copied, offload=True)
                except Exception:
                    # Out of pinned memory for the rows: the host tier is a cache.
                    log.warning("copying %d evicted KV blocks out failed; the host tier "
                                "does not get them", len(wanted), exc_info=True)  # fmt: skip
            if plan.kv_loads:
                try:
                    self.runner.import_blocks(
                        [b for b, _ in plan.kv_loads], [d for _, d in plan.kv_loads]
                    )
                except Exception:
                    # Out of memory for a staging copy, a bad view: the tier is a cache, so
                    # the requests that loaded compute those tokens instead and the step
                    # goes on (it failed every request in the batch). A sticky device
                    # error fails the next op.
                    log.warning("KV tier load failed (%d blocks in); the loads are "
                                "recomputed", len(plan.kv_loads), exc_info=True)  # fmt: skip
                    export = None  # a device error may have spoiled its copy too
                    self._recompute_loads(plan)
        except BaseException:
            self._undo_loads(plan)
            raise
        if export is not None:
            self._exports.append(export)

    def _recompute_loads(self, plan: BatchPlan) -> None:
        """The loads never reached the cache: their requests leave this step and are queued
        to compute their prompts, without the tier (a load that fails once may fail again)."""
        loaded = {block_id for block_id, _ in plan.kv_loads}
        self._undo_loads(plan)
        for req in [r for r in plan.requests if not loaded.isdisjoint(r.block_table)]:
            req.skip_kv_tier = True
            self.batcher.recompute(req, plan)
        plan.kv_loads.clear()

    def _undo_loads(self, plan: BatchPlan) -> None:
        """Tier hits whose bytes never arrived: their requests did not compute them, and the
        blocks lose the names scheduling gave them, so no later request with that prefix
        hits stale bytes (freeing a request names every block it computed)."""
        loaded = {block_id for block_id, _ in plan.kv_loads}
        bs = self.pool.block_size
        for req in {id(r): r for r in [*plan.requests, *self.batcher.running]}.values():
            first = next((i for i, b in enumerate(req.block_table) if b in loaded), None)
            if first is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, first * bs)
        self.pool.forget(loaded)

    def _accept_or_fail(
        self,
        req: Request,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        now: float,
    ) -> RequestDelta:
        """:meth:`_accept` an appended token; a request it raises for (a tokenizer's decode,
        the grammar library) ends alone with an error. Raised out of the step, it failed
        every running request with a 500, and one preempted in the same step was left with
        a token its caller never got."""
        try:
            return self._accept(req, token, logprob, top, now, appended=True)
        except Exception as exc:
            log.exception("request %s: settling its token failed; ending it", req.request_id)
            # Said whether or not it had finished already: the bridge reads the error's kind
            # from it (a guided failure's 400 is not this).
            req.stop_reason = f"{ENGINE_FAILED} ({type(exc).__name__})"
            if req.request_id in self.requests:
                self._finish(req, "error", now)
            return RequestDelta(
                request_id=req.request_id,
                token_ids=[],
                text="",
                finished=True,
                finish_reason="error",
                output=RequestOutput.of(req),
                num_output_tokens=req.num_output_tokens,
                at=now,
            )

    def _accept(
        self,
        req: Request,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        now: float,
        appended: bool = False,
    ) -> RequestDelta:
        """Record a sampled token (``appended``: it is in place already); decide whether it
        ends the request; release its text."""
        params = req.params
        if not appended:
            req.append_token(token)
        first = req.first_token_time is None
        if first:
            req.first_token_time = now
            if params.prompt_logprobs is not None:
                self._join_prompt_logprobs(req)
        asked = params.logprobs is not None
        if asked:
            lp = float(logprob) if logprob is not None else 0.0
            req.logprobs.append(lp)
            req.cumulative_logprob += lp
            req.top_logprobs.append(list(top or []))
        # The first min_tokens tokens end nothing but the length (the sampler kept EOS and
        # stop ids out of them; no stop string ends in their text), as in vLLM.
        at_limit = (
            req.num_output_tokens >= params.max_tokens or req.num_tokens >= req.max_total_tokens
        )
        complete, failed = False, None
        if req.guide is not None:
            req.guide.consume(token)
            failed = req.guide.error
            complete = req.guide.done  # a failed one too: its held-back text is released
        text, reason = settle_token(
            req, token, self.eos_token_ids, at_limit, primary_eos=self.primary_eos,
            complete=complete,
        )  # fmt: skip
        if failed is not None:
            # Not "stop": what came out matches nothing whole. The worker answers an error.
            log.warning("request %s: guided decoding failed: %s", req.request_id, failed)
            reason, req.stop_reason = "error", f"{GUIDED_FAILED}: {failed}"
        if text:
            req.text_pieces.append(text)
        if reason is not None:
            self._finish(req, reason, now)
        return RequestDelta(
            request_id=req.request_id,
            token_ids=[token],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=[req.logprobs[-1]] if asked else None,
            top_logprobs=[req.top_logprobs[-1]] if asked else None,
            output=RequestOutput.of(req) if reason is not None else None,
            num_output_tokens=req.num_output_tokens,
            first_token_metrics=RequestMetrics.of(req) if first else None,
            at=now,
            prompt_logprobs=req.prompt_logprobs if first else None,
            prompt_top_logprobs=req.prompt_top_logprobs if first else None,
        )

    def _finish(self, req: Request, reason: str, now: float) -> None:
        self.batcher.finish(req, reason)
        self._prompt_lp_owed.discard(req)
        req.finish_time = now
        self.requests.pop(req.request_id, None)

    # --- telemetry -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Counters and gauges for telemetry (cheap: no device work)."""
        return EngineStats(
            num_running=len(self.batcher.running),
            num_waiting=len(self.batcher.waiting),
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            kv_usage=self.pool.usage(),
            fragmentation=self.pool.fragmentation(self.batcher.running),
            prefix_cache_queries=self.pool.prefix_queries,
            prefix_cache_hits=self.pool.prefix_hits,
            num_preemptions=self.batcher.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens,
            num_tokens_computed=self.num_tokens_computed,
            kv_tier_queries=self.batcher.tier_query_tokens,
            kv_tier_hits=self.batcher.tier_hit_tokens,
            num_priority_preemptions=self.batcher.num_priority_preemptions,
        )


@dataclass
class _Inflight:
    """A launched step whose sampled tokens are still on their way to the host."""

    requests: list[Request]  # row i sampled for requests[i]
    tokens: torch.Tensor  # [rows] on the device
    host: torch.Tensor  # [rows], pinned on CUDA: the copy's target
    ready: torch.cuda.Event | None  # recorded after the copies (CUDA)
    # When a request asked for logprobs, on the host as the tokens are: the chosen ids' raw
    # logprobs [rows], the top k values and ids [rows, k] (None when no row asked for any).
    logprobs: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


@dataclass
class _Export:
    """Blocks handed to the KV tier once their bytes are on the host: full blocks written
    through (``store_async``), or blocks the device cache evicted (``offload``)."""

    hashes: Sequence[bytes]
    rows: torch.Tensor  # uint8 [blocks, bytes per block] on the host (pinned on CUDA)
    copied: torch.cuda.Event | None  # recorded after the copy (CUDA); None: already there
    offload: bool = False


def _load_tokenizer(args: EngineArgs) -> Any | None:
    """The model's tokenizer; None for a folder without one (token ids in and out only)."""
    from common.tokenizer import TokenizerFileNotFoundError, load_tokenizer

    source = args.tokenizer or args.model
    try:
        return load_tokenizer(source)
    except TokenizerFileNotFoundError as exc:
        if args.tokenizer is not None:
            raise
        # Named: a folder with tokenizer.json but no tokenizer_config.json read as "no
        # tokenizer" with nothing to say which file was missing.
        log.warning("no tokenizer for %s (%s): the engine takes and returns token ids only",
                    source, exc)  # fmt: skip
        return None
