"""``qosserve provision``: create (or check) the JetStream objects, once, as an admin.

The request stream, one consumer per instance group and the state bucket. Every service
makes sure they exist at start, and on an open NATS server the first one up creates them.
Under ``deploy/nats/permissions.conf`` no service may: whoever may create or update a
consumer on the request stream may read every prompt through one of its own, or cap,
park or seal a group's queue. Only the ``qos-admin`` user may, and this command, run as it
(a Kubernetes Job, or by hand), is what uses it; the services wait for the objects.

Examples::

    QOS_NATS__USER=qos-admin QOS_NATS__PASSWORD=... qosserve provision --config my.yaml
    qosserve provision --nats-url nats://127.0.0.1:4222   # an open server

Exits 0 once everything exists with the settings of the configuration (what can change
in place is updated), 2 for a configuration or permission problem, 1 when NATS cannot be
reached.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from common.config import Config, load_config, with_settings
from common.errors import ConfigError
from common.nats import connect, ensure_jetstream


async def provision(config: Config, wait_s: float = 0.0) -> list[str]:
    """Create or check the stream, the groups' consumers and the bucket; what exists now.
    ``wait_s``: how long to wait for objects this user may not create (0: not at all)."""
    nc = await connect(config.nats, "qosserve-provision", service="admin")
    try:
        js = nc.jetstream()
        # Strict: a change it could not make is its failure (a service leaves it as is).
        try:
            stream, consumers, kv = await ensure_jetstream(
                js, config.nats, config.groups, wait_s=wait_s, strict=True
            )
        except TimeoutError:
            raise ConfigError(
                f"JetStream did not answer user {config.nats.user or '(none)'}: run as "
                "qos-admin under deploy/nats/permissions.conf (replies come on _INBOX_admin)"
            ) from None
        status = await kv.status()
        return [
            f"stream {stream.config.name} ({', '.join(stream.config.subjects or [])})",
            *(f"consumer {c.name} ({group})" for group, c in consumers.items()),
            f"KV bucket {status.bucket}",
        ]
    finally:
        await nc.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qosserve provision", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config file (else $QOS_CONFIG, else defaults)")
    p.add_argument("--nats-url", help="overrides nats.url")
    args = p.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.nats_url:
            config = with_settings(config, "flags", nats={"url": args.nats_url})
        made = asyncio.run(provision(config))
    except ConfigError as exc:
        print(f"qosserve provision: {exc.message}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError) as exc:
        print(f"qosserve provision: {exc}", file=sys.stderr)
        return 1
    for line in made:
        print(f"ok: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
