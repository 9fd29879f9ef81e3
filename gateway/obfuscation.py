"""Stream obfuscation, as OpenAI's ``stream_options.include_obfuscation``: each streamed
chunk gets an ``obfuscation`` field of filler, so its size no longer tells a passive
observer of the TLS traffic the length of the token it carries.

A worker sends a chunk per engine step (``worker.coalesce_ms`` is shorter than a decode
step), so without it each SSE event's size is a token's length plus a constant, and a
reply can be largely reconstructed from those lengths (Weiss et al., 2024, "What Was
Your Prompt?"). A stream's chunks are padded to one size, its first chunk's plus a
headroom (``HEADROOM`` bytes, more with logprobs: each alternative spells its token out
again) rounded up to ``BUCKET``: every chunk whose token (and growing usage counters)
fits in that headroom is the same size, byte for byte. A larger one goes to a bucket
above, with a random offset before rounding, so its bucket is not its length's. A
stream's opening (a chat's role, an echoed prompt) is padded apart, setting nothing: its
size is not a chunk's. Events over ``BIG_EVENT_BYTES`` are left as they are: padding
hides nothing there and would copy megabytes on the event loop.
"""

from __future__ import annotations

import base64
import os
import random

BUCKET = 64
HEADROOM = 48
HEADROOM_PER_LOGPROB = 96  # a token's text, its bytes as numbers and its logprob, again
BIG_EVENT_BYTES = 16 * 1024
_FIELD = b',"obfuscation":"'
_CLOSE = b'"}'
_rng = random.Random(os.urandom(16))  # the sizes' offsets: not secrets, only unpredictable


class Padder:
    """Pads one stream's events (see the module docstring)."""

    __slots__ = ("floor", "headroom")

    def __init__(self, logprobs: int | None = None) -> None:
        """``logprobs``: the alternatives each chunk carries per token (None: none)."""
        self.headroom = HEADROOM + (
            0 if logprobs is None else (logprobs + 1) * HEADROOM_PER_LOGPROB
        )
        self.floor = 0  # set by the stream's first chunk

    def __call__(self, data: bytes) -> bytes:
        """``data``'s SSE events (``data: {...}\\n\\n``), each JSON object with an
        ``obfuscation`` field; ``[DONE]``, big events and anything not an object as is."""
        out = []
        for event in data.split(b"\n\n"):
            if event.startswith(b"data: {") and event.endswith(b"}"):
                event = self._padded(event)
            out.append(event)
        return b"\n\n".join(out)

    def _padded(self, event: bytes) -> bytes:
        size = len(event) - 1 + len(_FIELD) + len(_CLOSE)  # the event's "}" goes
        if size > BIG_EVENT_BYTES:
            return event
        if not self.floor:
            self.floor = _bucket(size + self.headroom)
        target = self.floor if size <= self.floor else _bucket(size + _rng.randrange(BUCKET))
        n = target - size  # 0: an empty filler, still the stream's size
        fill = base64.urlsafe_b64encode(os.urandom(n * 3 // 4 + 3))[:n]
        return event[:-1] + _FIELD + fill + _CLOSE


def _bucket(size: int) -> int:
    return -(-size // BUCKET) * BUCKET
