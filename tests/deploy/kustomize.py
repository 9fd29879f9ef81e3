"""The part of ``kustomize build`` that ``deploy/k8s`` uses, in Python, for machines without it.

Supported: ``resources`` (files and folders), ``components``, ``namespace``, ``images``
(``newName``/``newTag`` on container images), ``configMapGenerator`` (``files`` and
``literals``, ``options.labels``/``annotations``, ``behavior`` create, merge or replace;
the name gets kustomize's content hash and the pod templates' references to it follow) and
``patches`` — a strategic-merge patch
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
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "components", "images", "patches"}
SUPPORTED.add("configMapGenerator")
GENERATOR = {"name", "files", "literals", "options", "behavior"}
GENERATOR_OPTIONS = {"labels", "annotations"}
_GENERATED = "__generated__"  # marks a generated ConfigMap until its name is hashed
COMPONENT = SUPPORTED - {"namespace"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def build(folder: Path) -> list[Obj]:
    """The objects ``kustomize build folder`` would print (in no particular order)."""
    return _hash_generated(_build(folder))


def _build(folder: Path) -> list[Obj]:
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
    for generator in spec.get("configMapGenerator", []):
        _generate(objects, folder, generator)
    for patch in spec.get("patches", []):
        _apply_patch(objects, folder, patch)
    for image in spec.get("images", []):
        _set_image(objects, image)


def _load(path: Path) -> list[Obj]:
    if path.is_dir():
        return _build(path)
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


def _generate(objects: list[Obj], folder: Path, generator: dict[str, Any]) -> None:
    """A ``configMapGenerator`` entry: a new ConfigMap, or (``behavior`` merge or replace)
    new data for the one of that name a base generated."""
    unknown = set(generator) - GENERATOR
    unknown |= {f"options.{k}" for k in set(generator.get("options", {})) - GENERATOR_OPTIONS}
    if unknown:
        raise NotImplementedError(f"{folder}: configMapGenerator fields {sorted(unknown)}")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (folder / path).read_text()
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    options = generator.get("options", {})
    behavior = generator.get("behavior", "create")
    name = generator["name"]
    existing = [o for o in objects if o.get(_GENERATED) and o["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise ValueError(f"{folder}: configMapGenerator {name} exists (behavior: merge?)")
        metadata: Obj = {"name": name}
        for field in ("labels", "annotations"):
            if options.get(field):
                metadata[field] = dict(options[field])
        objects.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data,
             _GENERATED: True}
        )  # fmt: skip
        return
    if behavior not in ("merge", "replace") or len(existing) != 1:
        raise ValueError(f"{folder}: configMapGenerator {name}: behavior {behavior}")
    (cm,) = existing
    cm["data"] = {**cm["data"], **data} if behavior == "merge" else data
    for field in ("labels", "annotations"):
        if options.get(field):
            cm["metadata"][field] = {**cm["metadata"].get(field, {}), **options[field]}


def _content_hash(data: dict[str, str]) -> str:
    """kustomize's suffix (api/hasher): the first 10 hex digits of the SHA-256 of the
    ConfigMap's JSON (Go's encoding: sorted keys, HTML characters escaped), with 0 1 3 a e
    spelled g h k m t. Its name is read from a path that is never there: always ""."""
    text = json.dumps(
        {"data": data, "kind": "ConfigMap", "name": ""},
        sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    )  # fmt: skip
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        text = text.replace(char, escaped)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _hash_generated(objects: list[Obj]) -> list[Obj]:
    """Suffix each generated ConfigMap's name with its content hash and point the pod
    templates' references (volumes, envFrom, configMapKeyRef) at the new name."""
    renamed: dict[tuple[str | None, str], str] = {}
    for obj in objects:
        if obj.pop(_GENERATED, False):
            meta = obj["metadata"]
            new = f"{meta['name']}-{_content_hash(obj['data'])}"
            renamed[(meta.get("namespace"), meta["name"])] = new
            meta["name"] = new
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        namespace = obj.get("metadata", {}).get("namespace")

        def rename(ref: Obj | None, namespace: str | None = namespace) -> None:
            if ref is not None and (namespace, ref.get("name")) in renamed:
                ref["name"] = renamed[(namespace, ref["name"])]

        for volume in pod.get("volumes", []):
            rename(volume.get("configMap"))
            for source in volume.get("projected", {}).get("sources", []):
                rename(source.get("configMap"))
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for entry in container.get("envFrom", []):
                rename(entry.get("configMapRef"))
            for entry in container.get("env", []):
                rename(entry.get("valueFrom", {}).get("configMapKeyRef"))
    return objects
