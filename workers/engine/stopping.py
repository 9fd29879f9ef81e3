"""How one sampled token ends a request, and the text it releases: one rule for the engine
and the simulated engine (``workers.sim``), so what the worker's tests see is what the
engine does.

As in vLLM: the first ``min_tokens`` tokens end nothing but the length; EOS (unless
``ignore_eos``) comes before a stop token id, whose id is the ``stop_reason`` (so is a
secondary EOS id's: one the generation config adds to the tokenizer's own, which vLLM
turns into a stop token id; the tokenizer's EOS reports none); a stop
token's own text stays out unless ``include_stop_str_in_output`` (what was held back
before it comes out as ``decode(..., skip_special_tokens=True)`` shows it: vLLM drops it,
a "\ufffd" the model wrote included); a stop string cuts the
text where it matched (``stop_reason`` = the string); an output ending any other way
releases what was held back (an unfinished character, a partial stop string), which can
still complete a stop string.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any


def settle_token(
    req: Any,
    token: int,
    eos_token_ids: Container[int],
    at_limit: bool,
    *,
    primary_eos: int | None,
    complete: bool = False,
) -> tuple[str, str | None]:
    """(text to send, finish reason or None) for ``token``, just appended to ``req``'s
    output. ``req`` has ``params``, ``detokenizer``, ``stop_matcher`` (either may be None),
    ``stop_reason`` (set here) and ``num_output_tokens``; ``at_limit``: its max_tokens or
    max sequence length is reached; ``primary_eos``: the tokenizer's own EOS id (None
    without a tokenizer: every EOS id is then a secondary one, as in vLLM); ``complete``:
    the request's guided-decoding grammar is matched and allows nothing more (``stop``)."""
    params = req.params
    reason: str | None = None
    armed = req.num_output_tokens > params.min_tokens
    # An EOS that completed a guided output ends it as any EOS does, ignore_eos or not: its
    # text (specials kept) joined the output and broke the grammar it was guided by.
    if token in eos_token_ids and ((armed and not params.ignore_eos) or complete):
        reason = "stop"
        if token != primary_eos:
            req.stop_reason = token
    elif armed and token in params.stop_token_ids:
        reason, req.stop_reason = "stop", token
    hidden = reason is not None and not params.include_stop_str_in_output
    text = ""
    if req.detokenizer is not None:
        # A stop token kept out of the text is kept out of the decoding too: fed to it, its
        # piece (and with it what the detokenizer held back before it, an unfinished
        # character) was dropped whole; what was held goes out now, as decode() shows it.
        piece = req.detokenizer.flush() if hidden else req.detokenizer.add(token)
        text = _match_stop(req, piece, armed)
        if reason is None and req.stop_matcher is not None and req.stop_matcher.stopped:
            reason = "stop"
    if reason is None and complete:
        reason = "stop"
    if reason is None and at_limit:
        reason = "length"
    stopped_by_string = req.stop_matcher is not None and req.stop_matcher.stopped
    if reason is not None and req.detokenizer is not None and not stopped_by_string:
        text += _match_stop(req, "" if hidden else req.detokenizer.flush(), armed)
        if req.stop_matcher is not None:
            text += req.stop_matcher.flush()
            if req.stop_matcher.stopped and reason == "length":
                reason = "stop"  # the released text completed a stop string
    return text, reason


def primary_eos(tokenizer: Any | None) -> int | None:
    """The tokenizer's own EOS id (its ``eos_token_id``, else the least of its
    ``eos_token_ids``); None without a tokenizer."""
    if tokenizer is None:
        return None
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if eos is not None else min(getattr(tokenizer, "eos_token_ids", ()), default=None)


def _match_stop(req: Any, piece: str, armed: bool) -> str:
    """Pass new text through the request's stop strings; remember which one matched (the
    one the text was cut at: the earliest to end, the longer on a tie). Not ``armed``
    (before min_tokens): the text passes unmatched."""
    matcher = req.stop_matcher
    if matcher is None or not piece:
        return piece
    check = matcher.feed(piece, match=armed)
    if check.stopped and req.stop_reason is None:
        req.stop_reason = matcher.matched
    return str(check.text)
