"""Logits in, next tokens out, for a batch whose requests each sample their own way.

Order, as in vLLM v1: logprobs are read from the raw model distribution
``log_softmax(logits)``; then min_tokens holds the stop ids, ``logit_bias`` is added,
penalties apply (repetition, then presence/frequency); greedy rows
(temperature below 1e-5) take the argmax; the others are divided by their temperature, filtered by min-p, top-k and
top-p, and sampled by an exponential race ``argmax(probs / E)``, ``E ~ Exp(1)``. A seeded
request draws ``E`` from its own generator, reseeded at each step from its seed and output
position (:func:`philox_key`), so its tokens depend neither on what else shares the batch
nor on steps lost and redone (a step discarded after it sampled, a preemption, a resume
on another worker: the same position draws the same noise).

On CUDA, rows without top-k/top-p/min-p skip all of that: one Triton kernel
(:mod:`workers.engine.kernels.sample`) takes ``argmax(logits / T + Gumbel)`` per row with
Philox noise keyed by the request's seed and output position. Same distribution, no
``[B, V]`` temporaries, and no per-row generator launches, which at batch 256 cost more
host time than the model's whole decode step. Rows with filters are filtered in torch and
then drawn by the same kernel (their masked tokens are -inf): the gateway seeds every
request, and a model's ``generation_config.json`` often sets top-k/top-p for every
request, so on CUDA none of them draws its noise row by row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from workers.engine.guided import allows_beyond, apply_masks, packed_masks
from workers.engine.sampling_params import SamplingParams
from workers.engine.transfer import host_to_device, to_device

_GREEDY_BELOW = 1e-5


class SamplerInput(Protocol):
    """What the sampler reads from a request; the engine's request objects satisfy it."""

    params: SamplingParams
    generator: torch.Generator | None  # on the logits' device; set when params.seed is
    prompt_token_ids: list[int]
    prompt_ids_device: torch.Tensor | None  # the sampler's cache of the prompt's ids
    output_token_ids: list[int]
    output_ids_cache: OutputIds | None  # the sampler's copy of the output, for penalties
    # Output tokens a resumed request carries at the end of its prompt (see Request).
    resumed_tokens: int
    eos_token_ids: frozenset[int]  # read for rows short of their min_tokens only
    guide: Any  # guided decoding's matcher (workers.engine.guided.Guide) or None


class OutputIds:
    """A request's output so far (the tokens it resumed with first) as int64, grown in
    place: a step copies its new tokens, not the whole output (at batch 256 with 2k-token
    outputs, rebuilding every row from its list took 35-55 ms of host time a step;
    ``python -m bench.host_step``)."""

    __slots__ = ("covered", "ids", "n")

    def __init__(self, first: Sequence[int]) -> None:
        self.ids = np.array(first, dtype=np.int64)
        self.n = len(first)
        self.covered = 0  # how many of the request's output_token_ids are in ``ids``

    def extend(self, tokens: Sequence[int]) -> None:
        need = self.n + len(tokens)
        if need > len(self.ids):
            grown = np.empty(max(need, 2 * len(self.ids), 16), dtype=np.int64)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        self.ids[self.n : need] = tokens
        self.n = need


def _output_ids(r: SamplerInput) -> np.ndarray:
    """Every output token, those a redelivered request resumed with included; a last token
    still on the device (a placeholder) is left to ``pending``."""
    out = r.output_token_ids
    end = len(out) - (1 if out and out[-1] < 0 else 0)
    cache = r.output_ids_cache
    if (
        cache is None
        or cache.covered > end  # tokens taken back (a step discarded)
        or (cache.covered and int(cache.ids[cache.n - 1]) != out[cache.covered - 1])
    ):
        resumed = r.prompt_token_ids[len(r.prompt_token_ids) - r.resumed_tokens :]
        cache = r.output_ids_cache = OutputIds(resumed if r.resumed_tokens else [])
    if end > cache.covered:
        cache.extend(out[cache.covered : end])
        cache.covered = end
    return cache.ids[: cache.n]


