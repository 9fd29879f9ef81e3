"""Tensors in, logits out: one :class:`BatchPlan` becomes one forward pass.

The runner owns the model, the paged KV cache (one ``[num_blocks, block_size, n_kv, d]``
pair per layer, plus ``[num_blocks, block_size, n_kv]`` fp32 scales when the cache is int8 or
fp8) and the per-step inputs. Inputs are built on the host with numpy, packed
into one pinned int64 buffer and copied to the device with a single non-blocking copy.
On CUDA, all-decode steps replay a CUDA graph captured for the next batch-size bucket
(padding rows write to slot -1), since without graphs Python launch overhead dominates.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.attention import AttentionMetadata, LayerKV
from workers.engine.batcher import BatchPlan, ScheduledSeq
from workers.engine.block_pool import KVCacheLayout
from workers.engine.kernels.kv_quant import SCALE_DTYPE, is_quantized
from workers.engine.loader import load_model
from workers.engine.models.llama import KVCache, ModelConfig
from workers.engine.sampler import pick_logprobs
from workers.engine.transfer import to_device, to_host

log = logging.getLogger(__name__)

GiB = 1 << 30
# Bytes staged per copy of KV blocks between host and device (tier loads, evictions).
COPY_CHUNK_BYTES = 128 << 20
# Prompt positions whose logits are computed at once for prompt logprobs: a long prompt never
# holds [prompt_len, vocab] logits (a 32k-token prompt over a 150k vocabulary: 19 GB in fp32).
PROMPT_LOGPROBS_ROWS = 256


def graph_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then every 8 up to the maximum."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 8))
    return [*sizes, max_batch_size]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over all layers in a cache of ``dtype``, scales included."""
    slots = 2 * cfg.num_layers * block_size * cfg.num_kv_heads
    elem = torch.empty((), dtype=dtype).element_size()
    scales = slots * SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
    return slots * cfg.head_dim * elem + scales


@dataclass(frozen=True)
class TokenFeed:
    """Last tokens that are still on the device: ``rows[i]`` (or -1) is the row of
    ``tokens`` that sequence ``i`` of the plan takes as its last input token."""

    tokens: torch.Tensor  # [rows] int64, on the device
    rows: np.ndarray  # [num seqs] int64


@dataclass(frozen=True)
class PromptRows:
    """Prompt positions of ``plan.seqs[seq]`` whose next-token logprobs are wanted: tokens
    ``first .. first + len(targets) - 1`` of its chunk, token ``first + i`` predicting
    ``targets[i]``, with the top ``k`` alternatives."""

    seq: int
    first: int
    targets: list[int]
    k: int


@dataclass(frozen=True)
class PromptLogprobs:
    """One :class:`PromptRows`' results, copied to the host without waiting (pinned on
    CUDA): read them once the step has synchronised, as its sampled tokens are."""

    chosen: torch.Tensor  # [n] fp32: the logprob of each target
    top_values: torch.Tensor | None  # [n, k of the step's largest ask]; None when that is 0
    top_ids: torch.Tensor | None


@dataclass
class StepInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_idx: torch.Tensor  # rows of the hidden states that sample
    num_seqs: int


