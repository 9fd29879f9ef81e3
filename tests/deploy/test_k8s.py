"""deploy/k8s: every overlay renders, validates against the Kubernetes schemas, and says
what the services actually do (groups, probe paths, ports, drain time, autoscaling names).

Rendering uses ``kubectl kustomize`` when it is installed and the Python renderer in
:mod:`tests.deploy.kustomize` otherwise; the Python renderer must give kubectl's renders,
kept in ``tests/deploy/renders/`` (:mod:`tests.deploy.renders`), on every machine. Built-in kinds are
validated with ``kubernetes-validate`` (its bundled schemas, strict: unknown fields fail);
KEDA's ScaledObject is a CRD, so its fields are checked here by name.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml

from common.config import Config, default_groups, load_config
from common.subjects import Subjects
from tests.deploy import kustomize, renders

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu")
K8S_VERSION = "1.30.0"  # the oldest minor still in upstream support when this was written
# What each component serves over HTTP (gateway/app.py, workers' and scheduler's /metrics).
SERVED = {"gateway": {"/health", "/metrics", "/v1/models"}, "worker": {"/metrics", "/livez"}}
SERVED["scheduler"] = {"/metrics", "/livez"}

Obj = dict[str, Any]


def render(folder: Path) -> list[Obj]:
    """kubectl's render where it is installed, else ours (the two agree: tested below)."""
    objects = renders.kubectl_render(folder)
    return kustomize.build(folder) if objects is None else objects


