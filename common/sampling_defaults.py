"""A model's recommended sampling settings, from its ``generation_config.json``.

Instruct models ship the settings they were tuned for (Qwen2.5: temperature 0.7, top_p
0.8, top_k 20, repetition_penalty 1.05; Llama 3.1: 0.6 / 0.9). ``transformers.generate``
starts from them, and so does vLLM's OpenAI server (``--generation-config auto``): a request
that leaves a field out gets the model's value, not OpenAI's neutral one. The gateway does
the same unless ``gateway.sampling_defaults`` is ``openai``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values for fields a request leaves out; None: OpenAI's (no change to the logits)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def given(self) -> dict[str, float]:
        """The fields the model sets, for a log line."""
        return {k: v for k, v in asdict(self).items() if v is not None}


# Each field's valid range (as the request body checks it): a value outside is ignored,
# with a warning, rather than sent to every worker to refuse.
_CHECKS = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v == int(v) and -1 <= v < 2**31,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
}


def load_sampling_defaults(model: str | Path | None) -> SamplingDefaults:
    """The sampling fields of ``<model>/generation_config.json``; none for a ``dummy:``
    spec, a folder without the file, or one that cannot be read (logged)."""
    if model is None:
        return SamplingDefaults()
    path = Path(model) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); no sampling defaults from it", path, exc)
        return SamplingDefaults()
    if not isinstance(data, dict):
        log.warning("%s: not a JSON object; no sampling defaults from it", path)
        return SamplingDefaults()
    fields: dict[str, float | int] = {}
    for name, valid in _CHECKS.items():
        value = data.get(name)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not valid(value):
            log.warning("%s: %s=%r is not a valid value; ignored", path, name, value)
            continue
        fields[name] = int(value) if name == "top_k" else float(value)
    return SamplingDefaults(**fields)  # type: ignore[arg-type]
