"""``python -m gateway`` / ``qosserve-gateway``: the OpenAI-compatible front over NATS.

Logs: ``--log-format text|json``, ``--log-level``, ``--no-access-log`` (else ``log.*``).
Traces: the standard ``OTEL_*`` variables (:mod:`common.tracing`); off when unset.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from common import runtime
from common.config import Config, load_config, with_settings
from common.errors import ConfigError
from common.logging import add_log_flags, log_config_from, setup_logging
from common.models import resolve_model, served_name
from common.services import port_in_use
from common.tokenizer import load_tokenizer
from common.tracing import init_tracing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qosserve gateway", description=__doc__)
    parser.add_argument("--config", help="YAML config file (default: $QOS_CONFIG, else defaults)")
    parser.add_argument(
        "--model",
        default=None,
        help="model folder (its tokenizer and chat template) or dummy:<shape>; "
        "default: worker.model from the config",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model name clients send (default: gateway.served_model_name, else the "
        "model folder's name)",
    )
    parser.add_argument("--host", help="listen address (default: gateway.host)")
    parser.add_argument("--port", type=int, help="listen port (default: gateway.port)")
    add_log_flags(parser)
    parser.add_argument(
        "--no-access-log", action="store_true", help="no line per HTTP request (log.access_log)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the config and tokenizer, then serve with uvicorn (uvloop + httptools)."""
    args = parse_args(argv)
    try:
        listen = {"host": args.host} if args.host else {}
        if args.port is not None:
            listen["port"] = args.port
        config = with_settings(load_config(args.config), "flags", gateway=listen)
        config.log = log_config_from(config.log, args)
        if args.no_access_log:
            config.log.access_log = False
        setup_logging("gateway", config.log)
        init_tracing("qosserve-gateway")
        # Before NATS: uvicorn binds only after the app's start-up, then exits 3.
        if port_in_use(config.gateway.host, config.gateway.port):
            raise ConfigError(
                f"port {config.gateway.port} on {config.gateway.host} is in use; stop what "
                "listens there or pass --port"
            )
    except (ConfigError, ValueError) as exc:
        print(f"qosserve-gateway: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    spec = args.model or config.worker.model
    try:
        model = resolve_model(spec)
        tokenizer = load_tokenizer(model)
    except (OSError, ValueError, ConfigError) as exc:
        print(f"qosserve-gateway: cannot load the tokenizer of {spec!r}: {exc}", file=sys.stderr)
        return 2

    try:
        asyncio.run(_reach_nats(config))
    except ConnectionError as exc:  # one line, as the worker and scheduler say it
        print(f"qosserve-gateway: {exc}", file=sys.stderr)
        return 1

    from gateway.app import create_app
    from gateway.server import GatewayServer, uvicorn_config

    if args.served_model_name:
        config.gateway.served_model_name = args.served_model_name
    elif config.gateway.served_model_name is None:
        config.gateway.served_model_name = served_name(spec)
    app = create_app(config, tokenizer, model=model)
    runtime.settle_heap()  # tokenizer, app and schemas stay; uvicorn brings uvloop
    server = GatewayServer(uvicorn_config(app, config), app.state.gateway.dispatch)
    server.run()
    return server.exit_code


async def _reach_nats(config: Config) -> None:
    """Connect once and close: NATS unreachable (or credentials refused) is then one clear
    line before uvicorn starts, not a traceback from the app's startup hook."""
    from common.nats import connect

    nc = await connect(config.nats, "qosserve-gateway-probe", service="gateway")
    await nc.close()


if __name__ == "__main__":
    sys.exit(main())
