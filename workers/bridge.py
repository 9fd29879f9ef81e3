"""EngineBridge: the engine in its own thread, talking to the asyncio service by queues.

The engine (``LLMEngine`` or ``SimEngine``) is synchronous and not thread-safe, and one
step can take long enough to starve an event loop. So one thread owns it: commands (add,
abort, batch cap, arbitrary calls) go in through a thread-safe queue, and what each step
produced goes back to the loop with ``loop.call_soon_threadsafe``. An idle thread sleeps
on the queue; it never spins.

Steps can come faster than the loop takes their output (a short step, a loop busy
publishing): then the output of later steps joins the batch already on its way instead
of scheduling a call (and a loop wake-up) of its own, so the loop takes everything
produced so far in one ``on_events`` call, in order.

An exception inside ``step`` fails only the requests it can have touched (the running
batch, and any request the engine lost track of) with an ``internal_error``; the thread
logs it and keeps serving the rest. A rejected ``add`` (bad prompt, too long) comes back
as a :class:`RequestFailed` carrying the engine's error.

The batch cap (:meth:`EngineBridge.set_batch_cap`) lowers how many requests the engine
runs at once: ``LLMEngine``'s batcher (and ``SimEngine``) admit no new request while the
running batch is at the cap; requests already running above it finish normally. The cap
never exceeds the engine's configured ``max_batch_size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from common.errors import GuidedDecodingError, InternalError, InvalidRequestError, QosError
from workers.engine.outputs import ENGINE_FAILED, GUIDED_FAILED, EngineStats, RequestDelta
from workers.engine.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

T = TypeVar("T")
# A fresh stats snapshot at most this often while busy (and always when going idle).
STATS_EVERY_S = 0.05
# A step that did nothing while requests wait (dynamic batching's max_wait, no free
# blocks): look at the queue again after this long instead of spinning.
IDLE_POLL_S = 0.002
# Steps failing in a row before the engine is judged broken (a sticky device error: every
# later step raises at once). Its thread then ends, and the worker hands its requests back
# and exits 1; it had answered every request it took with a 500, faster than healthy
# replicas could take them, in a hot loop of tracebacks.
MAX_FAILED_STEPS = 3
FAILED_STEP_PAUSE_S = 0.05  # after each failed step, times the failures in a row


class _EngineBroken(Exception):
    """Raised by :meth:`EngineBridge._step` to end the engine thread."""


class StepEngine(Protocol):
    """What the bridge needs of an engine: ``LLMEngine`` and ``SimEngine`` both are one."""

    tokenizer: Any
    max_seq_len: int
    requests: dict[str, Any]

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resumed_tokens: int = 0,
        delivered_text_len: int = 0,
        cache_salt: str = "",
    ) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class RequestFailed:
    """A request the engine rejected or lost; ``error.code`` goes into the error chunk."""

    request_id: str
    error: QosError


BridgeEvent = RequestDelta | RequestFailed


@dataclass(frozen=True)
class AddRequest:
    """Everything ``add_request`` needs; ``resume_token_ids`` extend the prompt (redelivery),
    and the caller has ``resume_text_len`` characters of their text."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    resume_token_ids: tuple[int, ...] = ()
    resume_text_len: int = 0
    priority: int = 0
    arrival_time: float | None = None
    cache_salt: str = ""
    guide: Any = None  # params.guided's matcher, compiled off the engine thread


def _failed_ending(delta: RequestDelta) -> list[BridgeEvent]:
    """A request the engine ended itself with an error: its last token goes out as any
    other (with the engine's output, for its trace), then the error: a 400 when its guided
    decoding failed (the client's grammar hit the library's limits), else a 500 for this
    request alone (the engine failed on it; the exception is in the worker's log)."""
    why = str(delta.output.stop_reason or "") if delta.output is not None else ""
    error: QosError
    if why.startswith(ENGINE_FAILED):
        error = InternalError(f"{why}; it was stopped")
    else:
        error = GuidedDecodingError(why or GUIDED_FAILED, param="guided")
    return [
        replace(delta, finished=False, finish_reason=None),
        RequestFailed(delta.request_id, error),
    ]


def engine_max_batch(engine: Any) -> int:
    """The batch size an engine was built with."""
    args = getattr(engine, "args", None)
    if args is not None:
        return int(args.max_batch_size)
    return int(getattr(engine, "_engine_max_batch", engine.max_batch_size))


