"""Where model specs point: ``demo`` is the small checkpoint that ships with qosserve."""

from __future__ import annotations

from pathlib import Path

from common.errors import ConfigError
from common.model_specs import hf_config

DEMO_MODEL_NAME = "pystd-tiny"


def demo_model_path() -> Path:
    """The trained demo checkpoint (``bench/models/pystd-tiny``, see ``bench/train_tiny.py``)."""
    return Path(__file__).resolve().parent.parent / "bench" / "models" / DEMO_MODEL_NAME


def resolve_model(spec: str) -> str:
    """``demo`` → the shipped checkpoint's folder; anything else is returned unchanged. A
    folder that does not exist is a ConfigError at once: the launcher used to start the
    whole stack before a worker said so."""
    if spec == "demo":
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the demo model is missing at {path}; run `python -m bench.train_tiny` to build it"
            )
        return str(path)
    if not spec.startswith("dummy:") and not Path(spec).is_dir():
        raise ConfigError(f"model {spec!r}: no such folder (a Hugging Face model folder, "
                          "dummy:<shape>, or 'demo')")  # fmt: skip
    return spec


def check_model_folder(spec: str) -> None:
    """A worker's model: a known dummy spec, or a folder whose ``config.json`` the engine
    can serve (a gateway needs only the tokenizer's files); ConfigError otherwise, before
    anything starts."""
    hf_config(resolve_model(spec))


def served_name(spec: str) -> str:
    """The model name clients use: ``demo`` → ``pystd-tiny``, a folder → its name."""
    if spec == "demo":
        return DEMO_MODEL_NAME
    if spec.startswith("dummy:"):
        return spec
    return Path(spec).name or spec


def configured_served_name(served_model_name: str | None, worker_model: str) -> str:
    """The name a worker's metrics and telemetry carry: the gateway's
    (``gateway.served_model_name``, else :func:`served_name` of ``worker.model``), so the
    series of both join on the ``model`` label."""
    return served_model_name or served_name(worker_model)
