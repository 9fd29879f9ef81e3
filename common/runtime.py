"""Process settings every long-running qosserve service shares: its event loop and its heap.

- :func:`run`: ``asyncio.run`` on uvloop when it is installed (it comes with
  ``uvicorn[standard]``); its transports and selector cost a fraction of asyncio's per
  message, and a worker sends a NATS message per chunk.
- :func:`settle_heap`: after start-up, move everything alive (modules, tokenizer, config,
  compiled schemas) out of the cyclic GC's reach with ``gc.freeze()``, and collect the
  youngest generation less often. Otherwise each full collection walks those objects
  again, pausing the event loop for tens of ms at a time: the serving path's p99.
- :data:`SWITCH_INTERVAL_S`: how long a thread holding the GIL keeps it while another
  waits. The worker's engine thread steps in Python; at CPython's 5 ms default, each
  NATS message the worker's loop wakes for can wait that long behind a step.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Young-generation threshold: CPython's 700 allocations run a collection every few requests.
GEN0_THRESHOLD = 50_000
SWITCH_INTERVAL_S = 0.0005


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop constructor when installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on :func:`loop_factory`'s loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def settle_heap() -> None:
    """Freeze what start-up left alive and make young collections rarer (module docstring)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def share_gil_quickly() -> None:
    """Hand the GIL over after :data:`SWITCH_INTERVAL_S` (a loop next to a busy thread)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
