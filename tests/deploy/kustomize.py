"""The part of ``kustomize build`` that ``deploy/k8s`` uses, in Python, for machines without it.

Supported: ``resources`` (files and folders), ``components``, ``namespace``, ``images``
(``newName``/``newTag`` on container images) and ``patches`` — a strategic-merge patch
(one document per object, matched by kind and name; lists of named items merge by name) or a
JSON 6902 patch (a list of ``add``/``replace``/``remove`` operations) applied to the objects
a ``target`` selects (kind, name, ``labelSelector`` of ``k=v`` pairs). A component adds its
resources to the kustomization that names it, and its patches and images apply to all that
kustomization holds so far (its resources and earlier components), as in kustomize. Anything
else in a kustomization raises, so the deploy files cannot silently outgrow this renderer;
the tests compare it with ``kubectl kustomize``'s renders, kept in ``tests/deploy/renders/``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "components", "images", "patches"}
COMPONENT = SUPPORTED - {"namespace"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def build(folder: Path) -> list[Obj]:
    """The objects ``kustomize build folder`` would print (in no particular order)."""
    spec = _spec(folder, SUPPORTED)
    objects: list[Obj] = []
    _accumulate(objects, folder, spec)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objects


def _spec(folder: Path, supported: set[str]) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - supported
    if unknown:
        raise NotImplementedError(f"{folder}: kustomization fields {sorted(unknown)}")
    return spec


def _accumulate(objects: list[Obj], folder: Path, spec: dict[str, Any]) -> None:
    """Add ``spec``'s resources and components to ``objects``, then apply its patches and
    images to all of them: a component's patches reach what the kustomization naming it holds
    (kustomize's rule: components/secure patches the base's Deployments)."""
    for entry in spec.get("resources", []):
        objects += _load(folder / entry)
    for entry in spec.get("components", []):
        _accumulate(objects, folder / entry, _spec(folder / entry, COMPONENT))
    for patch in spec.get("patches", []):
        _apply_patch(objects, folder, patch)
    for image in spec.get("images", []):
        _set_image(objects, image)


def _load(path: Path) -> list[Obj]:
    if path.is_dir():
        return build(path)
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _selected(obj: Obj, target: dict[str, Any]) -> bool:
    if "kind" in target and obj["kind"] != target["kind"]:
        return False
    if "name" in target and obj["metadata"]["name"] != target["name"]:
        return False
    labels = obj["metadata"].get("labels") or {}
    for pair in filter(None, target.get("labelSelector", "").split(",")):
        key, _, value = pair.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _apply_patch(objects: list[Obj], folder: Path, patch: dict[str, Any]) -> None:
    text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if len(docs) == 1 and isinstance(docs[0], list):  # JSON 6902
        targets = [o for o in objects if _selected(o, patch.get("target", {}))]
        if not targets:
            raise ValueError(f"patch {patch} selects nothing")
        for obj in targets:
            for op in docs[0]:
                _json_patch(obj, op)
        return
    for doc in docs:  # strategic merge: each document names its object
        matches = [
            o
            for o in objects
            if o["kind"] == doc["kind"] and o["metadata"]["name"] == doc["metadata"]["name"]
        ]
        if len(matches) != 1:
            raise ValueError(f"patch for {doc['kind']}/{doc['metadata']['name']}: {len(matches)}")
        _merge(matches[0], doc)


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge, simplified: maps merge, lists of named maps merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        for key, value in patch.items():
            base[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return base
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(i, dict) and "name" in i for i in base + patch):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            if item["name"] in by_name:
                _merge(by_name[item["name"]], item)
            else:
                base.append(copy.deepcopy(item))
        return base
    return copy.deepcopy(patch)


def _json_patch(obj: Obj, op: dict[str, Any]) -> None:
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if isinstance(node, list):
        if kind == "add":
            position = len(node) if last == "-" else int(last)
            node.insert(position, copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[int(last)]
        else:
            raise NotImplementedError(kind)
        return
    if kind in ("add", "replace"):
        if kind == "replace" and last not in node:
            raise KeyError(f"replace of missing {op['path']}")
        node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[last]
    else:
        raise NotImplementedError(kind)


def _set_image(objects: list[Obj], image: dict[str, str]) -> None:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                name = image.get("newName", name)
                container["image"] = (
                    f"{name}:{image.get('newTag', tag)}" if tag or "newTag" in image else name
                )
