"""Guided decoding in the engine: one llguidance matcher per guided request, a token mask
per step.

The mask of a step depends on the token the step before chose: with asynchronous output,
a step holding a guided request waits for the step in flight's sampling before queueing
its own (``LLMEngine._run_step``; its forward is queued already); the masks are computed on
the host (tens of microseconds a row; a batch's rows on llguidance's threads), sent packed (one
bit a token) and unpacked on the logits' device, then applied before penalties and
filters. A matcher that can only end (its grammar is complete) finishes the request with
``stop``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from common.guided import GuidedSpec, GuidedSpecError
from common.tokenizer import ByteTokenizer
from workers.engine.transfer import to_device

_CACHED_MATCHERS = 64  # fresh matchers kept per distinct spec; a request takes a copy
_executor: Any = None  # llguidance's thread pool for a batch's masks, made at first use


class Guide:
    """A request's matcher: what may come next, and the tokens so far fed to it. With
    ``after`` (a reasoning model's ``</think>``), the output is free up to that token and
    the grammar holds from the one after it: the model thinks, then answers in shape."""

    def __init__(
        self, matcher: Any, words: int, after: int | None = None, eos: tuple[int, ...] = ()
    ) -> None:
        self._matcher = matcher
        self.words = words  # int32 words of its packed mask: one bit per token id
        self.after = after
        self.active = after is None  # the grammar holds now
        # Before it holds, the output may not end: an answer that never reached its
        # grammar ended "stop" with nothing in shape (max_tokens still ends it, "length").
        self.eos = eos

    def consume(self, token: int) -> None:
        """Feed a chosen token (the mask allowed it)."""
        if self.active:
            self._matcher.consume_token(token)
        elif token == self.after:
            self.active = True

    def replay(self, tokens: list[int]) -> bool:
        """Feed a redelivered request's output so far; False when the grammar rejects it."""
        if not self.active:
            if self.after not in tokens:
                return True
            tokens = tokens[tokens.index(self.after) + 1 :]
            self.active = True
        return not tokens or bool(self._matcher.consume_tokens(tokens))

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a parser limit of llguidance's reached mid-output: its
        mask then allows only EOS), or None. The output so far matches nothing whole."""
        if not self.active or not self._matcher.is_error():
            return None
        return str(self._matcher.get_error())

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (or the matcher failed)."""
        return self.active and bool(self._matcher.is_stopped() or self._matcher.is_error())


def allows_beyond(packed: np.ndarray, ids: Collection[int]) -> bool:
    """Whether a packed mask row allows some token not in ``ids`` (a row short of its
    min_tokens has EOS and its stop ids held: the grammar must leave it another token)."""
    bits = np.unpackbits(packed.view(np.uint8), bitorder="little")
    held = [i for i in ids if i < bits.size and bits[i]]
    return int(bits.sum()) > len(held)


class Guides:
    """An engine's llguidance view of its tokenizer, and compiled matchers by spec. Safe
    to call from several threads: a worker compiles off its engine thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        import llguidance

        eos = sorted(eos_token_ids)
        if isinstance(tokenizer, ByteTokenizer):
            source: Any = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, eos))
        else:
            source = tokenizer.to_json()
        self._tokenizer = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)
        # A mask's int32 words: llguidance's vocabulary may be the tokenizer's, not n_vocab
        # (a byte vocabulary's), and its buffers must be exactly this size.
        self._words = (self._tokenizer.vocab_size + 31) // 32
        self._eos = tuple(eos)
        self._fresh: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache only: compiles run side by side

    def start(self, spec: GuidedSpec, resumed: list[int], after: int | None = None) -> Guide:
        """A matcher for ``spec`` that has read ``resumed`` (a redelivered request's output
        so far), holding from the token after ``after`` when given (see :class:`Guide`).
        Raises :class:`GuidedSpecError`."""
        import llguidance

        with self._lock:
            fresh = self._fresh.get(spec)
            if fresh is not None:
                self._fresh.move_to_end(spec)
                matcher = fresh.deep_copy()
        if fresh is None:
            fresh = llguidance.LLMatcher(self._tokenizer, spec.grammar(), log_level=0)
            if fresh.is_error():
                raise GuidedSpecError(fresh.get_error())
            with self._lock:
                self._fresh[spec] = fresh
                if len(self._fresh) > _CACHED_MATCHERS:
                    self._fresh.popitem(last=False)
                matcher = fresh.deep_copy()
        guide = Guide(matcher, self._words, after, self._eos)
        if resumed and not guide.replay(resumed):
            raise GuidedSpecError("the output so far does not match: " + matcher.get_error())
        return guide


def packed_masks(guides: list[Guide]) -> np.ndarray:
    """Each guide's mask, int32 ``[rows, words]``, bit ``t % 32`` of word ``t // 32`` set
    when token ``t`` is allowed; a batch's rows are computed in parallel."""
    global _executor
    words = max(g.words for g in guides)
    out = np.zeros((len(guides), words), dtype=np.int32)
    # A finished guide's row (its request ended on the token just read back, its row still
    # in this step's batch, to be thrown away) allows every token: never an empty row.
    live: list[tuple[int, Guide]] = []
    bits = out.view(np.uint32)
    for row, g in enumerate(guides):
        if g.done:  # ended: every token allowed (its row is thrown away)
            out[row] = -1
        elif not g.active:  # not holding yet: every token but EOS
            out[row] = -1
            for t in g.eos:
                if t >> 5 < words:
                    bits[row, t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        else:
            live.append((row, g))
    if not live:
        return out
    if len(live) == 1:
        row, g = live[0]
        g._matcher.unsafe_compute_mask_ptr(out[row].ctypes.data, g.words * 4)
        return out
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    pairs = [(g._matcher, row) for row, g in live]
    _executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, words * 4, len(guides))
    return out


def apply_masks(logits: torch.Tensor, masks: np.ndarray, rows: list[int]) -> torch.Tensor:
    """``logits`` with every token the packed ``masks`` (:func:`packed_masks`, one per row
    of ``rows``) forbid at -inf (a new tensor). They travel packed, 32 tokens a word (19 KB
    a row for a 152k vocabulary, not 152 KB), and are unpacked on the logits' device."""
    vocab = logits.shape[-1]
    packed = to_device(masks, logits.device, torch.int32)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)
    if allowed.shape[1] < vocab:  # ids past the tokenizer's: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = to_device(rows, logits.device, torch.long)
    kept = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits.index_put((index,), kept)


class _ByteVocabulary:
    """:class:`ByteTokenizer` as llguidance's ``TokenizerWrapper`` reads a tokenizer."""

    def __init__(self, tokenizer: ByteTokenizer, eos: list[int]) -> None:
        specials = sorted(tokenizer.all_special_ids)
        self.tokens = [bytes([i]) for i in range(256)] + [
            (tokenizer.id_to_token(i) or "").encode() for i in specials
        ]
        self.special_token_ids = specials
        self.eos_token_id = eos[0] if eos else tokenizer.EOS
        self.bos_token_id = tokenizer.BOS

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
