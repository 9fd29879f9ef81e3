"""LLM: the offline API. Queue every prompt, step until all finish, return in input order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from workers.engine.args import EngineArgs
from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams

# How long to sleep when a step had nothing to run (a dynamic batch still collecting).
_IDLE_SLEEP_S = 0.0005


class LLM:
    """``LLM("path/or/dummy:tiny", policy="hybrid").generate(["Hello"], SamplingParams())``.

    Keyword arguments are :class:`EngineArgs` fields.
    """

    def __init__(self, model: str, tokenizer: Any | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), tokenizer=tokenizer)
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (texts, or token id lists); outputs in input order.

        ``sampling_params`` is one object for all prompts or one per prompt.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts / prompt_token_ids")
        texts: list[str | None]
        ids: list[list[int] | None]
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            ids = [None] * len(texts)
        else:
            ids = [list(p) for p in prompt_token_ids or []]
            texts = [None] * len(ids)
        n = len(texts)
        if sampling_params is None:
            params = [SamplingParams()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        if priorities is not None and len(priorities) != n:
            raise ValueError(f"{len(priorities)} priorities for {n} prompts")

        engine = self.engine
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * n
        try:
            for i in range(n):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                engine.add_request(
                    request_id,
                    texts[i],
                    params[i],
                    prompt_token_ids=ids[i],
                    priority=priorities[i] if priorities is not None else 0,
                )
                order[request_id] = i
            while engine.has_unfinished():
                for delta in engine.step():
                    if delta.output is not None and delta.request_id in order:
                        results[order[delta.request_id]] = delta.output
                if engine.last_step_num_tokens == 0:
                    time.sleep(_IDLE_SLEEP_S)
        except BaseException:
            # A prompt refused (too long, a bad id) or a step that raised (Ctrl-C): the
            # requests already added went on in the next call, holding blocks and steps
            # for outputs nobody read.
            for request_id in order:
                engine.abort(request_id)
            raise
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"requests {missing} never finished")
        return [r for r in results if r is not None]
