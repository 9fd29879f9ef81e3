"""GapWatch: a gap that stays open asks for resyncs, then gives up; a fill or a cut-off
link restarts its clock."""

from __future__ import annotations

import asyncio

from common.gap_watch import GapWatch


class Stream:
    def __init__(self) -> None:
        self.holding = True
        self.connected = True
        self.resyncs = 0
        self.given_up = asyncio.Event()

    def watch(self, give_up_s: float = 0.3) -> GapWatch:
        def resync() -> None:
            self.resyncs += 1

        return GapWatch(
            holding=lambda: self.holding, connected=lambda: self.connected, resync=resync,
            give_up=self.given_up.set, resync_s=0.05, give_up_s=give_up_s,
        )  # fmt: skip


async def test_a_gap_left_open_asks_for_resyncs_then_gives_up() -> None:
    s = Stream()
    watch = s.watch()
    watch.update()
    await asyncio.wait_for(s.given_up.wait(), 5)
    assert s.resyncs >= 2  # asked again while it stayed open, before giving up


async def test_a_filled_gap_ends_the_watch_and_a_later_one_is_timed_afresh() -> None:
    s = Stream()
    watch = s.watch(give_up_s=1.0)  # 0.7 s of margin: a stalled loop must not give up early
    loop = asyncio.get_running_loop()
    watch.update()
    await asyncio.sleep(0.3)
    s.holding = False  # filled
    watch.update()
    asked = s.resyncs
    await asyncio.sleep(0.3)
    assert s.resyncs == asked and not s.given_up.is_set()
    s.holding = True  # a new gap: its own 1 s, not what is left of the first
    opened = loop.time()
    watch.update()
    await asyncio.wait_for(s.given_up.wait(), 5)
    assert loop.time() - opened >= 1.0


async def test_the_clock_holds_still_while_cut_off() -> None:
    s = Stream()
    s.connected = False
    watch = s.watch(give_up_s=0.2)
    watch.update()
    await asyncio.sleep(0.6)  # three times the give-up, all of it cut off
    assert not s.given_up.is_set()
    s.connected = True
    await asyncio.wait_for(s.given_up.wait(), 5)
    watch.cancel()


async def test_cancel_stops_it() -> None:
    s = Stream()
    watch = s.watch(give_up_s=0.1)
    watch.update()
    watch.cancel()
    await asyncio.sleep(0.3)
    assert s.resyncs == 0 and not s.given_up.is_set()
