"""Stream obfuscation, as OpenAI's ``stream_options.include_obfuscation``: each streamed
chunk gets an ``obfuscation`` field of random characters, so its size no longer tells a
passive observer of the TLS traffic the length of the token it carries.

A worker sends a chunk per engine step (``worker.coalesce_ms`` is shorter than a decode
step), so without it each SSE event's size is a token's length plus a constant, and a
reply can be largely reconstructed from those lengths (Weiss et al., 2024, "What Was
Your Prompt?"). Each event is padded to the next multiple of ``BUCKET`` bytes, plus a
random 0 to ``JITTER - 1``: tokens of up to a few dozen bytes all look alike.
"""

from __future__ import annotations

import random

BUCKET = 64
JITTER = 32
_FIELD = b',"obfuscation":"'
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_rng = random.SystemRandom()


def pad_events(data: bytes) -> bytes:
    """``data``'s SSE events (``data: {...}\\n\\n``), each JSON object with an
    ``obfuscation`` field that pads it; ``[DONE]`` and anything not an object unchanged."""
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {") and event.endswith(b"}"):
            size = len(event) + len(_FIELD) + 2  # the field's closing quote and brace
            target = -(-size // BUCKET) * BUCKET + _rng.randrange(JITTER)
            fill = bytes(_rng.choice(_ALPHABET) for _ in range(max(1, target - size)))
            event = event[:-1] + _FIELD + fill + b'"}'
        out.append(event)
    return b"\n\n".join(out)
