"""Streamed text: token ids to text deltas, and stop strings cut out of the stream.

``IncrementalDetokenizer`` uses vLLM's prefix/read offsets: each step decodes only a
small window of recent tokens, and text is released only once it ends in a complete
character, so a client never sees U+FFFD for a character whose bytes are still coming.
``StopStringMatcher`` holds back any tail that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context: enough for merges and SentencePiece spacing.
_CONTEXT_TOKENS = 5
# A character's bytes span at most 4 tokens, so text still ending in U+FFFD after this
# many held tokens is invalid UTF-8 for good: release all but the last 4 tokens' worth.
# Without a bound a model emitting stray bytes made every token decode a window as long
# as the output (quadratic work on the engine thread, which every request waits for).
_MAX_HELD_TOKENS = 8
_MAX_CHAR_TOKENS = 4
# How far back from a resumed prompt's end to look for a token its first attempt released
# everything at; past it (a stream of stray bytes) that attempt is replayed whole.
_RESUME_SCAN_TOKENS = 2 * _MAX_HELD_TOKENS


class Decoder(Protocol):
    """The part of ``common.tokenizer.BaseTokenizer`` the detokenizer needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn one request's output tokens into text deltas, O(window) work per token.

    The prompt's last tokens are decoded as left context, as in vLLM, so the first
    output token keeps the leading space a SentencePiece decoder would strip at the start
    of a text. For byte-level BPE the deltas add up to ``tokenizer.decode(output_ids)``;
    call :meth:`flush` when the request ends to get any incomplete tail held back (after
    ``flush``, ``add`` is not meant to be called again).

    ``resumed_tokens``: the prompt ends with that many output tokens of an earlier attempt
    (a redelivered request). The deltas go on as that attempt's would have: what it held
    back at the cut (an unfinished character, stray bytes) comes out with the next text.
    A new request's prompt is context only: bytes of a character it leaves unfinished are
    not the output's, which decodes as ``decode(output_ids)`` does.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        resumed_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix = 0  # window start: decoded only as context for the next delta
        self._read = 0  # tokens before this have been emitted as text
        self._silent: dict[int, bool] = {}  # token id -> decodes to nothing
        cut = len(prompt_token_ids) - min(max(resumed_tokens, 0), len(prompt_token_ids))
        self._resume(prompt_token_ids, cut)

    def _resume(self, ids: Sequence[int], cut: int) -> None:
        """Take the state the attempt that started after ``ids[:cut]`` had after ``ids``.

        The held-back text depends only on the tokens since the last step that released
        everything, so the replay starts there: the latest output token that, decoded
        after its own context, ends in a whole character (its bytes cannot be part of an
        earlier one, so that attempt released everything at it too). Without one close
        to the end, the attempt is replayed from ``cut``: linear, once per redelivery."""
        for sync in range(len(ids), max(cut, len(ids) - _RESUME_SCAN_TOKENS), -1):
            self._start(ids[: sync - 1])
            if self.add(ids[sync - 1]):
                break
        else:
            sync = cut
            self._start(ids[:cut])
        for token in ids[sync:]:
            self.add(token)

    def _start(self, prompt_token_ids: Sequence[int]) -> None:
        self._tokens = self._context(prompt_token_ids)
        self._prefix, self._read = 0, len(self._tokens)

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens as left context, cut on character boundaries.

        A byte-fallback decoder (Llama 2, Mistral, Gemma) turns a whole run of byte tokens
        into U+FFFD if any byte in it is invalid: a context starting or ending inside a
        character corrupted the output's own bytes decoded with it (mojibake, lost
        characters). Bytes of a character the prompt leaves unfinished are left out, not
        owed: as in vLLM, the output's text is its own tokens' (``decode(output_ids)``)."""
        n = _MAX_CHAR_TOKENS
        tokens = list(prompt_token_ids[-(_CONTEXT_TOKENS + 2 * n) :])
        for end in range(len(tokens), len(tokens) - n, -1):
            for drop in range(n):
                start = max(0, end - _CONTEXT_TOKENS) + drop
                if start >= end:
                    break
                text = self._tokenizer.decode(tokens[start:end], skip_special_tokens=self._skip)
                if not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                    return tokens[start:end]
        # Every window starts or ends in invalid bytes (a token prompt ending in stray
        # bytes): no context. Decoded with the output, a stray byte's run took the
        # output's first character into U+FFFD.
        return []

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes (often ``""``)."""
        self._tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), for a finished request."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._tokens))
        start = len(prefix_text)
        if prefix_text.endswith(_REPLACEMENT):
            # Stray bytes released by a cut end so; a byte-fallback decoder may turn them
            # into other text once later bytes join their run: go on from where they differ.
            start = _common_prefix_length(prefix_text, full_text)
        end = len(self._tokens)
        if len(full_text) <= start:
            if end - self._read > _MAX_HELD_TOKENS:
                self._drop_silent_tokens(prefix_text)
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            if end - self._read <= _MAX_HELD_TOKENS:
                return ""  # its bytes may still be coming
            if self._drop_silent_held(full_text):
                end = len(self._tokens)
                if end - self._read <= _MAX_HELD_TOKENS:
                    return ""
            cut = self._settled_cut(full_text, start)
            if cut is None:
                return ""
            end, full_text = cut
        delta = full_text[start:]
        # Next window starts where this delta's text began; drop what no window needs.
        del self._tokens[: self._read]
        self._prefix, self._read = 0, end - self._read
        return delta

    def _drop_silent_tokens(self, prefix_text: str) -> None:
        """Held tokens that add no text (skipped specials, ids a dummy model's byte tokenizer
        does not know) leave the window, except the last few a character may still need."""
        keep_from = len(self._tokens) - _MAX_CHAR_TOKENS
        if self._decode(self._prefix, keep_from) == prefix_text:
            del self._tokens[self._read : keep_from]

    def _drop_silent_held(self, full_text: str) -> bool:
        """Drop held tokens that decode to nothing (skipped specials, ids past the
        vocabulary), if the window's text stays the same without them. Kept inside a
        character, they took the place of its bytes among the last few tokens a cut holds:
        the character went out as U+FFFD, then again whole."""
        held = self._tokens[self._read :]
        kept = [t for t in held if not self._is_silent(t)]
        if len(kept) == len(held):
            return False
        window = [*self._tokens[self._prefix : self._read], *kept]
        if self._tokenizer.decode(window, skip_special_tokens=self._skip) != full_text:
            return False  # a piece with text only beside others (a SentencePiece space)
        del self._tokens[self._read :]
        self._tokens += kept
        return True

    def _is_silent(self, token: int) -> bool:
        # Remembered: a stream of stray bytes asks this for every token it holds.
        silent = self._silent.get(token)
        if silent is None:
            silent = not self._tokenizer.decode([token], skip_special_tokens=self._skip)
            self._silent[token] = silent
        return silent

    def _settled_cut(self, full_text: str, start: int) -> tuple[int, str] | None:
        """(tokens, text) of the longest head of the window, short of its last few tokens,
        that decodes to a prefix of the whole window's text: what later bytes can no
        longer change. None if no such head adds text."""
        # A character that later tokens can still complete has at most 3 of its bytes here,
        # and no silent token among them (dropped first), so it starts in one of the last 3
        # tokens: holding the last 4 never splits it.
        last = len(self._tokens) - _MAX_CHAR_TOKENS
        for end in range(last, max(self._read, last - _MAX_CHAR_TOKENS), -1):
            head = self._decode(self._prefix, end)
            if len(head) > start and full_text.startswith(head):
                return end, head
        return None

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._tokens[start:end], skip_special_tokens=self._skip)


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class StopCheck(NamedTuple):
    """Text that is safe to send now, and whether a stop string ended the output."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Cut a streamed text at the first stop string, never leaking part of one.

    Fed the detokenizer's deltas, it returns what can be sent now. A tail that is a prefix
    of some stop string waits until the next delta decides it; on a match, the output ends
    right before the stop string (or right after it with ``include_stop_str_in_output``).
    The earliest-ending match wins: generation would have stopped there.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = list(stop)
        self._include = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, delta: str, match: bool = True) -> StopCheck:
        """Add ``delta``; return the text now safe to emit and whether a stop matched.

        ``match`` False (a request short of its min_tokens): no stop string ends in this
        text, but a tail that may begin one is still held: one that starts before
        min_tokens and ends after it stops the output, as in vLLM. Only a stop string that
        ends in ``delta`` counts (one inside text held unmatched does not)."""
        if self.stopped:
            return StopCheck("", True)
        if not self._stop:
            return StopCheck(delta, False)
        held = len(self._held)
        text = self._held + delta
        found = self._first_match(text, ends_after=held) if match else None
        if found is not None:
            start, end = found
            self.stopped, self.matched = True, text[start:end]
            self._held = ""
            return StopCheck(text[: end if self._include else start], True)
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep], False)

    def hold(self, text: str) -> None:
        """Start with ``text`` held: not yet sent, ahead of the next delta (a resumed
        request's tail that the first attempt had held back)."""
        self._held = text + self._held

    def flush(self) -> str:
        """The held-back tail, once the output ended for another reason (length, EOS)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str, ends_after: int = 0) -> tuple[int, int] | None:
        """(start, end) of the stop string that completes first in ``text``, of those that
        end past its first ``ends_after`` characters."""
        best: tuple[int, int] | None = None
        for s in self._stop:
            start = text.find(s, max(0, ends_after - len(s) + 1))
            if start < 0:
                continue
            end = start + len(s)
            # Earliest end first; for the same end, the longer string (earlier start).
            if best is None or (end, start) < (best[1], best[0]):
                best = (start, end)
        return best

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


def attach_text_state(
    req: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: Any,
    *,
    resumed_tokens: int = 0,
    delivered_text_len: int = 0,
) -> None:
    """Give a request (engine or sim) its incremental detokenizer and stop-string matcher.

    A resumed request's prompt ends with ``resumed_tokens`` output tokens its caller already
    has, with ``delivered_text_len`` characters of their text: the rest of that text, which
    the first attempt was holding back as a possible stop-string prefix, starts out held in
    the new matcher, so it is sent (or cut at a stop string) as if nothing had happened.
    The detokenizer goes on as the first attempt's would have (see
    :class:`IncrementalDetokenizer`'s ``resumed_tokens``).
    """
    skip = params.skip_special_tokens
    if resumed_tokens > 0 and params.stop:
        # The held text needs the first attempt's deltas anyway: one replay gives both.
        cut = len(prompt_ids) - resumed_tokens
        detok, text = _replay(tokenizer, prompt_ids[:cut], prompt_ids[cut:], skip)
        req.detokenizer = detok
        req.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        req.stop_matcher.hold(text[delivered_text_len:])
        return
    req.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip, resumed_tokens)
    if params.stop:
        req.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)


def held_back_text(
    tokenizer: Decoder,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    delivered_text_len: int,
    skip_special_tokens: bool = True,
) -> str:
    """The text of ``output_ids`` past the first ``delivered_text_len`` characters, as the
    streamed deltas give it (an unfinished character at the end stays out: the detokenizer
    of the resumed prompt emits it whole)."""
    _, text = _replay(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    return text[delivered_text_len:]


def _replay(
    tokenizer: Decoder,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    skip_special_tokens: bool,
) -> tuple[IncrementalDetokenizer, str]:
    """An attempt's detokenizer after ``output_ids``, and the text its deltas gave."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return detok, "".join(detok.add(token) for token in output_ids)


def resumed_ending(
    tokenizer: Decoder,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    delivered_text_len: int,
    params: Any,
) -> tuple[str, str | None]:
    """The last text a resumed request owes its caller when it has nothing left to
    generate (its ``max_tokens`` or the context limit reached with the tokens the caller
    has): what its first attempt would have released had it ended there -- the tail held
    back as a possible stop-string start, and an unfinished character -- and the stop
    string that text completes, if any (``params``: ``stop``,
    ``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``, as on
    :class:`SamplingParams`)."""
    detok, text = _replay(tokenizer, prompt_ids, output_ids, params.skip_special_tokens)
    held = text[delivered_text_len:]
    last = detok.flush()
    if not params.stop:
        return held + last, None
    matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
    matcher.hold(held)
    check = matcher.feed(last, match=len(output_ids) > params.min_tokens)
    if check.stopped:
        return check.text, matcher.matched
    return check.text + matcher.flush(), None
