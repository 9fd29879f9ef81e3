"""``kubectl kustomize``'s renders of deploy/k8s, kept as files, so the Python renderer
(:mod:`tests.deploy.kustomize`) is checked against kubectl on every machine, kubectl or not.

Where kubectl is installed, the tests also render with it and compare with these files, so
a change under deploy/k8s that is not re-rendered here fails. To refresh::

    python -m tests.deploy.renders
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
HERE = Path(__file__).resolve().parent / "renders"
OVERLAYS = ("cpu-demo", "gpu")
RENDERS = (*OVERLAYS, "hpa")  # hpa: base + components/hpa, the documented KEDA alternative
SECURE = tuple(f"{name}-secure" for name in RENDERS)  # each with components/secure added

Obj = dict[str, Any]


def write_hpa_overlay(folder: Path, k8s: Path = K8S) -> Path:
    """A kustomization in ``folder``: base + components/hpa of ``k8s`` (kustomize takes
    relative paths)."""
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "qosserve",
        "resources": [os.path.relpath(k8s / "base", folder)],
        "components": [os.path.relpath(k8s / "components" / "hpa", folder)],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return folder


def write_secure_overlays(folder: Path) -> dict[str, Path]:
    """A copy of deploy/k8s in ``folder`` with ``../../components/secure`` added to the
    components of each overlay and of an hpa one, as deploy/k8s/README.md says to:
    {name in :data:`SECURE`: its kustomization folder}."""
    copy = folder / "deploy" / "k8s"
    shutil.copytree(K8S, copy)
    hpa = copy / "overlays" / "hpa"
    hpa.mkdir()
    write_hpa_overlay(hpa, copy)
    out = {}
    for name in RENDERS:
        path = copy / "overlays" / name / "kustomization.yaml"
        spec = yaml.safe_load(path.read_text())
        spec["components"].append("../../components/secure")
        path.write_text(yaml.safe_dump(spec))
        out[f"{name}-secure"] = path.parent
    return out


def kubectl_render(folder: Path) -> list[Obj] | None:
    """``kubectl kustomize folder``'s objects, or None without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True, timeout=60
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def ordered(objects: list[Obj]) -> list[Obj]:
    """Objects in a fixed order (kind, name): renderers need not agree on one."""
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))


def load(name: str) -> list[Obj]:
    """The kept render ``name`` (one of :data:`RENDERS` or :data:`SECURE`)."""
    return [d for d in yaml.safe_load_all((HERE / f"{name}.yaml").read_text()) if d]


def refresh() -> None:
    """Render every overlay with kubectl into :data:`HERE`."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: K8S / "overlays" / name for name in OVERLAYS}
        folders["hpa"] = write_hpa_overlay(Path(tmp))
        folders |= write_secure_overlays(Path(tmp))
        for name, folder in folders.items():
            objects = kubectl_render(folder)
            if objects is None:
                sys.exit("kubectl is not installed: the renders are kubectl's, by definition")
            text = yaml.safe_dump_all(ordered(objects), sort_keys=True)
            (HERE / f"{name}.yaml").write_text(text)
            print(f"{HERE / name}.yaml: {len(objects)} objects")


if __name__ == "__main__":
    refresh()