@pytest.fixture(scope="module")
def hpa_overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base + components/hpa: the documented alternative to the KEDA component."""
    return renders.write_hpa_overlay(tmp_path_factory.mktemp("hpa-overlay"))


@pytest.mark.parametrize("name", renders.RENDERS)
def test_the_python_renderer_gives_what_kubectl_kustomize_gives(
    name: str, hpa_overlay: Path
) -> None:
    folder = hpa_overlay if name == "hpa" else K8S / "overlays" / name
    kept = renders.ordered(renders.load(name))  # kubectl's, kept: checked on every machine
    assert renders.ordered(kustomize.build(folder)) == kept
    live = renders.kubectl_render(folder)
    if live is not None:  # and the kept render is still kubectl's of today's files
        assert renders.ordered(live) == kept, "deploy/k8s changed: python -m tests.deploy.renders"


@pytest.fixture(scope="module")
def rendered(hpa_overlay: Path) -> dict[str, list[Obj]]:
    out = {name: render(K8S / "overlays" / name) for name in OVERLAYS}
    out["hpa"] = render(hpa_overlay)
    return out


def by_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def config_map(objects: list[Obj]) -> Obj:
    """The ConfigMap every pod mounts at /etc/qosserve (QOS_CONFIG's folder): generated,
    so named qosserve-config-<hash of its content>, and the same for all of them."""
    names = set()
    for deploy, container in containers(objects):
        volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/qosserve"]
        names.add(volumes[mount["name"]]["configMap"]["name"])
    (name,) = names
    return by_kind(objects, "ConfigMap")[name]


def config_of(objects: list[Obj], tmp_path: Path, env: dict[str, str] | None = None) -> Config:
    data = config_map(objects)["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(data)
    return load_config(path, env=env or {})


def containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for deploy in by_kind(objects, "Deployment").values():
        for container in deploy["spec"]["template"]["spec"]["containers"]:
            yield deploy, container


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_built_in_kinds_validate_against_the_kubernetes_schemas(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    checked = 0
    for obj in rendered[overlay]:
        if obj["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}"
            ) from None
        checked += 1
    assert checked >= 14


def test_every_namespaced_object_lands_in_the_qosserve_namespace(
    rendered: dict[str, list[Obj]],
) -> None:
    for objects in rendered.values():
        for obj in objects:
            if obj["kind"] != "Namespace":
                where = f"{obj['kind']}/{obj['metadata']['name']}"
                assert obj["metadata"].get("namespace") == "qosserve", where


def test_the_configmap_is_a_config_the_loader_accepts_with_the_default_groups(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    config = config_of(rendered["cpu-demo"], tmp_path)
    assert config.groups == default_groups(), "the ConfigMap's groups drifted from the defaults"
    assert config.nats.url == "nats://nats:4222"  # the nats Helm release's Service
    assert config.redis.url.startswith("redis://redis-master:6379")
    assert config.scheduler.move_replicas is False, "Deployments, not the scheduler, own groups"
    assert config.worker.kv_redis, "the redis Helm release is there for the shared KV tier"
    assert config.nats.replicas == 3, "the nats Helm release runs 3 servers: survive one"


def test_an_edit_of_the_config_rolls_every_pod(tmp_path: Path) -> None:
    """The services read config.yaml once, at start: a ConfigMap edited in place left the
    running pods on the old config and those started later (scale-ups, restarts) on the new
    one. Generated, it is named after its content and every pod template names it, so an
    edit changes every template and ``kubectl apply -k`` rolls the pods."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    before = render(copy / "overlays" / "cpu-demo")
    assert config_of(before, tmp_path).gateway.shutdown_grace_s == 60
    setting = re.compile(r"^(\s+shutdown_grace_s:) 60$", re.M)
    (source,) = [f for f in (copy / "base").glob("*.yaml") if setting.search(f.read_text())]
    source.write_text(setting.sub(r"\1 61", source.read_text()))
    after = render(copy / "overlays" / "cpu-demo")
    assert config_of(after, tmp_path).gateway.shutdown_grace_s == 61
    old, new = config_map(before)["metadata"]["name"], config_map(after)["metadata"]["name"]
    assert old.startswith("qosserve-config-") and new.startswith("qosserve-config-")
    assert old != new, "an edited ConfigMap keeps its name: no pod template changes"
    templates = {d["metadata"]["name"]: d["spec"]["template"] for d, _ in containers(before)}
    for deploy, _ in containers(after):
        assert deploy["spec"]["template"] != templates[deploy["metadata"]["name"]]


def test_every_pod_names_its_model_and_listen_addresses_in_the_manifests(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """The image sets no QOS_* variable (an environment variable wins over the ConfigMap, so
    one there silently overrode an operator's edit; tests/deploy/test_compose.py): the
    ConfigMap and the Deployments' env say which model each pod serves (the image's copy of
    the demo model or a mounted one, not ``demo``, which needs a source tree) and listen on
    0.0.0.0 where the probes and Prometheus reach them (loopback by default)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    in_image = re.search(r"cp -r /src/bench/models/\S+ (/\S+)", dockerfile)
    assert in_image
    for overlay, objects in rendered.items():
        for deploy, container in containers(objects):
            env = {k: v for k, v in env_of(container).items()
                   if k.startswith("QOS_") and k != "QOS_CONFIG"}  # fmt: skip
            config = config_of(objects, tmp_path, env)
            component = deploy["metadata"]["labels"]["app.kubernetes.io/component"]
            where = f"{overlay}: {deploy['metadata']['name']}"
            listens = {
                "gateway": config.gateway.host,
                "worker": config.worker.metrics_host,
                "scheduler": config.scheduler.metrics_host,
            }[component]
            assert listens == "0.0.0.0", f"{where} listens on {listens}"
            if component in ("gateway", "worker"):
                mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
                model = config.worker.model
                assert model == in_image[1] or any(
                    model.startswith(f"{m}/") for m in mounts if m != "/etc/qosserve"
                ), f"{where} serves {model!r}, which is not in its container"


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_every_group_has_a_deployment_a_pdb_and_an_autoscaler(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objects = rendered[overlay]
    config = config_of(objects, tmp_path)
    deployments, pdbs = by_kind(objects, "Deployment"), by_kind(objects, "PodDisruptionBudget")
    scalers = by_kind(objects, "HorizontalPodAutoscaler" if overlay == "hpa" else "ScaledObject")
    for group in config.groups:
        name = f"worker-{group}"
        deploy = deployments[name]
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:3] == ["python", "-m", "workers"]
        assert args[args.index("--group") + 1] == group
        pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
        selector = pdbs[name]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items(), f"{name}: the PDB selects other pods"
        assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert scalers[name]["spec"]["scaleTargetRef"]["name"] == name
    for name in ("gateway", "scheduler"):
        assert name in deployments and name in pdbs
    assert set(scalers) == {f"worker-{g}" for g in config.groups}


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_no_autoscaled_deployment_sets_replicas(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    """spec.replicas on a Deployment an HPA (KEDA's included) scales is reset to that
    number by every ``kubectl apply`` or GitOps sync, undoing the autoscaler's count."""
    objects = rendered[overlay]
    deployments = by_kind(objects, "Deployment")
    targets = {
        scaler["spec"]["scaleTargetRef"]["name"]
        for kind in ("ScaledObject", "HorizontalPodAutoscaler")
        for scaler in by_kind(objects, kind).values()
    }
    assert targets and targets <= set(deployments)
    for name in targets:
        assert "replicas" not in deployments[name]["spec"], f"{overlay}: {name} sets replicas"
    for name in set(deployments) - targets:  # nothing else sets their count: the file does
        assert deployments[name]["spec"].get("replicas", 0) >= 1, f"{overlay}: {name}"


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_no_pod_gets_service_link_variables(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """A Service named qos-... in the namespace (``helm install qos-nats``) would inject
    QOS_NATS_PORT & co., unknown configuration keys: every pod would exit on ConfigError."""
    for name, deploy in by_kind(rendered[overlay], "Deployment").items():
        assert deploy["spec"]["template"]["spec"].get("enableServiceLinks") is False, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_each_group_on_its_own_jetstream_consumer(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objects = rendered[overlay]
    config = config_of(objects, tmp_path)
    services = by_kind(objects, "Service")
    for name, scaled in by_kind(objects, "ScaledObject").items():
        group = name.removeprefix("worker-")
        spec = scaled["spec"]
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        assert meta["stream"] == config.nats.stream == "QOS_REQ"
        assert meta["consumer"] == Subjects.consumer(group) == f"grp-{group}"
        assert meta["account"] == "$G"
        # The nats chart (1.x) serves 8222 on its headless Service only, and KEDA asks each
        # server as <pod>.<endpoint host>: names only the headless Service has.
        namespace = scaled["metadata"]["namespace"]
        endpoint = f"nats-headless.{namespace}.svc.cluster.local:8222"
        assert meta["natsServerMonitoringEndpoint"] == endpoint
        # KEDA's lag counts running requests too: a replica per full batch, no more (a
        # higher threshold left a request queued behind every full replica).
        assert int(meta["lagThreshold"]) == config.groups[group].max_batch
        assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
    assert "gateway" in services and "workers-metrics" in services


@pytest.mark.parametrize("overlay", [*OVERLAYS, "hpa"])
def test_every_disruption_budget_lets_a_node_drain_at_the_fewest_replicas(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    """minAvailable 1 on a one-replica Deployment (cpu-demo's gateway and scheduler, a group
    scaled down to one) allows no eviction: a node drain waits for ever."""
    objects = rendered[overlay]
    deployments = by_kind(objects, "Deployment").items()
    fewest = {name: d["spec"].get("replicas", 1) for name, d in deployments}  # the API's default
    for kind in ("ScaledObject", "HorizontalPodAutoscaler"):
        for scaler in by_kind(objects, kind).values():
            spec = scaler["spec"]
            target = spec["scaleTargetRef"]["name"]
            fewest[target] = min(
                fewest[target], spec.get("minReplicaCount", spec.get("minReplicas", 1))
            )
    pdbs = by_kind(objects, "PodDisruptionBudget")
    assert set(pdbs) == set(fewest)  # each PDB is named after its Deployment
    for name, pdb in pdbs.items():
        spec = pdb["spec"]
        allowed = spec.get("maxUnavailable", fewest[name] - spec.get("minAvailable", 0))
        assert isinstance(allowed, int) and allowed >= 1, f"{overlay}: PDB {name} blocks drains"


def test_the_hpa_alternative_reads_qos_desired_replicas_per_group(
    rendered: dict[str, list[Obj]],
) -> None:
    for name, hpa in by_kind(rendered["hpa"], "HorizontalPodAutoscaler").items():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "qos_desired_replicas"
        selector = metric["external"]["metric"]["selector"]["matchLabels"]
        assert selector == {"group": name.removeprefix("worker-")}
        # replicas = ceil(metric / averageValue): 1 makes the HPA follow the scheduler.
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    adapter = yaml.safe_load((K8S / "helm-values" / "prometheus-adapter.yaml").read_text())
    assert "qos_desired_replicas" in adapter["rules"]["external"][0]["seriesQuery"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_point_at_paths_and_ports_the_services_serve(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objects = rendered[overlay]
    for deploy, container in containers(objects):
        component = deploy["metadata"]["labels"]["app.kubernetes.io/component"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        probes = [
            container[k]
            for k in ("readinessProbe", "livenessProbe", "startupProbe")
            if k in container
        ]
        assert "readinessProbe" in container and "livenessProbe" in container, component
        for probe in probes:
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert action is not None and action["port"] in ports, f"{component}: {probe}"
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] in SERVED[component], f"{component}: {probe}"
        env = env_of(container)
        config = config_of(
            objects,
            tmp_path,
            {k: v for k, v in env.items() if k.startswith("QOS_") and k != "QOS_CONFIG"},
        )
        expected = {
            "gateway": config.gateway.port,
            "scheduler": config.scheduler.metrics_port,
            "worker": config.worker.metrics_port,
        }[component]
        assert expected in ports.values(), f"{component} listens on {expected}, not {ports}"
        assert env.get("QOS_CONFIG") == "/etc/qosserve/config.yaml"
    gateway = by_kind(objects, "Deployment")["gateway"]["spec"]["template"]["spec"]
    container = gateway["containers"][0]
    readiness = container["readinessProbe"]["httpGet"]["path"]
    assert readiness == "/health"
    # Liveness asks the event loop (a wedged loop still accepts TCP) on a path that does not
    # need NATS (/health is 503 in an outage, which a restart cannot cure), and gives it time.
    liveness = container["livenessProbe"]
    assert "tcpSocket" not in liveness and liveness["httpGet"]["path"] == "/metrics", liveness
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    gateway_env = {k: v for k, v in env_of(container).items()
                   if k.startswith("QOS_") and k != "QOS_CONFIG"}  # fmt: skip
    port = config_of(objects, tmp_path, gateway_env).gateway.port
    assert ports[liveness["httpGet"]["port"]] == port, liveness
    assert liveness.get("failureThreshold", 3) * liveness.get("periodSeconds", 10) >= 60
    # Workers' and the scheduler's /metrics come from a thread of their own and answer while
    # their event loop is wedged: liveness asks /livez, which the loop's beat answers.
    for deploy, container in containers(objects):
        if deploy["metadata"]["labels"]["app.kubernetes.io/component"] != "gateway":
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez", deploy["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_time_to_drain_and_everything_spreads_across_zones(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    for deploy, container in containers(rendered[overlay]):
        pod = deploy["spec"]["template"]["spec"]
        keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
        assert "topology.kubernetes.io/zone" in keys, deploy["metadata"]["name"]
        if deploy["metadata"]["name"].startswith("worker-"):
            args = container["args"]
            # Without the flag a worker drains for the CLI's default, 30 s.
            grace = float(args[args.index("--grace-s") + 1]) if "--grace-s" in args else 30.0
            assert pod["terminationGracePeriodSeconds"] >= grace + 10, deploy["metadata"]["name"]
        if deploy["metadata"]["name"] == "gateway":
            sleep, seconds = container["lifecycle"]["preStop"]["exec"]["command"]
            assert sleep == "sleep"
            env = {k: v for k, v in env_of(container).items()
                   if k.startswith("QOS_") and k != "QOS_CONFIG"}  # fmt: skip
            gateway = config_of(rendered[overlay], tmp_path, env).gateway
            # preStop, then the graceful stop, then 5 s to exit before the SIGKILL.
            grace = float(seconds) + gateway.shutdown_grace_s + 5
            assert pod["terminationGracePeriodSeconds"] >= grace
        assert pod["securityContext"]["runAsNonRoot"] is True
        # The runtime's syscall filter, and no API token: no pod here calls Kubernetes.
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drains_last_as_long_as_the_slowest_groups_slo(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    """A request started just before SIGTERM may take its group's E2E p99 SLO: the gateway
    (every group's streams) and each worker (its group's) must wait that long, and the pod's
    grace period must outlast the drain (checked above), or the long group's documents are
    cut short or redone elsewhere at every rollout."""
    objects = rendered[overlay]
    groups = config_of(objects, tmp_path).groups
    slowest = max(g.slo_e2e_p99_ms for g in groups.values()) / 1000
    assert slowest >= 60, "the long group's SLO: the numbers below were sized on it"
    for deploy, container in containers(objects):
        name = deploy["metadata"]["name"]
        pod = deploy["spec"]["template"]["spec"]
        env = {k: v for k, v in env_of(container).items()
               if k.startswith("QOS_") and k != "QOS_CONFIG"}  # fmt: skip
        if name == "gateway":
            drain = config_of(objects, tmp_path, env).gateway.shutdown_grace_s
            assert drain >= slowest, f"{overlay}: gateway drains {drain} s < {slowest} s"
        elif name.startswith("worker-"):
            args = container["args"]
            group = groups[args[args.index("--group") + 1]]
            drain = float(args[args.index("--grace-s") + 1]) if "--grace-s" in args else 30.0
            assert drain >= group.slo_e2e_p99_ms / 1000, f"{overlay}: {name} drains {drain} s"
        else:
            continue
        assert pod["terminationGracePeriodSeconds"] > drain, f"{overlay}: {name}"


def test_only_the_gpu_overlay_gives_workers_gpus_and_the_cuda_image(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    for overlay in OVERLAYS:
        for deploy, container in containers(rendered[overlay]):
            limits = container["resources"].get("limits", {})
            is_gpu_worker = overlay == "gpu" and deploy["metadata"]["name"].startswith("worker-")
            assert ("nvidia.com/gpu" in limits) == is_gpu_worker, deploy["metadata"]["name"]
            assert container["image"].endswith(":cuda") == is_gpu_worker
            # The nvidia.com/gpu request places the pod; a GPU Feature Discovery label (absent
            # where GFD does not run, e.g. GKE's own device plugin) would leave it Pending.
            selector = deploy["spec"]["template"]["spec"].get("nodeSelector", {})
            assert not any(k.startswith("nvidia.com/") for k in selector), selector
            if is_gpu_worker:
                env = {
                    k: v
                    for k, v in env_of(container).items()
                    if k.startswith("QOS_") and k != "QOS_CONFIG"
                }
                assert config_of(rendered[overlay], tmp_path, env).worker.device == "cuda"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlays_images_entry_names_every_pods_image(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    """One place sets the registry: an image the entry misses (the gpu overlay's gateway and
    scheduler once) would be pulled from docker.io/library/qosserve."""
    spec = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    (entry,) = spec["images"]
    assert entry["name"] == "qosserve"
    for deploy, container in containers(rendered[overlay]):
        name, _, tag = container["image"].rpartition(":")
        assert name == entry["newName"], (deploy["metadata"]["name"], container["image"])
        assert tag in ("cpu", "cuda")
    if overlay == "gpu":  # GPU clusters pull from a registry: the placeholder says where
        assert "." in entry["newName"].split("/")[0], entry


def test_the_models_claim_is_mounted_read_only_by_pods_on_many_nodes(
    rendered: dict[str, list[Obj]],
) -> None:
    """The gateway and every GPU worker mount qosserve-models: a ReadOnlyMany claim needs
    read-only mounts, and a ReadWriteOnce one would attach to one node only."""
    objects = rendered["gpu"]
    users = []
    for deploy, container in containers(objects):
        pod = deploy["spec"]["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        for mount in container.get("volumeMounts", []):
            if mount["name"] in claims:
                claim = claims[mount["name"]]
                assert claim["claimName"] == "qosserve-models"
                assert claim["readOnly"] is True and mount["readOnly"] is True
                users.append(deploy["metadata"]["name"])
    assert "gateway" in users and len(users) >= 4, users
    for pvc in by_kind(objects, "PersistentVolumeClaim").values():  # none now: yours
        assert set(pvc["spec"]["accessModes"]) & {"ReadOnlyMany", "ReadWriteMany"}, pvc
    readme = (K8S / "README.md").read_text()
    assert "ReadOnlyMany" in readme and "ReadWriteMany" in readme


def test_the_gateway_reads_the_checkpoint_the_workers_serve(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """The gateway tokenizes and renders the chat template: another model's tokens would
    reach the workers as garbage."""
    for overlay in OVERLAYS:
        models = {}
        for deploy, container in containers(rendered[overlay]):
            name = deploy["metadata"]["name"]
            if name == "gateway" or name.startswith("worker-"):
                env = {k: v for k, v in env_of(container).items()
                       if k.startswith("QOS_") and k != "QOS_CONFIG"}  # fmt: skip
                models[name] = config_of(rendered[overlay], tmp_path, env).worker.model
        assert len(set(models.values())) == 1, (overlay, models)


def test_helm_values_configure_jetstream_and_an_lru_cache_redis() -> None:
    values = yaml.safe_load((K8S / "helm-values" / "nats.yaml").read_text())
    nats = values["config"]
    assert nats["jetstream"]["enabled"] and nats["jetstream"]["fileStore"]["enabled"]
    assert nats["monitor"]["enabled"] and nats["monitor"]["port"] == 8222
    assert nats["merge"]["max_payload"] >= Config().nats.max_payload_bytes
    # Spread, never required: nodes without the zone label (kind, k3s, bare metal) or one
    # node would leave DoNotSchedule-constrained servers Pending.
    spread = values["podTemplate"]["topologySpreadConstraints"]
    assert {"topology.kubernetes.io/zone", "kubernetes.io/hostname"} <= set(spread)
    for key, constraint in spread.items():
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway", key
    redis = yaml.safe_load((K8S / "helm-values" / "redis.yaml").read_text())
    settings = dict(
        line.split(None, 1) for line in redis["commonConfiguration"].splitlines() if line.strip()
    )
    assert settings["maxmemory-policy"] == "allkeys-lru"
    assert settings["save"] == '""' and settings["appendonly"] == "no"
    assert redis["master"]["persistence"]["enabled"] is False
