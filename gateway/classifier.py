"""Which instance group a request belongs to.

The rule, in order:

1. **Explicit**: the URL path (``/v1/<group>/…``) or the ``X-QoS-Group`` header names a
   configured group (an unknown path group is a 404, an unknown header value a 400 naming
   the header, and the two disagreeing a 400). The request must fit that group's
   ``max_seq_len`` or it is refused with ``context_length_exceeded``: the client asked for
   that service class, and silently moving it would break its latency expectation.
2. **By length**: otherwise the lowest-``rank`` group whose ``max_seq_len`` holds
   ``prompt tokens + max_tokens`` (a group's limit is what its live workers serve when
   that is less: a model's context or a KV cache can be shorter than the configured one). Groups with ``max_batch == 1`` (``realtime``) are only
   ever chosen explicitly: one slot would queue everyone behind one request. (If every
   group has ``max_batch == 1``, all of them are candidates.)
3. A request with no ``max_tokens`` asks for ``gateway.default_max_tokens``; when that does
   not fit anywhere, it gets what is left of the first group that holds its prompt.
4. Nothing holds it: 400 ``context_length_exceeded``.

Values from the client (path, header) are only ever compared with configured names, so
nothing a client sends becomes part of a NATS subject unchecked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from common.config import Config, GroupConfig
from common.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)

GROUP_HEADER = "X-QoS-Group"
Source = Literal["path", "header", "length"]


@dataclass(frozen=True, slots=True)
class Classification:
    group: str
    max_tokens: int
    source: Source


def explicit_group(config: Config, path_group: str | None, header_group: str | None) -> str | None:
    """The group the client named, validated against the configuration; None if none."""
    if path_group is not None and path_group not in config.groups:
        raise NotFoundError(
            f"unknown instance group {path_group!r} in the path; "
            f"configured: {', '.join(sorted(config.groups))}",
            code="group_not_found",
        )
    if header_group is not None:
        header_group = header_group.strip()
        if header_group not in config.groups:
            raise InvalidRequestError(
                f"header {GROUP_HEADER} names no configured instance group "
                f"(configured: {', '.join(sorted(config.groups))})",
                param=GROUP_HEADER,
                code="invalid_group",
            )
        if path_group is not None and header_group != path_group:
            raise InvalidRequestError(
                f"header {GROUP_HEADER}={header_group!r} contradicts the path's group "
                f"{path_group!r}",
                param=GROUP_HEADER,
                code="invalid_group",
            )
    return path_group or header_group


def permitted_group(
    config: Config,
    path_group: str | None,
    header_group: str | None,
    allowed: Collection[str] | None,
) -> str | None:
    """:func:`explicit_group`, which a key ``allowed`` these groups (None: all) must be
    allowed to use: 403 otherwise."""
    named = explicit_group(config, path_group, header_group)
    if named is not None and allowed is not None and named not in allowed:
        raise PermissionDeniedError(
            f"this API key may not use instance group {named!r} "
            f"(it may use: {', '.join(sorted(allowed))})",
            code="group_not_allowed",
        )
    return named


def auto_candidates(config: Config) -> list[tuple[str, GroupConfig]]:
    """Groups length routing may choose, first choice first."""
    ranked = config.groups_by_rank()
    batched = [(name, group) for name, group in ranked if group.max_batch > 1]
    return batched or ranked


def classify(
    config: Config,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    path_group: str | None = None,
    header_group: str | None = None,
    prompt_param: str = "prompt",
    seq_limit: Callable[[str], int] | None = None,
    allowed: Collection[str] | None = None,
    min_tokens: int = 0,
    max_tokens_param: str = "max_tokens",
) -> Classification:
    """Pick the group and settle ``max_tokens``; raise a 4xx :class:`QosError` if none fits.
    ``seq_limit(group)`` is a group's limit now (default: its configured ``max_seq_len``;
    the gateway passes what its live workers serve, when that is less). ``allowed``: the
    groups the caller's API key may use (None: every group). ``min_tokens``: a settled
    ``max_tokens`` is never below it (the default was, and cut the answer silently).
    ``max_tokens_param``: the parameter that set ``max_tokens``, for an error to name."""
    limit_of = seq_limit or (lambda name: config.groups[name].max_seq_len)
    default = max(config.gateway.default_max_tokens, min_tokens)
    named = permitted_group(config, path_group, header_group, allowed)
    if named is not None:
        limit = limit_of(named)
        settled = _settle(prompt_tokens, max_tokens, default, limit)
        if settled is None or settled < min_tokens:
            raise _too_long(
                prompt_tokens, max_tokens, limit, (prompt_param, max_tokens_param),
                f"group {named!r}",
            )  # fmt: skip
        return Classification(named, settled, "path" if path_group else "header")

    candidates = auto_candidates(config)
    if allowed is not None:  # the key's groups: batched ones first, as for everyone
        candidates = [c for c in candidates if c[0] in allowed] or [
            c for c in config.groups_by_rank() if c[0] in allowed
        ]
    limits = [(name, limit_of(name)) for name, _ in candidates]
    want = max_tokens if max_tokens is not None else default
    for name, limit in limits:
        if prompt_tokens + want <= limit:
            return Classification(name, want, "length")
    if max_tokens is None:
        for name, limit in limits:
            if prompt_tokens + max(1, min_tokens) <= limit:
                return Classification(name, limit - prompt_tokens, "length")
    largest = max(limit for _, limit in limits)
    where = "any instance group" if allowed is None else "any instance group this key may use"
    raise _too_long(prompt_tokens, max_tokens, largest, (prompt_param, max_tokens_param), where)


def settle_max_tokens(prompt: int, default: int, limit: int) -> int | None:
    """What a request without ``max_tokens`` gets in a group of ``limit``."""
    return _settle(prompt, None, default, limit)


def _settle(prompt: int, max_tokens: int | None, default: int, limit: int) -> int | None:
    if max_tokens is not None:
        return max_tokens if prompt + max_tokens <= limit else None
    return min(default, limit - prompt) if prompt < limit else None


def _too_long(
    prompt: int, max_tokens: int | None, limit: int, params: tuple[str, str], where: str
) -> ContextLengthExceededError:
    prompt_param, max_tokens_param = params
    # OpenAI's and vLLM's first sentence, which LiteLLM matches to raise its
    # ContextWindowExceededError (and take a router's context-window fallback).
    head = f"This model's maximum context length is {limit} tokens"
    if prompt >= limit or max_tokens is None:
        return ContextLengthExceededError(
            f"{head}. However, your prompt has {prompt} tokens, and at least one completion "
            f"token is needed ({where} accepts at most {limit} tokens).",
            param=prompt_param,
        )
    return ContextLengthExceededError(
        f"{head}. However, you requested {prompt + max_tokens} tokens ({prompt} in the "
        f"{'messages' if prompt_param == 'messages' else 'prompt'}, {max_tokens} in the "
        f"completion). Please reduce the length of the {prompt_param} or completion "
        f"({where} accepts at most {limit} tokens).",
        param=max_tokens_param,
    )
