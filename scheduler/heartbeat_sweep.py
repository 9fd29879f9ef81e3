"""Heartbeat keys of workers long gone, out of the state bucket.

A worker writes ``workers.<id>`` about every second and purges it when it stops cleanly.
Ids are host-pid, so a worker that was killed (OOM, a lost node) left its key for good,
and a clean stop left a purge marker: each a subject in the bucket's stream, which the
scrape-targets tool reads one by one on every pass (after thousands of restarts, thousands
of round trips a pass). The leader now and then removes every heartbeat subject whose
latest value is a marker or older than ``stale_s``.
"""

from __future__ import annotations

import json
import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from common.nats import heartbeat_keys

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 300.0
STALE_AFTER_S = 600.0  # a heartbeat this old: its worker is gone (they beat every second)


async def sweep_heartbeats(
    js: JetStreamContext, kv: KeyValue, bucket: str, stale_s: float, now_ms: float
) -> list[str]:
    """Remove the heartbeat subjects of workers gone (stale, or only a marker left); returns
    their keys. A value that is not a heartbeat is left alone."""
    removed = []
    for key in await heartbeat_keys(js, bucket):
        try:
            entry = await kv.get(key)
            beat = json.loads(entry.value or b"{}")
            gone = now_ms - float(beat["ts_ms"]) > stale_s * 1000
        except nats.js.errors.KeyNotFoundError:  # deleted or purged: only a marker is left
            gone = True
        except (ValueError, KeyError, TypeError):
            continue  # not a heartbeat: not ours to remove
        if gone:
            await js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
            removed.append(key)
    if removed:
        log.info("removed %d heartbeat keys of workers gone: %s", len(removed),
                 ", ".join(removed[:10]) + (" ..." if len(removed) > 10 else ""))  # fmt: skip
    return removed
