"""Where a decode step's time goes: host phases and device time, per step.

Wraps one engine's methods (instance attributes, nothing global) with timers:
``schedule`` (batcher), ``build`` (inputs + upload), ``execute`` (host time to launch the
forward, ``build`` included), ``sample`` (host time to choose tokens: launches on CUDA),
``read_back`` (asynchronous output: waiting for the previous step's tokens, then
accepting them), ``accept`` (stop checks, detokenizing, deltas; inside ``read_back`` when
asynchronous), and on CUDA ``device_forward`` (CUDA events around ``execute``: the device's
time from the inputs' upload to the logits, queueing behind the previous step included).
``other`` is the rest of ``LLMEngine.step`` (a synchronous step's wait for its tokens).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from workers.engine.engine import LLMEngine

PHASES = ("schedule", "build", "execute", "sample", "read_back", "accept")
NESTED = ("build",)  # inside execute


class PhaseTimer:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._events: tuple[Any, Any] | None = None
        self._pending_events: list[tuple[int, tuple[Any, Any]]] = []
        self.cuda = engine.device.type == "cuda"
        targets = {  # phase: (object, method) wrapped on that instance
            "schedule": (engine.batcher, "schedule"),
            "build": (engine.runner, "build_inputs"),
            "execute": (engine.runner, "execute"),
            "sample": (engine.sampler, "choose"),
            "read_back": (engine, "_read_back"),
            "accept": (engine, "_accept"),
        }
        for phase, (obj, method) in targets.items():
            setattr(obj, method, self._wrap(phase, getattr(obj, method)))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            events = None
            if phase == "execute" and self.cuda:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current[phase] += time.perf_counter() - t0
            if events is not None:
                events[1].record()
                self._events = events
            return out

        return timed

    def step(self) -> list[Any]:
        """``engine.step()``, timed; the step's figures go to ``steps``."""
        self.current.clear()
        self._events = None
        t0 = time.perf_counter()
        deltas = self.engine.step()
        total = time.perf_counter() - t0
        row = {k: 1e3 * v for k, v in self.current.items()}
        row["total"] = 1e3 * total
        nested = set(NESTED) | ({"accept"} if self.engine.async_output else set())
        row["other"] = row["total"] - sum(row.get(p, 0.0) for p in PHASES if p not in nested)
        if self._events is not None:
            # Read once the run is over: synchronizing here would stall the next step's
            # launch and hide the overlap that asynchronous output buys.
            self._pending_events.append((len(self.steps), self._events))
        row["batch"] = self.engine.last_step_num_seqs
        row["decode"] = float(self.engine.last_step_num_tokens == self.engine.last_step_num_seqs)
        self.steps.append(row)
        return deltas

    def summary(self, batch: int | None = None, decode: bool = True) -> dict[str, float]:
        """Median ms per phase over decode steps (``decode=False``: steps that computed
        prompt tokens) of exactly ``batch`` sequences (None: of any batch)."""
        for i, (start, end) in self._pending_events:
            end.synchronize()
            self.steps[i]["device_forward"] = start.elapsed_time(end)
        self._pending_events.clear()
        rows = [
            r
            for r in self.steps
            if bool(r["decode"]) == decode and (batch is None or r["batch"] == batch)
        ]
        if not rows:
            return {}
        keys = [*PHASES, "other", "total"] + (["device_forward"] if self.cuda else [])
        out = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 3) for k in keys}
        out["steps"] = len(rows)
        out["mean_batch"] = round(statistics.fmean(r["batch"] for r in rows), 1)
        return out
