"""``POST /tokenize`` and ``/detokenize`` (vLLM's endpoints, also under ``/v1``).

Clients count a prompt's tokens against a group's limit before sending it, or turn ids back
into text, with exactly the tokenizer and chat template the gateway itself applies: a chat is
rendered as ``/v1/chat/completions`` renders it, so the count is the one admission will see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from pydantic import Field, model_validator
from starlette.requests import Request

from common.errors import InvalidRequestError
from gateway.generate import Generator
from gateway.openai_api import (
    MAX_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    _Strict,
    parse_body,
)

# Token lists longer than this are decoded (or spelled out) on a thread, as long prompts are
# encoded there: a million ids would hold every stream on the event loop for a second.
INLINE_DETOKENIZE_IDS = 4096
_T = TypeVar("_T")


async def _off_loop_if(big: bool, work: Callable[[], _T]) -> _T:
    return await asyncio.to_thread(work) if big else work()


class TokenizeRequest(_Strict):
    """A completion prompt (``prompt``) or a conversation (``messages``), as vLLM takes it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    # None: True for a prompt (as /v1/completions), False for a chat (its template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("give either prompt or messages")
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give either prompt or messages, not both")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenize(
    generator: Generator,
    request: Request,
    allowed: Collection[str] | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` for the body's input;
    ``max_model_len`` over the groups ``allowed`` (the caller's key's), or ``group``'s
    (``/v1/{group}/tokenize``, as a client whose base URL names a group calls it)."""
    max_model_len = generator.max_model_len(allowed, group)  # a bad group: before the body
    body = parse_body(TokenizeRequest, await generator.read_body(request))
    generator.check_model(body.model)
    if body.messages is not None:
        chat = ChatCompletionRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        # The template's text, with the tokenizer's BOS too when asked: encoded from the
        # rendered text (decoded from its ids and encoded again, a SentencePiece prefix
        # space doubled after <s> and the ids came out other than admission's).
        special = bool(body.add_special_tokens)
        ids, _ = await generator.prompt_ids(chat, big=True, chat_special_tokens=special)
    else:
        assert body.prompt is not None
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await generator.encode(body.prompt, add_special_tokens=special)
    strs = None
    if body.return_token_strs:
        strs = await _off_loop_if(
            len(ids) > INLINE_DETOKENIZE_IDS,
            lambda: [generator.token_bytes(t).decode("utf-8", errors="replace") for t in ids],
        )
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


async def detokenize(generator: Generator, request: Request) -> dict[str, Any]:
    """``{"prompt"}``: the text of the body's token ids, special tokens included."""
    body = parse_body(DetokenizeRequest, await generator.read_body(request))
    generator.check_model(body.model)
    vocab = generator.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens"
        )
    tokenizer = generator.tokenizer
    text = await _off_loop_if(
        len(body.tokens) > INLINE_DETOKENIZE_IDS,
        lambda: tokenizer.decode(body.tokens, skip_special_tokens=False),
    )
    return {"prompt": text}
