"""How a benchmark hands over its result: JSON on stdout, and to ``--out`` when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(doc: dict[str, Any], out: Path | str | None) -> None:
    """Print ``doc`` as JSON; with ``out``, also replace that file whole (written aside,
    then renamed: a reader never sees half a result)."""
    text = json.dumps(doc, indent=2)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
    print(text)