@dataclass
class SampleOutput:
    """One step's choice per row. ``logprobs``/``top_logprobs`` are filled when any row
    asked (rows that did not ask get their chosen logprob and an empty top list)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Stateless: everything a step needs comes with the batch.

    ``fused``: use the Triton Gumbel-max kernel for rows without filters; ``None`` = on CUDA.
    """

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def sample(self, logits: torch.Tensor, batch: Sequence[SamplerInput]) -> SampleOutput:
        """Choose one token per row of ``logits`` ``[B, V]`` for ``batch[row]``."""
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {len(batch)}")
        logits = logits.float()
        params = [r.params for r in batch]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        tokens = self.choose(logits, batch)
        if raw_logprobs is None:
            return SampleOutput(token_ids=tokens.tolist())
        return _with_logprobs(tokens, raw_logprobs, params)

    def choose_with_logprobs(
        self,
        logits: torch.Tensor,
        batch: Sequence[SamplerInput],
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`choose`, plus what :meth:`sample` reads back for logprobs, all left on the
        device: (ids, the chosen ids' raw logprobs, the top ``k`` raw logprobs and their ids
        for the largest ``k`` any row asked, or None when that is 0)."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        tokens = self.choose(logits, batch, pending)
        k_max = max((r.params.logprobs or 0) for r in batch)
        return (tokens, *pick_logprobs(raw, tokens, k_max))

    def choose(
        self,
        logits: torch.Tensor,
        batch: Sequence[SamplerInput],
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chosen ids ``[B]`` as a device tensor: nothing waits for the device here.
        ``pending`` (see :func:`apply_penalties`): tokens still on the device that the rows'
        penalties count. ``logits`` may be half precision: the fused kernel widens as it
        reads, the rest widen first."""
        params = [r.params for r in batch]
        guided = [i for i, r in enumerate(batch) if r.guide is not None]
        masks = packed_masks([batch[i].guide for i in guided]) if guided else None
        early = [i for i, r in enumerate(batch) if len(r.output_token_ids) < r.params.min_tokens]
        if early and masks is not None:
            # A hold the grammar leaves no way around (only EOS or a stop id may come next):
            # the grammar wins, or the row would have nothing left to draw.
            at = {row: k for k, row in enumerate(guided)}
            early = [i for i in early
                     if i not in at or allows_beyond(masks[at[i]], _held_ids(batch[i]))]  # fmt: skip
        if early:
            logits = _hold_stops(logits, [batch[i] for i in early], early)
        if masks is not None:
            logits = apply_masks(logits, masks, guided)
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            logits = _add_logit_bias(logits, [batch[i] for i in biased], biased)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            logits = logits.float()
            rows = to_device(penalized, logits.device)
            # index_put (not in place): the caller's logits stay untouched.
            penalties = apply_penalties(
                logits[rows],
                [batch[i] for i in penalized],
                None if pending is None else pending[rows],
            )
            logits = logits.index_put((rows,), penalties)

        fused = logits.is_cuda if self.fused is None else self.fused
        plain = [fused and not _has_filters(p) for p in params]
        if all(plain):
            tokens = _sample_fused(logits, batch)
        elif not any(plain):
            tokens = _sample_torch(logits.float(), batch, fused)
        else:
            logits = logits.float()
            tokens = torch.empty(len(batch), dtype=torch.long, device=logits.device)
            fast, rest = _split_rows(plain, logits.device)
            tokens[fast[1]] = _sample_fused(logits[fast[1]], [batch[i] for i in fast[0]])
            tokens[rest[1]] = _sample_torch(logits[rest[1]], [batch[i] for i in rest[0]], fused)
        return tokens


def pick_logprobs(
    raw: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """From raw logprobs ``[n, V]`` (fp32 ``log_softmax`` of the model's logits): each
    row's logprob of ``ids[row]``, and its top ``k`` values and ids (None when ``k`` is 0),
    left on the device. Generated tokens' and prompt tokens' logprobs both come from here."""
    chosen = raw.gather(1, ids.unsqueeze(1)).squeeze(1)
    if k == 0:
        return chosen, None, None
    top = raw.topk(k, dim=-1)
    return chosen, top.values, top.indices


def _hold_stops(
    logits: torch.Tensor, batch: Sequence[SamplerInput], rows: Sequence[int]
) -> torch.Tensor:
    """``logits`` with EOS and the stop ids at -inf in ``rows``, requests short of their
    min_tokens (a new tensor: the caller's logits, whose raw logprobs are reported, stay
    untouched). EOS is held with ``ignore_eos`` too, as vLLM holds every stop id: ignored, an
    EOS sampled early would not end the output, but the model would go on after it. The count is this attempt's output, placeholders of a step
    still in flight included, as ``min_tokens`` on a resumed request is what is left."""
    vocab = logits.shape[-1]
    row_ids: list[int] = []
    col_ids: list[int] = []
    for row, r in zip(rows, batch, strict=True):
        ids = {t for t in _held_ids(r) if t < vocab}
        row_ids += [row] * len(ids)
        col_ids += sorted(ids)
    if not row_ids:
        return logits
    flat = to_device([r * vocab + c for r, c in zip(row_ids, col_ids, strict=True)],
                     logits.device, torch.long)  # fmt: skip
    held = logits.contiguous().clone()
    # index_fill_ takes the value as a scalar argument; an indexed assignment copies it to
    # the device as a tensor first, and that blocking copy waited for the step.
    held.view(-1).index_fill_(0, flat, float("-inf"))
    return held


def _held_ids(r: SamplerInput) -> set[int]:
    """What a row short of its min_tokens may not draw: EOS and its stop ids."""
    return set(r.params.stop_token_ids) | r.eos_token_ids


def _add_logit_bias(
    logits: torch.Tensor, batch: Sequence[SamplerInput], rows: Sequence[int]
) -> torch.Tensor:
    """``logits`` (widened to fp32, a new tensor) with each of ``rows``' ``logit_bias``
    added: one ``index_add_`` for the batch. A held stop id (-inf) stays held."""
    vocab = logits.shape[-1]
    flat: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for row, r in zip(rows, batch, strict=True):
        ids, bias = r.params.bias_arrays()
        inside = ids < vocab  # the engine refuses others; off the row, one would bias the next
        flat.append(ids[inside] + row * vocab)
        values.append(bias[inside])
    index, added = np.concatenate(flat), np.concatenate(values)
    if not index.size:
        return logits
    out = logits.float()
    out = out.contiguous().clone() if out is logits else out.contiguous()
    out.view(-1).index_add_(
        0, to_device(index, out.device, torch.long), to_device(added, out.device, torch.float32)
    )
    return out


def _is_greedy(params: SamplingParams) -> bool:
    # vLLM's rule: a temperature this small would overflow logits / T; it means argmax.
    return params.temperature < _GREEDY_BELOW


def _has_filters(params: SamplingParams) -> bool:
    """Top-k, top-p or min-p in effect (a greedy row needs none of them)."""
    if _is_greedy(params):
        return False
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0


def _sample_torch(
    logits: torch.Tensor, batch: Sequence[SamplerInput], fused: bool = False
) -> torch.Tensor:
    """Greedy rows take the argmax, the others are filtered and drawn (``fused``: by the
    Gumbel-max kernel, else by the exponential race)."""
    greedy = [_is_greedy(r.params) for r in batch]
    if all(greedy):
        return logits.argmax(dim=-1)
    if not any(greedy):
        return _sample_random(logits, batch, fused)
    tokens = torch.empty(len(batch), dtype=torch.long, device=logits.device)
    chosen, sampled = _split_rows(greedy, logits.device)
    tokens[chosen[1]] = logits[chosen[1]].argmax(dim=-1)
    tokens[sampled[1]] = _sample_random(logits[sampled[1]], [batch[i] for i in sampled[0]], fused)
    return tokens


RowIndex = tuple[list[int], torch.Tensor]  # row numbers, and the same as a device index


def _split_rows(flags: Sequence[bool], device: torch.device) -> tuple[RowIndex, RowIndex]:
    """Rows where ``flags`` holds, and the rest. Integer indices, not a boolean mask: a mask
    index counts its rows on the device, which makes the host wait for the step."""
    yes = [i for i, f in enumerate(flags) if f]
    no = [i for i, f in enumerate(flags) if not f]
    return (yes, to_device(yes, device, torch.long)), (no, to_device(no, device, torch.long))


def _sample_fused(
    logits: torch.Tensor, batch: Sequence[SamplerInput], divided: bool = False
) -> torch.Tensor:
    """One Triton kernel draws every row; seeds and temperatures go up pinned.
    ``divided``: ``logits`` are already over their temperature (and filtered)."""
    from workers.engine.kernels.sample import gumbel_argmax

    # Unseeded rows: keys from torch's global generator, so torch.manual_seed governs them.
    base = int(torch.randint(0, 1 << 62, (1,)).item())
    seeds = [
        philox_key(r.params.seed, r.resumed_tokens + len(r.output_token_ids))
        if r.params.seed is not None
        else (base + i * _GOLDEN) & _MASK63
        for i, r in enumerate(batch)
    ]
    temps = [1.0 if divided else r.params.temperature for r in batch]
    pin = logits.is_cuda
    seeds_t = torch.tensor(seeds, dtype=torch.int64, pin_memory=pin)
    temps_t = torch.tensor(temps, dtype=torch.float32, pin_memory=pin)
    device = logits.device
    return gumbel_argmax(
        logits.contiguous(),
        temps_t.to(device, non_blocking=True),
        seeds_t.to(device, non_blocking=True),
    )


_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    return _splitmix64(seed & _MASK64)


def philox_key(seed: int, draw: int) -> int:
    """The 63-bit Philox key of draw number ``draw`` of a request seeded with ``seed``.

    Keyed by the output position, a request recomputed after preemption, or resumed on
    another worker, draws the same noise for the same token.
    """
    return _splitmix64(_seed_key(seed) ^ draw) & _MASK63


def apply_penalties(
    logits: torch.Tensor, batch: Sequence[SamplerInput], pending: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalized copy of ``logits`` ``[n, V]``.

    Repetition (HF): a logit of a token seen in prompt or output is divided by the penalty
    when positive, multiplied when negative. Presence/frequency (OpenAI), over output
    tokens only: ``logit -= presence * (count > 0) + frequency * count``. ``pending``
    (``[n]`` on the device, -1 for none): each row's last output token while it is still
    on the device, its place in the host's list a placeholder (asynchronous output).
    """
    vocab = logits.shape[1]
    device = logits.device
    out = logits
    # Decisions read the params on the host, never a device tensor: no sync per step.
    repetition = any(r.params.repetition_penalty != 1.0 for r in batch)
    additive = any(r.params.presence_penalty != 0 or r.params.frequency_penalty != 0 for r in batch)
    if not (repetition or additive):
        return out
    counts = _token_counts([_output_ids(r) for r in batch], vocab, device, pending)
    if repetition:  # the resumed tokens end the prompt: counted either way
        factor = to_device([[r.params.repetition_penalty] for r in batch], device)
        seen = (counts > 0) | _prompt_seen(batch, vocab, device)
        out = torch.where(seen, torch.where(out > 0, out / factor, out * factor), out)
    if additive:
        presence = to_device([[r.params.presence_penalty] for r in batch], device)
        frequency = to_device([[r.params.frequency_penalty] for r in batch], device)
        out = out - frequency * counts - presence * (counts > 0)
    return out


def _prompt_seen(batch: Sequence[SamplerInput], vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, V]`` bool: which ids each row's prompt holds, from ids kept on the device per
    request (made once: the prompt does not change), so a step's host work does not grow
    with prompt length."""
    parts = []
    for r in batch:
        ids = r.prompt_ids_device
        if ids is None or ids.device != device:
            distinct = np.unique(np.asarray(r.prompt_token_ids, dtype=np.int64))
            ids = host_to_device(torch.from_numpy(distinct), device)
            r.prompt_ids_device = ids
        parts.append(ids)
    lengths = [int(t.numel()) for t in parts]
    total = sum(lengths)
    seen = torch.zeros(len(batch), vocab + 1, dtype=torch.bool, device=device)
    if total:
        ids = torch.cat(parts)
        ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)  # off-vocabulary: dropped
        # Sizes known on the host (output_size): nothing waits for the device.
        rows = torch.repeat_interleave(
            torch.arange(len(batch), device=device),
            to_device(lengths, device, torch.long),
            output_size=total,
        )
        seen.view(-1).index_fill_(0, rows * (vocab + 1) + ids, True)
    return seen[:, :vocab]


def _token_counts(
    token_ids: Sequence[np.ndarray],
    vocab: int,
    device: torch.device,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[n, V]`` float counts of each id per row (ids outside the vocabulary ignored),
    plus ``pending``'s (tokens still on the device)."""
    width = max(1, max((len(t) for t in token_ids), default=0))
    # Padding points at an extra column that is dropped afterwards; ids are laid out on
    # the host (numpy slices) and counted on the device (the [n, V] part).
    ids = np.full((len(token_ids), width), vocab, dtype=np.int64)
    for row, tokens in enumerate(token_ids):
        ids[row, : len(tokens)] = tokens
    ids[(ids < 0) | (ids > vocab)] = vocab
    on_device = host_to_device(torch.from_numpy(ids), device)
    counts = torch.zeros(len(token_ids), vocab + 1, device=device)
    counts.scatter_add_(1, on_device, torch.ones(on_device.shape, device=device))
    if pending is not None:  # on the device already: counted there, nothing waits
        extra = torch.where((pending >= 0) & (pending < vocab), pending, vocab).unsqueeze(1)
        counts.scatter_add_(1, extra, torch.ones(extra.shape, device=device))
    return counts[:, :vocab]


def _sample_random(
    logits: torch.Tensor, batch: Sequence[SamplerInput], fused: bool = False
) -> torch.Tensor:
    """Sampled ids for non-greedy rows ``[n, V]``: temperature, filters, then the Gumbel-max
    kernel (``fused``) or the exponential race."""
    device = logits.device
    params = [r.params for r in batch]
    temperature = to_device([p.temperature for p in params], device)
    logits = logits / temperature.unsqueeze(1)

    if any(p.min_p > 0 for p in params):
        logits = _apply_min_p(logits, to_device([p.min_p for p in params], device))
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    elif any(top_k):
        logits = _apply_top_k(logits, top_k)

    if fused:
        return _sample_fused(logits, batch, divided=True)
    probs = torch.softmax(logits, dim=-1)
    return probs.div_(_exponential_noise(probs, batch)).argmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (ties at the k-th value kept); 0 = all.

    One ``topk`` of the largest k instead of a full-vocabulary sort.
    """
    k = to_device(top_k, logits.device)
    largest = logits.topk(max(top_k), dim=-1).values
    kth = largest.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    kth = torch.where(k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k, then keep the smallest set of most likely tokens whose mass reaches ``p``."""
    vocab = logits.shape[1]
    device = logits.device
    ordered, order = logits.sort(dim=-1, descending=True)
    k = to_device([kk or vocab for kk in top_k], device)
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))

    p = to_device(top_p, device).unsqueeze(1)
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # p == 1 keeps everything: rounding in the cumsum must not drop the tail.
    drop = (mass_before >= p) & (p < 1.0)
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _exponential_noise(probs: torch.Tensor, batch: Sequence[SamplerInput]) -> torch.Tensor:
    """``Exp(1)`` noise ``[n, V]``: seeded rows from their own generator, keyed by their
    output position (resumed tokens included) as the fused kernel keys its Philox noise."""
    noise = torch.empty_like(probs)
    seeded = [i for i, r in enumerate(batch) if r.generator is not None]
    if len(seeded) < len(batch):
        noise.exponential_()
    for i in seeded:
        r = batch[i]
        assert r.generator is not None and r.params.seed is not None
        r.generator.manual_seed(
            philox_key(r.params.seed, r.resumed_tokens + len(r.output_token_ids))
        )
        noise[i].exponential_(generator=r.generator)
    # Exp(1) can round to 0, and 0/0 would be a NaN that argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _with_logprobs(
    tokens: torch.Tensor, raw_logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> SampleOutput:
    """Attach the chosen token's raw logprob and the top ``k`` raw logprobs per row."""
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k_max = max((p.logprobs or 0) for p in params)
    token_ids: list[int] = tokens.tolist()
    if k_max == 0:
        return SampleOutput(token_ids, chosen.tolist(), [[] for _ in params])
    top = raw_logprobs.topk(k_max, dim=-1)
    top_values: list[list[float]] = top.values.tolist()
    top_ids: list[list[int]] = top.indices.tolist()
    tops = [
        list(zip(top_ids[row][: p.logprobs or 0], top_values[row][: p.logprobs or 0], strict=True))
        for row, p in enumerate(params)
    ]
    return SampleOutput(token_ids, chosen.tolist(), tops)