def apply_batch_cap(engine: Any, cap: int) -> int:
    """Cap ``engine``'s running batch at ``cap`` (clamped to [1, built size]); returns it."""
    cap = max(1, min(int(cap), engine_max_batch(engine)))
    if hasattr(engine, "set_max_batch_size"):
        engine.set_max_batch_size(cap)
    else:  # LLMEngine: its batcher checks max_batch_size before every admission
        engine.batcher.max_batch_size = cap
    return cap


def apply_group_scheduling(
    engine: Any, priority_preemption: bool, delay_factor: float, aging_s: float = 0.0
) -> None:
    """A group's batcher settings (its policy stays the engine's own): the project's engine
    has them all, the sim engine only the aging."""
    batcher = getattr(engine, "batcher", None)
    if batcher is not None:
        batcher.priority_preemption = priority_preemption
        batcher.prefill_delay_factor = delay_factor
        batcher.priority_aging_s = aging_s
    elif hasattr(engine, "priority_aging_s"):
        engine.priority_aging_s = aging_s


def running_ids(engine: Any) -> list[str]:
    """Ids of the requests in the engine's running batch."""
    if hasattr(engine, "running_ids"):
        return list(engine.running_ids())
    return [r.request_id for r in engine.batcher.running]


def encode_prompt(engine: Any, prompt: str) -> list[int]:
    """A text prompt as the engine would tokenize it in ``add_request``."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return list(tokenizer.encode(prompt))
    if hasattr(engine, "encode"):
        return list(engine.encode(prompt))
    raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids", param="prompt")


# How long stop() waits for the engine thread to finish its step.
STOP_JOIN_S = 10.0


class EngineBridge:
    """Owns the engine thread. Create and use it from the event loop's thread."""

    def __init__(
        self,
        engine: StepEngine,
        on_events: Callable[[list[BridgeEvent]], None],
        loop: asyncio.AbstractEventLoop,
        *,
        name: str = "engine",
    ) -> None:
        self.engine = engine
        self._on_events = on_events
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Set when the thread ends, under the lock call() queues under: a call is either
        # queued before the end (and failed by it) or refused.
        self._calls_lock = threading.Lock()
        self._ended = False
        # When the thread last took every command queued (time.monotonic()): an abort sent
        # before it was acted on, even if its output has not reached the loop yet.
        self.drained_at = float("-inf")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._live: set[str] = set()  # added and not finished (engine thread only)
        self._failed: set[str] = set()  # failed here: their abort deltas are swallowed
        self._failed_steps = 0  # engine steps failed in a row (MAX_FAILED_STEPS)
        self.batch_cap = engine_max_batch(engine)
        # The longest sequence the engine was built for, and the current group's limit.
        self.built_max_seq_len = int(engine.max_seq_len)
        self.seq_limit = self.built_max_seq_len
        self.stats: EngineStats = engine.stats()
        self.busy_s = 0.0  # wall time spent inside step() that did work
        # time.monotonic() when the step running now began; None between steps. Read from
        # the loop: a step that never returns is a hung device (see step_running_s).
        self._step_began: float | None = None
        self._last_stats = 0.0
        # Output handed to the loop and not taken yet; ``_handoff_lock`` guards both.
        self._outbox: list[BridgeEvent] = []
        self._handoff_pending = False
        self._handoff_lock = threading.Lock()

    # --- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def add(self, command: AddRequest) -> None:
        self._queue.put(("add", command))

    def abort(self, request_id: str) -> None:
        self._queue.put(("abort", request_id))

    def set_batch_cap(self, cap: int) -> int:
        """Cap the running batch (see the module docstring); returns the cap applied."""
        self.batch_cap = max(1, min(int(cap), engine_max_batch(self.engine)))
        self._queue.put(("cap", self.batch_cap))
        return self.batch_cap

    def set_seq_limit(self, limit: int) -> int:
        """Serve sequences of at most ``limit`` tokens (the group's ``max_seq_len``, clamped
        to what the engine was built for); returns the limit applied. Requests added after
        it see it; those running keep theirs."""
        self.seq_limit = max(2, min(int(limit), self.built_max_seq_len))
        self._queue.put(("seq_limit", self.seq_limit))
        return self.seq_limit

    def set_group_scheduling(
        self, priority_preemption: bool, delay_factor: float, aging_s: float = 0.0
    ) -> None:
        """The group's priority preemption and prefill delay, from the next step on."""
        self._queue.put(("scheduling", (priority_preemption, delay_factor, aging_s)))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; await its result.
        RuntimeError once the thread has ended (stopped, or its engine broke): nothing
        reads the queue then, and the caller waited for good."""
        future: asyncio.Future[T] = self._loop.create_future()
        with self._calls_lock:
            if self._ended:
                raise RuntimeError("the engine thread has ended")
            self._queue.put(("call", (fn, future)))
        return await future

    async def stop(self, join_s: float | None = None) -> None:
        """Stop the thread after the current step (waiting ``join_s``, default
        :data:`STOP_JOIN_S`); requests still inside are left as is."""
        if self._thread.is_alive():
            self._queue.put(("stop", None))
            # Bounded: a wedged device holds the thread forever, and the service must still
            # close its connections (the thread is a daemon: it does not keep the process).
            wait_s = STOP_JOIN_S if join_s is None else join_s
            await asyncio.to_thread(self._thread.join, wait_s)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s (a hung device?); "
                          "leaving it", wait_s)  # fmt: skip

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def step_running_s(self) -> float:
        """How long the engine's current step has run (0.0 between steps)."""
        began = self._step_began
        return 0.0 if began is None else time.monotonic() - began

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._end_calls()

    def _end_calls(self) -> None:
        """Fail the calls nobody will run now (queued behind a stop, or after the engine
        broke): their awaiters would wait for good."""
        with self._calls_lock:
            self._ended = True
            while True:
                try:
                    kind, arg = self._queue.get_nowait()
                except queue.Empty:
                    return
                if kind == "call":
                    error = RuntimeError("the engine thread has ended")
                    with contextlib.suppress(RuntimeError):  # the loop is closed already
                        self._loop.call_soon_threadsafe(_set_exception, arg[1], error)

    def _serve(self) -> None:
        engine = self.engine
        _use_engine_device(engine)
        while True:
            busy = engine.has_unfinished()
            if not busy:
                self._snapshot(force=True)
            read_at = time.monotonic()  # before a read that finds the queue empty
            try:
                # Idle: sleep on the queue until a command comes.
                item = self._queue.get() if not busy else self._queue.get_nowait()
            except queue.Empty:
                item = None
                self.drained_at = read_at
            events: list[BridgeEvent] = []
            while item is not None:
                if item[0] == "stop":
                    # Blocks copied off the device for the KV tiers reach them before the
                    # tier closes (a stop takes no further step that would hand them over).
                    flush = getattr(engine, "flush_exports", None)
                    if flush is not None:
                        flush()
                    self._snapshot(force=True)
                    return
                self._handle(item, events)
                read_at = time.monotonic()
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
                    self.drained_at = read_at
            if engine.has_unfinished():
                try:
                    self._step(events)
                except _EngineBroken:
                    self._emit(events)
                    return
            self._emit(events)

    def _handle(self, item: tuple[str, Any], events: list[BridgeEvent]) -> None:
        kind, arg = item
        try:
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "cap":
                apply_batch_cap(self.engine, arg)
            elif kind == "seq_limit":  # both engines check max_seq_len at add_request
                self.engine.max_seq_len = arg
            elif kind == "scheduling":
                apply_group_scheduling(self.engine, *arg)
            elif kind == "call":
                fn, future = arg
                try:
                    result = fn(self.engine)
                except BaseException as exc:  # SystemExit too: its awaiter must hear of it
                    self._loop.call_soon_threadsafe(_set_exception, future, exc)
                else:
                    self._loop.call_soon_threadsafe(_set_result, future, result)
        except QosError as exc:
            if kind == "add":
                events.append(RequestFailed(arg.request_id, exc))
            else:
                log.warning("engine command %s failed: %s", kind, exc)
        except SamplingParamsError as exc:  # raised by engines that re-validate
            if kind == "add":
                events.append(
                    RequestFailed(arg.request_id, InvalidRequestError(str(exc), param=exc.param))
                )
        except Exception as exc:
            log.exception("engine command %s failed", kind)
            if kind == "add":
                # The details stay in this log: an engine's exception text can name devices,
                # memory and file paths, and the message goes back to the client.
                error = InternalError(
                    f"the engine failed to take the request ({type(exc).__name__})"
                )
                events.append(RequestFailed(arg.request_id, error))

    def _add(self, cmd: AddRequest) -> None:
        # Only engines that guide take one (the sim engine refuses guided requests).
        extra = {"guide": cmd.guide} if cmd.guide is not None else {}
        if cmd.resume_token_ids:
            base = cmd.prompt_token_ids or encode_prompt(self.engine, cmd.prompt or "")
            self.engine.add_request(
                cmd.request_id, None, cmd.params,
                prompt_token_ids=[*base, *cmd.resume_token_ids],
                priority=cmd.priority, arrival_time=cmd.arrival_time,
                resumed_tokens=len(cmd.resume_token_ids),
                delivered_text_len=cmd.resume_text_len, cache_salt=cmd.cache_salt, **extra,
            )  # fmt: skip
        else:
            self.engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params,
                prompt_token_ids=cmd.prompt_token_ids if cmd.prompt is None else None,
                priority=cmd.priority, arrival_time=cmd.arrival_time,
                cache_salt=cmd.cache_salt, **extra,
            )  # fmt: skip
        self._live.add(cmd.request_id)

    def _step(self, events: list[BridgeEvent]) -> None:
        engine = self.engine
        steps_before = getattr(engine, "num_steps", None)
        started = time.perf_counter()
        self._step_began = time.monotonic()
        try:
            deltas = engine.step()
        except Exception as exc:
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                log.exception("engine step failed, %d in a row: the engine is broken; its "
                              "thread ends and its requests go back", self._failed_steps)  # fmt: skip
                raise _EngineBroken from exc
            log.exception("engine step failed; failing the requests it touched")
            self._fail_batch(exc, events)
            time.sleep(FAILED_STEP_PAUSE_S * self._failed_steps)
            return
        finally:
            self._step_began = None
        self._failed_steps = 0
        elapsed = time.perf_counter() - started
        did_work = bool(deltas) or getattr(engine, "num_steps", None) != steps_before
        if did_work:
            self.busy_s += elapsed
        for delta in deltas:
            if delta.request_id in self._failed:
                if delta.finished:
                    self._failed.discard(delta.request_id)
                continue
            if delta.finished:
                self._live.discard(delta.request_id)
            if delta.finished and delta.finish_reason == "error":
                events.extend(_failed_ending(delta))
                continue
            events.append(delta)
        self._snapshot(force=False)
        if not did_work:
            time.sleep(IDLE_POLL_S)

    def _fail_batch(self, exc: Exception, events: list[BridgeEvent]) -> None:
        engine = self.engine
        try:
            touched = set(running_ids(engine))
        except Exception:
            touched = set(self._live)
        # Requests the engine no longer holds would never finish otherwise -- but for those
        # whose ending (finished, aborted at a deadline) the next step still reports: a
        # completed answer read as a failed step.
        pending = getattr(engine, "pending_finished_ids", None)
        ending = pending() if pending is not None else set()
        touched |= {rid for rid in self._live if rid not in engine.requests}
        touched -= ending
        # The exception's text stays in the worker's log (it can name devices and paths).
        error = InternalError(
            f"the engine step failed ({type(exc).__name__}); the request was stopped"
        )
        for rid in sorted(touched):
            self._live.discard(rid)
            try:
                if engine.abort(rid):
                    self._failed.add(rid)
            except Exception:
                log.exception("abort of %s after a failed step failed too", rid)
            events.append(RequestFailed(rid, error))
        self._snapshot(force=True)

    def _snapshot(self, *, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._last_stats >= STATS_EVERY_S:
            try:
                self.stats = self.engine.stats()
            except Exception:
                log.exception("engine stats failed")
            self._last_stats = now

    def _emit(self, events: list[BridgeEvent]) -> None:
        if not events:
            return
        with self._handoff_lock:
            self._outbox.extend(events)
            if self._handoff_pending:
                return  # the loop has a delivery coming: these ride along
            self._handoff_pending = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed under us: the service is gone
            log.debug("event loop closed; dropping %d engine events", len(events))

    def _deliver(self) -> None:
        """On the loop: everything the engine produced since the last delivery."""
        with self._handoff_lock:
            events, self._outbox = self._outbox, []
            self._handoff_pending = False
        if events:
            self._on_events(events)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _use_engine_device(engine: object) -> None:
    """Make the engine's GPU current on its thread (the current device is per thread): on
    ``cuda:1`` the step's events, and kernels that launch on the current device's stream,
    went to cuda:0's while the tensors lived on cuda:1."""
    device = getattr(engine, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_device(device)
