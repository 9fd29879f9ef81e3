"""``python -m workers.scrape_targets``: Prometheus file-SD targets from the workers' heartbeats.

Workers pick a free ``/metrics`` port by default (``worker.metrics_port: 0``), so no static
scrape config can name them; each one puts ``host`` and ``metrics_port`` in its heartbeat
(``workers.<id>`` in the state bucket). This writes them as a ``file_sd_configs`` file,
labelled with ``group`` and ``worker``, and rewrites it every ``--interval-s`` (0 = once)::

    python -m workers.scrape_targets --out /etc/prometheus/targets/workers.json --interval-s 15

Stopped workers, silent ones (no heartbeat for ``--max-age-s``) and workers without a port
are left out. The file is replaced atomically, so Prometheus never reads half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from common.config import load_config
from common.errors import ConfigError
from common.nats import connect, ensure_kv, heartbeat_keys

log = logging.getLogger(__name__)


async def scrape_targets(
    js: JetStreamContext, bucket: str, max_age_s: float = 30.0
) -> list[dict[str, Any]]:
    """One file-SD entry per live worker with a ``/metrics`` port, sorted by worker id.

    The heartbeat keys come from the bucket's stream (its subjects under ``workers.``), one
    API call, rather than ``KeyValue.keys()``, whose watcher could end its listing empty on a
    loaded server and blank every target until the next rewrite.
    """
    kv = await js.key_value(bucket)
    keys = await heartbeat_keys(js, bucket)
    now_ms = time.time() * 1000
    found = []
    for key in keys:
        try:
            entry = await kv.get(key)
            beat = json.loads(entry.value or b"{}")
            # A value of another shape (another release's, a hand-written one) is skipped,
            # not the end of the process: one bad heartbeat froze every target.
            port = int(beat.get("metrics_port") or 0)
            fresh = now_ms - float(beat.get("ts_ms", 0)) <= max_age_s * 1000
            worker, host = str(beat["worker"]), beat.get("host")
        except (nats.js.errors.KeyNotFoundError, ValueError, TypeError, KeyError, AttributeError):
            continue  # gone (deleted), or not a heartbeat: nothing to scrape
        if port and fresh and beat.get("state") != "stopped" and host:
            found.append(
                {
                    "targets": [f"{host}:{port}"],
                    "labels": {"group": str(beat.get("group", "")), "worker": worker},
                }
            )
    return found


def write_atomically(path: Path, targets: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``targets`` as JSON in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(targets, indent=2) + "\n")
    tmp.replace(path)


async def run(config_path: str | None, out: Path, interval_s: float, max_age_s: float) -> None:
    config = load_config(config_path)
    nc = await connect(config.nats, "qosserve-scrape-targets", service="scheduler")
    try:
        js = nc.jetstream()
        await ensure_kv(js, config.nats)
        while True:
            try:
                targets = await scrape_targets(js, config.nats.kv_bucket, max_age_s)
            except Exception as exc:  # a timeout on a loaded server: the next round retries
                if interval_s <= 0:
                    raise
                log.warning("reading the heartbeats failed (%s); the targets file stays", exc)
            else:
                write_atomically(out, targets)
                log.info("%d worker targets written to %s", len(targets), out)
            if interval_s <= 0:
                return
            await asyncio.sleep(interval_s)
    finally:
        await nc.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.scrape_targets", description=__doc__)
    p.add_argument("--config", help="YAML config file (else $QOS_CONFIG, else defaults)")
    p.add_argument("--out", type=Path, required=True, help="file_sd JSON file to write")
    p.add_argument("--interval-s", type=float, default=0.0, help="rewrite period (0 = once)")
    p.add_argument("--max-age-s", type=float, default=30.0, help="heartbeats older are left out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # A container's stop is SIGTERM, to PID 1, which has no default action there: as Ctrl-C,
    # it ends the loop at once (else docker waits its 10 s and kills it).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(run(args.config, args.out, args.interval_s, args.max_age_s))
    except ConfigError as exc:
        print(f"scrape_targets: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
