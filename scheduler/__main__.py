"""``python -m scheduler`` / ``qosserve-scheduler``: run one scheduler replica.

Examples::

    qosserve-scheduler --config my-config.yaml   # any YAML of common.config's keys
    qosserve-scheduler --nats-url nats://nats:4222 --metrics-port 9300

Configuration comes from ``--config`` / ``QOS_CONFIG`` and ``QOS_*`` variables
(:mod:`common.config`, keys ``scheduler.*`` and ``groups.<g>.breaker.*``); flags override
the keys they name. Several replicas may run: one holds the lease and acts, the others
watch. SIGTERM or SIGINT hands the lease over and exits 0; the breaker state stays in the
bucket for the gateways and the next scheduler.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from common import runtime
from common.config import Config, load_config, with_settings
from common.errors import ConfigError
from common.lifecycle import run_until_signalled
from common.logging import add_log_flags, log_config_from, setup_logging
from scheduler.service import SchedulerService


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qosserve scheduler", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config file (else $QOS_CONFIG, else defaults)")
    p.add_argument("--nats-url", help="overrides nats.url")
    p.add_argument("--metrics-port", type=int, help="overrides scheduler.metrics_port (0 = off)")
    p.add_argument("--scheduler-id", help="this replica's name (default sched-<host>-<pid>-…)")
    add_log_flags(p)
    return p


def _apply_flags(config: Config, args: argparse.Namespace) -> Config:
    nats = {"url": args.nats_url} if args.nats_url else {}
    scheduler = {} if args.metrics_port is None else {"metrics_port": args.metrics_port}
    return with_settings(config, "flags", nats=nats, scheduler=scheduler)


async def serve(config: Config, scheduler_id: str | None) -> int:
    service = SchedulerService(config, scheduler_id=scheduler_id)
    return await run_until_signalled(service)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qosserve-scheduler`` and ``python -m scheduler``."""
    args = build_parser().parse_args(argv)
    try:
        config = _apply_flags(load_config(args.config), args)
        config.log = log_config_from(config.log, args)
        setup_logging("scheduler", config.log)
        if args.scheduler_id is not None and not re.fullmatch(
            r"[A-Za-z0-9_-]{1,128}", args.scheduler_id
        ):
            raise ConfigError(f"--scheduler-id {args.scheduler_id!r}: use [A-Za-z0-9_-]{{1,128}}")
        runtime.settle_heap()
        return runtime.run(serve(config, args.scheduler_id))
    except ConfigError as exc:
        print(f"qosserve-scheduler: {exc.message}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"qosserve-scheduler: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
