"""No asyncio.wait_for in the services' code: on Python 3.11 (supported) it can return a
result and swallow a cancellation that came with it. A NATS client's timeout then never
fired and no abort reached the worker; a gateway handler ran on after its client left; a
drain's wait loop ignored its stop. ``async with asyncio.timeout(...)`` has no such race
(a cancelled ``Queue.get`` leaves its item in the queue)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "gateway", "workers", "scheduler", "kvstore")


def _wait_for_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "wait_for"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "asyncio"
    ]


def test_the_services_wait_with_asyncio_timeout_not_wait_for() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (lines := _wait_for_calls(path))
    }
    assert found == {}, f"asyncio.wait_for at {found}: use async with asyncio.timeout()"


def test_the_scan_sees_a_wait_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\nasync def f(q):\n    await asyncio.wait_for(q.get(), 1)\n")
    assert _wait_for_calls(sample) == [3]
