"""deploy/k8s/components/secure: added to an overlay (one line in its ``components``, as
deploy/k8s/README.md says), it renders and validates; every service reads its credentials from
the Secret qosserve-secrets, as its own NATS user; ingress is denied unless a policy opens a
port a pod listens on, to the pods that need it; and the NATS and Redis Helm values read the
same Secret keys. The NetworkPolicies are read by a small evaluator of their semantics
(:func:`admits`), which refuses the selector forms it does not model.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml

from common.config import SECRET_KEYS, load_config
from common.errors import ConfigError
from tests.deploy import kustomize, renders
from tests.deploy.test_k8s import (
    K8S,
    K8S_VERSION,
    OVERLAYS,
    by_kind,
    config_map,
    containers,
    render,
)

ROOT = K8S.parents[1]
SECURE = K8S / "components" / "secure"
PERMISSIONS = ROOT / "deploy" / "nats" / "permissions.conf"
SECRET = "qosserve-secrets"
PLACEHOLDER = "REPLACE-ME"  # every value of secret.example.yaml (the key list: ["REPLACE-ME"])
NAMESPACE = "qosserve"
# The charts' pod labels networkpolicies-nats-redis.yaml assumes (releases nats and redis).
NATS_POD = {
    "app.kubernetes.io/name": "nats",
    "app.kubernetes.io/instance": "nats",
    "app.kubernetes.io/component": "nats",
}
NATS_BOX_POD = NATS_POD | {"app.kubernetes.io/component": "nats-box"}
REDIS_POD = {
    "app.kubernetes.io/name": "redis",
    "app.kubernetes.io/instance": "redis",
    "app.kubernetes.io/component": "master",
}
# Who might connect: (namespace, pod labels).
Pod = tuple[str, dict[str, str]]
PROMETHEUS: Pod = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
KEDA: Pod = ("keda", {"app": "keda-operator"})
STRANGER_HERE: Pod = (NAMESPACE, {"app": "debug-shell"})
STRANGER_ELSEWHERE: Pod = ("default", {"app": "debug-shell"})
NATS_SERVER: Pod = (NAMESPACE, NATS_POD)
REDIS_SERVER: Pod = (NAMESPACE, REDIS_POD)

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def secure_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each overlay, and base + components/hpa, in a copy of deploy/k8s with the component
    added the documented way: one more entry in the overlay's components."""
    folders = renders.write_secure_overlays(tmp_path_factory.mktemp("secure"))
    return {name.removesuffix("-secure"): folder for name, folder in folders.items()}


@pytest.fixture(scope="module")
def secure(secure_folders: dict[str, Path]) -> dict[str, list[Obj]]:
    return {name: render(folder) for name, folder in secure_folders.items()}


