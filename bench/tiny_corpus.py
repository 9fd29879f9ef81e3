"""The demo model's training text (``bench/train_tiny.py``): the stdlib's own sources, cut at
top-level statements into short documents, and the ``pydoc`` topic help texts."""

from __future__ import annotations

import ast
import itertools
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Packages whose modules join the top-level Lib/*.py files (code corpus and Q/A).
EXTRA_PACKAGES = [
    "collections",
    "concurrent/futures",
    "html",
    "http",
    "json",
    "logging",
    "re",
    "urllib",
]

# Data tables and build artefacts, not code anyone writes: they would only teach the model to
# emit entity or config tables.
SKIP_MODULES = ("html.entities", "_sysconfigdata", "this", "antigravity")


@dataclass(frozen=True)
class SourceFile:
    """One stdlib module: dotted name, path relative to the stdlib root, text, parsed tree."""

    module: str
    relpath: str
    text: str
    tree: ast.Module | None


def stdlib_root() -> Path:
    """The running interpreter's ``Lib`` directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_sources(root: Path) -> list[SourceFile]:
    """Read ``Lib/*.py`` and ``EXTRA_PACKAGES`` in sorted (deterministic) order."""
    paths = sorted(root.glob("*.py"))
    for pkg in EXTRA_PACKAGES:
        paths += sorted((root / pkg).glob("*.py"))
    files = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        parts = rel[: -len(".py")].split("/")
        if parts[-1] == "__init__":
            parts.pop()
        if ".".join(parts).startswith(SKIP_MODULES):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree: ast.Module | None = ast.parse(text)
        except SyntaxError:  # a file for another Python version: still good text
            tree = None
        files.append(SourceFile(".".join(parts), rel, text, tree))
    return files


def _block_starts(nodes: list[ast.stmt], lines: list[str]) -> list[int]:
    """0-based first lines of the def/class blocks among ``nodes``, decorators and comments
    just above included."""
    starts = []
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            while first > 0 and lines[first - 1].lstrip().startswith("#"):
                first -= 1
            starts.append(first)
    return starts


def _cut(lines: list[str], cuts: list[int]) -> list[str]:
    """Join ``lines`` between successive cut points into non-blank documents."""
    docs = ["".join(lines[a:b]).strip("\n") + "\n" for a, b in itertools.pairwise(cuts)]
    return [d for d in docs if d.strip()]


def split_top_level(src: SourceFile, max_chars: int) -> list[str]:
    """Split a module into documents: docstring, header (imports, constants), each def/class.

    Why: every training window starts at a document start, right after ``<|bos|>``, which is
    exactly what a prompt such as ``class `` or ``import os`` looks like at serving time.  A
    class longer than ``max_chars`` is split further at its methods (indented, as in the file),
    so short methods such as ``__init__``/``__repr__`` are still seen.
    """
    if src.tree is None:
        return [src.text]
    lines = src.text.splitlines(keepends=True)
    body = src.tree.body
    cuts = [0]
    head = body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        cuts.append(body[0].end_lineno or 0)  # the module docstring is a document of prose
        head = body[1:]
    # The leading imports are a document of their own: what follows an ``import os`` prompt.
    n_imports = 0
    while n_imports < len(head) and isinstance(head[n_imports], ast.Import | ast.ImportFrom):
        n_imports += 1
    if 0 < n_imports < len(head):
        cuts.append(head[n_imports].lineno - 1)
    cuts += [c for c in _block_starts(body, lines) if c > cuts[-1]]
    cuts.append(len(lines))
    docs = []
    for a, b in itertools.pairwise(sorted(set(cuts))):
        block = "".join(lines[a:b])
        cls = next(
            (n for n in body if isinstance(n, ast.ClassDef) and a < n.lineno <= b),
            None,
        )
        if len(block) > max_chars and cls is not None:
            inner = [c for c in _block_starts(cls.body, lines) if a < c < b]
            docs += _cut(lines, [a, *inner, b])
        else:
            docs += _cut(lines, [a, b])
    return docs


def select_code_docs(files: Sequence[SourceFile], max_chars: int, count: int) -> list[str]:
    """The code corpus: short documents, all import blocks, an even spread of everything else.

    Why so small: ten minutes of 2-core CPU are ~1M training tokens.  A corpus of a few tens of
    thousands of tokens is then seen 10+ times, so the model reproduces real stdlib idioms with
    high confidence instead of mixing half-learned fragments.  The stride keeps every part of
    the stdlib (file order) represented; the choice depends on the stdlib text alone.
    """
    docs = [d for f in files for d in split_top_level(f, max_chars) if len(d) <= max_chars]
    imports = [d for d in docs if d.startswith(("import ", "from "))]
    others = [d for d in docs if not d.startswith(("import ", "from "))]
    want = max(0, min(len(others), count - len(imports)))
    picked = {round(i * len(others) / want) for i in range(want)} if want else set()
    keep = set(imports) | {others[i] for i in picked}
    seen: set[str] = set()
    out = []
    for d in docs:  # file order, each text once
        if d in keep and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def topic_docs(max_chars: int) -> list[str]:
    """The interactive-help topics (``help('FORMATTING')``) that ship in ``pydoc_data``.

    Each is cut to its leading paragraphs within ``max_chars``, like the code documents.
    """
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        text = f"Help on {name}:\n\n{topics[name].strip()}\n"
        if len(text) > max_chars:
            cut = text.rfind("\n\n", 0, max_chars)
            text = text[: cut if cut > 0 else max_chars].rstrip() + "\n"
        docs.append(text)
    return docs
