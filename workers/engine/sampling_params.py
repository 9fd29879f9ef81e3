"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from common.guided import GuidedSpec, shape_problem

MAX_STOP_TOKEN_IDS = 64  # as the wire allows (common.protocol): the engine is used alone too
MAX_STOP_CHARS = 1024  # likewise, per stop string
MAX_LOGIT_BIAS = 1024  # likewise, token ids a request may bias
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """Sampling settings of one request. ``temperature=0`` is greedy.

    ``seed`` fixes the request's random stream: the same seed gives the same tokens whatever
    else shares the batch. ``logprobs=k`` returns the chosen token's logprob and the top k.
    ``prompt_logprobs=k`` (vLLM's) returns, per prompt token, its logprob given the tokens
    before it and the top k there (the first token has none): the request then computes its
    whole prompt, taking no prefix-cache or KV-tier hit.
    ``logit_bias`` (OpenAI's): token id -> a number in [-100, 100] added to its logit before
    penalties, filters and the draw (logprobs stay those of the model's own distribution).
    ``guided`` (structured output): the output matches this JSON schema, regex, choice or
    grammar (:mod:`common.guided`); it ends with ``stop`` once nothing more can match.
    ``guided_after``: a token id (a reasoning model's ``</think>``) up to which the output
    is free; the grammar holds from the token after it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: EOS and stop_token_ids cannot be sampled, and stop strings do not end the
    # output, before this many tokens (max_tokens still ends it).
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    guided: GuidedSpec | None = None
    guided_after: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if not self.logit_bias:
            self.logit_bias = None  # {} asks for nothing: the sampler skips None rows
        self.validate()

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as (token ids int64, biases float32), built once per request:
        the sampler reads them at every step."""
        cached: tuple[np.ndarray, np.ndarray] | None = self.__dict__.get("_bias_arrays")
        if cached is None:
            bias = self.logit_bias or {}
            cached = (
                np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
            )
            self.__dict__["_bias_arrays"] = cached
        return cached

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` naming the first bad parameter."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise SamplingParamsError(name, f"must be a finite number, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise SamplingParamsError("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError("top_k", "must be an integer >= 0 (0 or -1 = off)")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise SamplingParamsError("seed", "must be an integer in [0, 2**63)")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise SamplingParamsError("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= 20
        ):
            raise SamplingParamsError("prompt_logprobs", "must be an integer in [0, 20]")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedSpec):
                raise SamplingParamsError("guided", "must be a GuidedSpec")
            # Compiled by the engine (LLMEngine.guide), off the caller's event loop.
            why = shape_problem(self.guided.kind, self.guided.spec)
            if why is not None:
                raise SamplingParamsError("guided", why)
        if self.guided_after is not None and (
            self.guided is None
            or isinstance(self.guided_after, bool)
            or not isinstance(self.guided_after, int)
            or self.guided_after < 0
        ):
            raise SamplingParamsError("guided_after", "a token id, with guided only")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", "must be non-empty strings")
        if len(self.stop) > 16:
            raise SamplingParamsError("stop", "at most 16 stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            # Each is matched against every token's text on the engine thread, for the batch.
            raise SamplingParamsError("stop", f"at most {MAX_STOP_CHARS} characters each")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError("min_tokens", "must be an integer in [0, max_tokens]")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            # Each generated token is looked up in them on the engine thread, for the batch.
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "must map token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS:
        # Each biased row adds its entries to the step's logits on the engine thread.
        raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SamplingParamsError(
                "logit_bias", f"keys must be non-negative token ids, got {token!r}"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT
        ):
            raise SamplingParamsError(
                "logit_bias", f"token {token}: the bias must be in [-100, 100], got {value!r}"
            )
