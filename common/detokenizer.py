"""Streamed text: token ids to text deltas, and stop strings cut out of the stream.

``IncrementalDetokenizer`` uses vLLM's prefix/read offsets: each step decodes only a
small window of recent tokens, and text is released only once it ends in a complete
character, so a client never sees U+FFFD for a character whose bytes are still coming.
``StopStringMatcher`` holds back any tail that could still grow into a stop string.
"""

from __future__ import annotations

import codecs
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
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        start, end, context = self._context(prompt_token_ids)
        self._tokens = context[start:]
        self._prefix = 0  # window start: decoded only as context for the next delta
        self._read = end - start  # tokens before this have been emitted as text

    def _context(self, prompt_token_ids: Sequence[int]) -> tuple[int, int, list[int]]:
        """The prompt's last tokens as left context, cut on character boundaries: (start,
        end, tokens), ``tokens[start:end]`` the context and ``tokens[end:]`` a character the
        prompt leaves unfinished (a resumed request's), to be emitted whole as output.

        A byte-fallback decoder (Llama 2, Mistral, Gemma) turns a whole run of byte tokens
        into U+FFFD if any byte in it is invalid: a context starting or ending inside a
        character corrupted the output's own bytes decoded with it (mojibake, lost
        characters, a resumed request's character sent twice)."""
        n = _MAX_CHAR_TOKENS
        tokens = list(prompt_token_ids[-(_CONTEXT_TOKENS + 2 * n) :])
        # Only bytes that leave a character unfinished are held as output; a U+FFFD the
        # prompt really ends with is text like any other.
        for pending in range(n) if self._ends_unfinished(tokens) else (0,):
            end = len(tokens) - pending
            for drop in range(n):
                start = max(0, end - _CONTEXT_TOKENS) + drop
                if start >= end:
                    break
                text = self._tokenizer.decode(tokens[start:end], skip_special_tokens=self._skip)
                if not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                    return start, end, tokens
        # Every window starts or ends in invalid bytes (a token prompt ending in a stray
        # byte): no context. Decoded with the output, the stray byte's run took the
        # output's first character into U+FFFD.
        return len(tokens), len(tokens), tokens

    def _ends_unfinished(self, tokens: Sequence[int]) -> bool:
        """Whether the bytes of ``tokens`` end inside a character (False when the
        tokenizer cannot tell its tokens' bytes)."""
        token_bytes = getattr(self._tokenizer, "token_bytes", None)
        if token_bytes is None or not tokens:
            return False
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        utf8.decode(b"".join(token_bytes(t) for t in tokens[-_MAX_CHAR_TOKENS:]))
        return bool(utf8.getstate()[0])

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
            # Only a prompt ends so (a resumed request cut inside a character the client
            # never got): emit that character whole once its bytes complete it.
            start = _common_prefix_length(prefix_text, full_text)
        end = len(self._tokens)
        if len(full_text) <= start:
            if end - self._read > _MAX_HELD_TOKENS:
                self._drop_silent_tokens(prefix_text)
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            if end - self._read <= _MAX_HELD_TOKENS:
                return ""  # its bytes may still be coming
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

    def _settled_cut(self, full_text: str, start: int) -> tuple[int, str] | None:
        """(tokens, text) of the longest head of the window, short of its last few tokens,
        that decodes to a prefix of the whole window's text: what later bytes can no
        longer change. None if no such head adds text."""
        # A character that later tokens can still complete has at most 3 of its bytes here,
        # so it starts in one of the last 3 tokens: holding the last 4 never splits it.
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
    """
    req.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
    if params.stop:
        req.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        if resumed_tokens > 0:
            cut = len(prompt_ids) - resumed_tokens
            held = held_back_text(
                tokenizer, prompt_ids[:cut], prompt_ids[cut:], delivered_text_len,
                params.skip_special_tokens,
            )  # fmt: skip
            req.stop_matcher.hold(held)


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
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    text = "".join(detok.add(token) for token in output_ids)
    return text[delivered_text_len:]


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
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
    held = "".join(detok.add(token) for token in output_ids)[delivered_text_len:]
    last = detok.flush()
    if not params.stop:
        return held + last, None
    matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
    matcher.hold(held)
    check = matcher.feed(last, match=len(output_ids) > params.min_tokens)
    if check.stopped:
        return check.text, matcher.matched
    return check.text + matcher.flush(), None
