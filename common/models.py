"""Where model specs point: ``demo`` is the small checkpoint that ships with qosserve."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "pystd-tiny"


def demo_model_path() -> Path:
    """The trained demo checkpoint (``bench/models/pystd-tiny``, see ``bench/train_tiny.py``)."""
    return Path(__file__).resolve().parent.parent / "bench" / "models" / DEMO_MODEL_NAME


def resolve_model(spec: str) -> str:
    """``demo`` → the shipped checkpoint's folder; anything else is returned unchanged."""
    if spec == "demo":
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the demo model is missing at {path}; run `python -m bench.train_tiny` to build it"
            )
        return str(path)
    return spec


def served_name(spec: str) -> str:
    """The model name clients use: ``demo`` → ``pystd-tiny``, a folder → its name."""
    if spec == "demo":
        return DEMO_MODEL_NAME
    if spec.startswith("dummy:"):
        return spec
    return Path(spec).name or spec
