"""Breaker alerts: one structured JSON log line each, and an optional webhook POST.

The log line (logger ``scheduler.alerts``, WARNING when a breaker opens, INFO otherwise) is
``{"event": "breaker_transition", "group", "from", "to", "reason", "fallback",
"batch_cap", "ts_ms", "scheduler"}``; the webhook gets the same JSON body. The POST runs
with :mod:`urllib` in a daemon thread with a short timeout, so a slow or dead receiver
never delays the scheduler's tick; a failure is logged and dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from scheduler.records import BreakerRecord

log = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_S = 5.0


@dataclass(eq=False)
class QueuedAlert:
    """A breaker transition's alert, waiting for its ``record`` to be stored. One object
    wherever it is queued, so it is sent once whichever path confirms it first."""

    record: BreakerRecord
    event: dict[str, Any]
    sent: bool = False


class Alerter:
    """Emits alerts; ``webhook_url`` None = log only."""

    def __init__(self, webhook_url: str | None = None) -> None:
        self.webhook_url = webhook_url

    def breaker(self, event: dict[str, Any]) -> None:
        """Log ``event`` (a breaker transition) and post it to the webhook."""
        body = {"event": "breaker_transition", **event}
        line = json.dumps(body, separators=(",", ":"), sort_keys=True)
        log.log(logging.WARNING if body.get("to") == "open" else logging.INFO, line)
        if self.webhook_url:
            threading.Thread(
                target=_post, args=(self.webhook_url, line.encode()), daemon=True,
                name="alert-webhook",
            ).start()  # fmt: skip


def _post(url: str, data: bytes) -> None:
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
            response.read()
    except Exception as exc:
        # The host and the error's kind only: a webhook's path is often its secret
        # (Slack-style URLs), and urllib's messages quote the URL's parts (a password in
        # "user:pw@host" read as a non-numeric port).
        log.warning("alert webhook on %s failed: %s", urlsplit(url).hostname, type(exc).__name__)
