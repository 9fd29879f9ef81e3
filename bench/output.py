"""How a benchmark hands over its result: JSON on stdout, and to ``--out`` when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | str, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole with ``doc`` as JSON (see :func:`_replace`)."""
    _replace(Path(path), json.dumps(doc, indent=2))


def emit(doc: dict[str, Any], out: Path | str | None) -> None:
    """Print ``doc`` as JSON; with ``out``, also replace that file whole with it."""
    text = json.dumps(doc, indent=2)
    if out:
        _replace(Path(out), text)
    print(text)


def _replace(path: Path, text: str) -> None:
    """Written aside, then renamed: a reader never sees half a result, and a run that
    rewrites its file as it goes leaves the last whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