def env_entries(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_key(entry: Obj) -> str:
    """The key of qosserve-secrets an env entry reads; fails for anything else."""
    assert "value" not in entry, entry["name"]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert ref["name"] == SECRET, entry
    assert not ref.get("optional", False), f"{entry['name']}: a missing key must stop the pod"
    return str(ref["key"])


def component(deploy: Obj) -> str:
    return str(deploy["metadata"]["labels"]["app.kubernetes.io/component"])


def nats_users() -> dict[str, tuple[str, str]]:
    """permissions.conf's users: permission block (GATEWAY...) -> (user, password variable)."""
    users = re.findall(
        r'\{\s*user:\s*"([^"]+)",\s*password:\s*\$(\w+),\s*permissions:\s*\$(\w+)\s*\}',
        PERMISSIONS.read_text(),
    )
    assert len(users) == 4, users
    return {block: (user, variable) for user, variable, block in users}


def example_secret() -> dict[str, str]:
    docs = list(yaml.safe_load_all((SECURE / "secret.example.yaml").read_text()))
    (secret,) = docs
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == SECRET
    assert secret["metadata"]["namespace"] == NAMESPACE
    return dict(secret["stringData"])


def _matches(selector: Obj, labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise NotImplementedError(f"selector {selector}: only matchLabels is modelled here")
    return dict(selector.get("matchLabels") or {}).items() <= labels.items()


def _peer_admits(peer: Obj, policy_namespace: str, source: Pod) -> bool:
    if set(peer) - {"podSelector", "namespaceSelector"}:
        raise NotImplementedError(f"peer {peer}: ipBlock is not modelled here")
    namespace, labels = source
    if "namespaceSelector" in peer:  # the label every namespace has (Kubernetes >= 1.22)
        in_namespace = _matches(
            peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}
        )
    else:
        in_namespace = namespace == policy_namespace
    return in_namespace and _matches(peer.get("podSelector") or {}, labels)


def admits(policies: list[Obj], target: Pod, port: int, source: Pod) -> bool:
    """Whether the NetworkPolicies let ``source`` open a TCP connection to ``port`` of the pod
    ``target``: a pod no Ingress policy selects takes anything; one that is selected takes
    what some rule of some selecting policy allows (rules add up, none subtracts)."""
    namespace, labels = target
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and "Ingress" in p["spec"]["policyTypes"]
        and _matches(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports") or []
            for entry in ports:
                if not isinstance(entry["port"], int) or "endPort" in entry:
                    raise NotImplementedError(f"port {entry}: only numbers are modelled here")
            port_ok = not ports or any(
                p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports
            )
            peers = rule.get("from") or []
            source_ok = not peers or any(_peer_admits(p, namespace, source) for p in peers)
            if port_ok and source_ok:
                return True
    return False


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_secure_mode_renders_with_each_overlay_and_validates(
    secure: dict[str, list[Obj]], overlay: str
) -> None:
    objects = secure[overlay]
    for obj in objects:
        if not obj["apiVersion"].startswith("keda.sh/"):
            try:
                kv.validate(obj, K8S_VERSION, strict=True)
            except kv.ValidationError as exc:
                where = f"{obj['kind']}/{obj['metadata']['name']}"
                raise AssertionError(f"{where}: {exc.message}") from None
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
    assert set(by_kind(objects, "NetworkPolicy")) == {
        "default-deny-ingress", "gateway-api", "prometheus-scrapes", "nats", "redis",
    }  # fmt: skip
    # The Secret is yours to make: rendered here, every apply would reset it to placeholders.
    assert not by_kind(objects, "Secret")
    # Every Deployment of the overlay got its credentials (workers through a label target).
    assert all(
        "QOS_NATS__PASSWORD" in env_entries(container) for _, container in containers(objects)
    )


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_the_python_renderer_gives_kubectls_secure_render(
    secure_folders: dict[str, Path], overlay: str
) -> None:
    """The component patches the base's Deployments (kustomize's rule for components, which
    tests/deploy/kustomize.py follows): checked against kubectl's renders, kept, everywhere,
    and against kubectl itself where it is installed."""
    kept = renders.ordered(renders.load(f"{overlay}-secure"))
    assert renders.ordered(kustomize.build(secure_folders[overlay])) == kept
    live = renders.kubectl_render(secure_folders[overlay])
    if live is not None:
        assert renders.ordered(live) == kept, "deploy/k8s changed: python -m tests.deploy.renders"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_reads_its_credentials_from_the_secret_as_its_own_nats_user(
    secure: dict[str, list[Obj]], overlay: str
) -> None:
    users = nats_users()
    password_keys: dict[str, set[str]] = {}
    for deploy, container in containers(secure[overlay]):
        role = component(deploy)
        env = env_entries(container)
        user, _ = users[role.upper()]  # GATEWAY, WORKER, SCHEDULER in permissions.conf
        assert env["QOS_NATS__USER"].get("value") == user, deploy["metadata"]["name"]
        password_keys.setdefault(role, set()).add(secret_key(env["QOS_NATS__PASSWORD"]))
        redis = {name for name in env if name.startswith("QOS_REDIS__")}
        if role == "worker":
            assert redis == {"QOS_REDIS__PASSWORD", "QOS_REDIS__KV_MAC_SECRET"}
            secret_key(env["QOS_REDIS__PASSWORD"])
            secret_key(env["QOS_REDIS__KV_MAC_SECRET"])
        else:  # the gateway and the scheduler never use Redis: no Redis secret either
            assert not redis, deploy["metadata"]["name"]
        assert ("QOS_GATEWAY__API_KEY_SHA256" in env) == (role == "gateway")
        if role == "gateway":
            secret_key(env["QOS_GATEWAY__API_KEY_SHA256"])
    # One password per user: every worker shares one, no two users share one.
    assert all(len(keys) == 1 for keys in password_keys.values()), password_keys
    assert len(set.union(*password_keys.values())) == 3, password_keys


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_only_the_provision_job_connects_as_qos_admin_and_it_reads_the_services_config(
    secure: dict[str, list[Obj]], overlay: str
) -> None:
    """No service may create the JetStream objects under permissions.conf; the Job that
    does runs `qosserve provision` as qos-admin, with the ConfigMap the services mount (the
    stream's and consumers' settings come from it)."""
    objects = secure[overlay]
    (job,) = by_kind(objects, "Job").values()
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_entries(container)
    users = nats_users()
    assert env["QOS_NATS__USER"].get("value") == users["ADMIN"][0] == "qos-admin"
    secret_key(env["QOS_NATS__PASSWORD"])
    assert container["args"] == ["python", "-m", "common.provision"]
    mounted = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/qosserve"]
    assert mounted[mount["name"]]["configMap"]["name"] == config_map(objects)["metadata"]["name"]
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "qosserve"
    admin = [d for d, c in containers(objects) if env_entries(c)["QOS_NATS__USER"].get("value")
             == "qos-admin"]  # fmt: skip
    assert admin == []


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_no_secret_is_a_plain_env_value(secure: dict[str, list[Obj]], overlay: str) -> None:
    for deploy, container in containers(secure[overlay]):
        for entry in container.get("env", []):
            name = entry["name"]
            key = name.removeprefix("QOS_").split("__")[-1].lower()
            if key in SECRET_KEYS or key == "api_key_sha256":
                secret_key(entry)  # valueFrom the Secret, never a value
            elif "valueFrom" in entry:
                raise AssertionError(f"{deploy['metadata']['name']}: {name} from {entry}")


def _service_env(container: Obj, values: dict[str, str]) -> dict[str, str]:
    """The QOS_* variables a container starts with when the Secret holds ``values``."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            env[entry["name"]] = values[secret_key(entry)]
    return {k: v for k, v in env.items() if k.startswith("QOS_") and k != "QOS_CONFIG"}


def test_the_services_load_real_secrets_and_stop_on_the_placeholders(
    secure: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """secret.example.yaml holds exactly the keys the pods and the charts read, each the
    placeholder; with it the gateway (no SHA-256 digest) and the workers (a MAC secret under 16
    characters) refuse to start, and with real values every service loads the config."""
    objects = secure["gpu"]
    example = example_secret()
    read = {
        secret_key(entry)
        for _, container in containers(objects)
        for entry in container.get("env", [])
        if "valueFrom" in entry
    }
    nats = yaml.safe_load((K8S / "helm-values" / "nats-secure.yaml").read_text())
    read |= {e["valueFrom"]["secretKeyRef"]["key"] for e in nats["container"]["env"].values()}
    redis = yaml.safe_load((K8S / "helm-values" / "redis-secure.yaml").read_text())
    read.add(redis["auth"]["existingSecretPasswordKey"])
    assert set(example) == read
    for key, value in example.items():
        assert value == PLACEHOLDER or yaml.safe_load(value) == [PLACEHOLDER], key
    assert len(PLACEHOLDER) < 16  # what makes the workers' redis.kv_mac_secret refuse it

    config_file = tmp_path / "config.yaml"
    config_file.write_text(config_map(objects)["data"]["config.yaml"])
    digest = hashlib.sha256(b"a client's key").hexdigest()
    real = {key: secrets.token_hex(24) for key in example}
    real["gateway-api-key-sha256"] = f'["{digest}"]'
    for deploy, container in containers(objects):
        name, role = deploy["metadata"]["name"], component(deploy)
        config = load_config(config_file, env=_service_env(container, real))
        assert config.nats.user is not None and config.nats.password is not None, name
        assert config.nats.password in real.values(), name
        if role == "gateway":
            assert config.gateway.api_key_sha256 == [digest]
        if role == "worker":
            assert config.redis.password and config.redis.kv_mac_secret, name
        if role in ("gateway", "worker"):
            with pytest.raises(ConfigError) as refused:
                load_config(config_file, env=_service_env(container, example))
            wrong = "api_key_sha256" if role == "gateway" else "kv_mac_secret"
            assert wrong in str(refused.value), refused.value
            assert PLACEHOLDER not in str(refused.value)  # errors never quote a secret


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_is_denied_by_default_and_every_listening_port_is_opened_to_its_callers(
    secure: dict[str, list[Obj]], overlay: str
) -> None:
    objects = secure[overlay]
    policies = list(by_kind(objects, "NetworkPolicy").values())
    deny = by_kind(objects, "NetworkPolicy")["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert not deny.get("ingress"), "a default deny with rules allows them"
    for deploy, container in containers(objects):
        pod: Pod = (NAMESPACE, deploy["spec"]["template"]["metadata"]["labels"])
        for port in (p["containerPort"] for p in container["ports"]):
            name = f"{deploy['metadata']['name']}:{port}"
            if component(deploy) == "gateway":  # the API: clients from anywhere
                assert admits(policies, pod, port, STRANGER_ELSEWHERE), name
            else:  # /metrics and /livez: Prometheus (and the kubelet, always allowed) only
                assert admits(policies, pod, port, PROMETHEUS), name
                assert not admits(policies, pod, port, STRANGER_HERE), name
                assert not admits(policies, pod, port, STRANGER_ELSEWHERE), name
        # Nothing else of a qosserve pod is open: say, a debugger's port 5678.
        assert not admits(policies, pod, 5678, (NAMESPACE, pod[1])), deploy["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_takes_clients_only_from_qosserve_pods_and_redis_only_from_workers(
    secure: dict[str, list[Obj]], overlay: str
) -> None:
    objects = secure[overlay]
    policies = list(by_kind(objects, "NetworkPolicy").values())
    pods = {
        component(d): (NAMESPACE, d["spec"]["template"]["metadata"]["labels"])
        for d in by_kind(objects, "Deployment").values()
    }
    assert set(pods) == {"gateway", "scheduler", "worker"}
    outsiders = [STRANGER_HERE, STRANGER_ELSEWHERE, PROMETHEUS, KEDA, (NAMESPACE, NATS_BOX_POD)]
    for source in pods.values():
        assert admits(policies, NATS_SERVER, 4222, source), source
    for source in outsiders:
        assert not admits(policies, NATS_SERVER, 4222, source), source
    # Routes between the servers; the monitoring port for KEDA's JetStream scaler.
    assert admits(policies, NATS_SERVER, 6222, NATS_SERVER)
    assert not admits(policies, NATS_SERVER, 6222, pods["gateway"])
    assert admits(policies, NATS_SERVER, 8222, KEDA)
    assert not any(admits(policies, NATS_SERVER, 8222, s) for s in [*pods.values(), STRANGER_HERE])
    assert admits(policies, REDIS_SERVER, 6379, pods["worker"])
    for source in [pods["gateway"], pods["scheduler"], NATS_SERVER, *outsiders]:
        assert not admits(policies, REDIS_SERVER, 6379, source), source
    assert admits(policies, REDIS_SERVER, 9121, PROMETHEUS)  # the chart's exporter


def test_the_nats_and_redis_helm_values_read_the_keys_the_services_read(
    secure: dict[str, list[Obj]],
) -> None:
    deployments = by_kind(secure["cpu-demo"], "Deployment")
    read_by = {  # permissions.conf block -> the Secret key its service's password comes from
        component(d).upper(): secret_key(env_entries(d["spec"]["template"]["spec"]["containers"][0])["QOS_NATS__PASSWORD"])
        for d in deployments.values()
    }  # fmt: skip
    job = by_kind(secure["cpu-demo"], "Job")["qosserve-provision"]
    read_by["ADMIN"] = secret_key(
        env_entries(job["spec"]["template"]["spec"]["containers"][0])["QOS_NATS__PASSWORD"]
    )
    nats = yaml.safe_load((K8S / "helm-values" / "nats-secure.yaml").read_text())
    (include,) = [v for k, v in nats["config"]["merge"].items() if k.endswith("$include")]
    assert include == PERMISSIONS.name
    env = nats["container"]["env"]
    for block, (_, variable) in nats_users().items():
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": SECRET, "key": read_by[block]}, variable
    assert set(env) == {variable for _, variable in nats_users().values()}
    assert nats["natsBox"]["enabled"] is False  # no user of its own, and no way past 4222

    redis = yaml.safe_load((K8S / "helm-values" / "redis-secure.yaml").read_text())
    worker = deployments["worker-short"]["spec"]["template"]["spec"]["containers"][0]
    assert redis["auth"] == {
        "enabled": True,
        "existingSecret": SECRET,
        "existingSecretPasswordKey": secret_key(env_entries(worker)["QOS_REDIS__PASSWORD"]),
    }
    # The chart's own policy admits every pod to 6379, and policies add up.
    assert redis["networkPolicy"]["enabled"] is False

    readme = (K8S / "README.md").read_text()
    assert "## Secure mode" in readme and "../../components/secure" in readme
    assert "-f deploy/k8s/helm-values/nats-secure.yaml" in readme
    assert r"--set-file 'configMap.merge.data.permissions\.conf=deploy/nats/permissions.conf'" in (
        readme
    )
    assert "-f deploy/k8s/helm-values/redis-secure.yaml" in readme
    assert all(f"--from-literal={key}=" in readme for key in example_secret()), "create command"
    assert "deploy/k8s/README.md" in (ROOT / "README.md").read_text().split("## Security")[1]