class ModelRunner:
    """Loads the model, allocates the KV cache and runs steps."""

    def __init__(
        self,
        model: str,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        backend: str,
        block_size: int,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # int8 / float8_e4m3fn: quantised with scales
        self.backend = backend
        self.block_size = block_size
        self.model = load_model(model, cfg, device, dtype, backend, seed)
        self.kv_caches: list[KVCache] = []
        self._kv: torch.Tensor | None = None  # [2, layers, blocks, block_size, kv_heads, dim]
        self._kv_scale: torch.Tensor | None = None  # [2, layers, blocks, block_size, kv_heads]
        self.num_blocks = 0
        self.max_seq_len = 0
        self.max_batch_size = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_bufs: dict[str, torch.Tensor] = {}

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # --- KV cache ------------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.cfg, self.block_size, self.kv_dtype)

    def profile_num_blocks(
        self, gpu_memory_utilization: float, max_tokens: int, max_batch_size: int
    ) -> int:
        """Blocks that fit in this engine's share ``gpu_memory_utilization`` of the device
        once its weights, the peak activations of a ``max_tokens`` forward (measured, not
        guessed) and the sampler's work on ``[max_batch_size, vocab]`` logits are paid
        (:func:`kv_budget_bytes`)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # A throw-away cache just big enough for the profile run's sequences.
        n_seqs = max(1, -(-max_tokens // 2048))
        seq_len = -(-max_tokens // n_seqs)
        blocks_per_seq = -(-seq_len // self.block_size)
        self.allocate_kv_cache(n_seqs * blocks_per_seq)
        seqs = [
            ScheduledSeq(
                request_id=str(i),
                token_ids=[0] * seq_len,
                start_pos=0,
                block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                sample=True,
            )
            for i in range(n_seqs)
        ]
        self.prepare(max_seq_len=seq_len, max_batch_size=n_seqs, capture=False)
        self.execute(BatchPlan(seqs=seqs))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        cache_bytes = n_seqs * blocks_per_seq * self.bytes_per_block()
        self.kv_caches, self._kv, self._kv_scale = [], None, None
        torch.cuda.empty_cache()
        activations = max(0, peak - cache_bytes)
        # Softmax, sort and noise for top-p/top-k sampling: a few fp32 copies of the logits.
        sampler = 6 * max_batch_size * self.cfg.vocab_size * 4
        budget = kv_budget_bytes(
            total=total,
            free=free,
            own=base,
            working=activations + sampler,
            utilization=gpu_memory_utilization,
        )
        log.info(
            "kv budget: total %.1f GiB, free %.1f GiB, this engine's weights %.2f GiB, "
            "activations %.2f GiB, share %.2f -> %.2f GiB",
            total / GiB,
            free / GiB,
            base / GiB,
            activations / GiB,
            gpu_memory_utilization,
            budget / GiB,
        )
        return int(budget // self.bytes_per_block())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer (and their scales if quantised), carved from a
        single allocation each."""
        cfg = self.cfg
        shape = (2, cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads)
        cache = torch.zeros(*shape, cfg.head_dim, dtype=self.kv_dtype, device=self.device)
        scale = None
        if is_quantized(self.kv_dtype):
            scale = torch.zeros(shape, dtype=SCALE_DTYPE, device=self.device)
        self.kv_caches = [
            LayerKV(
                cache[0, i],
                cache[1, i],
                None if scale is None else scale[0, i],
                None if scale is None else scale[1, i],
            )
            for i in range(cfg.num_layers)
        ]
        self._kv, self._kv_scale = cache, scale
        self.num_blocks = num_blocks

    def _kv_bytes(self) -> list[torch.Tensor]:
        """Byte views of the cache tensors, scales first: the tier row order."""
        assert self._kv is not None
        parts = [self._kv] if self._kv_scale is None else [self._kv_scale, self._kv]
        # A block's bytes are dim 2 of a [2, layers, blocks, row bytes] view.
        return [p.view(torch.uint8).view(*p.shape[:3], -1) for p in parts]

    def export_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host copy of whole blocks for the KV tiers: uint8 ``[n, bytes_per_block]``, row
        ``i`` the ``[2, layers, block_size, kv_heads, head_dim]`` K/V of ``block_ids[i]``,
        preceded in a quantised cache by their ``[2, layers, block_size, kv_heads]`` scales."""
        rows, copied = self.export_blocks_async(block_ids)
        if copied is not None:
            copied.synchronize()
        return rows.numpy()

    def export_blocks_async(
        self, block_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """:meth:`export_blocks` without waiting: (host rows, the event recorded after their
        copy on CUDA, None elsewhere). The copy is queued behind the work already launched,
        so the rows hold the blocks as that work leaves them."""
        ids = to_device(list(block_ids), self.device, torch.long)
        if not self.is_cuda:
            return self._gather_rows(ids), None
        # In chunks: gathered at once, a thousand evicted 2 MiB blocks took 2 GiB of device
        # memory the profile never counted, and the step's OOM failed the whole batch.
        n, per = len(ids), self._blocks_per_copy()
        host = torch.empty((n, self.bytes_per_block()), dtype=torch.uint8, pin_memory=True)
        for start in range(0, n, per):
            rows = self._gather_rows(ids[start : start + per])
            host[start : start + len(rows)].copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # cuda:N's stream, not cuda:0's
        return host, copied

    def _gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks ``ids`` as rows of bytes in the export format, on the cache's device."""
        return torch.cat(
            [p.index_select(2, ids).permute(2, 0, 1, 3).reshape(len(ids), -1)
             for p in self._kv_bytes()],
            dim=1,
        )  # fmt: skip

    def _blocks_per_copy(self) -> int:
        """Blocks per staged copy in and out of the cache: about COPY_CHUNK_BYTES."""
        return max(1, COPY_CHUNK_BYTES // self.bytes_per_block())

    def kv_layout(self) -> KVCacheLayout:
        """What a KV tier needs to tell this cache's blocks from other layouts'."""
        return KVCacheLayout(
            block_size=self.block_size,
            dtype=str(self.kv_dtype).removeprefix("torch."),
            num_layers=self.cfg.num_layers,
            num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim,
            quant="per_token_head" if is_quantized(self.kv_dtype) else "none",
            compute_dtype=str(self.dtype).removeprefix("torch."),
        )

    def import_blocks(self, block_ids: Sequence[int], data: Sequence[memoryview]) -> None:
        """Copy blocks in the :meth:`export_blocks` format into the cache, a bounded chunk
        at a time (a whole load staged at once on the device could be gigabytes)."""
        per = self._blocks_per_copy()
        for start in range(0, len(block_ids), per):
            self._import_chunk(block_ids[start : start + per], data[start : start + per])

    def _import_chunk(self, block_ids: Sequence[int], data: Sequence[memoryview]) -> None:
        n = len(block_ids)
        # Gathered straight into pinned memory on CUDA (torch's caching host allocator keeps
        # it until the copy has run): a pageable gather pinned afterwards copied every
        # loaded byte twice on the host before the device saw it.
        staged = torch.empty(
            (n, self.bytes_per_block()), dtype=torch.uint8, pin_memory=self.is_cuda
        )
        host = staged.numpy()
        for i, buf in enumerate(data):
            host[i] = np.frombuffer(buf, dtype=np.uint8)
        src = staged.to(self.device, non_blocking=True) if self.is_cuda else staged
        ids = to_device(list(block_ids), self.device, torch.long)
        offset = 0
        for part in self._kv_bytes():  # byte views: index_copy_ writes the cache itself
            two, layers, _, width = part.shape
            chunk = src[:, offset : offset + two * layers * width].view(n, two, layers, width)
            part.index_copy_(2, ids, chunk.permute(1, 2, 0, 3))
            offset += two * layers * width

    # --- preparing -----------------------------------------------------------------------

    def prepare(self, max_seq_len: int, max_batch_size: int, capture: bool) -> None:
        """Size host buffers for the engine's limits; capture decode graphs if asked."""
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self._graphs.clear()
        if capture and self.is_cuda:
            self._capture_graphs()

    def _stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Move host int arrays to the device as int64, in one copy on CUDA."""
        if not self.is_cuda:
            return [torch.from_numpy(a.astype(np.int64, copy=False)) for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        # A fresh pinned buffer each step, from torch's caching host allocator, which reuses
        # one only once the copy that read it has run: reusing our own made the host wait
        # for the previous step's copy, and with it for the steps queued before.
        pinned = torch.empty(total, dtype=torch.int64, pin_memory=True)
        host = pinned.numpy()
        offset = 0
        for a, n in zip(arrays, sizes, strict=True):
            host[offset : offset + n] = a.reshape(-1)
            offset += n
        dev = pinned.to(self.device, non_blocking=True)
        out, offset = [], 0
        for a, n in zip(arrays, sizes, strict=True):
            out.append(dev[offset : offset + n].view(a.shape))
            offset += n
        return out

    def build_inputs(
        self, seqs: list[ScheduledSeq], decode: bool, feed: TokenFeed | None = None
    ) -> StepInputs:
        """Packed inputs and attention metadata of one step (host work, one copy).

        ``feed``: the last token of some sequences is still on the device (the previous
        step's sample, not read back yet); it is gathered there instead of uploaded.
        """
        bs = self.block_size
        n = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        t = int(cu[-1])
        input_ids = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=t
        )
        if feed is not None:
            has = feed.rows >= 0
            holes = cu[1:][has] - 1  # the sequence's last token
            from_rows = feed.rows[has]
            input_ids[holes] = 0  # a placeholder never reaches the embedding
        else:
            holes = from_rows = np.zeros(0, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(n), lens)
        positions = np.arange(t, dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((n, width), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        context_lens = starts + lens
        sample_rows = np.fromiter((i for i, s in enumerate(seqs) if s.sample), dtype=np.int64)
        logits_idx = sample_rows if decode else cu[1:][sample_rows] - 1
        ids_d, pos_d, slots_d, tables_d, ctx_d, cu_d, idx_d, holes_d, rows_d = self._stage(
            [input_ids, positions, slots, tables, context_lens, cu, logits_idx, holes, from_rows]
        )
        if feed is not None:
            ids_d[holes_d] = feed.tokens[rows_d]
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            block_tables=tables_d.to(torch.int32),
            context_lens=ctx_d.to(torch.int32),
            cu_seqlens_q=None if decode else cu_d.to(torch.int32),
            max_seqlen_q=int(lens.max()),
            max_context_len=int(context_lens.max()),
        )
        return StepInputs(ids_d, pos_d, meta, idx_d, n)

    # --- running -------------------------------------------------------------------------

    def execute(self, plan: BatchPlan, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step; logits ``[num sampling seqs, vocab]`` (model dtype) in plan order."""
        return self.execute_with_prompt_logprobs(plan, feed)[0]

    @torch.inference_mode()
    def execute_with_prompt_logprobs(
        self,
        plan: BatchPlan,
        feed: TokenFeed | None = None,
        prompt_rows: Sequence[PromptRows] = (),
    ) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """:meth:`execute`, and the logprobs of ``prompt_rows`` (one result each), from the
        same hidden states: only those rows get logits, a slice at a time."""
        decode = plan.is_decode
        inputs = self.build_inputs(plan.seqs, decode, feed)
        # A graph keeps only the hidden states of the last tokens, and all-decode steps are
        # where prompt rows are rare (a one-token chunk): those run eagerly.
        if decode and self._graphs and inputs.num_seqs <= self.max_batch_size and not prompt_rows:
            return self._replay(inputs), []
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.logits_idx])
        if not prompt_rows:
            return logits, []
        return logits, self._prompt_logprobs(hidden, plan.seqs, prompt_rows)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, seqs: Sequence[ScheduledSeq], wanted: Sequence[PromptRows]
    ) -> list[PromptLogprobs]:
        """fp32 ``log_softmax`` of the LM head over ``wanted``'s rows of ``hidden`` (as the
        sampler reads generated tokens' logprobs), :data:`PROMPT_LOGPROBS_ROWS` rows at a
        time; the results go to the host without waiting for the device."""
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum([len(s.token_ids) for s in seqs], out=offsets[1:])
        rows = np.concatenate(
            [offsets[w.seq] + w.first + np.arange(len(w.targets), dtype=np.int64) for w in wanted]
        )
        targets = np.fromiter(
            itertools.chain.from_iterable(w.targets for w in wanted),
            dtype=np.int64,
            count=len(rows),
        )
        rows_d, targets_d = self._stage([rows, targets])
        n, k = len(rows), max(w.k for w in wanted)
        dev = hidden.device
        chosen = torch.empty(n, dtype=torch.float32, device=dev)
        values = torch.empty(n, k, dtype=torch.float32, device=dev) if k else None
        ids = torch.empty(n, k, dtype=torch.int64, device=dev) if k else None
        for start in range(0, n, PROMPT_LOGPROBS_ROWS):
            end = min(n, start + PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(hidden[rows_d[start:end]])
            raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # one fp32 copy
            c, v, i = pick_logprobs(raw, targets_d[start:end], k)
            chosen[start:end] = c
            if values is not None and ids is not None and v is not None and i is not None:
                values[start:end], ids[start:end] = v, i
        chosen_h = to_host(chosen)
        values_h = to_host(values) if values is not None else None
        ids_h = to_host(ids) if ids is not None else None
        out, at = [], 0
        for w in wanted:
            part = slice(at, at + len(w.targets))
            at = part.stop
            out.append(
                PromptLogprobs(
                    chosen_h[part],
                    values_h[part] if values_h is not None else None,
                    ids_h[part] if ids_h is not None else None,
                )
            )
        return out

    # --- CUDA graphs ---------------------------------------------------------------------

    def _capture_graphs(self) -> None:
        """One graph per bucket, largest first so the smaller ones reuse its memory pool.

        A graph ends at the final norm, writing into one shared ``hidden`` buffer: the LM head
        runs eagerly on the sampling rows only, so no bucket keeps a ``[bucket, vocab]``
        logits tensor alive.
        """
        max_bs = self.max_batch_size
        width = -(-self.max_seq_len // self.block_size)
        dev = self.device
        bufs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(max_bs, width, dtype=torch.int32, device=dev),
            # Padding rows have no context: the decode kernel writes zeros for them.
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "hidden": torch.zeros(max_bs, self.cfg.hidden_size, dtype=self.dtype, device=dev),
        }
        self._graph_bufs = bufs
        pool = None
        for bs in reversed(graph_buckets(max_bs)):
            meta = AttentionMetadata(
                slot_mapping=bufs["slot_mapping"][:bs],
                block_tables=bufs["block_tables"][:bs],
                context_lens=bufs["context_lens"][:bs],
                cu_seqlens_q=None,
                max_seqlen_q=1,
                max_context_len=self.max_seq_len,  # static grid: kernels stop at context_lens
            )

            def run(bs: int = bs, meta: AttentionMetadata = meta) -> None:
                hidden = self.model(
                    bufs["input_ids"][:bs], bufs["positions"][:bs], meta, self.kv_caches
                )
                bufs["hidden"][:bs].copy_(hidden)

            with torch.inference_mode(), torch.cuda.device(dev):
                run()  # compile / autotune the kernels outside the capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                # A capture stream of the engine's device: torch.cuda.graph's default is one
                # stream made once, on whichever device was current then, for every engine.
                with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(dev)):
                    run()
            pool = graph.pool()
            self._graphs[bs] = graph
        torch.cuda.synchronize(dev)
        log.info("captured decode graphs for batch sizes %s", sorted(self._graphs))

    def _replay(self, inputs: StepInputs) -> torch.Tensor:
        n = inputs.num_seqs
        bucket = next(b for b in sorted(self._graphs) if b >= n)
        bufs = self._graph_bufs
        meta = inputs.meta
        bufs["input_ids"][:n].copy_(inputs.input_ids)
        bufs["positions"][:n].copy_(inputs.positions)
        bufs["slot_mapping"][:n].copy_(meta.slot_mapping)
        bufs["context_lens"][:n].copy_(meta.context_lens)
        width = meta.block_tables.shape[1]
        bufs["block_tables"][:n, :width].copy_(meta.block_tables)
        if bucket > n:
            bufs["input_ids"][n:bucket].zero_()
            bufs["positions"][n:bucket].zero_()
            bufs["slot_mapping"][n:bucket].fill_(-1)
            bufs["context_lens"][n:bucket].zero_()
        self._graphs[bucket].replay()
        return self.model.compute_logits(bufs["hidden"][inputs.logits_idx])


# Left free on the device beyond the working memory: the CUDA context, cuBLAS workspaces
# and allocator slack that torch does not count as allocated.
FREE_MARGIN_FRACTION = 0.02


def kv_budget_bytes(total: int, free: int, own: int, working: int, utilization: float) -> int:
    """KV cache bytes for an engine whose weights take ``own`` bytes and whose forward and
    sampler need ``working`` more, on a device of ``total`` bytes with ``free`` free.

    Its share is ``utilization`` of ``total`` whatever other processes hold (vLLM's
    per-instance meaning: two workers sharing a GPU set 0.45 each); a cache larger than
    what is free would fail to allocate, so that bounds it too. Never negative.
    """
    share = total * utilization - own - working
    available = free - working - total * FREE_MARGIN_FRACTION
    return max(0, int(min(share, available)))
