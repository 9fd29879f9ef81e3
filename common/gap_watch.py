"""The watch over one stream's open gap, shared by the gateway and the NATS-native client.

Chunks travel on core NATS (at most once). A chunk lost without a reconnect or a slow
consumer leaves a gap that nothing else would fill: the worker acked its message, so no
redelivery comes. While a gap stays open, the caller asks the workers to resync every
``resync_s`` (its heartbeat's count: workers re-send what it lacks), and gives up after
``give_up_s`` with a retryable error rather than wait to the request's deadline. The clock
restarts when the gap fills (a later gap is timed from its own start) and holds still while
the caller is cut off from NATS: the resync after its reconnect fills the gap then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.sequencer import GAP_GIVE_UP_S, GAP_RESYNC_S


class GapWatch:
    """Call :meth:`update` after each chunk a stream takes, :meth:`cancel` when it ends.

    ``holding``: whether the stream holds a gap now; ``connected``: whether the caller's
    NATS link is up; ``resync``: ask the workers to re-send; ``give_up``: end the stream
    (with :func:`~common.sequencer.gap_given_up`).
    """

    __slots__ = ("_connected", "_give_up", "_holding", "_resync", "_since", "_timer",
                 "give_up_s", "resync_s")  # fmt: skip

    def __init__(
        self,
        *,
        holding: Callable[[], bool],
        connected: Callable[[], bool],
        resync: Callable[[], None],
        give_up: Callable[[], None],
        resync_s: float = GAP_RESYNC_S,
        give_up_s: float = GAP_GIVE_UP_S,
    ) -> None:
        self._holding = holding
        self._connected = connected
        self._resync = resync
        self._give_up = give_up
        self.resync_s = resync_s
        self.give_up_s = give_up_s
        self._since: float | None = None  # loop time this gap was first seen (or reconnected)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def open_since(self) -> float | None:
        """Loop time the open gap's clock started; None while no gap is open."""
        return self._since

    def update(self) -> None:
        """A gap that opened starts its clock and checks; one that filled stops both."""
        if not self._holding():
            self.cancel()
            return
        loop = asyncio.get_running_loop()
        if self._since is None:
            self._since = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(self.resync_s, self._check)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._since = None

    def _check(self) -> None:
        self._timer = None
        if not self._holding():
            self._since = None
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self._connected() or self._since is None:
            self._since = now  # cut off: the resync after the reconnect fills it
        if now - self._since >= self.give_up_s:
            self._since = None
            self._give_up()
            return
        self._resync()
        self._timer = loop.call_later(self.resync_s, self._check)
