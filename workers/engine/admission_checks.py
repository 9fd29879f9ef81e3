"""What ``add_request`` checks before queueing, shared by the engine and the sim engine."""

from __future__ import annotations

from collections.abc import Callable, Container

from common.errors import ContextLengthExceededError, InvalidRequestError


def checked_prompt_ids(
    request_id: object,
    known: Container[str],
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    encode: Callable[[str], list[int]],
    max_seq_len: int,
    vocab_size: int | None = None,
) -> list[int]:
    """The request's prompt token ids, or the :class:`InvalidRequestError` /
    :class:`ContextLengthExceededError` (HTTP 400) that says what is wrong with it.

    ``encode`` runs only for a text prompt; ``vocab_size`` None skips the id range check.
    """
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
    if request_id in known:
        raise InvalidRequestError(f"request {request_id!r} already exists", param="request_id")
    if (prompt is None) == (prompt_token_ids is None):
        raise InvalidRequestError("give exactly one of prompt / prompt_token_ids", param="prompt")
    ids = encode(prompt) if prompt is not None else list(prompt_token_ids or [])
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if vocab_size is not None and any(
        not isinstance(t, int) or not 0 <= t < vocab_size for t in ids
    ):
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size})", param="prompt_token_ids"
        )
    if len(ids) >= max_seq_len:
        raise ContextLengthExceededError(
            f"prompt has {len(ids)} tokens but this engine's max_seq_len is {max_seq_len} "
            "(prompt plus at least one generated token)",
            param="prompt",
        )
    return ids


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> None:
    """An :class:`InvalidRequestError` (HTTP 400) for a ``logit_bias`` token id outside the
    model's vocabulary (vLLM refuses them too): the caller meant another model's ids."""
    outside = sorted(t for t in bias or () if t >= vocab_size)
    if outside:
        shown = ", ".join(map(str, outside[:5])) + (", ..." if len(outside) > 5 else "")
        raise InvalidRequestError(
            f"logit_bias names token ids outside this model's vocabulary [0, {vocab_size}): "
            f"{shown}",
            param="logit_bias",
        )
