"""Fencing tokens: telling a deposed scheduler leader's late commands from today's.

A leader stamps its commands (``Control.fence``) and breaker records (``fence``) with the
lease bucket's revision at the start of its term; revisions only rise, so a later leader's
token is higher. One cut off from NATS can still have publishes queued in its client, sent
when it gets back, after a standby took over: a receiver that has seen a higher token from
a command issued later drops them.

The issue time is what lets a token fall: a bucket made again (JetStream's storage lost)
numbers from 1, and its leader's commands, issued after everything seen, are taken and
their token adopted, rather than every command dropped for good.
"""

from __future__ import annotations


class FenceGuard:
    """The newest scheduler term a receiver has seen, and whether a message is older."""

    def __init__(self) -> None:
        self.fence = 0
        self._issued_ms = 0  # the issue time of the newest message of that term seen

    def stale(self, fence: int, issued_ms: int) -> bool:
        """Whether a message of term ``fence`` issued at ``issued_ms`` (wall ms; 0 unknown)
        comes from a leader deposed since; if not, it counts as seen."""
        if fence < self.fence and issued_ms <= self._issued_ms:
            return True
        if fence != self.fence or issued_ms > self._issued_ms:
            self.fence, self._issued_ms = fence, max(issued_ms, 0)
        return False
