"""``python -m gateway`` / ``qosserve-gateway``: the OpenAI-compatible front over NATS."""

from __future__ import annotations

import argparse
import logging
import sys

from common.config import load_config
from common.errors import ConfigError
from common.models import resolve_model, served_name
from common.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qosserve-gateway", description=__doc__)
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
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the config and tokenizer, then serve with uvicorn (uvloop + httptools)."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"qosserve-gateway: {exc.message}", file=sys.stderr)
        return 2
    spec = args.model or config.worker.model
    try:
        model = resolve_model(spec)
        tokenizer = load_tokenizer(model)
    except (OSError, ValueError) as exc:
        print(f"qosserve-gateway: cannot load the tokenizer of {spec!r}: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from gateway.app import create_app

    if args.served_model_name:
        config.gateway.served_model_name = args.served_model_name
    elif config.gateway.served_model_name is None:
        config.gateway.served_model_name = served_name(spec)
    app = create_app(config, tokenizer, model=model)
    uvicorn.run(
        app,
        host=args.host or config.gateway.host,
        port=args.port if args.port is not None else config.gateway.port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,  # a log line per request costs more than the request at 1k req/s
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
